"""Train the learned acceptance model (``specrl.accmodel``) for several seeds and compare it with
every baseline and the oracle on the held-out prompts (replay), like the PPO runs in the README.

Each seed: collect on the training prompts (round 0 with ``goodput`` driving, then DAgger rounds
with the model driving), fit, save to ``runs/accmodel-s<seed>`` (safetensors + JSON; use it with
``specrl evaluate --policies accmodel:runs/accmodel-s0``), and score it on the validation episodes
(training prompts, arrival seeds from ``specrl.train.VALIDATION_SEED0``) beside ``goodput``.
Then one held-out evaluation of every baseline, the oracle and every seed (table and plots in
``--out``).

Usage: python benchmarks/acceptance_model.py [--seeds 0,1,2] [--steps 2000] [--rounds 2]
       [--loads closed:1,2,4,8,16] [--eval-seeds 3] [--out results/accmodel]
Final line: {"learned_vs_best": r, "learned_vs_goodput": g, "of_oracle": o, "by_load": {load: r}, "seeds": {...}}
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import _common  # noqa: F401  (offline env vars, repo on sys.path)

from specrl import accmodel
from specrl.envs.config import load_env_config, policy_context
from specrl.evaluate import EVAL_HORIZON_S, evaluate, parse_loads
from specrl.policies import BASELINES
from specrl.policies.base import ActionTable
from specrl.train import VALIDATION_SEED0, prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="envs/replay.yaml")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=accmodel.Recipe.steps)
    ap.add_argument("--rounds", type=int, default=accmodel.Recipe.rounds)
    ap.add_argument("--loads", default="closed:1,2,4,8,16")
    ap.add_argument("--eval-seeds", type=int, default=3)
    ap.add_argument("--horizon", type=float, default=EVAL_HORIZON_S)
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--out", default="results/accmodel")
    args = ap.parse_args()
    cfg = load_env_config(args.env)
    prepare(cfg)  # traces and cost model (cached)
    ctx = policy_context(cfg)
    table = ActionTable(cfg.k_choices, cfg.w_choices)
    loads = parse_loads([args.loads])
    seeds = [int(s) for s in args.seeds.split(",")]
    recipe = replace(accmodel.Recipe(), steps=args.steps, rounds=args.rounds)
    val_cfg = replace(cfg, prompt_split="train", horizon_s=args.horizon)
    val_seeds = list(range(VALIDATION_SEED0, VALIDATION_SEED0 + args.eval_seeds))
    extra, per_seed = {}, {}
    for seed in seeds:
        model, info = accmodel.train(cfg, recipe, seed)
        run = accmodel.save(model, Path(args.runs) / f"accmodel-s{seed}", table, info)
        name = f"learned-s{seed}"
        extra[name] = lambda m=model: accmodel.AcceptanceModelPolicy(ctx, m)
        val = evaluate(val_cfg, ["goodput"], loads, val_seeds, None, progress=False, extra={name: extra[name]})
        per_seed[seed] = {"validation_vs_goodput": val["overall"][name] / val["overall"]["goodput"], "dir": str(run)}
        print(f"seed {seed}: saved {run}; validation {val['overall'][name]:.2f} vs goodput "
              f"{val['overall']['goodput']:.2f} tokens/s ({per_seed[seed]['validation_vs_goodput']:.3f}x)", flush=True)
    test_cfg = replace(cfg, prompt_split="test", horizon_s=args.horizon)
    res = evaluate(test_cfg, [*BASELINES, "oracle"], loads, list(range(args.eval_seeds)), Path(args.out), extra=extra)
    names = list(extra)

    def learned(g: dict[str, float]) -> float:  # mean over training seeds
        return sum(g[n] for n in names) / len(names)

    def best(g: dict[str, float]) -> tuple[str, float]:
        return max(((p, g[p]) for p in BASELINES), key=lambda x: x[1])

    print(f"\nheld-out prompts, arrival seeds 0..{args.eval_seeds - 1}, {args.horizon:.0f} s episodes, goodput "
          "tokens/s (replay); learned = mean of the training seeds")
    print("| load | `ar` | best baseline | `goodput` | learned (" + " / ".join(f"s{s}" for s in seeds)
          + ") | / best | oracle |")
    print("|---|---|---|---|---|---|---|")
    by_load = {}
    for ld, g in res["by_load"].items():
        bp, bv = best(g)
        by_load[ld] = learned(g) / bv
        print(f"| {ld} | {g['ar']:.1f} | `{bp}` {bv:.1f} | {g['goodput']:.1f} | {learned(g):.1f} ("
              + " / ".join(f"{g[n]:.1f}" for n in names) + f") | {by_load[ld]:.3f} | {g['oracle']:.1f} |")
    ov = res["overall"]
    bp, bv = best(ov)
    lo = math.exp(sum(math.log(ov[n]) for n in names) / len(names))
    print(f"| geometric mean | {ov['ar']:.1f} | `{bp}` {bv:.1f} | {ov['goodput']:.1f} | {lo:.1f} ("
          + " / ".join(f"{ov[n] / bv:.3f}" for n in names) + f"x) | {lo / bv:.3f} | {ov['oracle']:.1f} "
          f"({lo / ov['oracle']:.3f} reached) |")
    print(f"table and plots: {args.out}")
    print(json.dumps({"learned_vs_best": round(lo / bv, 4), "learned_vs_goodput": round(lo / ov["goodput"], 4),
                      "of_oracle": round(lo / ov["oracle"], 4), "by_load": {k: round(v, 4) for k, v in by_load.items()},
                      "seeds": per_seed}))


if __name__ == "__main__":
    main()
