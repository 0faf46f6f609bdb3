"""Traces, replay tables and the replay env reproduce the live engine (greedy)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specrl.engine import Action, SpecEngine
from specrl.errors import ConfigError, TraceError
from specrl.replay import ReplayBackend, ReplayTables, action_table
from specrl.serving import LiveBackend
from specrl.traces import Traces

K, W = [0, 1, 2, 4, 6], [1, 2, 3]


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_replay_step_outcomes_equal_live_engine(tiny_traces, drafter):
    """Lockstep: same admissions and actions; every step's accept lengths, drafted depths,
    verify width and commit counts are identical in live and replay."""
    pair, prompts, tr = tiny_traces
    traces = tr[drafter]
    tables = ReplayTables.build(traces, action_table(K, W), drafter, progress=False)
    live = LiveBackend(SpecEngine(pair, drafter=drafter), traces.prompt_ids)
    rep = ReplayBackend(tables, list(range(len(traces))), K, W, drafter)
    rng = np.random.default_rng(0)
    queue = list(range(len(traces)))
    rid, running, steps, accepted, packed = 0, set(), 0, 0, 0
    while queue or running:
        while queue and len(running) < 4:
            p = queue.pop(0)
            live.add(rid, p, 40)
            rep.add(rid, p, 40)
            running.add(rid)
            rid += 1
        act = Action(int(rng.choice(K)), int(rng.choice(W)))
        a, b = live.step(act), rep.step(act)
        assert a.rids == b.rids
        np.testing.assert_array_equal(a.accept_len, b.accept_len)
        np.testing.assert_array_equal(a.num_committed, b.num_committed)
        np.testing.assert_array_equal(a.draft_depth, b.draft_depth)
        assert a.tree_tokens == b.tree_tokens and a.level_sizes == b.level_sizes
        assert a.verify_rows == b.verify_rows  # the ragged verify's token rows (n-gram: rows without a match)
        assert a.prefill_rows == b.prefill_rows and a.prefill_len == b.prefill_len
        np.testing.assert_allclose(a.match_len, b.match_len)
        np.testing.assert_allclose(a.num_matches, b.num_matches)
        if drafter == "model" and act.k > 0:
            np.testing.assert_allclose(a.draft_top1, b.draft_top1, rtol=1e-4)
        assert sorted(a.finished) == sorted(b.finished)
        running -= set(a.finished)
        steps += 1
        accepted += int(a.accept_len.sum())
        packed += a.verify_rows < a.batch_size * a.tree_tokens
    assert steps > 20 and accepted > 10
    if drafter == "ngram":
        assert packed > 0, "no step had a row without an n-gram match: the ragged replay charge went untested"


def test_trace_roundtrip_and_corruption(tiny_traces, tmp_path):
    _, _, tr = tiny_traces
    path = tr["model_path"]
    t = Traces.load(path)
    assert len(t) == 16 and t.ranks is not None and t.meta["drafter"] == "model"
    # a truncated tensor file fails the checksum
    st = path.with_suffix(".safetensors")
    bad = tmp_path / "bad"
    bad.with_suffix(".safetensors").write_bytes(st.read_bytes()[:-100])
    bad.with_suffix(".json").write_text(path.with_suffix(".json").read_text())
    with pytest.raises(TraceError, match="checksum"):
        Traces.load(bad)
    # recorded for another tokenizer / model
    with pytest.raises(TraceError, match="tokenizer='.*', but 'abc' is needed.*specrl collect"):
        Traces.load(path, expect={"tokenizer": "abc"})
    with pytest.raises(TraceError, match="missing"):
        Traces.load(tmp_path / "nothing")
    meta = json.loads(path.with_suffix(".json").read_text())
    meta["format"] = 99
    bad.with_suffix(".safetensors").write_bytes(st.read_bytes())
    bad.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(TraceError, match="format 99"):
        Traces.load(bad)


def replay_cfg(path, target, drafter="ngram", **kw):
    cfg = dict(backend="replay", model=target, drafter=drafter, traces=str(path), cost_model="analytic",
               prompt_split="all", k_choices=K, w_choices=W, horizon_s=5.0,
               workload={"arrival": "closed", "concurrency": [1, 4], "max_new_tokens": 40})
    cfg.update(kw)
    return cfg


def test_replay_env_check_env(tiny_traces, tiny_pair_dirs, isolated_cache):
    from gymnasium.utils.env_checker import check_env

    import specrl

    _, prompts, tr = tiny_traces
    env = specrl.make_env(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache)))
    check_env(env.unwrapped, skip_render_check=True)


def _write(prompts, folder):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "p.jsonl"
    path.write_text("\n".join(json.dumps({"turns": [p.text], "category": p.category}) for p in prompts))
    return str(path)


def test_replay_env_refuses_mismatched_traces(tiny_traces, tiny_pair_dirs, isolated_cache):
    import specrl

    _, prompts, tr = tiny_traces
    pfile = _write(prompts, isolated_cache)
    with pytest.raises(ConfigError, match="drafter='model', but 'ngram' is needed.*specrl collect"):
        specrl.make_env(replay_cfg(tr["model_path"], tiny_pair_dirs[0], prompts=pfile))
    with pytest.raises(ConfigError, match="max_new_tokens=64.*stop at 40"):
        specrl.make_env(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=pfile,
                                   workload={"arrival": "closed", "max_new_tokens": 64}))
    with pytest.raises(ConfigError, match="have no trace"):
        specrl.make_env(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts="builtin"))


def test_replay_and_live_env_agree_with_the_same_cost_model(tiny_traces, tiny_pair_dirs, isolated_cache):
    """With the analytic cost model as the clock, the live env and the replay env give the same
    rewards and observations step by step for the same seed and actions."""
    import specrl

    pair, prompts, tr = tiny_traces
    pfile = _write(prompts, isolated_cache)
    common = dict(prompts=pfile, time_source="profiled",
                  workload={"arrival": "poisson", "rate": 3.0, "max_new_tokens": 40})
    live = specrl.make_env(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], backend="live", **common), pair=pair)
    rep = specrl.make_env(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], **common))
    o1, _ = live.reset(seed=11)
    o2, _ = rep.reset(seed=11)
    np.testing.assert_allclose(o1, o2)
    rng = np.random.default_rng(1)
    for _ in range(60):
        a = rng.integers(0, [len(K), len(W)])
        o1, r1, t1, u1, i1 = live.step(a)
        o2, r2, t2, u2, i2 = rep.step(a)
        np.testing.assert_allclose(o1, o2, rtol=1e-5)
        assert r1 == pytest.approx(r2) and (t1, u1) == (t2, u2)
        if t1 or u1:
            break


@pytest.mark.parametrize("variant", [
    dict(workload={"arrival": "closed", "concurrency": [1, 3, 6], "max_new_tokens": 40}, time_penalty="ar"),
    dict(workload={"arrival": "closed", "concurrency": [1, 3, 6], "max_new_tokens": 40}, time_penalty="ar",
         reward_per_row=True),
    dict(reward="latency", workload={"arrival": "poisson", "rate": [1.0, 6.0], "max_new_tokens": [8, 40],
                                     "max_batch_size": 4}),
    dict(reward="slo", switch_cost=2.0, workload={"arrival": "bursty", "max_new_tokens": 40, "slo_tpot_s": 0.05,
                                                  "max_batch_size": 3}),
    dict(workload={"arrival": "closed", "concurrency": [1, 3, 6], "max_new_tokens": 40, "episode_categories": [1, 2]},
         time_penalty="ar"),
], ids=["closed", "closed-per-row", "poisson-latency", "bursty-slo", "closed-episode-categories"])
def test_vector_env_matches_scalar_replay_envs(variant, tiny_traces, tiny_pair_dirs, isolated_cache):
    """The native vectorised env reproduces N independent scalar replay envs step for step,
    auto-resets included."""
    import specrl
    from specrl.envs.vector import SpecReplayVecEnv

    _, prompts, tr = tiny_traces
    cfg = replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache), horizon_s=3.0,
                     **variant)
    n = 3
    vec = SpecReplayVecEnv(cfg, n)
    scal = [specrl.make_env(cfg) for _ in range(n)]
    vec.seed(100)
    ov = vec.reset()
    for i, e in enumerate(scal):
        o, _ = e.reset(seed=100 + i)
        np.testing.assert_allclose(ov[i], o, rtol=1e-6)
    rng = np.random.default_rng(0)
    episodes = 0
    for _ in range(300):
        acts = rng.integers(0, [len(K), len(W)], size=(n, 2))
        vec.step_async(acts)
        ov, rv, dv, iv = vec.step_wait()
        for i, e in enumerate(scal):
            o, r, term, trunc, info = e.step(acts[i])
            assert rv[i] == pytest.approx(r, rel=1e-5, abs=1e-5)
            assert dv[i] == (term or trunc)
            assert iv[i]["tokens"] == info["tokens"] and iv[i]["batch_size"] == info["batch_size"]
            assert iv[i]["dt"] == pytest.approx(info["dt"], rel=1e-9)
            if term or trunc:
                episodes += 1
                np.testing.assert_allclose(iv[i]["terminal_observation"], o, rtol=1e-5, atol=1e-6)
                assert iv[i]["TimeLimit.truncated"] == trunc
                for key, val in info["episode_summary"].items():
                    assert iv[i]["episode_summary"][key] == pytest.approx(val, rel=1e-6, nan_ok=True), key
                o, _ = e.reset()
            np.testing.assert_allclose(ov[i], o, rtol=1e-5, atol=1e-6)
    assert episodes >= 3


def test_validate_replay_agrees_exactly_when_both_sides_use_the_cost_model(tiny_traces, tiny_pair_dirs,
                                                                           isolated_cache, tmp_path):
    """Per-request policies included: live they plan through SpecDecodeEnv.row_view / step_rows,
    in replay through the vector env's, and both sides must take the same steps."""
    from specrl import rowmodel
    from specrl.envs.config import load_env_config
    from specrl.envs.replay import load_replay_data
    from specrl.evaluate import parse_loads
    from specrl.replay import action_table
    from specrl.validate import table, validate

    pair, prompts, tr = tiny_traces
    cfg = load_env_config(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache),
                                     horizon_s=3.0))
    _, _, rows, tables = load_replay_data(cfg)
    rowmodel.save(rowmodel.fit(tables, np.asarray(rows), action_table(cfg.k_choices, cfg.w_choices)), tmp_path / "rm")
    res = validate(cfg, ["ar", "static:2,1", "static:6,3", "goodput", "goodput-rows", f"rowmodel:{tmp_path / 'rm'}"],
                   parse_loads(["closed:1,3"]), [0], pair=pair, progress=False, live_time="profiled")
    assert {r["policy"] for r in res["rows"]} >= {"goodput-rows", "rowmodel"}
    assert res["max_goodput_rel_error"] < 1e-9 and res["same_static_ranking"] and res["spearman"] > 0.99
    assert all(abs(r["live_accept_len"] - r["replay_accept_len"]) < 1e-9 for r in res["rows"])
    # the live side's own clock is the cost model here, so charging it on the same steps agrees
    assert all(r["live_time_vs_model"] == pytest.approx(1.0) for r in res["rows"])
    assert res["mean_step_time_corrected_error"] < 1e-9
    assert "| closed:1 | static:2,1 |" in table(res)


