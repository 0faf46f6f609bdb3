"""benchmarks/probe_period.py: the goodput rule's probe period swept on a tiny replay env."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import probe_period  # noqa: E402

from specrl.errors import ConfigError  # noqa: E402


def test_sweep_runs_every_period_and_refuses_a_bad_one(tiny_replay_env):
    from specrl.envs.config import load_env_config
    from specrl.train import prepare

    cfg = load_env_config(tiny_replay_env)
    prepare(cfg, progress=False)  # records the tiny traces on first use
    cfg = replace(cfg, horizon_s=2.0)
    res = probe_period.sweep(cfg, [1, 64], ["closed:1"], [0])
    assert set(res["overall"]) == {"ar", "probe:1", "probe:64"}
    assert all(v > 0 for v in res["overall"].values())
    with pytest.raises(ConfigError, match=r"probe_every=65 \(batch size 1\) is outside 1..64"):
        probe_period.sweep(cfg, [16, 65], ["closed:1"], [0])
