"""Tiny-budget training runs for every agent preset, resume, wandb offline, bad presets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from specrl.errors import ConfigError
from specrl.features import NUM_FEATURES
from specrl.train import load_agent_config, train

TINY = ["agent.total_timesteps=256", "agent.n_envs=4", "agent.eval_every=0", "agent.keep=last", "agent.checkpoint_every=128",
        "agent.eval_seeds=1", "agent.eval_loads=[closed:1]", "agent.eval_horizon_s=2.0",
        "agent.pretrain_steps=128", "agent.pretrain_epochs=2"]
SMALL_BATCH = {"ppo": ["agent.hyperparams.n_steps=32", "agent.hyperparams.batch_size=64"],
               "ppo-defer": ["agent.hyperparams.n_steps=32", "agent.hyperparams.batch_size=64"],
               "ppo-framestack": ["agent.hyperparams.n_steps=32", "agent.hyperparams.batch_size=64"],
               "a2c": [], "dqn": ["agent.hyperparams.learning_starts=32", "agent.hyperparams.buffer_size=1000"]}


@pytest.fixture(scope="module")
def tiny_env(tiny_replay_env):
    return tiny_replay_env


@pytest.mark.parametrize("agent", ["ppo", "a2c", "dqn", "ppo-framestack", "ppo-defer"])
def test_every_agent_preset_trains_and_evaluates(agent, tiny_env, tmp_path):
    summary = train(tiny_env, f"agents/{agent}.yaml", TINY + SMALL_BATCH[agent], seed=1, run_dir=tmp_path / agent,
                    progress=False)
    run = Path(summary["run_dir"])
    assert summary["steps"] >= 256
    for f in ("config.json", "model.zip", "obs_stats.json", "obs_range.json", "summary.json", "eval/table.md"):
        assert (run / f).exists(), f
    assert "learned" in summary["eval"]["overall"] and "oracle" in summary["eval"]["overall"]
    assert list((run / "checkpoints").glob("step_*/config.json"))
    from specrl.runtime import Controller
    from specrl.runtime.export import export_run

    ctl = Controller.load(export_run(run, tmp_path / f"{agent}-export"))
    assert ctl.frame_stack == (4 if agent == "ppo-framestack" else 1)


def test_keep_best_validates_on_training_prompts_and_keeps_the_best(tiny_env, tmp_path, monkeypatch):
    """Periodic evaluations run on validation episodes (training prompts, unused arrival seeds),
    compare with the best baseline per load, and keep='best' ends the run with the best of them."""
    import specrl.train as tr

    calls = []
    real = tr.quick_eval

    def spy(*args, **kw):
        calls.append((kw.get("split", "test"), kw.get("seed0", 0)))
        return real(*args, **kw)

    monkeypatch.setattr(tr, "quick_eval", spy)
    over = [o for o in TINY if not o.startswith("agent.eval_every")] + SMALL_BATCH["ppo"]
    summary = train(tiny_env, "agents/ppo.yaml", over + ["agent.eval_every=128", "agent.keep=best",
                                                         "agent.total_timesteps=384"],
                    seed=3, run_dir=tmp_path / "kb", progress=False)
    hist = [json.loads(line) for line in (tmp_path / "kb" / "validation.jsonl").read_text().splitlines()]
    assert len(hist) >= 5  # the behaviour clone (step 0), every 128 steps, and the final weights
    assert hist[0]["step"] == 0
    assert all("vs_best_baseline" in h for h in hist)
    assert summary["kept"]["validation_goodput"] == max(h["goodput"] for h in hist)
    assert calls[-1] == ("test", 0)  # the final evaluation: held-out prompts
    assert set(calls[:-1]) == {("train", tr.VALIDATION_SEED0)}  # everything before: validation only
    with pytest.raises(ConfigError, match="eval_every"):
        load_agent_config("agents/ppo.yaml", {"keep": "best", "eval_every": 0})
    with pytest.raises(ConfigError, match="keep"):
        load_agent_config("agents/ppo.yaml", {"keep": "first"})


def test_resume_continues_with_the_same_config(tiny_env, tmp_path):
    first = train(tiny_env, "agents/ppo.yaml", TINY + SMALL_BATCH["ppo"], seed=2, run_dir=tmp_path / "r",
                  progress=False, final_eval=False)
    cfg1 = json.loads((tmp_path / "r" / "config.json").read_text())
    # ask for more steps by editing the saved config, as a user resuming a longer run would
    cfg1["agent"]["total_timesteps"] = 512
    (tmp_path / "r" / "config.json").write_text(json.dumps(cfg1))
    second = train(None, None, [], resume=tmp_path / "r", progress=False, final_eval=False)
    cfg2 = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg2 == cfg1 and second["run_dir"] == first["run_dir"]
    assert second["steps"] >= 512 > first["steps"]
    ck = sorted((tmp_path / "r" / "checkpoints").glob("step_*"))[-1]
    assert json.loads((ck / "config.json").read_text()) == cfg1


def test_linear_schedules_anneal_and_survive_resume(tiny_env, tmp_path):
    from specrl.train import load_model

    over = TINY + SMALL_BATCH["ppo"] + ["agent.hyperparams.learning_rate=lin_0.001", "agent.hyperparams.clip_range=lin_0.2"]
    train(tiny_env, "agents/ppo.yaml", over, seed=4, run_dir=tmp_path / "s", progress=False, final_eval=False)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["agent"]["hyperparams"]["learning_rate"] == "lin_0.001"  # the config keeps the text, not a pickle
    agent = load_agent_config(None, cfg["agent"])
    model = load_model(tmp_path / "s", agent)
    # SB3 passes progress_remaining: 1 at the first step, 0 at the last
    assert model.lr_schedule(1.0) == pytest.approx(1e-3) and model.lr_schedule(0.25) == pytest.approx(2.5e-4)
    assert model.clip_range(0.5) == pytest.approx(0.1)
    # the optimiser's rate at the end of the run is the annealed one, not the start value
    assert model.policy.optimizer.param_groups[0]["lr"] < 1e-3
    cfg["agent"]["total_timesteps"] = 512
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
    second = train(None, None, [], resume=tmp_path / "s", progress=False, final_eval=False)
    assert second["steps"] >= 512


@pytest.mark.parametrize("text", ["lin_0", "lin_fast", "cos_0.0003", "0.0003x"])
def test_bad_schedules_are_refused_by_name(text):
    with pytest.raises(ConfigError, match=rf"hyperparams.learning_rate='{text}'.*lin_0.0003"):
        load_agent_config(None, {"hyperparams.learning_rate": text})


def test_track_writes_an_offline_wandb_run(tiny_env, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(tiny_env, "agents/ppo.yaml", TINY + SMALL_BATCH["ppo"], seed=3, track=True, run_dir=tmp_path / "w",
          progress=False, final_eval=False)
    runs = list((tmp_path / "w" / "wandb").glob("offline-run-*"))
    assert runs and any(runs[0].rglob("*.wandb"))


def test_without_track_wandb_is_not_imported(tiny_env, tmp_path):
    import subprocess
    import sys

    code = (f"import sys; from pathlib import Path; from specrl.train import train; "
            f"train({tiny_env!r}, 'agents/ppo.yaml', {TINY + SMALL_BATCH['ppo']!r}, run_dir=Path({str(tmp_path / 'n')!r}), "
            f"progress=False, final_eval=False); print('wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


@pytest.mark.parametrize("bad,match", [
    ({"algo": "sac"}, "Unknown algo 'sac'"),
    ({"n_env": 4}, "Did you mean 'n_envs'"),
    ({"total_timesteps": "lots"}, "expected an integer"),
    ({"net_arch": 64}, "expected a list"),
])
def test_bad_agent_presets(bad, match, tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match=match):
        load_agent_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_agent_config(tmp_path / "nope.yaml")


def test_train_refuses_the_live_backend(tiny_env, tmp_path):
    with pytest.raises(ConfigError, match="replay backend"):
        train(tiny_env, "agents/ppo.yaml", TINY + ["backend=live"], run_dir=tmp_path / "l", progress=False)


@pytest.mark.parametrize("agent", ["ppo", "accmodel", "decision", "rowmodel"])
def test_cli_train_smoke(agent, tiny_env, tmp_path):
    """The CLI end to end on a tiny budget (subprocess, as a user would run it)."""
    import subprocess
    import sys

    over = {"ppo": TINY + SMALL_BATCH["ppo"], "rowmodel": ROW_TINY}.get(agent, ACC_TINY)
    args = [sys.executable, "-m", "specrl.cli", "train", "--env", tiny_env, "--agent", f"agents/{agent}.yaml",
            "--run-dir", str(tmp_path / "cli"), *sum((["--set", s] for s in over), [])]
    out = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "steps/s)" in out.stdout and "overall goodput" in out.stdout
    assert (tmp_path / "cli" / "eval" / "goodput_vs_load.png").exists()


def test_pretrain_clones_the_rule_before_rl(tiny_env, tmp_path):
    """Behaviour cloning of a rule: a clone of ``static:2,2`` must pick (2, 2) deterministically, and
    the warm start is reported in the summary."""
    import numpy as np

    from specrl.envs.config import load_env_config
    from specrl.pretrain import agreement, clone, collect
    from specrl.train import build_model, make_vec_env, prepare

    cfg = load_env_config(tiny_env)
    prepare(cfg, progress=False)  # records the tiny traces on first use
    demos = collect(cfg, "static:2,2", n_envs=4, steps=400, seed=0)
    assert demos.obs.shape == (400, NUM_FEATURES) and demos.goodput > 0
    want = (cfg.k_choices.index(2), cfg.w_choices.index(2))
    assert (demos.actions == want).all()
    agent = load_agent_config("agents/ppo.yaml", {"n_envs": 4})
    vec = make_vec_env(cfg, agent, 0)
    model = build_model(agent, vec, 0, tmp_path)
    x = (demos.obs - demos.obs.mean(0)) / (demos.obs.std(0) + 1e-8)
    before = agreement(model, x, demos.actions)
    losses = clone(model, x, demos.actions, epochs=150)
    assert losses[-1] < losses[0] / 4
    assert agreement(model, x, demos.actions) == 1.0 > before
    summary = train(tiny_env, "agents/ppo.yaml", TINY + SMALL_BATCH["ppo"] + [
        "agent.pretrain=static:2,2", "agent.pretrain_steps=200", "agent.pretrain_epochs=5"],
        run_dir=tmp_path / "bc", progress=False, final_eval=False)
    assert summary["pretrain"]["rule"] == "static:2,2" and summary["pretrain"]["demo_steps"] == 200
    assert np.isfinite(summary["pretrain"]["loss_last"])


@pytest.mark.parametrize("over,match", [
    ({"pretrain": "goodput", "algo": "dqn"}, "works with algo ppo or a2c"),
    ({"pretrain": "goodput", "frame_stack": 4}, "frame_stack 1"),
])
def test_pretrain_refuses_what_it_cannot_clone_into(over, match):
    with pytest.raises(ConfigError, match=match):
        load_agent_config("agents/ppo.yaml", over)


def test_pretrain_refuses_the_oracle(tiny_env):
    from specrl.envs.config import load_env_config
    from specrl.pretrain import collect

    with pytest.raises(ConfigError, match="cannot be cloned"):
        collect(load_env_config(tiny_env), "oracle", 2, 10, 0)


def test_training_evaluations_use_every_category(tiny_env):
    """workload.episode_categories shapes training episodes only: evaluations (the periodic
    validations, the final one, `specrl evaluate`) run the standard episodes, every category in
    every episode, so their results do not depend on it."""
    from specrl.envs.config import load_env_config
    from specrl.train import prepare, quick_eval

    agent = load_agent_config("agents/ppo.yaml", {"eval_loads": ["closed:1,4"], "eval_seeds": 2, "eval_horizon_s": 3.0})
    res = {}
    for n in (0, [1, 2]):
        cfg = load_env_config(tiny_env, workload={"arrival": "closed", "concurrency": [1, 4], "episode_categories": n})
        prepare(cfg, progress=False)
        res[str(n)] = quick_eval(cfg, agent, None, ["ar", "goodput"])["by_load"]
    assert res["0"] == res["[1, 2]"]


ACC_TINY = ["agent.n_envs=4", "agent.eval_seeds=1", "agent.eval_loads=[closed:1]", "agent.eval_horizon_s=2.0",
            "agent.hyperparams.steps=6", "agent.hyperparams.rounds=1", "agent.hyperparams.round_steps=4",
            "agent.hyperparams.hidden=[16]", "agent.hyperparams.epochs=2"]
ROW_TINY = ["agent.eval_seeds=1", "agent.eval_loads=['closed:1,4']", "agent.eval_horizon_s=2.0"]


def test_rowmodel_preset_trains_and_evaluates_beside_per_request_references(tiny_env, tmp_path):
    """agents/rowmodel.yaml through `specrl train`: the table is saved in the run and loads through
    the registry; the final evaluation has the per-request baseline and oracle beside the others."""
    from specrl.envs.config import load_env_config, policy_context
    from specrl.policies import make_policy

    summary = train(tiny_env, "agents/rowmodel.yaml", ROW_TINY, run_dir=tmp_path / "rm", progress=False)
    run = Path(summary["run_dir"])
    for f in ("config.json", "rowmodel/rowmodel.json", "summary.json", "eval/table.md"):
        assert (run / f).exists(), f
    fit = summary["rowmodel"]
    assert fit["rows"] > 0 and fit["mae"] < fit["mae_constant"]  # the buckets explain some acceptance
    overall = summary["eval"]["overall"]
    assert {"learned", "goodput", "goodput-rows", "oracle", "oracle-rows"} <= set(overall)
    pol = make_policy(f"rowmodel:{run / 'rowmodel'}", policy_context(load_env_config(tiny_env)))
    assert pol.per_row and pol.table.shape[1] == len(pol.actions_kw)


@pytest.mark.parametrize("over, match", [
    ({"pretrain": "goodput"}, "algo 'rowmodel' is not an SB3 agent"),
    ({"hyperparams": {"lr": 0.1}}, r"has no hyperparams \['lr'\]"),
])
def test_rowmodel_preset_refuses_what_does_not_apply(over, match):
    with pytest.raises(ConfigError, match=match):
        load_agent_config("agents/rowmodel.yaml", over)


def test_accmodel_preset_trains_evaluates_tracks_and_exports(tiny_env, tmp_path, monkeypatch):
    """agents/accmodel.yaml through `specrl train`: the model is saved in the run, evaluated beside
    every baseline, logged to wandb offline, and `specrl export` turns the run into a controller."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = train(tiny_env, "agents/accmodel.yaml", ACC_TINY, seed=1, track=True, run_dir=tmp_path / "am",
                    progress=False)
    run = Path(summary["run_dir"])
    for f in ("config.json", "accmodel/accmodel.json", "accmodel/accmodel.safetensors", "summary.json", "eval/table.md"):
        assert (run / f).exists(), f
    assert [h["samples"] for h in summary["accmodel"]] == [24, 40]
    assert summary["validation"]["learned"] > 0 and summary["validation"]["goodput"] > 0
    assert "learned" in summary["eval"]["overall"] and "oracle" in summary["eval"]["overall"]
    assert list((run / "wandb").glob("offline-run-*"))
    from specrl.train import learned_policy, load_run_config

    env_cfg, agent, _ = load_run_config(run)  # what benchmarks/generalisation.py loads
    pol = learned_policy(run, env_cfg, agent)
    assert pol.name == "learned" and type(pol).__name__ == "AcceptanceModelPolicy"
    from specrl.runtime import Controller
    from specrl.runtime.export import export_run

    ctl = Controller.load(export_run(run, tmp_path / "am-export"))
    assert ctl.kind == "rule" and (tmp_path / "am-export" / "accmodel.safetensors").exists()


