"""``specrl validate-replay``: is the replay env faithful to the live engine?

The same fixed policies (several static (k, w) and adaptive rules) run on the same prompts,
loads and arrival seeds in the live env (real decoding, measured time) and in the replay env
(traces + cost model). Reported per (policy, load): goodput and mean accept length on both
sides and the relative goodput error; plus whether the static policies rank identically and
the Spearman rank correlation of all policies. Targets: goodput error <= 5%, same ranking.

Machine speed drifts: on a shared CPU the same forward pass can take 30% longer for minutes at
a time, while the cost model was profiled at one moment. So around every policy's live runs
the validator times reference target forwards at cost-model grid points and reports the
*speed factor* (measured / profiled). Errors are reported raw and after scaling the replay's
time by that factor ("speed-corrected"): the first is what a user sees, the second isolates
what the replay itself gets wrong.

Goodput error has two sources, and the validator separates them: the *time* charged for a step
(cost model vs wall clock) and the *trajectory* (batch compositions drift apart once one side
finishes a request earlier). "Live time / cost model" charges the cost model on exactly the
steps the live run took: divided by the speed factor it is the cost model's own error, free of
trajectory effects (``mean_step_time_corrected_error``).

Finally, the live side is not a fixed reference: with ``--repeats 2`` (the default) every live
policy runs twice, the second time in reversed policy order, and the spread between the two is
the *live noise*. A replay error below it cannot be told apart from the live side's error
against itself; the ranking is judged both over all static policies and over the static pairs
whose live gap is larger than that noise (the only pairs whose live order means something).
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


PROBE_BATCH, PROBE_TOKENS = (1, 4), (1, 5)


def machine_speed(pair: Any, cost: Any, reps: int = 3) -> float:
    """Measured / profiled seconds of reference target forwards now (1.0 = as fast as when profiled).

    Median over a few cost-model grid points (batch 1 and 4, 1 and 5 tokens, the smallest
    profiled context), so one noisy point does not decide it."""
    from specrl.profiling import forward_grid

    ctx = cost.context[0]
    meas = forward_grid(pair.target, pair.device, PROBE_BATCH, PROBE_TOKENS, [ctx], reps, pair.vocab_size)
    ratios = [meas[i, j, 0] / cost.isolated_verify_time(b, n, ctx) for i, b in enumerate(PROBE_BATCH)
              for j, n in enumerate(PROBE_TOKENS)]
    return float(np.median(ratios))


def validate(cfg: Any, policies: list[str], loads: list[Any], seeds: list[int], pair: Any = None,
             progress: bool = True, live_time: str = "measured", probe_speed: bool | None = None,
             repeats: int = 1) -> dict[str, Any]:
    """``live_time='profiled'`` charges the live env with the cost model too (a plumbing check:
    then the two sides must agree exactly). ``probe_speed`` (default: when time is measured)
    times reference forwards before and after each policy's live runs (see the module doc).

    ``repeats`` > 1 runs every live policy that many times, in alternating order (forward, then
    reversed) so slow drift does not favour the policies that run first; live goodput is the
    mean, and the spread between repeats is the *live noise*: the error the live side makes
    against itself, a floor under any replay error this machine can measure. Static pairs whose
    live gap exceeds both policies' noise are *resolved*; the ranking is also judged on those."""
    from tqdm import tqdm

    from specrl.envs.config import load_cost_model
    from specrl.envs.live import shared_pair, time_function
    from specrl.errors import ConfigError
    from specrl.evaluate import aggregate, run_live, run_replay
    from specrl.policies import PolicyContext, make_policy

    if repeats < 1:
        raise ConfigError(f"--repeats {repeats} is not allowed: use 1 or more (2 or more also measure the "
                          "live noise)")
    cost = load_cost_model(cfg)
    ctx = PolicyContext(cfg.k_choices, cfg.w_choices, cost, cfg.drafter, cfg.verify)
    live_cfg = replace(cfg, backend="live", time_source=live_time)
    rep_cfg = replace(cfg, backend="replay")
    if probe_speed is None:
        probe_speed = live_time == "measured"
    if probe_speed and pair is None:
        pair = shared_pair(live_cfg)
    by_repeat: list[list[Any]] = [[] for _ in range(repeats)]
    rep_eps: list[Any] = []
    probes: dict[str, list[float]] = {}
    model_time = time_function(replace(cfg, time_source="profiled"), cost)

    def make_for(spec: str) -> Any:
        return lambda: make_policy(spec, ctx)

    runs = [(r, spec) for r in range(repeats) for spec in (policies if r % 2 == 0 else policies[::-1])]
    for r, spec in tqdm(runs, desc="live vs replay", disable=not progress):
        before = machine_speed(pair, cost) if probe_speed else 1.0
        eps = run_live(live_cfg, spec, loads, seeds, make_for(spec), pair=pair, also_time=model_time)
        after = machine_speed(pair, cost) if probe_speed else 1.0
        by_repeat[r] += eps
        if r == 0:  # replay is deterministic: once is enough
            rep_eps += run_replay(rep_cfg, spec, loads, seeds, make_for(spec))
        for e in eps:
            probes.setdefault(e.policy, []).append((before + after) / 2)
    live_eps = [e for eps in by_repeat for e in eps]
    live, rep = aggregate(live_eps), aggregate(rep_eps)
    per_rep = [aggregate(eps) for eps in by_repeat]
    speed = {p: float(np.mean(v)) for p, v in probes.items()}
    names = list(dict.fromkeys(e.policy for e in live_eps))
    rows, errs, cerrs, terrs = [], [], [], []
    step_times: dict[tuple[str, str], tuple[float, float]] = {}
    for e in live_eps:
        m, c = step_times.get((e.policy, e.load.label), (0.0, 0.0))
        step_times[e.policy, e.load.label] = (m + e.summary["time_s"], c + e.summary["also_time_s"])
    noise: dict[tuple[str, str], float] = {}
    for ld in loads:
        lab = ld.label
        for p in names:
            gl, gr = live[p][lab]["goodput"][0], rep[p][lab]["goodput"][0]
            al, ar_ = live[p][lab]["accept_len"][0], rep[p][lab]["accept_len"][0]
            sp = speed.get(p, 1.0)
            err, cerr = abs(gr - gl) / gl, abs(gr / sp - gl) / gl
            measured, modelled = step_times[p, lab]
            time_ratio = measured / modelled if modelled > 0 else float("nan")
            gs = [a[p][lab]["goodput"][0] for a in per_rep]
            nz = (max(gs) - min(gs)) / gl if repeats > 1 else None
            noise[p, lab] = nz if nz is not None else 0.0
            errs.append(err)
            cerrs.append(cerr)
            terrs.append(abs(time_ratio / sp - 1))
            rows.append({"load": lab, "policy": p, "live_goodput": gl, "replay_goodput": gr, "rel_error": err,
                         "speed_factor": sp, "corrected_rel_error": cerr, "live_time_vs_model": time_ratio,
                         "live_noise": nz, "live_goodputs": gs,
                         "live_accept_len": al, "replay_accept_len": ar_})
    same, rho, resolved, agree = True, [], 0, 0
    for ld in loads:
        lab = ld.label
        st = [p for p in names if p in STATIC or p.startswith("static")]
        live_g = {p: live[p][lab]["goodput"][0] for p in st}
        rep_g = {p: rep[p][lab]["goodput"][0] for p in st}
        same &= sorted(st, key=lambda p: -live_g[p]) == sorted(st, key=lambda p: -rep_g[p])
        rho.append(spearman([live[p][lab]["goodput"][0] for p in names], [rep[p][lab]["goodput"][0] for p in names]))
        for i, a in enumerate(st):
            for b in st[i + 1:]:
                gap = abs(live_g[a] - live_g[b]) / ((live_g[a] + live_g[b]) / 2)
                if repeats > 1 and gap > max(noise[a, lab], noise[b, lab]):
                    resolved += 1
                    agree += (live_g[a] > live_g[b]) == (rep_g[a] > rep_g[b])
    noises = [r["live_noise"] for r in rows if r["live_noise"] is not None]
    return {"max_goodput_rel_error": float(max(errs)), "mean_goodput_rel_error": float(np.mean(errs)),
            "max_corrected_rel_error": float(max(cerrs)), "mean_corrected_rel_error": float(np.mean(cerrs)),
            "mean_step_time_corrected_error": float(np.mean(terrs)),
            "mean_accept_len_abs_error": float(np.mean([abs(r["live_accept_len"] - r["replay_accept_len"])
                                                        for r in rows])),
            "same_static_ranking": bool(same), "spearman": float(np.mean(rho)),
            "repeats": repeats,
            "live_noise_mean": float(np.mean(noises)) if noises else None,
            "live_noise_max": float(max(noises)) if noises else None,
            "resolved_static_pairs": resolved if repeats > 1 else None,
            "resolved_static_pairs_agreeing": agree if repeats > 1 else None,
            "rows": rows}


