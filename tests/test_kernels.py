"""The CPU few-row linear path: same numbers as nn.Linear, survives deepcopy, can be turned off."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from specrl.kernels import MAX_ROWS, PAD_TO, SkinnyLinear, kernel_tag, use_skinny_linear


@pytest.fixture(autouse=True)
def forced_on(monkeypatch):
    """These tests exercise the skinny path itself: force it on, whatever this machine measured
    (auto mode may have chosen F.linear for every row count once a large model was loaded)."""
    monkeypatch.setenv("SPECRL_SKINNY_LINEAR", "1")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (2, 3), (4, 4), (1, 11), (2, 8), (1, MAX_ROWS + 1), (3, 9)])
def test_skinny_linear_matches_linear(bias, shape):
    torch.manual_seed(0)
    ref = nn.Linear(24, 40, bias=bias)
    sk = copy.deepcopy(ref)
    sk.__class__ = SkinnyLinear
    x = torch.randn(*shape, 24)
    out = sk(x)
    assert out.shape == (*shape, 40)
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
    assert out.is_contiguous()  # the next layer's GEMM is 4x slower on a column-major input
    xt = x.reshape(-1, 24).T.contiguous().T.reshape(x.shape)  # same values, column-major
    torch.testing.assert_close(sk(xt), ref(x), rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)
    sk(x).sum().backward()  # the draft trainer backpropagates through copied target layers
    assert x.grad is not None and x.grad.shape == x.shape


def test_use_skinny_linear_switches_plain_linears_and_survives_deepcopy(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_skinny_linear(model) == 2
    assert all(type(m) is SkinnyLinear for m in (model[0], model[2]))
    assert use_skinny_linear(model) == 0  # already switched
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # same parameters
    assert type(copy.deepcopy(model)[0]) is SkinnyLinear

    monkeypatch.setenv("SPECRL_SKINNY_LINEAR", "0")
    other = nn.Sequential(nn.Linear(8, 8))
    assert use_skinny_linear(other) == 0 and type(other[0]) is nn.Linear
    assert kernel_tag(torch.device("cpu")) == "linear"


def test_cost_profiles_are_keyed_by_kernels(monkeypatch, tmp_path):
    from specrl.costs import cost_path

    monkeypatch.setenv("SPECRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECRL_SKINNY_LINEAR", "1")
    on = cost_path("default", None, "ngram", "float32", "cpu")
    monkeypatch.setenv("SPECRL_SKINNY_LINEAR", "0")
    off = cost_path("default", None, "ngram", "float32", "cpu")
    assert on != off and f"-skinny{MAX_ROWS}pad-" in on.name and "-linear-" in off.name
    assert "-linear-" in cost_path("default", None, "ngram", "float32", "cuda").name  # no CUDA needed


def test_row_padding_table():
    """Every skinny product is padded to at least its own size and never past MAX_ROWS."""
    assert len(PAD_TO) == MAX_ROWS + 1
    assert all(r <= p <= MAX_ROWS for r, p in enumerate(PAD_TO) if r)
    assert PAD_TO[1] == 2  # the one-row matrix-vector product is the slow case


def test_skinny_linear_leaves_other_dtypes_to_f_linear(monkeypatch):
    """bfloat16 products take F.linear (faster there); the result is the plain layer's, bit for bit."""
    import torch.nn.functional as F

    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    ref = nn.Linear(24, 40).to(torch.bfloat16)
    sk = copy.deepcopy(ref)
    sk.__class__ = SkinnyLinear
    x = torch.randn(2, 24, dtype=torch.bfloat16)
    assert torch.equal(sk(x), real(x, ref.weight, ref.bias)) and calls == [1]
    sk.float()(x.float())
    assert calls == [1]  # float32: the skinny path


@pytest.fixture
def auto_mode(monkeypatch, tmp_path):
    """Auto mode with an empty cache and no choice made yet in this process."""
    from specrl import kernels

    monkeypatch.setenv("SPECRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECRL_SKINNY_LINEAR", "auto")
    monkeypatch.setattr(kernels, "CALIBRATE_MIN_BYTES", 1)  # let a small model stand in for a large one
    kernels._reset_for_tests()
    yield kernels
    kernels._reset_for_tests()


