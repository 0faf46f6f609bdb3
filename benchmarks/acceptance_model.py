"""Train the learned acceptance model or the decision network (``specrl.accmodel``, ``--objective``)
for several seeds and compare it with every baseline and the oracle on the held-out prompts
(replay), like the PPO runs in the README.

Each seed: collect on the training prompts (round 0 with ``goodput`` driving, then DAgger rounds
with the model driving), fit, save to ``runs/accmodel-s<seed>`` or ``runs/decision-s<seed>``
(safetensors + JSON; use it with ``specrl evaluate --policies accmodel:runs/accmodel-s0``; the
registry reads either objective), and score it on the validation episodes
(training prompts, arrival seeds from ``specrl.train.VALIDATION_SEED0``) beside ``goodput``.
Then one held-out evaluation of every baseline, the oracle and every seed (table and plots in
``--out``).

Usage: python benchmarks/acceptance_model.py [--objective acceptance|decision] [--seeds 0,1,2]
       [--steps 2000] [--rounds 2] [--loads closed:1,2,4,8,16] [--eval-seeds 3] [--out DIR]
       [--also accmodel:runs/accmodel-s0,...]
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


def plot_ratios(by_load: dict[str, dict[str, float]], learned: list[str], path: Path,
                label: str = "learned acceptance model") -> Path:
    """Goodput / `goodput`'s per load: the learned seeds (mean, min-max band), the best other
    baseline, `ar` and the oracle; the 2% differences that matter here vanish on a linear plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(by_load)
    x = [int(ld.split(":")[1]) if ld.split(":")[1].isdigit() else i for i, ld in enumerate(loads)]
    ratio = {p: [by_load[ld][p] / by_load[ld]["goodput"] for ld in loads] for p in by_load[loads[0]]}
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    seeds = [ratio[n] for n in learned]
    mean = [sum(v) / len(v) for v in zip(*seeds)]
    ax.fill_between(x, [min(v) for v in zip(*seeds)], [max(v) for v in zip(*seeds)], color="C3", alpha=0.2)
    ax.plot(x, mean, "o-", color="C3", lw=2, label=f"{label} (mean of {len(learned)} seeds)")
    others = [p for p in BASELINES if p not in ("goodput", "ar")]
    best_other = [max(ratio[p][i] for p in others) for i in range(len(loads))]
    ax.plot(x, best_other, "s--", color="C2", label="best other baseline (per load)")
    ax.plot(x, ratio["ar"], "^:", color="C0", label="`ar` (no speculation)")
    ax.plot(x, ratio["oracle"], "k*-", label="clairvoyant oracle (myopic)")
    ax.axhline(1.0, color="C1", lw=1.5, label="`goodput` (SmartSpec argmax)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel("goodput / goodput of `goodput`")
    ax.set_title("held-out prompts, replay")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    ap.add_argument("--out", default=None, help="default results/<accmodel|decision>")
    ap.add_argument("--objective", choices=accmodel.OBJECTIVES, default="acceptance",
                    help="acceptance: the acceptance model (runs/accmodel-s<seed>); decision: the decision "
                         "network (runs/decision-s<seed>)")
    ap.add_argument("--also", default="", help="more policies for the held-out table, comma-separated "
                                               "(e.g. accmodel:runs/accmodel-s0); not in the learned mean")
    args = ap.parse_args()
    cfg = load_env_config(args.env)
    prepare(cfg)  # traces and cost model (cached)
    ctx = policy_context(cfg)
    table = ActionTable(cfg.k_choices, cfg.w_choices)
    loads = parse_loads([args.loads])
    seeds = [int(s) for s in args.seeds.split(",")]
    recipe = replace(accmodel.Recipe(), steps=args.steps, rounds=args.rounds, objective=args.objective)
    prefix = "accmodel" if args.objective == "acceptance" else "decision"
    args.out = args.out or f"results/{prefix}"
    val_cfg = replace(cfg, prompt_split="train", horizon_s=args.horizon)
    val_seeds = list(range(VALIDATION_SEED0, VALIDATION_SEED0 + args.eval_seeds))
    extra, per_seed = {}, {}
    for seed in seeds:
        model, info = accmodel.train(cfg, recipe, seed)
        run = accmodel.save(model, Path(args.runs) / f"{prefix}-s{seed}", table, info)
        name = f"learned-s{seed}"
        extra[name] = lambda m=model: accmodel.policy_for(ctx, m, args.objective)
        val = evaluate(val_cfg, ["goodput"], loads, val_seeds, None, progress=False, extra={name: extra[name]})
        per_seed[seed] = {"validation_vs_goodput": val["overall"][name] / val["overall"]["goodput"], "dir": str(run)}
        print(f"seed {seed}: saved {run}; validation {val['overall'][name]:.2f} vs goodput "
              f"{val['overall']['goodput']:.2f} tokens/s ({per_seed[seed]['validation_vs_goodput']:.3f}x)", flush=True)
    test_cfg = replace(cfg, prompt_split="test", horizon_s=args.horizon)
    also = [a.strip() for a in args.also.split(",") if a.strip()]
    res = evaluate(test_cfg, [*BASELINES, "oracle", *also], loads, list(range(args.eval_seeds)), Path(args.out), extra=extra)
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
    plot_ratios(res["by_load"], names, Path(args.out) / "ratio_vs_goodput.png",
                "learned acceptance model" if args.objective == "acceptance" else "decision network")
    print(f"table and plots: {args.out} (ratio_vs_goodput.png: every load relative to `goodput`)")
    print(json.dumps({"learned_vs_best": round(lo / bv, 4), "learned_vs_goodput": round(lo / ov["goodput"], 4),
                      "of_oracle": round(lo / ov["oracle"], 4), "by_load": {k: round(v, 4) for k, v in by_load.items()},
                      "seeds": per_seed}))


if __name__ == "__main__":
    main()
