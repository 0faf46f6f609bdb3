"""Each baseline rule's logic on hand-written inputs."""

from __future__ import annotations

import numpy as np
import pytest

from specrl.costs import CostModel
from specrl.errors import ConfigError
from specrl.features import INDEX, initial_features
from specrl.policies import PolicyContext, make_policy
from specrl.policies.goodput import expected_accepted
from specrl.policies.rules import roc_threshold

CTX = PolicyContext([0, 1, 2, 3, 4, 6, 8], [1, 2, 3, 4], CostModel.analytic(), "ngram")


def feats(**kw):
    v = initial_features(1)[0]
    for name, val in kw.items():
        v[INDEX[name]] = val
    return v


def test_static_and_ar():
    assert make_policy("ar", CTX).decide(feats()) == (0, 1)
    assert make_policy("static:4,2", CTX).decide(feats()) == (4, 2)
    assert make_policy("static:3", CTX).decide(feats()) == (3, 1)
    assert make_policy("hf-constant", CTX).decide(feats()) == (8, 1)  # HF's 20, clipped to the table
    for bad in ("static:x", "static:1,2,3", "static:", "static:2,x"):
        with pytest.raises(ConfigError, match=f"{bad} is invalid. Allowed: static:K or static:K,W"):
            make_policy(bad, CTX)
    with pytest.raises(ConfigError, match="k=99 is out of range"):
        make_policy("static:99", CTX)
    with pytest.raises(ConfigError, match="w=9 is out of range"):
        make_policy("static:2,9", CTX)
    with pytest.raises(ConfigError, match="Did you mean 'goodput'"):
        make_policy("goodptu", CTX)


def test_hf_heuristic_schedule():
    p = make_policy("hf-heuristic", CTX)
    assert p.decide(feats()) == (8, 1)
    p.observe(feats(), {"k": 8, "accept_len_mean": 3.0})  # not all accepted: k - 1
    assert p.k == 7
    p.observe(feats(), {"k": 7, "accept_len_mean": 7.0})  # all accepted: k + 2
    assert p.k == 9
    assert p.decide(feats()) == (8, 1)  # snapped to the table
    for _ in range(20):
        p.observe(feats(), {"k": 1, "accept_len_mean": 0.0})
    assert p.k == 1  # never below 1


def test_hf_confidence_threshold_and_roc():
    p = make_policy("hf-confidence", CTX)
    assert p.decide(feats(draft_top1=0.2)) == (0, 1)  # below the 0.4 threshold: no drafting
    # p^k >= 0.4: 0.9^8 = 0.43 -> k = 8; 0.7^2 = 0.49, 0.7^3 = 0.34 -> k = 2
    assert p.decide(feats(draft_top1=0.9)) == (8, 1)
    assert p.decide(feats(draft_top1=0.7)) == (2, 1)
    # ROC refit: accepted drafts above 0.6, rejected below -> threshold moves into (0.3, 0.6]
    pairs = [(0.9, True), (0.8, True), (0.6, True), (0.3, False), (0.2, False), (0.1, False)]
    th = roc_threshold(pairs, 0.4)
    assert 0.3 < th <= 0.6
    assert roc_threshold([(0.5, True)] * 3, 0.4) == 0.4  # one class only: keep the current threshold


def test_sglang_ema_warmup_tiers_and_hysteresis():
    p = make_policy("sglang-ema", CTX)
    assert p.decide(feats(batch_size=1)) == (4, 1)  # warm-up default
    for _ in range(8):
        p.observe(feats(), {"k": 4, "accept_len_mean": 3.6})
        p.decide(feats(batch_size=1))
    # EMA of 3.6 -> target k = round(4.6) = 5 -> snapped to the table (4 or 6)
    assert p.decide(feats(batch_size=1))[0] in (4, 6)
    assert p.decide(feats(batch_size=16))[0] <= 1  # large-batch tier caps k
    q = make_policy("sglang-ema", CTX)
    for _ in range(12):
        q.observe(feats(), {"k": 4, "accept_len_mean": 0.1})
        q.decide(feats(batch_size=2))
    assert q.decide(feats(batch_size=2))[0] == 1  # low acceptance: speculate little


