"""Does a trained policy serve loads and prompt categories it never trained on?

The issue asks for one policy across loads and for generalisation across load levels,
categories and prompt splits. Held-out prompts are the default evaluation everywhere; this
script covers the other two axes. Train a run on part of the space, e.g.

    specrl train --set "workload.concurrency=[1,4,16]" --set "agent.eval_loads=['closed:1,4,16']" ...
    specrl train --set "categories=[chat,code,math,rag]" ...

(``agent.eval_loads`` keeps the periodic validations, and so ``keep: best``, on the training
loads), then evaluate it here beside a reference run trained on everything and every baseline,
on held-out prompts, at all load points, on the categories the run did not train on (or
``--categories``). Both learned policies run in-process from their run directories (the SB3
model with its normalisation; the exported controller's range guard is not involved).

Usage: python benchmarks/generalisation.py --run RUN [--reference RUN] [--categories a,b]
       [--loads closed:1,2,4,8,16] [--seeds 3] [--horizon 120] [--out DIR]
Final line: {"run": r, "unseen_loads": [...], "categories": [...], "learned_over_best": x,
             "reference_over_best": y, "by_load": {load: {"learned": a, "reference": b, "best": c}}}
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import _common  # noqa: F401  (offline env vars, repo on sys.path)

from specrl.evaluate import EVAL_HORIZON_S, evaluate, parse_loads
from specrl.policies import BASELINES
from specrl.prompts import load_prompts
from specrl.train import _fresh, learned_policy, load_run_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="run trained on part of the loads or categories")
    ap.add_argument("--reference", default=None, help="run trained on everything (same env otherwise)")
    ap.add_argument("--categories", default=None, help="comma list (default: the ones --run did not train on)")
    ap.add_argument("--loads", nargs="+", default=["closed:1,2,4,8,16"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--horizon", type=float, default=EVAL_HORIZON_S, help="simulated seconds per episode")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    run = Path(args.run)
    cfg, agent, _ = load_run_config(run)
    every = sorted({p.category for p in load_prompts(cfg.prompts)})
    if args.categories:
        cats = args.categories.split(",")
    elif cfg.categories:
        cats = [c for c in every if c not in cfg.categories]
    else:
        cats = every
    loads = parse_loads(args.loads)
    conc = cfg.workload.concurrency if isinstance(cfg.workload.concurrency, list) else [cfg.workload.concurrency]
    trained = {str(c) for c in conc} if cfg.workload.arrival == "closed" else set()
    unseen = [ld.label for ld in loads if ld.label.split(":")[1] not in trained]
    # held-out prompts of the chosen categories; the full load sweep is given explicitly
    ev = replace(cfg, categories=cats, prompt_split="test", horizon_s=args.horizon)  # evaluate() runs standard episodes
    learned = learned_policy(run, cfg, agent)
    extra = {"learned": lambda: _fresh(learned)}
    if args.reference:
        ref_cfg, ref_agent, _ = load_run_config(Path(args.reference))
        reference = learned_policy(Path(args.reference), ref_cfg, ref_agent, name="reference")
        extra["reference"] = lambda: _fresh(reference)
    print(f"run {run}: trained on concurrency {sorted(trained, key=int)} and categories {cfg.categories or 'all'}; "
          f"evaluating on {cats} (held-out prompts) at {[ld.label for ld in loads]} (unseen loads: {unseen})",
          flush=True)
    res = evaluate(ev, list(BASELINES), loads, list(range(args.seeds)),
                   Path(args.out) if args.out else None, extra=extra)
    by_load = {}
    print(f"\n| load | best baseline | learned | / best |{' reference | / best |' if args.reference else ''}")
    print(f"|---|---|---|---|{'---|---|' if args.reference else ''}")
    for lab, g in res["by_load"].items():
        base = {p: v for p, v in g.items() if p in BASELINES}
        best = max(base, key=base.get)
        row = {"learned": g["learned"], "best": base[best], "best_name": best}
        line = f"| {lab}{' (unseen)' if lab in unseen else ''} | `{best}` {base[best]:.1f} | {g['learned']:.1f} | " \
               f"{g['learned'] / base[best]:.3f} |"
        if args.reference:
            row["reference"] = g["reference"]
            line += f" {g['reference']:.1f} | {g['reference'] / base[best]:.3f} |"
        print(line)
        by_load[lab] = row
    ov = res["overall"]
    best_overall = max(ov[p] for p in BASELINES)
    out = {"run": str(run), "unseen_loads": unseen, "categories": cats,
           "learned_over_best": round(ov["learned"] / best_overall, 4),
           "reference_over_best": round(ov["reference"] / best_overall, 4) if args.reference else None,
           "by_load": by_load}
    ref = f", reference {ov['reference']:.2f}" if args.reference else ""
    print(f"\noverall (geometric mean over loads): learned {ov['learned']:.2f}, best single baseline "
          f"{best_overall:.2f}{ref}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
