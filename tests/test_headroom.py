"""The headroom benchmark's per-row acceptance predictor (benchmarks/headroom.py)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import headroom  # noqa: E402


def _tables(accept_11, extra=None):
    """Two prompts of 4 and 3 positions; action 0 = (1, 1), action 1 = a second action."""
    acc = np.zeros((7, 2), np.uint8)
    acc[:, 0] = accept_11
    if extra is not None:
        acc[:, 1] = extra
    return SimpleNamespace(accept=acc, offsets=np.array([0, 4, 7]), prompt_len=np.array([5, 5]),
                           match_len=np.zeros(7, np.float32), num_matches=np.zeros(7, np.float32))


def test_copy_run_counts_consecutive_hits_and_restarts_per_prompt():
    tb = _tables([1, 1, 0, 1, 1, 1, 1])
    # prompt 0: hits at 0, 1, miss at 2, hit at 3; prompt 1 starts from 0 again
    assert headroom.copy_run(tb, 0).tolist() == [0, 1, 2, 0, 0, 1, 2]


def test_fit_predicts_bucket_means_shrunk_to_the_global_mean():
    tb = _tables([0, 0, 0, 0, 0, 0, 0], extra=[4, 4, 0, 0, 2, 2, 2])
    ids = np.array([0, 0, 1, 1, 2, 2, 2])
    train = np.arange(4)  # only the first prompt's rows train the predictor
    pred = headroom.fit(tb, train, ids, 3, prior=1e-9)
    assert np.allclose(pred[:4, 1], [4.0, 4.0, 0.0, 0.0])
    shrunk = headroom.fit(tb, train, ids, 3, prior=2.0)
    assert shrunk[0, 1] == (8 + 2 * 2.0) / (2 + 2)  # two 4s plus two pseudo-counts at the mean 2
    assert shrunk[4, 1] == 2.0  # unseen bucket: the global training mean


def test_buckets_separate_run_lengths():
    tb = _tables([1] * 7)
    run = headroom.copy_run(tb, 0)
    ids, n = headroom.bucket_ids(tb, run)
    ids0, n0 = headroom.bucket_ids(tb, None)
    assert n == n0 * (len(headroom.RUN_EDGES) + 1)
    assert len(set(ids.tolist())) > len(set(ids0.tolist())) == 1


def test_ragged_env_and_row_choice_on_tiny_traces(tiny_traces, tiny_pair_dirs, isolated_cache):
    """RaggedVec commits what the padded env commits (same rows, same actions) at most its step
    time; a per-row choice scored on actual outcomes is never worse than the best batch action."""
    from test_replay import _write, replay_cfg

    from specrl.envs.config import load_env_config
    from specrl.envs.vector import SpecReplayVecEnv

    _, prompts, tr = tiny_traces
    cfg = load_env_config(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache),
                                     horizon_s=3.0, workload={"arrival": "closed", "concurrency": [4],
                                                              "max_new_tokens": 40}))
    pad, rag = SpecReplayVecEnv(cfg, 2), headroom.RaggedVec(cfg, 2)
    for env in (pad, rag):
        env.seed(7)
        env.reset()
    n_w = len(cfg.w_choices)
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(40):
        a = rng.integers(0, len(pad.actions_kw), size=2)
        p, r = pad._outcome(a), rag._outcome(a)
        assert np.array_equal(p["committed"], r["committed"])
        assert np.all(r["dt"] <= p["dt"] + 1e-12)
        # per-row choice on the actual outcomes vs every batch-level action, exactly timed
        valid = rag.active
        rows = np.where(valid, rag.tables.offsets[rag.trow] + rag.pos, 0)
        value = np.where(valid[..., None], np.minimum(rag.tables.accept[rows] + 1.0, (rag.limit - rag.pos)[..., None]),
                         0.0)
        choice = headroom.row_choice(rag, value)
        rag.row_actions = choice
        out = rag._outcome(np.zeros(2, np.int64))
        got = out["committed"].sum(1) / out["dt"]
        batch_g = []
        for b in range(len(rag.actions_kw)):
            o = rag._outcome(np.full(2, b))
            batch_g.append(o["committed"].sum(1) / o["dt"])
        assert np.all(got >= np.max(batch_g, axis=0) - 1e-9)
        checked += int(valid.any())
        for env in (pad, rag):
            env.step_async(np.stack([a // n_w, a % n_w], 1))
            env.step_wait()
    assert checked > 20


def test_ragged_world_runs_standard_episodes(tiny_traces, tiny_pair_dirs, isolated_cache):
    """The what-if world evaluates like `specrl evaluate`: every category in every episode, whatever
    the preset's training-only ``workload.episode_categories`` says (it once leaked into this table)."""
    from dataclasses import replace

    from test_replay import _write, replay_cfg

    from specrl.envs.config import load_env_config
    from specrl.evaluate import parse_loads

    _, prompts, tr = tiny_traces
    assert len({p.category for p in prompts}) > 1
    cfg = load_env_config(replay_cfg(tr["ngram_path"], tiny_pair_dirs[0], prompts=_write(prompts, isolated_cache),
                                     horizon_s=3.0, workload={"arrival": "closed", "concurrency": [2],
                                                              "max_new_tokens": 40}))
    loads = parse_loads(["closed:2"])

    def k1(vec, obs):  # (1, 1) for every env: acceptance differs between category mixes
        return np.full(vec.num_envs, [tuple(a) for a in vec.actions_kw.tolist()].index((1, 1)))

    std = headroom.run_ragged(cfg, loads, [0, 1, 2], k1)
    one = headroom.run_ragged(replace(cfg, workload=replace(cfg.workload, episode_categories=1)), loads, [0, 1, 2], k1)
    assert std == one