def test_machine_speed_is_measured_over_profiled_time(monkeypatch):
    from types import SimpleNamespace

    import specrl.profiling
    from specrl.costs import CostModel
    from specrl.validate import machine_speed

    grid = np.full((2, 2, 1), 0.010)  # the cost model says 10 ms everywhere
    cost = CostModel([1, 4], [1, 5], [128], grid.tolist())
    measured = np.array([[[0.020], [0.030]], [[0.020], [0.500]]])  # one outlier point
    monkeypatch.setattr(specrl.profiling, "forward_grid", lambda *a, **k: measured)
    pair = SimpleNamespace(target=None, device=None, vocab_size=8)  # forward_grid is stubbed out
    assert machine_speed(pair, cost) == pytest.approx(2.5)  # median of 2, 3, 2, 50


def test_validate_speed_correction_scales_replay_time(tiny_traces, tiny_pair_dirs, isolated_cache, monkeypatch):
    import specrl.validate as v
    from specrl.envs.config import load_env_config
    from specrl.evaluate import parse_loads

    pair, prompts, tr = tiny_traces
    cfg = load_env_config(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache),
                                     horizon_s=3.0))
    monkeypatch.setattr(v, "machine_speed", lambda pair, cost: 2.0)  # the machine runs at half speed
    res = v.validate(cfg, ["ar", "static:2,1"], parse_loads(["closed:2"]), [0], pair=pair, progress=False,
                     live_time="profiled", probe_speed=True)
    # both sides use the cost model, so raw agreement is exact and the correction halves replay goodput
    assert res["max_goodput_rel_error"] < 1e-9
    assert res["max_corrected_rel_error"] == pytest.approx(0.5)
    assert all(r["speed_factor"] == 2.0 for r in res["rows"])
    # the live steps took exactly the modelled time, so at half speed the cost model is off by half
    assert res["mean_step_time_corrected_error"] == pytest.approx(0.5)