def test_ucb_tries_every_arm_then_exploits():
    p = make_policy("ucb", CTX)
    arms = set()
    for _ in range(len(p.arms)):
        a = p.decide(feats())
        arms.add(a)
        good = a == (2, 1)
        p.observe(feats(), {"tokens": 10 if good else 2, "dt": 0.1})
    assert len(arms) == len(p.arms)
    picks = []
    for _ in range(200):
        a = p.decide(feats())
        picks.append(a)
        p.observe(feats(), {"tokens": 10 if a == (2, 1) else 2, "dt": 0.1})
    assert picks[100:].count((2, 1)) > 70  # mostly the best arm once explored


def test_expected_accepted_matches_hand_computation():
    alpha = np.full(8, 0.5)
    assert expected_accepted(0, 1, alpha) == 0.0
    assert expected_accepted(3, 1, alpha) == pytest.approx(0.5 + 0.25 + 0.125)
    # a width-2 tree adds branches, so it can only accept more
    assert expected_accepted(4, 2, alpha) > expected_accepted(4, 1, alpha)


def test_path_tables_batch_equals_one_tree_at_a_time():
    """The goodput rule scores every action through one block-diagonal PathTables: each block
    must give what its tree gives alone (a wrong block offset would mix trees)."""
    from specrl.policies.goodput import PathTables
    from specrl.tree import tree_shape

    actions = [(0, 1), (1, 1), (3, 2), (8, 4), (2, 3), (0, 1), (6, 1)]
    alpha = np.array([0.9, 0.7, 0.6, 0.0, 0.5, 0.4, 0.3, 0.2])
    batch = PathTables([tree_shape(k, w) if k else None for k, w in actions]).expected_accepted(alpha)
    alone = [expected_accepted(k, w, alpha) for k, w in actions]
    assert batch == pytest.approx(alone, abs=1e-12)
    assert batch[0] == batch[5] == 0.0 and batch[1] == pytest.approx(0.9)
    # depth 4 has acceptance 0 (siblings included), so nothing at depth >= 4 counts
    deeper = alpha.copy()
    deeper[4:] = 1.0
    assert expected_accepted(8, 4, deeper) == pytest.approx(batch[3], abs=1e-12)


def test_goodput_picks_ar_at_low_acceptance_and_speculates_at_high():
    p = make_policy("goodput", CTX)
    low = feats(batch_size=1, mean_context=200, **{f"accept_d{d}": 0.0 for d in range(1, 9)})
    high = feats(batch_size=1, mean_context=200, draft_top1=1.0, **{f"accept_d{d}": 0.9 for d in range(1, 9)})
    assert p.decide(low)[0] == 0
    assert p.decide(high)[0] >= 4
    # at large batch the analytic verify cost grows with batch x tokens: speculate less
    big = feats(batch_size=16, mean_context=200, draft_top1=1.0, **{f"accept_d{d}": 0.5 for d in range(1, 9)})
    small = feats(batch_size=1, mean_context=200, draft_top1=1.0, **{f"accept_d{d}": 0.5 for d in range(1, 9)})
    assert p.decide(big)[0] * p.decide(big)[1] <= p.decide(small)[0] * p.decide(small)[1]


def test_goodput_needs_a_cost_model():
    with pytest.raises(ConfigError, match="cost model"):
        make_policy("goodput", PolicyContext())


def test_oracle_picks_best_step_goodput_and_needs_outcomes():
    p = make_policy("oracle", CTX)
    with pytest.raises(ConfigError, match="replay"):
        p.decide(feats())
    p.set_outcomes([(0, 1), (2, 1), (4, 2)], np.array([4, 7, 9]), np.array([0.04, 0.05, 0.09]))
    assert p.decide(feats()) == (2, 1)  # 140 tok/s beats 100 and 100


def test_goodput_scales_by_match_coverage_and_probes_out_of_k0():
    from specrl.features import FeatureTracker

    p = make_policy("goodput", CTX)
    tr = FeatureTracker()
    picks = []
    for _ in range(34):  # no request has a match: drafting is pointless...
        f = tr.vector()
        f[[INDEX["batch_size"], INDEX["mean_context"], INDEX["draft_top1"]]] = (1, 200, 0.0)
        f[INDEX["accept_d1"] : INDEX["accept_d1"] + 8] = 0.9
        k, w = p.decide(f)
        picks.append(k)
        tr.update_step(np.array([0]), np.array([k]), k, w)
    # ...but after 16 steps at k = 0 (the feature since_draft) it drafts once to refresh its estimates
    assert [i for i, k in enumerate(picks) if k > 0] == [16, 33]
    # the rule keeps no state: the same features give the same decision, whatever came before
    f = feats(batch_size=1, mean_context=200, draft_top1=0.0, since_draft=16, **{f"accept_d{d}": 0.9 for d in range(1, 9)})
    first, again = p.decide(f), p.decide(f)
    assert first[0] > 0 and again == first
    assert p.decide(feats(batch_size=1, mean_context=200, draft_top1=0.0, since_draft=15))[0] == 0
    with pytest.raises(ConfigError, match=r"probe_every=65 \(batch size 1\) is outside 1..64"):
        from specrl.policies.goodput import GoodputArgmax
        GoodputArgmax(CTX, probe_every=65)


