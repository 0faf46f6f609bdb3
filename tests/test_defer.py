"""The "defer to a rule" action (specrl.defer): training wrapper, evaluation, export and runtime agree."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specrl.errors import ArtifactError, ConfigError
from specrl.features import NUM_FEATURES
from specrl.train import load_agent_config, train

TINY = ["agent.total_timesteps=512", "agent.n_envs=4", "agent.eval_every=0", "agent.keep=last",
        "agent.checkpoint_every=256", "agent.eval_seeds=1", "agent.eval_loads=['closed:1,4']", "agent.eval_horizon_s=2.0",
        "agent.pretrain_steps=256", "agent.pretrain_epochs=200", "agent.hyperparams.n_steps=32",
        "agent.hyperparams.batch_size=64"]


@pytest.fixture(scope="module")
def defer_run(tiny_replay_env, tmp_path_factory):
    from specrl.runtime.export import export_run

    root = tmp_path_factory.mktemp("defer")
    summary = train(tiny_replay_env, "agents/ppo-defer.yaml", TINY, seed=0, run_dir=root / "run", progress=False)
    return summary, export_run(Path(summary["run_dir"]), root / "export")


@pytest.mark.parametrize("rule", ["goodput", "sglang-ema"])
def test_always_defer_replays_the_rule_exactly(rule, tiny_replay_env):
    """Every step handed to a rule through the wrapper is the same rollout as the rule itself
    (the rule's state is reset at episode ends and observes every step, as the reference loop below;
    sglang-ema keeps state across steps, so a missed reset shows)."""
    from specrl.defer import make_vec_defer
    from specrl.envs.config import load_env_config, policy_context
    from specrl.envs.vector import SpecReplayVecEnv
    from specrl.policies import ActionTable, make_policy
    from specrl.train import prepare

    cfg = load_env_config(tiny_replay_env)
    prepare(cfg, progress=False)
    ctx = policy_context(cfg)
    table = ActionTable(cfg.k_choices, cfg.w_choices)
    n, steps = 3, 300

    wrapped = make_vec_defer(SpecReplayVecEnv(cfg, n), rule, ctx)
    assert tuple(wrapped.action_space.nvec) == (len(cfg.k_choices) + 1, len(cfg.w_choices))
    wrapped.seed(7)
    wrapped.reset()
    defer = np.tile([len(cfg.k_choices), 0], (n, 1))
    got = []
    for _ in range(steps):
        _, _, done, infos = wrapped.step(defer)
        got.append([(i["k"], i["w"], i["tokens"], i["dt"], i["deferred"]) for i in infos])

    plain = SpecReplayVecEnv(cfg, n)
    plain.seed(7)
    obs = plain.reset()
    rules = [make_policy(rule, ctx) for _ in range(n)]
    want = []
    for _ in range(steps):
        act = np.array([table.index(*r.decide(o)) for r, o in zip(rules, obs)])
        obs, _, done, infos = plain.step(act)
        want.append([(i["k"], i["w"], i["tokens"], i["dt"], True) for i in infos])
        for r, o, d, i in zip(rules, obs, done, infos):
            r.reset() if d else r.observe(o, i)
    assert got == want
    assert len({g[0] for row in got for g in row}) > 1  # the rule changed k along the way: not a trivial rollout


def test_defer_run_clones_the_rule_exports_and_keeps_parity(defer_run, tiny_replay_env):
    from specrl.config import from_dict
    from specrl.runtime import Controller
    from specrl.train import AgentConfig, learned_policy

    summary, out = defer_run
    run = Path(summary["run_dir"])
    assert summary["pretrain"]["agreement"] == 1.0  # the clone of the rule is "always defer"
    ctl = Controller.load(out)
    assert ctl.meta["actions"]["defer"] == "goodput" and ctl.meta["architecture"]["head"]["sizes"][0] == 8
    ctl.low = ctl.high = None  # parity over every feature seen: no guard
    saved = json.loads((run / "config.json").read_text())
    from specrl.envs.config import EnvConfig

    env_cfg, agent = from_dict(EnvConfig, saved["env"]), from_dict(AgentConfig, saved["agent"])
    pol = learned_policy(run, env_cfg, agent)
    # features of a real rollout; both sides see the same decide/observe sequence
    from specrl.pretrain import collect

    demos = collect(env_cfg, "static:2,2", n_envs=1, steps=200, seed=3)
    deferred = 0
    for x in demos.obs:
        a, b = pol.decide(x), ctl.decide(x)
        assert a == b
        deferred += int(pol.model.predict(pol.normalise(x), deterministic=True)[0][0] == len(env_cfg.k_choices))
        pol.observe(x, {})
        ctl.observe(x, {})
    assert deferred > 0  # the defer path ran


def test_an_always_deferring_policy_evaluates_as_the_rule(defer_run, tiny_replay_env):
    """Force the k head onto 'defer': the evaluation must equal the goodput baseline's, load by load."""
    import torch

    from specrl.config import from_dict
    from specrl.envs.config import EnvConfig
    from specrl.train import AgentConfig, learned_policy, quick_eval

    summary, _ = defer_run
    run = Path(summary["run_dir"])
    saved = json.loads((run / "config.json").read_text())
    env_cfg, agent = from_dict(EnvConfig, saved["env"]), from_dict(AgentConfig, saved["agent"])
    pol = learned_policy(run, env_cfg, agent)
    with torch.no_grad():
        bias = pol.model.policy.action_net.bias
        bias[len(env_cfg.k_choices)] = 1e4  # the k head's defer logit
    res = quick_eval(env_cfg, agent, pol, ["goodput", "ar"])
    for load, g in res["by_load"].items():
        assert g["learned"] == pytest.approx(g["goodput"], rel=1e-12), load
    assert any(g["goodput"] != g["ar"] for g in res["by_load"].values())  # goodput is not plain decoding here