def test_validate_repeats_alternate_order_and_measure_live_noise(tiny_traces, tiny_pair_dirs, isolated_cache,
                                                                 monkeypatch):
    import specrl.evaluate as ev
    from specrl.envs.config import load_env_config
    from specrl.errors import ConfigError
    from specrl.validate import summary, table, validate

    pair, prompts, tr = tiny_traces
    cfg = load_env_config(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache),
                                     horizon_s=3.0))
    calls, real = [], ev.run_live

    def spy(cfg, spec, *a, **k):  # the second live repeat of 'ar' runs 10% faster than the first
        eps = real(cfg, spec, *a, **k)
        calls.append(spec)
        if spec == "ar" and calls.count("ar") == 2:
            for e in eps:
                e.summary["goodput"] *= 1.1
        return eps

    monkeypatch.setattr(ev, "run_live", spy)
    loads = ev.parse_loads(["closed:2"])
    res = validate(cfg, ["ar", "static:2,1", "static:6,3"], loads, [0], pair=pair, progress=False,
                   live_time="profiled", repeats=2)
    assert calls == ["ar", "static:2,1", "static:6,3", "static:6,3", "static:2,1", "ar"]
    rows = {r["policy"]: r for r in res["rows"]}
    # the profiled clock is deterministic: only the doctored policy shows noise, 0.1 / mean(1, 1.1)
    assert rows["static:2,1"]["live_noise"] == 0 and rows["static:6,3"]["live_noise"] == 0
    assert rows["ar"]["live_noise"] == pytest.approx(0.1 / 1.05)
    assert rows["ar"]["live_goodput"] == pytest.approx(rows["ar"]["replay_goodput"] * 1.05)
    assert res["live_noise_max"] == pytest.approx(0.1 / 1.05)
    # replay differs from live only by the doctored 5% on 'ar', less than its noise: every pair
    # resolved beyond the noise keeps its order
    assert 1 <= res["resolved_static_pairs"] <= 3
    assert res["resolved_static_pairs_agreeing"] == res["resolved_static_pairs"]
    assert "live noise" in summary(res) and "| 9.5% |" in table(res)
    with pytest.raises(ConfigError, match="repeats 0"):
        validate(cfg, ["ar"], loads, [0], pair=pair, progress=False, live_time="profiled", repeats=0)