def test_since_draft_counts_steps_without_a_draft_and_saturates():
    from specrl.features import SINCE_DRAFT_CAP, FeatureTracker

    tr = FeatureTracker()
    assert tr.vector()[INDEX["since_draft"]] == 0
    for i in range(1, 4):
        tr.update_step(np.array([0, 0]), np.array([0, 0]), 0, 1)
        assert tr.vector()[INDEX["since_draft"]] == i
    tr.update_step(np.array([1, 0]), np.array([2, 2]), 2, 1)
    assert tr.vector()[INDEX["since_draft"]] == 0
    for _ in range(SINCE_DRAFT_CAP + 10):
        tr.update_step(np.array([0]), np.array([0]), 0, 1)
    assert tr.vector()[INDEX["since_draft"]] == SINCE_DRAFT_CAP


def test_goodput_probe_period_by_batch_size():
    """``goodput:1=4,8=32``: probe after 4 steps at k = 0 below batch 8, after 32 from batch 8 on."""
    p = make_policy("goodput:1=4,8=32", CTX)
    assert p.name == "goodput:1=4,8=32" and make_policy("goodput", CTX).name == "goodput"
    assert [p.probe_period(b) for b in (1, 7, 8, 16)] == [4, 4, 32, 32]
    base = dict(mean_context=200, draft_top1=0.0, **{f"accept_d{d}": 0.9 for d in range(1, 9)})
    assert p.decide(feats(batch_size=1, since_draft=4, **base))[0] > 0  # small batch: probes at 4
    assert p.decide(feats(batch_size=1, since_draft=3, **base))[0] == 0
    assert p.decide(feats(batch_size=8, since_draft=31, **base))[0] == 0  # large batch: waits for 32
    assert p.decide(feats(batch_size=8, since_draft=32, **base))[0] > 0
    one = make_policy("goodput:8", CTX)
    assert [one.probe_period(b) for b in (1, 16)] == [8, 8]


@pytest.mark.parametrize("spec, match", [
    ("goodput:x", "goodput:x is invalid. Allowed: goodput:P"),
    ("goodput:1=4,8", "goodput:1=4,8 is invalid"),
    ("goodput:1=4,1=8", "goodput:1=4,1=8 is invalid"),
    ("goodput:2=4", "must start at batch size 1"),
    ("goodput:0", "probe_every=0 .* is outside 1..64"),
    ("goodput:1=4,8=65", r"probe_every=65 \(batch size 8\) is outside 1..64"),
])
def test_goodput_probe_spec_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        make_policy(spec, CTX)


def test_cli_policy_list_keeps_commas_inside_specs():
    from specrl.evaluate import _split_policies

    assert _split_policies("ar, static:4,1,goodput:1=4,8=16,static:3,goodput:8,oracle") == [
        "ar", "static:4,1", "goodput:1=4,8=16", "static:3", "goodput:8", "oracle"]


def test_eval_table_marks_missing_references_instead_of_nan():
    from specrl.evaluate import markdown_table

    def m(g):
        return {"goodput": (g, 0.5), "accept_len": (0.3,), "latency_p50": (1.0,), "latency_p99": (2.0,),
                "tpot_p50": (0.05,), "tpot_p99": (0.07,)}

    alone = markdown_table({"goodput": {"closed:1": m(20.0)}}, ["closed:1"], ["goodput"])
    assert "nan" not in alone and "| 20.0 ± 0.5 | - |" in alone and alone.endswith("| - |")
    both = markdown_table({"ar": {"closed:1": m(10.0)}, "goodput": {"closed:1": m(20.0)},
                           "oracle": {"closed:1": m(25.0)}}, ["closed:1"], ["ar", "goodput", "oracle"])
    assert "| closed:1 | goodput | 20.0 ± 0.5 | 2.00x |" in both and "| 0.80 |" in both