def test_auto_mode_sends_only_the_measured_winning_rows_to_the_skinny_path(auto_mode, tmp_path):
    kernels = auto_mode
    calls = []

    def timer(weights, rows):  # skinny wins clearly at 2-4 rows, ties at 5 (inside the margin), loses elsewhere
        calls.append(rows)
        return 1.0, {2: 0.5, 3: 0.6, 4: 0.9, 5: 0.99}.get(rows, 2.0)

    model = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24))
    assert kernels.active_rows() == kernels.ALL_ROWS  # nothing measured yet: the old default
    assert kernels.calibrate(model, timer) == frozenset({2, 3, 4})
    assert calls == list(kernels.MEASURED_ROWS)
    assert kernels.active_rows() == {2, 3, 4} and kernel_tag(torch.device("cpu")) == "skinny2-3-4"
    stored = json.loads((tmp_path / "kernels.json").read_text())[kernels.machine_key()]
    assert stored["skinny_rows"] == [2, 3, 4] and stored["ms"]["16"] == [1000.0, 2000.0]
    # a new process reads the choice back instead of measuring again
    kernels._reset_for_tests()
    assert kernels.calibrate(model, lambda w, r: pytest.fail("measured twice")) == frozenset({2, 3, 4})
    # the layers follow the choice: F.linear at 1 row, the skinny product at 3 (both the same numbers)
    use_skinny_linear(model)
    import torch.nn.functional as F

    seen = []
    real = F.linear
    try:
        F.linear = lambda *a, **k: seen.append(a[0].shape[0]) or real(*a, **k)
        x1, x3 = torch.randn(1, 24), torch.randn(3, 24)
        torch.testing.assert_close(model[0](x1), real(x1, model[0].weight, model[0].bias))
        torch.testing.assert_close(model[0](x3), real(x3, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)
    finally:
        F.linear = real
    assert seen == [1]  # the 1-row product took F.linear, the 3-row one the skinny product


def test_auto_mode_where_skinny_never_wins_tags_profiles_linear(auto_mode):
    kernels = auto_mode
    assert kernels.calibrate(nn.Sequential(nn.Linear(8, 8)), lambda w, r: (1.0, 3.0)) == frozenset()
    assert kernel_tag(torch.device("cpu")) == "linear"


def test_auto_mode_skips_small_models_and_forced_modes(auto_mode, monkeypatch):
    kernels = auto_mode
    monkeypatch.setattr(kernels, "CALIBRATE_MIN_BYTES", 64 << 20)
    small = nn.Sequential(nn.Linear(8, 8))
    assert kernels.calibrate(small, lambda w, r: pytest.fail("a cached-size model was timed")) is None
    monkeypatch.setattr(kernels, "CALIBRATE_MIN_BYTES", 1)
    for forced, rows in (("1", kernels.ALL_ROWS), ("0", frozenset())):
        monkeypatch.setenv("SPECRL_SKINNY_LINEAR", forced)
        assert kernels.calibrate(small, lambda w, r: pytest.fail("a forced mode was timed")) is None
        assert kernels.active_rows() == rows
    monkeypatch.setenv("SPECRL_SKINNY_LINEAR", "yes")
    with pytest.raises(ValueError, match="Allowed: auto, 1, 0"):
        kernels.mode()


def test_time_paths_measures_both_sides():
    ws = [torch.randn(40, 24), torch.randn(24, 40)]
    lin, sk = __import__("specrl.kernels", fromlist=["time_paths"]).time_paths(ws, 3, reps=1)
    assert lin > 0 and sk > 0


def test_auto_mode_reads_the_remembered_choice_once_not_per_product(auto_mode, monkeypatch):
    """SkinnyLinear asks for the choice on every product: the disk must be read once per process."""
    kernels = auto_mode
    reads = []
    monkeypatch.setattr(kernels, "_remembered", lambda: reads.append(1))  # nothing remembered
    monkeypatch.setattr(kernels, "CALIBRATE_MIN_BYTES", 64 << 20)
    layer = nn.Linear(8, 8)
    use_skinny_linear(layer)  # too small to measure: stays unmeasured
    for _ in range(5):
        layer(torch.randn(2, 8))
    assert kernels.active_rows() == kernels.ALL_ROWS and len(reads) == 1


def test_skinny_product_pads_and_keeps_rows_row_major():
    torch.manual_seed(0)
    w = torch.randn(40, 24)
    for rows in (1, 3, 9):
        x = torch.randn(rows, 24)
        out = __import__("specrl.kernels", fromlist=["skinny_product"]).skinny_product(w, x.T.contiguous().T)
        assert out.shape == (rows, 40) and out.is_contiguous()
        torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)