def test_reward_per_row_divides_by_the_batch(tiny_traces, tiny_pair_dirs, isolated_cache):
    """reward_per_row: the same episode and actions give the plain reward / batch size at every step."""
    from specrl.envs.vector import SpecReplayVecEnv

    _, prompts, tr = tiny_traces
    base = dict(prompts=_write(prompts, isolated_cache), horizon_s=3.0, time_penalty="ar",
                workload={"arrival": "closed", "concurrency": [1, 3, 6], "max_new_tokens": 40})
    envs = [SpecReplayVecEnv(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], reward_per_row=flag, **base), 3)
            for flag in (False, True)]
    for v in envs:
        v.seed(7)
        v.reset()
    rng = np.random.default_rng(3)
    batches = set()
    for _ in range(80):
        acts = rng.integers(0, [len(K), len(W)], size=(3, 2))
        outs = []
        for v in envs:
            v.step_async(acts)
            outs.append(v.step_wait())
        (_, r_plain, _, infos), (_, r_row, _, _) = outs
        b = np.array([max(1, i["batch_size"]) for i in infos])
        batches |= set(b.tolist())
        np.testing.assert_allclose(r_row, r_plain / b, rtol=1e-5, atol=1e-6)
    assert len(batches) > 1  # the check saw more than one batch size


