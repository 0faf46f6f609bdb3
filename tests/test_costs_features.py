"""Cost model interpolation and persistence; the feature tracker on hand-written steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specrl.costs import CostModel, interp3
from specrl.errors import TraceError
from specrl.features import INDEX, FeatureTracker


def test_interpolation_hits_grid_points_and_is_monotone_where_the_data_is():
    cm = CostModel.analytic()
    for i, b in enumerate(cm.batch):
        for j, n in enumerate(cm.tokens):
            for k, c in enumerate(cm.context):
                assert cm.verify_time(b, n, c) == pytest.approx(cm.verify[i][j][k])
    # the analytic grid increases in batch, tokens and context: so must every interpolated value
    ctx = np.linspace(100, 5000, 17)
    for b in range(1, 17):
        t = [cm.verify_time(b, n, 600) for n in range(1, 34)]
        assert np.all(np.diff(t) >= -1e-12)
        assert np.all(np.diff([cm.verify_time(b, 5, c) for c in ctx]) >= -1e-12)
    assert np.all(np.diff([cm.verify_time(b, 5, 600) for b in range(1, 17)]) >= -1e-12)


def test_interp3_vectorised_equals_scalar():
    rng = np.random.default_rng(0)
    vals = rng.random((3, 4, 2))
    axes = (np.array([0.0, 1, 2]), np.array([0.0, 1, 2, 3]), np.array([0.0, 10]))
    pts = rng.random((50, 3)) * [2, 3, 10]
    vec = interp3(vals, axes, pts[:, 0], pts[:, 1], pts[:, 2])
    for p, v in zip(pts, vec):
        assert float(interp3(vals, axes, p[0], p[1], p[2])) == pytest.approx(v)


def test_step_time_components():
    cm = CostModel.analytic()
    plain = cm.step_time("ngram", 0, 4, 1, (), 300)
    spec = cm.step_time("ngram", 4, 4, 9, (2, 2, 2, 2), 300)
    assert spec > plain
    assert cm.step_time("ngram", 4, 4, 1, (), 300) == pytest.approx(plain + 4 * cm.ngram_per_row)
    assert cm.step_time("ngram", 0, 4, 1, (), 300, prefill_rows=2, prefill_len=100) > plain
    # a model drafter: one forward for the pending tokens + one per inner level (3 of the 4 levels)
    model = cm.step_time("model", 4, 4, 9, (2, 2, 2, 2), 300)
    over = cm.overhead[0] + cm.overhead[1] * 4
    assert model == pytest.approx(4 * cm.draft_forward_time(4, 2, 300) + cm.verify_time(4, 9, 300) + over)


def test_cost_model_roundtrip_and_errors(tmp_path):
    cm = CostModel.analytic()
    p = cm.save(tmp_path / "c.json")
    back = CostModel.load(p)
    assert back.verify_time(3, 7, 500) == cm.verify_time(3, 7, 500)
    with pytest.raises(TraceError, match="does not exist"):
        CostModel.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(TraceError, match="not valid JSON"):
        CostModel.load(tmp_path / "bad.json")
    d = json.loads(p.read_text())
    d["verify"] = d["verify"][:2]
    (tmp_path / "shape.json").write_text(json.dumps(d))
    with pytest.raises(TraceError, match="shape"):
        CostModel.load(tmp_path / "shape.json")


def test_feature_tracker_on_hand_written_steps():
    tr = FeatureTracker(ema=0.5)
    v = tr.vector()
    assert v[INDEX["accept_d1"]] == 0.5 and v[INDEX["prev_w"]] == 1.0
    tr.update_load(3, 2, [100, 200, 300])
    # rows: accepted 2 of depth 4; accepted 0 of depth 4; did not draft (n-gram, no match)
    tr.update_step(np.array([2, 0, 0]), np.array([4, 4, 0]), 4, 2, match_len=np.array([3.0, 1.0, 0.0]),
                   num_matches=np.array([3.0, 1.0, 0.0]))
    v = tr.vector()
    assert (v[INDEX["batch_size"]], v[INDEX["queue_len"]], v[INDEX["mean_context"]], v[INDEX["max_context"]]) == (
        3, 2, 200, 300)
    # depth 1: rows 0 and 1 eligible, 1 accepted -> rate 0.5 -> EMA 0.5; depth 2: row 0 only, accepted -> 0.75;
    # depth 3: row 0 only, rejected -> 0.25; depth 5+: nobody drafted -> prior kept
    assert v[INDEX["accept_d1"]] == pytest.approx(0.5)
    assert v[INDEX["accept_d2"]] == pytest.approx(0.75)
    assert v[INDEX["accept_d3"]] == pytest.approx(0.25)
    assert v[INDEX["accept_d5"]] == pytest.approx(0.5)
    assert v[INDEX["last_accept_len"]] == pytest.approx(2 / 3)
    assert v[INDEX["match_len"]] == pytest.approx(4 / 3)
    assert v[INDEX["num_matches"]] == pytest.approx(np.mean(np.log1p([3, 1, 0])))
    assert (v[INDEX["prev_k"]], v[INDEX["prev_w"]]) == (4, 2)
    # NaN statistics (k = 0 with a model drafter) keep the previous values
    tr.update_step(np.array([0]), np.array([0]), 0, 1, draft_top1=np.array([np.nan]), match_len=np.array([np.nan]))
    assert tr.vector()[INDEX["match_len"]] == pytest.approx(4 / 3)
    tr.record_arrivals(4, now=1.0, window=1.0)
    assert tr.vector()[INDEX["arrival_rate"]] == pytest.approx(2.0)  # EMA 0.5 of 0 and 4/s


def test_verify_scale_multiplies_engine_time_not_the_isolated_grid(tmp_path):
    base = CostModel.analytic()
    d = base.to_json()
    d["verify_scale"] = [2.0, 1.0, 1.0, 1.0, 0.5]
    cm = CostModel(**{**d, "overhead": tuple(d["overhead"]), "prefill": tuple(d["prefill"])})
    assert cm.verify_time(1, 5, 128) == pytest.approx(2 * base.verify_time(1, 5, 128))
    assert cm.verify_time(16, 5, 128) == pytest.approx(0.5 * base.verify_time(16, 5, 128))
    assert cm.verify_time(4, 9, 1024) == pytest.approx(base.verify_time(4, 9, 1024))
    assert cm.isolated_verify_time(1, 5, 128) == pytest.approx(base.verify_time(1, 5, 128))
    assert CostModel.load(cm.save(tmp_path / "c.json")).verify_time(1, 5, 128) == cm.verify_time(1, 5, 128)
    with pytest.raises(TraceError, match="one positive factor per batch size"):
        CostModel(**{**d, "verify_scale": [1.0, 2.0]})


def test_engine_calibration_corrects_an_inflated_grid():
    """Calibrating on real engine steps pulls a grid that says forwards take 20x longer than they
    do back down, at every batch size, and measures the step's bookkeeping as overhead."""
    import torch
    from tiny import tiny_pair

    from specrl.profiling import calibrate_on_engine, forward_grid

    torch.manual_seed(0)
    pair = tiny_pair(vocab=64)
    batch, tokens, context = [1, 2], [1, 5, 9], [64, 128]
    grid = forward_grid(pair.target, pair.device, batch, tokens, context, 2, pair.vocab_size)
    inflated = CostModel(batch, tokens, context, (20 * grid).tolist())
    scale, (a, b) = calibrate_on_engine(pair, "ngram", inflated, 2, np.random.default_rng(0))
    assert len(scale) == 2 and all(0 < s < 0.5 for s in scale)
    assert a >= 0 and b >= 0 and a + b > 0