@pytest.mark.parametrize("over,match", [
    ({"defer": "goodput", "algo": "dqn", "pretrain": None}, "flattened table"),
    ({"defer": "oracle"}, "future outcomes"),
    ({"defer": "nope"}, "Unknown policy"),
])
def test_bad_defer_settings_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        load_agent_config("agents/ppo.yaml", over)


def test_controller_refuses_a_head_that_does_not_fit_defer(defer_run, tmp_path):
    import shutil

    from specrl.runtime import Controller

    _, out = defer_run
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    meta = json.loads((bad / "controller.json").read_text())
    del meta["actions"]["defer"]  # the head still has the extra choice
    (bad / "controller.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="do not match the action tables"):
        Controller.load(bad)
    meta["actions"]["defer"] = "oracle"
    (bad / "controller.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="actions.defer"):
        Controller.load(bad)


def test_label_smoothing_keeps_the_clone_exploring(tiny_replay_env, tmp_path):
    """A clone of a one-action rule ("always defer") fitted without smoothing is deterministic
    (PPO then never tries another action); with smoothing 0.1 each head keeps ~10% elsewhere."""
    import torch

    from specrl.envs.config import load_env_config
    from specrl.pretrain import clone
    from specrl.train import build_model, make_vec_env, prepare

    cfg = load_env_config(tiny_replay_env)
    prepare(cfg, progress=False)
    agent = load_agent_config("agents/ppo-defer.yaml", {"n_envs": 16})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, NUM_FEATURES)).astype(np.float32)
    y = np.tile([len(cfg.k_choices), 1], (512, 1))
    p_label = {}
    for eps in (0.0, 0.1):
        model = build_model(agent, make_vec_env(cfg, agent, 0), 0, tmp_path)
        clone(model, x, y, epochs=100, smoothing=eps)
        with torch.no_grad():
            heads = model.policy.get_distribution(torch.as_tensor(x)).distribution
        p_label[eps] = heads[0].probs[:, -1].numpy()  # (512,) probability of "defer"
        assert (heads[0].probs.argmax(-1) == len(cfg.k_choices)).all()  # the clone still defers
    assert p_label[0.0].mean() > 0.98
    assert 0.85 < p_label[0.1].mean() < 0.95  # 1 - 0.1 + 0.1 / 8 = 0.9125 at the optimum
    with pytest.raises(ConfigError, match="pretrain_smoothing"):
        load_agent_config("agents/ppo-defer.yaml", {"pretrain_smoothing": 1.0})