def test_action_outcomes_leave_out_the_newcomers_prefill(tiny_traces, tiny_pair_dirs, isolated_cache):
    """``prefill=False`` (what the oracle ranks by): the seconds drop by the same prefill cost for
    every action in steps that admit requests, and are unchanged in the other steps; the
    committed tokens never change. Both kinds of step are seen."""
    from specrl.envs.vector import SpecReplayVecEnv

    _, prompts, tr = tiny_traces
    cfg = replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache), horizon_s=3.0,
                     workload={"arrival": "closed", "concurrency": [1, 3, 6], "max_new_tokens": 40})
    vec = SpecReplayVecEnv(cfg, 3)
    vec.seed(5)
    vec.reset()
    rng = np.random.default_rng(1)
    seen = {True: 0, False: 0}
    for _ in range(60):
        acts, tok, sec = vec.action_outcomes()
        acts0, tok0, sec0 = vec.action_outcomes(prefill=False)
        assert acts0 == acts
        np.testing.assert_array_equal(tok0, tok)
        gap = sec - sec0  # (N, A)
        admitting = (vec.new & vec.active).any(1)  # (N,)
        for i in range(vec.num_envs):
            seen[bool(admitting[i])] += 1
            if admitting[i]:
                assert gap[i].min() > 0 and np.ptp(gap[i]) == pytest.approx(0.0, abs=1e-12)
            else:
                np.testing.assert_array_equal(gap[i], 0.0)
        vec.step_async(rng.integers(0, [len(K), len(W)], size=(3, 2)))
        vec.step_wait()
    assert seen[True] > 0 and seen[False] > 0


def test_evaluation_ranks_the_oracle_by_decode_seconds(tiny_traces, tiny_pair_dirs, isolated_cache):
    """The evaluation harness feeds the oracle ``action_outcomes(prefill=False)``, and its choices
    are the argmax of tokens / those seconds."""
    from specrl.envs.config import load_env_config, policy_context
    from specrl.envs.vector import SpecReplayVecEnv
    from specrl.evaluate import parse_loads, run_replay
    from specrl.policies import make_policy

    _, prompts, tr = tiny_traces
    cfg = load_env_config(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache),
                                     horizon_s=2.0))
    calls: list[bool] = []

    class Spy(SpecReplayVecEnv):
        def action_outcomes(self, prefill: bool = True):
            calls.append(prefill)
            return super().action_outcomes(prefill)

    picks: list[tuple[tuple[int, int], tuple[int, int]]] = []
    ctx = policy_context(cfg)
    oracle_cls = type(make_policy("oracle", ctx))

    class SpyOracle(oracle_cls):
        def decide(self, features):
            actions, tokens, seconds = self._outcomes
            want = actions[int(np.argmax(tokens / seconds))]
            got = super().decide(features)
            picks.append((want, got))
            return got

    def make():
        return SpyOracle(ctx)

    eps = run_replay(cfg, "oracle", parse_loads(["closed:4"]), [0, 1], make, make_vec=lambda c, n: Spy(c, n))
    assert len(eps) == 2 and calls and not any(calls)
    assert picks and all(want == got for want, got in picks)
