"""Env steps per second: the vectorised replay env (1, 16, 64 envs) vs the live env.

Random actions, closed loop over the load levels of the preset. The replay numbers exclude the
one-time table build (cached); the live number is real decoding on this machine. The final
stdout line is one JSON object: {"replay_steps_per_s_64": x, "live_steps_per_s": y, ...}.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import final_line, machine, table

from specrl.envs.config import load_env_config
from specrl.envs.vector import SpecReplayVecEnv


def replay_rate(cfg, n: int, seconds: float) -> float:
    vec = SpecReplayVecEnv(cfg, n)
    vec.seed(0)
    vec.reset()
    rng = np.random.default_rng(0)
    acts = rng.integers(0, [len(cfg.k_choices), len(cfg.w_choices)], size=(4096, n, 2))
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        vec.step_async(acts[steps % 4096])
        vec.step_wait()
        steps += 1
    return steps * n / (time.perf_counter() - t0)


def live_rate(cfg, steps: int) -> float:
    import specrl

    env = specrl.make_env(cfg, backend="live")
    env.reset(seed=0)
    env.action_space.seed(0)
    t0 = time.perf_counter()
    for _ in range(steps):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--env", default="envs/replay.yaml")
    ap.add_argument("--seconds", type=float, default=5.0, help="measuring time per replay setting")
    ap.add_argument("--live-steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.live_steps = 1.0, 8
    cfg = load_env_config(args.env)
    print(f"# env steps per second, {machine()}")
    rows, result = [], {}
    for n in (1, 16, 64):
        r = replay_rate(cfg, n, args.seconds)
        rows.append([f"replay (vectorised), {n} envs", r])
        result[f"replay_steps_per_s_{n}"] = r
    live = live_rate(load_env_config(args.env, backend="live", workload={"arrival": "closed", "concurrency": 4}),
                     args.live_steps)
    rows.append(["live (real decoding, 4 running requests)", live])
    result["live_steps_per_s"] = live
    result["speedup_64_vs_live"] = result["replay_steps_per_s_64"] / live
    print(table(["env", "steps/s"], rows))
    final_line(result)


if __name__ == "__main__":
    main()