def table(res: dict[str, Any]) -> str:
    head = ("| load | policy | live goodput | replay goodput | error | live noise | speed factor "
            "| speed-corrected error | live time / cost model | live accept len | replay accept len |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        noise = "n/a" if r["live_noise"] is None else f"{100 * r['live_noise']:.1f}%"
        lines.append(f"| {r['load']} | {r['policy']} | {r['live_goodput']:.1f} | {r['replay_goodput']:.1f} | "
                     f"{100 * r['rel_error']:.1f}% | {noise} | {r['speed_factor']:.2f} | "
                     f"{100 * r['corrected_rel_error']:.1f}% | {r['live_time_vs_model']:.2f} | "
                     f"{r['live_accept_len']:.2f} | {r['replay_accept_len']:.2f} |")
    return "\n".join(lines)


def summary(res: dict[str, Any]) -> str:
    """One paragraph a reader can act on: the errors, and the live noise floor they sit on."""
    out = (f"max goodput error {100 * res['max_goodput_rel_error']:.1f}% (mean {100 * res['mean_goodput_rel_error']:.1f}%); "
           f"speed-corrected max {100 * res['max_corrected_rel_error']:.1f}% (mean "
           f"{100 * res['mean_corrected_rel_error']:.1f}%); cost model vs live step time "
           f"{100 * res['mean_step_time_corrected_error']:.1f}% (mean, speed-corrected); accept length mean abs error "
           f"{res['mean_accept_len_abs_error']:.3f}; static ranking identical: {res['same_static_ranking']}, "
           f"Spearman {res['spearman']:.2f}")
    if res["live_noise_mean"] is not None:
        out += (f"\nlive noise (spread of {res['repeats']} live repeats of the same policy): mean "
                f"{100 * res['live_noise_mean']:.1f}%, max {100 * res['live_noise_max']:.1f}%; "
                f"static pairs resolved beyond that noise: {res['resolved_static_pairs']}, ordered the same in "
                f"replay: {res['resolved_static_pairs_agreeing']}")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", default="envs/replay.yaml", help="env preset (run live and in replay)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--policies", default=",".join(STATIC + ADAPTIVE))
    p.add_argument("--loads", nargs="+", default=["closed:1,4"])
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--horizon", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=2,
                   help="live runs per policy, in alternating order; 2 or more also measure the live noise")
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
    res = validate(cfg, _split_policies(args.policies), parse_loads(args.loads), list(range(args.seeds)),
                   repeats=args.repeats)
    print(table(res))
    print("\n" + summary(res))
    if args.json:
        print(json.dumps(res))
    return 0
