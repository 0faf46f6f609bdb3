"""``specrl validate-replay``: is the replay env faithful to the live engine?

The same fixed policies (several static (k, w) and adaptive rules) run on the same prompts,
loads and arrival seeds in the live env (real decoding, measured time) and in the replay env
(traces + cost model). Reported per (policy, load): goodput and mean accept length on both
sides and the relative goodput error; plus whether the static policies rank identically and
the Spearman rank correlation of all policies. Targets: goodput error <= 5%, same ranking.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import numpy as np

STATIC = ["ar", "static:2,1", "static:4,1", "static:8,1", "static:4,4"]
ADAPTIVE = ["hf-heuristic", "goodput"]


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if len(a) < 2:
        return 1.0
    return float(np.corrcoef(ra, rb)[0, 1])


def validate(cfg: Any, policies: list[str], loads: list[Any], seeds: list[int], pair: Any = None,
             progress: bool = True, live_time: str = "measured") -> dict[str, Any]:
    """``live_time='profiled'`` charges the live env with the cost model too (a plumbing check:
    then the two sides must agree exactly)."""
    from tqdm import tqdm

    from specrl.envs.config import load_cost_model
    from specrl.evaluate import aggregate, run_live, run_replay
    from specrl.policies import PolicyContext, make_policy

    ctx = PolicyContext(cfg.k_choices, cfg.w_choices, load_cost_model(cfg), cfg.drafter)
    live_cfg = replace(cfg, backend="live", time_source=live_time)
    rep_cfg = replace(cfg, backend="replay")
    live_eps, rep_eps = [], []
    for spec in tqdm(policies, desc="live vs replay", disable=not progress):
        def make(spec: str = spec) -> Any:
            return make_policy(spec, ctx)

        live_eps += run_live(live_cfg, spec, loads, seeds, make, pair=pair)
        rep_eps += run_replay(rep_cfg, spec, loads, seeds, make)
    live, rep = aggregate(live_eps), aggregate(rep_eps)
    names = list(dict.fromkeys(e.policy for e in live_eps))
    rows, errs = [], []
    for ld in loads:
        lab = ld.label
        for p in names:
            gl, gr = live[p][lab]["goodput"][0], rep[p][lab]["goodput"][0]
            al, ar_ = live[p][lab]["accept_len"][0], rep[p][lab]["accept_len"][0]
            err = abs(gr - gl) / gl
            errs.append(err)
            rows.append({"load": lab, "policy": p, "live_goodput": gl, "replay_goodput": gr, "rel_error": err,
                         "live_accept_len": al, "replay_accept_len": ar_})
    same, rho = True, []
    for ld in loads:
        lab = ld.label
        st = [p for p in names if p in STATIC or p.startswith("static")]
        order_l = sorted(st, key=lambda p: -live[p][lab]["goodput"][0])
        order_r = sorted(st, key=lambda p: -rep[p][lab]["goodput"][0])
        same &= order_l == order_r
        rho.append(spearman([live[p][lab]["goodput"][0] for p in names], [rep[p][lab]["goodput"][0] for p in names]))
    return {"max_goodput_rel_error": float(max(errs)), "mean_goodput_rel_error": float(np.mean(errs)),
            "same_static_ranking": bool(same), "spearman": float(np.mean(rho)), "rows": rows}


def table(res: dict[str, Any]) -> str:
    head = "| load | policy | live goodput | replay goodput | error | live accept len | replay accept len |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['load']} | {r['policy']} | {r['live_goodput']:.1f} | {r['replay_goodput']:.1f} | "
                     f"{100 * r['rel_error']:.1f}% | {r['live_accept_len']:.2f} | {r['replay_accept_len']:.2f} |")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", default="envs/replay.yaml", help="env preset (run live and in replay)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--policies", default=",".join(STATIC + ADAPTIVE))
    p.add_argument("--loads", nargs="+", default=["closed:1,4"])
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--horizon", type=float, default=20.0)
    p.add_argument("--split", default="test")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from specrl.collect import ensure_traces
    from specrl.config import split_override
    from specrl.envs.config import load_env_config
    from specrl.evaluate import _split_policies, parse_loads

    over = dict(split_override(s) for s in args.set)
    cfg = load_env_config(args.env, horizon_s=args.horizon, prompt_split=args.split, **over)
    ensure_traces(replace(cfg, backend="replay"))
    res = validate(cfg, _split_policies(args.policies), parse_loads(args.loads), list(range(args.seeds)))
    print(table(res))
    print(f"\nmax goodput error {100 * res['max_goodput_rel_error']:.1f}% (mean {100 * res['mean_goodput_rel_error']:.1f}%), "
          f"static ranking identical: {res['same_static_ranking']}, Spearman {res['spearman']:.2f}")
    if args.json:
        print(json.dumps(res))
    return 0
