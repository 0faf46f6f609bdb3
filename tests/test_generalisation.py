"""benchmarks/generalisation.py end to end on a tiny run (unseen loads and categories are found)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specrl.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["agent.total_timesteps=256", "agent.n_envs=4", "agent.eval_every=0", "agent.keep=last",
        "agent.checkpoint_every=256", "agent.pretrain_steps=128", "agent.pretrain_epochs=2",
        "agent.hyperparams.n_steps=32", "agent.hyperparams.batch_size=64"]


def test_generalisation_benchmark_on_a_tiny_run(tiny_replay_env, tmp_path, monkeypatch):
    """Also: the first run (two categories) records traces into an empty cache; the second (every
    category) must find its prompts there (traces are recorded for the whole prompt source)."""
    monkeypatch.setenv("SPECRL_CACHE_DIR", str(tmp_path / "cache"))
    part = train(tiny_replay_env, "agents/ppo.yaml", [*TINY, "workload.concurrency=[1]", "categories=[chat,code]"],
                 run_dir=tmp_path / "part", progress=False, final_eval=False)
    full = train(tiny_replay_env, "agents/ppo.yaml", TINY, run_dir=tmp_path / "full", progress=False, final_eval=False)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generalisation.py"), "--run", part["run_dir"],
                          "--reference", full["run_dir"], "--loads", "closed:1,4", "--seeds", "1", "--horizon", "2"],
                         capture_output=True, text=True, env=dict(os.environ), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["unseen_loads"] == ["closed:4"]
    assert "chat" not in res["categories"] and "code" not in res["categories"] and len(res["categories"]) >= 2
    for load in ("closed:1", "closed:4"):
        row = res["by_load"][load]
        assert row["best"] > 0 and row["learned"] > 0 and row["reference"] > 0
    assert "| closed:4 (unseen) |" in out.stdout and "| closed:1 |" in out.stdout