@pytest.mark.parametrize("over,match", [
    ({"hyperparams": {"epoch": 3}}, r"no hyperparameter\(s\) \['epoch'\]. Allowed: batch_size, epochs"),
    ({"pretrain": "goodput"}, "algo 'accmodel' is not an SB3 agent"),
    ({"defer": "goodput"}, "algo 'accmodel' is not an SB3 agent"),
])
def test_accmodel_preset_refuses_what_does_not_apply(over, match):
    with pytest.raises(ConfigError, match=match):
        load_agent_config("agents/accmodel.yaml", over)


def test_demo_comparison_puts_agents_beside_the_best_baseline_per_load():
    from specrl.demo import comparison

    def ev(learned):
        return {"by_load": {"closed:1": {"ar": 10.0, "goodput": 12.0, "oracle": 15.0, "learned": learned[0]},
                            "closed:8": {"ar": 40.0, "goodput": 38.0, "oracle": 41.0, "learned": learned[1]}},
                "overall": {"ar": 20.0, "goodput": 21.4, "oracle": 24.0, "learned": learned[2]}}

    text = comparison([("ppo", Path("a"), Path("b"), ev([12.0, 39.0, 21.0])),
                       ("accmodel", Path("c"), Path("d"), ev([13.2, 40.0, 23.0]))])
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| closed") or
            line.startswith("| overall")}
    assert "`goodput` 12.0 | 12.0 (1.000) | 13.2 (1.100) | 15.0" in rows["closed:1"]
    assert "`ar` 40.0 | 39.0 (0.975) | 40.0 (1.000) | 41.0" in rows["closed:8"]
    assert "`goodput` 21.4" in rows["overall"]


def test_demo_budget_applies_to_sb3_agents_only_and_yields_to_the_user():
    from specrl.demo import demo_overrides

    assert demo_overrides("agents/ppo.yaml", ["seed=1"], 500_000) == ["seed=1", "agent.total_timesteps=500000"]
    assert demo_overrides("agents/accmodel.yaml", [], 500_000) == []
    assert demo_overrides("agents/decision.yaml", [], 500_000) == []
    assert demo_overrides("agents/rowmodel.yaml", [], 500_000) == []
    assert demo_overrides("agents/ppo.yaml", ["agent.total_timesteps=64"], 500_000) == ["agent.total_timesteps=64"]
    assert demo_overrides("agents/ppo.yaml", [], 0) == []
