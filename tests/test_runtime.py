"""Export, the numpy runtime controller, its guard, malformed artifacts and both adapters."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specrl.errors import ArtifactError
from specrl.features import NUM_FEATURES, SCHEMA_VERSION
from specrl.runtime import Controller


@pytest.fixture(scope="module")
def trained_run(tiny_replay_env, tmp_path_factory):
    """A tiny PPO run on tiny traces (seconds), and its export."""
    from specrl.runtime.export import export_run
    from specrl.train import train

    root = tmp_path_factory.mktemp("run")
    summary = train(tiny_replay_env, "agents/ppo.yaml", [
        "agent.total_timesteps=2048", "agent.n_envs=8", "agent.hyperparams.n_steps=64",
        "agent.hyperparams.batch_size=128", "agent.eval_every=0", "agent.keep=last", "agent.eval_seeds=1", "agent.eval_loads=[closed:1]",
        "agent.pretrain_steps=128", "agent.pretrain_epochs=2",
    ], seed=0, run_dir=root / "run", progress=False, final_eval=False)
    return Path(summary["run_dir"]), export_run(Path(summary["run_dir"]), root / "export")


def test_parity_with_sb3_predict(trained_run):
    from specrl.config import from_dict
    from specrl.train import AgentConfig, load_model, load_stats

    run_dir, out = trained_run
    ctl = Controller.load(out)
    agent = from_dict(AgentConfig, json.loads((run_dir / "config.json").read_text())["agent"])
    model = load_model(run_dir, agent)
    stats = load_stats(run_dir / "obs_stats.json")
    ctl.low = ctl.high = None  # parity over the whole space: no guard
    rng = np.random.default_rng(0)
    obs = np.abs(rng.normal(0, 1, (1000, NUM_FEATURES)) * np.sqrt(stats["var"]) + stats["mean"]).astype(np.float32)
    same = 0
    for x in obs:
        norm = np.clip((x - stats["mean"]) / np.sqrt(stats["var"] + 1e-8), -10, 10).astype(np.float32)
        act, _ = model.predict(norm, deterministic=True)
        k = ctl.k_choices[int(act[0])]
        want = (k, 1) if k == 0 else (k, ctl.w_choices[int(act[1])])
        same += ctl.decide(x) == want
    assert same == 1000


def test_round_trip_guard_and_fallback(trained_run):
    _, out = trained_run
    ctl = Controller.load(out)
    assert ctl.kind == "mlp" and ctl.meta["schema"]["version"] == SCHEMA_VERSION
    x = np.zeros(NUM_FEATURES, np.float32)
    x[:] = (ctl.low + ctl.high) / 2
    k, w = ctl.decide(x)
    assert (k in ctl.k_choices) and ctl.fallbacks == 0
    bad = x.copy()
    bad[3] = np.nan
    assert ctl.decide(bad) == ctl.fallback.decide(np.nan_to_num(bad)) and ctl.fallbacks == 1
    far = x.copy()
    far[0] = 1e5  # a batch size never seen in training
    ctl.decide(far)
    assert ctl.fallbacks == 2
    assert ctl.decide(np.zeros(3)) is not None and ctl.fallbacks == 3  # wrong length: no exception

    def broken(features):
        raise RuntimeError("fallback broke too")

    ctl.fallback.decide = broken
    assert ctl.decide(far) == (0, 1) and ctl.fallbacks == 4  # one fallback, counted once


def _copy(out, tmp_path):
    import shutil

    dst = tmp_path / "a"
    shutil.copytree(out, dst)
    return dst


@pytest.mark.parametrize("break_it,match", [
    (lambda d: (d / "controller.json").unlink(), "no controller.json"),
    (lambda d: _edit(d, lambda m: m.pop("actions")), "missing key 'actions'"),
    (lambda d: _edit(d, lambda m: m["schema"].update(version=SCHEMA_VERSION + 1)), "schema version"),
    (lambda d: _edit(d, lambda m: m.update(format_version=9)), "format_version 9"),
    (lambda d: _edit(d, lambda m: m["architecture"]["layers"][0].update(activation="gelu")), "unknown activation"),
    (lambda d: _edit(d, lambda m: m["normalization"]["var"].__setitem__(0, float("nan"))), "NaN"),
    (lambda d: _tensors(d, lambda t: t.__setitem__("layer0.weight", t["layer0.weight"] * np.nan)), "NaN or inf"),
    (lambda d: _tensors(d, lambda t: t.__setitem__("layer0.weight", t["layer0.weight"][:, :5])), "shape"),
    (lambda d: _tensors(d, lambda t: t.pop("head.bias")), "missing"),
    (lambda d: (d / "controller.json").write_text("{not json"), "not valid JSON"),
    (lambda d: (d / "controller.json").write_bytes(b" " * (5 << 20)), "more than a controller"),
], ids=["no-json", "missing-key", "schema", "format", "activation", "nan-stats", "nan-weights", "shape",
        "missing-tensor", "bad-json", "huge-json"])
def test_malformed_artifacts_are_refused(trained_run, tmp_path, break_it, match):
    d = _copy(trained_run[1], tmp_path)
    break_it(d)
    with pytest.raises(ArtifactError, match=match):
        Controller.load(d)


def _edit(d, fn):
    m = json.loads((d / "controller.json").read_text())
    fn(m)
    (d / "controller.json").write_text(json.dumps(m))


def _tensors(d, fn):
    from safetensors.numpy import load_file, save_file

    t = load_file(str(d / "policy.safetensors"))
    fn(t)
    save_file(t, str(d / "policy.safetensors"))


class _Boom:
    def __reduce__(self):
        return (Path("/tmp/specrl_pickle_executed").touch, ())


def test_a_renamed_pickle_is_refused_without_running_it(trained_run, tmp_path):
    marker = Path("/tmp/specrl_pickle_executed")
    marker.unlink(missing_ok=True)
    d = _copy(trained_run[1], tmp_path)
    (d / "policy.safetensors").write_bytes(pickle.dumps({"w": _Boom()}))
    with pytest.raises(ArtifactError, match="safetensors"):
        Controller.load(d)
    assert not marker.exists()
    big = _copy(trained_run[1], tmp_path / "big")
    with (big / "policy.safetensors").open("r+b") as f:  # a header that claims to be gigabytes long
        f.write((1 << 40).to_bytes(8, "little"))
    with pytest.raises(ArtifactError, match="declared header"):
        Controller.load(big)


def test_runtime_imports_no_heavy_frameworks():
    """import specrl.runtime with torch, transformers, gymnasium and SB3 blocked; and without
    blocking, none of them ends up in sys.modules."""
    code = r'''
import sys, importlib.abc
BLOCKED = ("torch", "transformers", "gymnasium", "stable_baselines3")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import specrl.runtime
from specrl.runtime import Controller, FeatureTracker
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
print("ok")
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    out = subprocess.run([sys.executable, "-c", "import sys, specrl.runtime; "
                          "print(sorted({m.split('.')[0] for m in sys.modules} & "
                          "{'torch','transformers','gymnasium','stable_baselines3'}))"], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_rule_export_and_controller_policy(tmp_path, tiny_pair_dirs):
    from specrl.envs.config import load_env_config
    from specrl.policies import PolicyContext, make_policy
    from specrl.runtime.export import export_rule

    cfg = load_env_config({"cost_model": "analytic"})
    out = export_rule("goodput", cfg, tmp_path / "goodput")
    ctl = Controller.load(out)
    assert ctl.kind == "rule"
    pol = make_policy("goodput", PolicyContext(cfg.k_choices, cfg.w_choices, ctl.fallback.ctx.cost_model))
    rng = np.random.default_rng(1)
    for _ in range(50):
        x = np.abs(rng.normal(0, 1, NUM_FEATURES)).astype(np.float32)
        x[0] = rng.integers(1, 16)
        assert ctl.decide(x) == pol.decide(x)
    via_registry = make_policy(f"controller:{out}")
    assert via_registry.decide(x) == ctl.decide(x)


def test_engine_adapter_keeps_exactness(trained_run, tiny_pair_dirs):
    from specrl.engine import SpecEngine
    from specrl.models import ModelPair
    from specrl.policies import PolicyContext
    from specrl.runtime.adapters import EngineController
    from specrl.runtime.policy import ControllerPolicy

    pair = ModelPair.load(tiny_pair_dirs[0], device="cpu", dtype="float64")
    prompts = [[2, 3, 4, 2, 3], [5, 6, 7, 8]]
    ref = SpecEngine(pair).generate(prompts, 20)
    eng = SpecEngine(pair)
    ctl = EngineController(eng, ControllerPolicy(PolicyContext(), str(trained_run[1])))
    out = eng.generate(prompts, 20, action=ctl, batch_size=2)
    assert [r.output.tolist() for r in out] == [r.output.tolist() for r in ref]
    assert len(ctl.decisions) >= 5


def test_transformers_adapter_matches_plain_generate(tiny_pair_dirs):
    from specrl.models import ModelPair
    from specrl.runtime.adapters import controlled_generate

    pair = ModelPair.load(tiny_pair_dirs[0], draft=tiny_pair_dirs[1], device="cpu", dtype="float64")

    class Alternating:
        def __init__(self):
            self.n = 0

        def decide(self, features):
            self.n += 1
            return [(0, 1), (3, 1), (1, 1), (5, 1)][self.n % 4]

    x = torch.tensor([[2, 3, 4, 2, 3, 5, 6]])
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=30, min_new_tokens=30, do_sample=False,
              pad_token_id=0, eos_token_id=None)
    plain = pair.target.generate(x, **kw)
    out = controlled_generate(pair.target, x, pair.draft, Alternating(), **kw)
    assert out.tolist() == plain.tolist()
    decisions = controlled_generate.last_decisions
    assert len(decisions) >= 8 and set(decisions) >= {0, 3}
