"""Per-request actions in replay: the ragged verify charge, step_rows, the row view, the planner,
the learned per-request table (rowmodel), goodput-rows and the per-request oracle."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from test_replay import _write, replay_cfg

from specrl.costs import CostModel
from specrl.envs.config import load_env_config, policy_context
from specrl.envs.vector import SpecReplayVecEnv
from specrl.errors import ConfigError
from specrl.features import ACCEPT_DEPTHS, INDEX, NUM_FEATURES
from specrl.policies import make_policy
from specrl.replay import popcount64
from specrl.rows import RowView, copy_runs, plan_rows


@pytest.fixture()
def cfg(tiny_traces, tiny_pair_dirs, isolated_cache):
    _, prompts, tr = tiny_traces
    return load_env_config(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache),
                                      horizon_s=3.0, workload={"arrival": "closed", "concurrency": [4],
                                                               "max_new_tokens": 40}))


def test_cost_model_charges_fractional_tokens_per_row_linearly():
    cm = CostModel.analytic()
    for b, c in ((1, 200.0), (4, 700.0), (16, 3000.0)):
        lo, hi = cm.verify_time(b, 2, c), cm.verify_time(b, 3, c)
        assert cm.verify_time(b, 2.25, c) == pytest.approx(0.75 * lo + 0.25 * hi)
        assert cm.verify_time(b, 2.0, c) == lo  # integers: the grid value, unchanged
    got = cm.verify_time(np.array([4, 4]), np.array([2.5, 3.0]), np.array([700.0, 700.0]))
    assert got[1] == cm.verify_time(4, 3, 700.0) and cm.verify_time(4, 2, 700.0) < got[0] < got[1]


def test_verify_mode_is_validated():
    with pytest.raises(ConfigError, match="verify"):
        load_env_config(None, verify="packed")


def test_copy_runs_count_consecutive_hits_within_each_prompt():
    hit = np.array([1, 1, 0, 1, 1, 1, 1, 1, 0], bool)
    assert copy_runs(np.array([0, 5, 9]), hit).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def test_ragged_verify_charges_rows_their_own_trees_and_plans_never_lose(cfg):
    """Same rows and actions: ragged and padded commit the same tokens and the ragged step costs at
    most the padded one (less where some row proposes a smaller tree); a per-row plan on the actual
    outcomes is never below the best single action for the whole batch, exactly timed."""
    pad, rag = SpecReplayVecEnv(replace(cfg, verify="padded"), 2), SpecReplayVecEnv(cfg, 2)
    assert cfg.verify == "ragged"  # the default, as the engine's
    for env in (pad, rag):
        env.seed(7)
        env.reset()
    n_w = len(cfg.w_choices)
    ctx = policy_context(cfg)
    rng = np.random.default_rng(0)
    cheaper = checked = 0
    for _ in range(40):
        a = rng.integers(0, len(pad.actions_kw), size=2)
        p, r = pad._outcome(a), rag._outcome(a)
        assert np.array_equal(p["committed"], r["committed"])
        assert np.all(r["dt"] <= p["dt"] + 1e-12)
        cheaper += int(np.sum(r["dt"] < p["dt"] - 1e-9))
        value = rag.row_outcomes()
        choice = plan_rows(value, rag.row_view(), ctx.cost_model, cfg.drafter, rag.actions_kw)
        out = rag._outcome(np.zeros(2, np.int64), prefill=False, row_actions=choice)
        got = out["committed"].sum(1) / out["dt"]
        batch_g = [(lambda o: o["committed"].sum(1) / o["dt"])(rag._outcome(np.full(2, b), prefill=False))
                   for b in range(len(rag.actions_kw))]
        assert np.all(got >= np.max(batch_g, axis=0) - 1e-9)
        checked += int(rag.active.any())
        for env in (pad, rag):
            env.step_async(np.stack([a // n_w, a % n_w], 1))
            env.step_wait()
    assert checked > 20 and cheaper > 0


def test_step_rows_gives_every_row_its_own_action(cfg):
    vec = SpecReplayVecEnv(cfg, 1)
    vec.seed(3)
    vec.reset()
    tb = vec.tables
    kw = [tuple(x) for x in vec.actions_kw.tolist()]
    k0, k4 = kw.index((0, 1)), kw.index((4, 2))
    steps = mixed = 0
    for _ in range(500):
        if steps >= 30:
            break
        valid = vec.active[0].copy()
        if valid.sum() < 2:
            vec.step_async(np.zeros((1, 2), np.int64))
            vec.step_wait()
            continue
        acts = np.where(np.arange(vec.S) % 2 == 0, k0, k4)[None]  # (1, S): alternate rows
        rows = tb.offsets[vec.trow[0]] + vec.pos[0]
        expect = np.minimum(tb.accept[rows, acts[0]].astype(int) + 1, vec.limit[0] - vec.pos[0])
        pos0 = vec.pos[0].copy()
        view = vec.row_view()
        assert np.array_equal(view.row_tokens[0][valid], (1 + popcount64(tb.mask[rows]))[valid])
        assert np.array_equal(view.tokens_left[0][valid], (vec.maxnew[0] - vec.pos[0])[valid])
        _, _, done, info = vec.step_rows(acts)
        if done[0]:
            break
        ok = valid & (vec.pos[0] > pos0)  # rows still holding the same request (a newcomer restarts at 0)
        assert np.array_equal((vec.pos[0] - pos0)[ok], expect[ok])
        deep = (valid & (acts[0] == k4)).any()
        mixed += int(deep and (valid & (acts[0] == k0)).any())
        assert vec.obs[0, INDEX["prev_k"]] == (4 if deep else 0)  # the deepest row's action
        steps += 1
    assert mixed > 5
    with pytest.raises(ConfigError, match="expected"):
        vec.step_rows(np.zeros((2, vec.S), np.int64))
    with pytest.raises(ConfigError, match="must index"):
        vec.step_rows(np.full((1, vec.S), len(vec.actions_kw)))


def _view(match_len, valid=None, tokens_left=100, n_act=3):
    s = len(match_len)
    valid = np.ones(s, bool) if valid is None else np.asarray(valid)
    row_tokens = np.tile(np.array([1, 5, 9])[:n_act], (s, 1))
    return RowView(valid[None], np.asarray(match_len, float)[None], np.ones((1, s)), np.zeros((1, s), int),
                   np.full((1, s), tokens_left), np.full((1, s), 300), row_tokens[None], np.arange(s)[None])


def test_planner_drafts_where_acceptance_is_likely_and_only_there():
    """Rows expected to accept 3.5 of 4 drafts get the long chain, rows expected to accept none stay
    at k = 0; at one row the plan matches the best single action."""
    cm = CostModel.analytic()
    actions = np.array([[0, 1], [4, 1], [8, 1]])
    value = np.array([[[1.0, 4.5, 5.0], [1.0, 1.0, 1.0], [1.0, 4.5, 5.0], [1.0, 1.0, 1.0]]])  # (1, S=4, A)
    view = _view([3, 0, 3, 0])
    choice = plan_rows(value, view, cm, "ngram", actions)[0]
    assert choice[1] == 0 and choice[3] == 0 and choice[0] > 0 and choice[2] > 0
    batch_only = plan_rows(value, view, cm, "ngram", actions, iters=-1)[0]
    assert len(set(batch_only.tolist())) == 1  # iters=-1: one action for the batch


def test_goodput_rows_drafts_rows_with_a_match_and_probes_stale_estimates(cfg):
    pol = make_policy("goodput-rows", policy_context(cfg))
    feats = np.zeros((1, NUM_FEATURES), np.float32)
    view = RowView(*(np.zeros((1, 4), x) for x in (bool, float, float, int, int, int)),
                   np.ones((1, 4, len(pol.actions_kw)), int), np.arange(4)[None])
    view.valid[:] = True
    view.tokens_left[:] = 100
    view.context[:] = 300
    view.match_len[0, :2] = 3
    view.row_tokens = np.tile(1 + pol.actions_kw[:, 0] * pol.actions_kw[:, 1], (1, 4, 1))
    ks = pol.actions_kw[:, 0]
    feats[0, INDEX["accept_d1"] : INDEX["accept_d1"] + ACCEPT_DEPTHS] = 0.95  # near-certain acceptance
    choice = pol.decide_rows(feats, view)[0]
    assert (ks[choice[:2]] > 0).all() and (ks[choice[2:]] == 0).all()
    feats[0, INDEX["accept_d1"] : INDEX["accept_d1"] + ACCEPT_DEPTHS] = 0.0  # nothing accepted lately: no drafting ...
    assert (ks[pol.decide_rows(feats, view)[0]] == 0).all()
    feats[0, INDEX["since_draft"]] = 16  # ... until the probe period is over: rows with a match probe
    probe = pol.decide_rows(feats, view)[0]
    assert (ks[probe[:2]] > 0).all() and (ks[probe[2:]] == 0).all()


def test_rowmodel_fit_save_load_and_refusals(cfg, tmp_path):
    from specrl import rowmodel
    from specrl.envs.replay import load_replay_data
    from specrl.replay import action_table

    _, _, rows, tables = load_replay_data(cfg)
    actions = action_table(cfg.k_choices, cfg.w_choices)
    art = rowmodel.fit(tables, np.asarray(rows), actions)
    assert art["fit"]["mae"] < art["fit"]["mae_constant"]
    table = np.asarray(art["table"])
    assert table.shape == (rowmodel.num_buckets(art["edges"]), len(actions))
    k = np.array([a[0] for a in actions])
    assert np.all(table[:, k == 0] == 0) and table[:, k > 0].max() > 0  # k = 0 never accepts a draft
    path = rowmodel.save(art, tmp_path / "rm")
    pol = make_policy(f"rowmodel:{tmp_path / 'rm'}", policy_context(cfg))
    vec = SpecReplayVecEnv(cfg, 2)
    vec.seed(1)
    obs = vec.reset()
    choice = pol.decide_rows(obs, vec.row_view())
    assert choice.shape == vec.active.shape
    with pytest.raises(ConfigError, match="per request"):
        pol.decide(obs[0])
    with pytest.raises(ConfigError, match="No rowmodel artifact"):
        rowmodel.load(tmp_path / "nothing")
    bad = dict(art, kind="accmodel")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "rowmodel.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="not a rowmodel artifact"):
        rowmodel.load(tmp_path / "bad")
    path.write_text(json.dumps(dict(art, table=art["table"][:-1])))
    with pytest.raises(ConfigError, match="table has shape"):
        rowmodel.load(path)
    path.write_text(json.dumps(art))
    with pytest.raises(ConfigError, match="trained for actions"):
        make_policy(f"rowmodel:{tmp_path / 'rm'}", policy_context(replace(cfg, k_choices=[*cfg.k_choices, 8])))
    with pytest.raises(ConfigError, match="rowmodel: needs a directory"):
        make_policy("rowmodel", policy_context(cfg))


def test_rowmodel_calibration_follows_each_request_by_its_id(cfg, tmp_path):
    """Each request's realized / predicted accepted tokens so far scale its estimates: matched by
    rid (not slot) from one call to the next, realized = context growth - 1 where it drafted; the
    planner gets the table's estimates times (realized + m) / (predicted + m), clipped; new
    requests start at factor 1; reset forgets."""
    from specrl import rowmodel
    from specrl.envs.replay import load_replay_data
    from specrl.replay import action_table

    _, _, rows, tables = load_replay_data(cfg)
    art = rowmodel.fit(tables, np.asarray(rows), action_table(cfg.k_choices, cfg.w_choices), calibration=2.0)
    assert art["calibration"] == 2.0
    rowmodel.save(art, tmp_path / "rm")
    rowmodel.save(dict(art, calibration=0.0), tmp_path / "off")
    ctx = policy_context(cfg)
    pol, off = make_policy(f"rowmodel:{tmp_path / 'rm'}", ctx), make_policy(f"rowmodel:{tmp_path / 'off'}", ctx)
    k = pol.actions_kw[:, 0].astype(float)
    for p in (pol, off):
        p.table[:] = 0.5 * k  # every bucket: half of a chain's drafts accepted
    n_act = len(k)
    sizes = 1 + pol.actions_kw[:, 0] * pol.actions_kw[:, 1]

    def view(rids, contexts):
        s = len(rids)
        return RowView(np.ones((1, s), bool), np.full((1, s), 3.0), np.ones((1, s)), np.zeros((1, s), int),
                       np.full((1, s), 100), np.asarray(contexts)[None], np.tile(sizes, (1, s, 1)), np.asarray(rids)[None])

    feats = np.zeros((1, NUM_FEATURES), np.float32)
    first = pol.decide_rows(feats, view([10, 11], [300, 300]))[0]
    assert (k[first] > 0).all() and pol.history(view([10], [300]))[0].shape == (1, 1)
    pred = 0.5 * k[first]  # what the table predicted for each row's chosen action
    # next step: rows swapped, rid 10 accepted every draft, rid 11 none, rid 12 is new
    v2 = view([11, 10, 12], [301, 300 + 1 + int(k[first[0]]), 300])
    realized, predicted = pol.history(v2)
    assert realized[0].tolist() == [0, k[first[0]], 0] and predicted[0].tolist() == [pred[1], pred[0], 0]
    planned = {}
    for name, p in (("cal", pol), ("off", off)):
        plan = p.plan
        p.plan = lambda value, v, plan=plan, name=name: planned.setdefault(name, value) is not None and plan(value, v)
        p.decide_rows(feats, v2)
    factor = np.clip((np.array([0, k[first[0]], 0]) + 2.0) / (np.array([pred[1], pred[0], 0]) + 2.0), 0.25, 4.0)
    want = np.minimum(0.5 * k[None, :] * factor[:, None] + 1.0, 100)  # (S, A)
    np.testing.assert_allclose(planned["cal"][0], want)
    np.testing.assert_allclose(planned["off"][0], np.minimum(0.5 * k[None, :] + 1.0, 100).repeat(3, 0))
    assert factor[0] < 1 < factor[1] and factor[2] == 1 and n_act == pol.table.shape[1]
    pol.reset()
    assert not pol.history(v2)[0].any()
    with pytest.raises(ConfigError, match="calibration=-1"):
        rowmodel.fit(tables, np.asarray(rows), action_table(cfg.k_choices, cfg.w_choices), calibration=-1)


def test_per_request_policies_run_in_the_evaluation_harness(cfg, tmp_path):
    """`specrl evaluate`'s harness plans per-request policies through step_rows; the live harness
    refuses them before running anything."""
    from specrl import rowmodel
    from specrl.envs.replay import load_replay_data
    from specrl.evaluate import evaluate, parse_loads
    from specrl.replay import action_table

    _, _, rows, tables = load_replay_data(cfg)
    rowmodel.save(rowmodel.fit(tables, np.asarray(rows), action_table(cfg.k_choices, cfg.w_choices)), tmp_path / "rm")
    from specrl.runtime.export import export_rule

    ctl = export_rule(f"rowmodel:{tmp_path / 'rm'}", cfg, tmp_path / "ctl")
    names = ["goodput", "goodput-rows", f"rowmodel:{tmp_path / 'rm'}", "oracle-rows", f"controller:{ctl}"]
    res = evaluate(cfg, names, parse_loads(["closed:1,4"]), [0, 1], None, progress=False)
    for pol in ("goodput", "goodput-rows", "rowmodel", "oracle-rows"):
        assert all(res["by_load"][lab][pol] > 0 for lab in ("closed:1", "closed:4")), pol
    assert res["by_load"]["closed:4"]["rowmodel"] != res["by_load"]["closed:4"]["goodput"]
    # the exported artifact plans per request too (not its batch-level fallback): same episodes
    assert res["by_load"]["closed:4"][f"controller:{ctl}"] == res["by_load"]["closed:4"]["rowmodel"]
    with pytest.raises(ConfigError, match="future outcomes"):
        evaluate(cfg, ["oracle-rows"], parse_loads(["closed:1"]), [0], None, live=True, progress=False)


def test_live_env_gives_every_running_request_its_own_action(cfg, tiny_traces):
    """SpecDecodeEnv.row_view / step_rows: the engine runs one action per row (in row_view's
    order), info reports the deepest, and a wrong number of actions is refused with the fix."""
    import specrl
    from specrl.replay import action_table

    pair, _, _ = tiny_traces
    env = specrl.make_env(replace(cfg, backend="live", time_source="profiled"), pair=pair).unwrapped
    kw = np.asarray(action_table(cfg.k_choices, cfg.w_choices))
    assert np.array_equal(env.actions_kw, kw)
    seen: list = []
    step = env.loop.backend.step
    env.loop.backend.step = lambda a: seen.append(a) or step(a)
    env.reset(seed=3)
    rng = np.random.default_rng(0)
    mixed = 0
    for _ in range(12):
        view = env.row_view()
        n = int(view.valid.sum())
        assert view.row_tokens.shape == (1, n, len(kw)) and n == len(env.engine.rows) > 0
        choice = rng.integers(0, len(kw), n)
        _, _, term, trunc, info = env.step_rows(choice)
        want = [(int(k), 1 if k == 0 else int(w)) for k, w in kw[choice]]
        assert [(a.k, a.w) for a in seen[-1]] == want
        assert (info["k"], info["w"]) == max(want)
        mixed += len(set(want)) > 1
        if term or trunc:
            break
    assert mixed > 3
    env.row_view()
    with pytest.raises(ConfigError, match="one index per row"):
        env.step_rows([0] * (len(env.engine.rows) + 1))


def test_prefill_of_an_early_admission_is_charged_to_the_next_step(tiny_traces):
    """Per-request callers admit before choosing actions (to learn the rows); the prefill still
    lands in the next StepResult (rows, length, seconds), as when the step admits itself."""
    from specrl.engine import SpecEngine
    from specrl.step import Action

    pair, _, tr = tiny_traces
    prompts = tr["ngram"].prompt_ids
    eng = SpecEngine(pair, drafter="ngram", eos_token_ids=())
    eng.add_request(prompts[0], 8)
    eng.add_request(prompts[1], 8)
    eng.admit()
    eng.add_request(prompts[2], 8)  # this one the step admits itself
    res = eng.step(Action(2, 1))
    assert res.prefill_rows == 3 and res.prefill_len == max(len(p) for p in prompts[:3])
    assert res.prefill_time > 0 and res.step_time >= res.prefill_time + res.verify_time
    res = eng.step(Action(2, 1))
    assert res.prefill_rows == 0 and res.prefill_time == 0.0


def test_live_row_observer_sees_what_the_replay_tables_hold(tiny_traces):
    """The live engine's RowView (copy run, match statistics, each action's tree size) equals the
    replay tables' values at the same prompt and position, while per-row actions commit 1..k+1
    tokens per step (greedy follows the recorded trace exactly)."""
    from specrl.engine import SpecEngine
    from specrl.replay import ReplayTables, action_table
    from specrl.runtime.adapters import RowObserver
    from specrl.step import Action

    pair, _, tr = tiny_traces
    traces = tr["ngram"]
    kw = action_table([0, 1, 2, 4], [1, 2])
    tables = ReplayTables.build(traces, kw, "ngram", progress=False)
    a11 = kw.index((1, 1))
    run = copy_runs(tables.offsets, tables.accept[:, a11] > 0)
    eng = SpecEngine(pair, drafter="ngram", eos_token_ids=())
    obs = RowObserver(eng, np.asarray(kw))
    # each request runs to its trace's end, so every row has a trace position to compare with
    prompt_of = {eng.add_request(traces.prompt_ids[p], int(tables.cont_len[p])): p for p in range(4)}
    rng = np.random.default_rng(0)
    checked = mixed = 0
    while eng.has_work():
        eng.admit()
        view = obs.view()
        at = []  # (trace row or None, action index) per running row
        for b, r in enumerate(eng.rows):
            p, g = prompt_of[r.rid], r.length - len(r.prompt)
            row = tables.offsets[p] + g if g < tables.cont_len[p] else None
            at.append([row, int(rng.integers(len(kw))), r.max_new_tokens - g, int(tables.cont_len[p]) - g])
            if row is None:
                continue
            assert view.copy_run[0, b] == run[row], (p, g)
            assert view.match_len[0, b] == tables.match_len[row] and view.num_matches[0, b] == tables.num_matches[row]
            assert np.array_equal(view.row_tokens[0, b], 1 + popcount64(tables.mask[row])), (p, g)
            checked += 1
        res = eng.step([Action(*kw[a]) for _, a, _, _ in at])
        # the engine's per-row drafts are the replay tables' own-action drafts (not the union's)
        if all(row is not None for row, _, _, _ in at):
            rows_a = [(row, a) for row, a, _, _ in at]
            want = sum(1 + int(popcount64(tables.mask[row, a])) for row, a in rows_a)
            assert res.verify_rows == want
            for b, (row, a, room, cont) in enumerate(at):
                if tables.accept[row, a] + 1 <= min(room, cont):
                    assert res.accept_len[b] == tables.accept[row, a], (b, kw[a])
            mixed += len({a for _, a in rows_a}) > 1
        eng.pop_finished()
    assert checked > 30 and mixed > 5


def test_exported_rowmodel_controller_plans_rows_live_and_stays_lossless(cfg, tiny_traces, tmp_path):
    """export -> Controller: decide_rows matches the policy; on the live engine every request gets
    its own action and the output equals plain greedy decoding."""
    from specrl import rowmodel
    from specrl.engine import SpecEngine
    from specrl.envs.replay import load_replay_data
    from specrl.replay import action_table
    from specrl.runtime import Controller
    from specrl.runtime.adapters import EngineController
    from specrl.runtime.export import export_rule

    _, _, rows, tables = load_replay_data(cfg)
    rowmodel.save(rowmodel.fit(tables, np.asarray(rows), action_table(cfg.k_choices, cfg.w_choices)), tmp_path / "rm")
    ctl = Controller.load(export_rule(f"rowmodel:{tmp_path / 'rm'}", cfg, tmp_path / "ctl"))
    assert ctl.per_row and ctl.fallback_name == "goodput"
    pol = make_policy(f"rowmodel:{tmp_path / 'rm'}", policy_context(cfg))
    vec = SpecReplayVecEnv(cfg, 1)
    vec.seed(2)
    obs = vec.reset()
    for _ in range(20):
        view = vec.row_view()
        want = pol.decide_rows(obs, view)
        slots = np.flatnonzero(view.valid[0])
        one = RowView(*(getattr(view, f)[:, slots] for f in view.__dataclass_fields__))
        got = ctl.decide_rows(obs[0], one)
        assert got == [tuple(map(int, pol.actions_kw[a])) for a in want[0, slots]]
        obs, _, _, _ = vec.step_rows(want)
    bad = obs[0].copy()
    bad[0] = np.nan  # a broken feature vector: every row gets the fallback's batch decision
    before = ctl.fallbacks
    assert ctl.rule._last is not None  # the calibration follows the requests ...
    assert ctl.decide_rows(bad, one) == [ctl.fallback.decide(np.nan_to_num(bad))] * len(slots)
    assert ctl.fallbacks == before + 1 and ctl.rule._last is None  # ... and forgets a step it did not see
    pair, _, tr = tiny_traces
    prompts = [list(p) for p in tr["ngram"].prompt_ids[:4]]
    plain = [r.output.tolist() for r in SpecEngine(pair, drafter="ngram").generate(prompts, 24, batch_size=4)]
    eng = SpecEngine(pair, drafter="ngram")
    driver = EngineController(eng, ctl)
    acts: list = []
    out = eng.generate(prompts, 24, action=driver, batch_size=4, on_step=lambda res: acts.append(res.actions))
    assert [r.output.tolist() for r in out] == plain
    assert any(len(set(a)) > 1 for a in acts)  # rows really got different actions


def test_per_request_policies_refuse_what_they_cannot_plan(cfg, tmp_path):
    from specrl import rowmodel
    from specrl.engine import SpecEngine
    from specrl.envs.replay import load_replay_data
    from specrl.replay import action_table
    from specrl.runtime.adapters import EngineController

    with pytest.raises(ConfigError, match="no 0"):
        make_policy("goodput-rows", policy_context(replace(cfg, k_choices=[1, 2, 4])))
    _, _, rows, tables = load_replay_data(cfg)
    rowmodel.save(rowmodel.fit(tables, np.asarray(rows), action_table(cfg.k_choices, cfg.w_choices)), tmp_path / "rm")
    with pytest.raises(ConfigError, match="drafter"):
        make_policy(f"rowmodel:{tmp_path / 'rm'}", policy_context(replace(cfg, drafter="model")))
    pol = make_policy(f"rowmodel:{tmp_path / 'rm'}", policy_context(cfg))
    with pytest.raises(ConfigError, match="not an exported controller"):
        EngineController(SpecEngine.__new__(SpecEngine), pol)
