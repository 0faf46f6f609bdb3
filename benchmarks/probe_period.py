"""How often should `goodput` draft to re-measure acceptance? (its ``probe_every``)

The rule drafts once after ``probe_every`` steps without a draft (the feature ``since_draft``):
acceptance is only measured while drafting. The period is chosen here on *validation*
episodes (training prompts, arrival seeds from ``specrl.train.VALIDATION_SEED0``), the episodes
training uses to choose checkpoints; ``--split test`` shows the held-out prompts afterwards.

Usage: python benchmarks/probe_period.py [--periods 8,12,16,24,32] [--split train|test]
       [--loads closed:1,2,4,8,16] [--seeds 3] [--horizon 120]
Final line: {"split": s, "best": p, "overall": {period: goodput}, "by_load": {load: {period: goodput}}}
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import _common  # noqa: F401  (offline env vars, repo on sys.path)

from specrl.envs.config import load_env_config, policy_context
from specrl.evaluate import EVAL_HORIZON_S, evaluate, parse_loads
from specrl.policies.goodput import GoodputArgmax
from specrl.train import VALIDATION_SEED0


def sweep(cfg: Any, periods: list[int], loads: list[str], seeds: list[int]) -> dict[str, Any]:
    """Goodput of the rule at each probe period (and of `ar`), per load and overall."""
    ctx = policy_context(cfg)
    extra = {f"probe:{p}": (lambda p=p: GoodputArgmax(ctx, probe_every=p)) for p in periods}
    for p in periods:  # refuse a bad period before any episode runs
        extra[f"probe:{p}"]()
    return evaluate(cfg, ["ar"], parse_loads(loads), seeds, None, progress=False, extra=extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="envs/replay.yaml")
    ap.add_argument("--periods", default="8,12,16,24,32")
    ap.add_argument("--split", default="train", choices=["train", "test"],
                    help="train: validation episodes (choose here); test: held-out prompts (look afterwards)")
    ap.add_argument("--loads", default="closed:1,2,4,8,16")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--horizon", type=float, default=EVAL_HORIZON_S)
    args = ap.parse_args()
    periods = [int(p) for p in args.periods.split(",")]
    cfg = replace(load_env_config(args.env), prompt_split=args.split, horizon_s=args.horizon)
    seed0 = VALIDATION_SEED0 if args.split == "train" else 0
    res = sweep(cfg, periods, [args.loads], list(range(seed0, seed0 + args.seeds)))
    names = ["ar"] + [f"probe:{p}" for p in periods]
    print(f"{args.split} split, arrival seeds {seed0}..{seed0 + args.seeds - 1}, {args.horizon:.0f} s episodes, "
          "goodput in tokens/s (replay)")
    print("| load | " + " | ".join(f"`{n}`" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for load, g in res["by_load"].items():
        print(f"| {load} | " + " | ".join(f"{g[n]:.2f}" for n in names) + " |")
    print("| geometric mean | " + " | ".join(f"{res['overall'][n]:.2f}" for n in names) + " |")
    best = max(periods, key=lambda p: res["overall"][f"probe:{p}"])
    print(json.dumps({"split": args.split, "best": best,
                      "overall": {p: round(res["overall"][f"probe:{p}"], 3) for p in periods},
                      "by_load": {ld: {p: round(g[f"probe:{p}"], 3) for p in periods}
                                  for ld, g in res["by_load"].items()}}))


if __name__ == "__main__":
    main()
