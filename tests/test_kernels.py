"""The CPU few-row linear path: same numbers as nn.Linear, survives deepcopy, can be turned off."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from specrl.kernels import MAX_ROWS, PAD_TO, SkinnyLinear, kernel_tag, use_skinny_linear


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