def test_profile_grid_caches_equal_row_by_row_prefills():
    """The profiler prefills one row per context and replicates it; the result must be the cache
    that separate prefills of that row build (layout, capacity, contents), and stay independent
    of the row it was copied from."""
    import torch
    from tiny import tiny_pair

    from specrl.kvcache import RaggedKVCache, prefill
    from specrl.profiling import replicate_rows

    pair = tiny_pair(vocab=64)
    seq = np.random.default_rng(0).integers(0, 64, size=97)
    row = RaggedKVCache()
    prefill(pair.target, row, [seq], pair.device)
    for rows in (1, 3, 4):
        ref = RaggedKVCache()
        for _ in range(rows):
            prefill(pair.target, ref, [seq], pair.device)
        got = replicate_rows(row, rows)
        assert (got.B, got.T) == (ref.B, ref.T) == (rows, 96)
        assert torch.equal(got.valid[:rows, :96], ref.valid[:rows, :96])
        for mine, theirs in zip(got.keys + got.values, ref.keys + ref.values):
            assert mine.shape == theirs.shape
            torch.testing.assert_close(mine[:rows, :, :96], theirs[:rows, :, :96])
        got.keys[0][0].zero_()
        assert row.keys[0].abs().sum() > 0  # the source row is untouched


def test_verify_times_row_equals_verify_time_bit_for_bit():
    """The planner reads a whole row of verify times per env from one lookup; it must charge what
    verify_time charges at every integer tokens per row (batches and contexts off the grid too)."""
    cm = CostModel.analytic()
    rng = np.random.default_rng(0)
    batch, ctx = rng.integers(1, 70, 40), rng.uniform(10, 5000, 40)
    rows = cm.verify_times(batch, ctx)
    assert rows.shape == (40, 66)
    for t in range(66):
        assert np.array_equal(rows[:, t], cm.verify_time(batch, np.full(40, t), ctx)), t
