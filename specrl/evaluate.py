"""``specrl evaluate``: policies side by side over a load sweep, same prompts and arrival seeds.

Replay (default): every (policy, load, seed) episode runs in the vectorised replay env, one
env per (load, seed), so all policies see identical arrivals and prompts. Live (``--live``):
a subset spot-checked on the real engine, reported beside the replay numbers.

Metrics per (policy, load): goodput (committed tokens per simulated second), speedup vs ``ar``,
mean accept length, p50/p99 request latency and TPOT, fraction of the oracle's goodput; means
over seeds with 95% confidence intervals (Student t). "Overall" is the geometric mean of
goodput over the load points (every load weighs the same).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specrl.errors import ConfigError

# two-sided 95% Student t quantiles for n - 1 degrees of freedom
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
        20: 2.09, 30: 2.04}
METRICS = ("goodput", "accept_len", "latency_p50", "latency_p99", "tpot_p50", "tpot_p99", "ttft_p99",
           "slo_attainment")


# Simulated seconds per evaluation episode, here and in training's evaluations. Long enough that
# the episode's edges do not decide the result: at concurrency 16 the opening admission prefills
# 16 prompts (~11 s) and the step that crosses the horizon can be the next admission (~4 s), so
# 30 s episodes measured mostly where those fell (plain decoding 64.7 tok/s at 30 s, 88.9 at 120 s).
EVAL_HORIZON_S = 120.0


def ci95(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% confidence interval)."""
    a = np.asarray([x for x in xs if not math.isnan(x)], float)
    if a.size == 0:
        return float("nan"), float("nan")
    if a.size == 1:
        return float(a[0]), 0.0
    df = a.size - 1
    t = _T95[max(k for k in _T95 if k <= df)]
    return float(a.mean()), float(t * a.std(ddof=1) / math.sqrt(a.size))


@dataclass(frozen=True)
class Load:
    """A load point: closed-loop concurrency or Poisson rate."""

    arrival: str
    value: float

    @property
    def label(self) -> str:
        return f"closed:{int(self.value)}" if self.arrival == "closed" else f"poisson:{self.value:g}"

    def level(self) -> dict[str, float]:
        return {"concurrency": int(self.value)} if self.arrival == "closed" else {"rate": float(self.value)}


def parse_loads(items: list[str]) -> list[Load]:
    out = []
    for item in items:
        kind, _, vals = item.partition(":")
        if kind not in ("closed", "poisson") or not vals:
            raise ConfigError(f"Load {item!r} is invalid. Allowed: closed:C1,C2,... or poisson:R1,R2,... "
                              "(e.g. closed:1,2,4,8,16 poisson:0.5,1,2).")
        try:
            out += [Load(kind, float(v)) for v in vals.split(",")]
        except ValueError as e:
            raise ConfigError(f"Load {item!r} has a non-numeric value.") from e
    return out


@dataclass
class Episode:
    policy: str
    load: Load
    seed: int
    summary: dict[str, Any]
    actions: list[tuple[float, int, int]] = field(default_factory=list)  # (time, k, w) per step


def episode_env_config(base: Any, load: Load) -> Any:
    """The env config of one load point's episodes. Evaluation episodes draw from every category:
    ``workload.episode_categories`` shapes training episodes only."""
    from dataclasses import replace

    wl = replace(base.workload, arrival=load.arrival, episode_categories=0)
    return replace(base, workload=wl)


def run_replay(cfg: Any, policy_spec: str, loads: list[Load], seeds: list[int], make: Callable[[], Any],
               record_actions: bool = True, make_vec: Callable[[Any, int], Any] | None = None) -> list[Episode]:
    """One episode per (load, seed) for one policy; same load kind shares one vectorised env.

    ``make_vec(cfg, n)`` builds that env (default ``SpecReplayVecEnv``; what-if benchmarks pass a
    subclass)."""
    from specrl.envs.vector import SpecReplayVecEnv
    from specrl.policies.base import ActionTable

    episodes: list[Episode] = []
    for kind in sorted({ld.arrival for ld in loads}):
        pts = [(ld, s) for ld in loads if ld.arrival == kind for s in seeds]
        vec = (make_vec or SpecReplayVecEnv)(episode_env_config(cfg, pts[0][0]), len(pts))
        vec.set_levels([ld.level() for ld, _ in pts])
        vec.seed_each([s for _, s in pts])
        pols = [make() for _ in pts]
        table = ActionTable(cfg.k_choices, cfg.w_choices)
        obs = vec.reset()
        finished: dict[int, Episode] = {}
        acts_log: list[list[tuple[float, int, int]]] = [[] for _ in pts]
        per_row = getattr(pols[0], "per_row", False)
        is_oracle = getattr(pols[0], "clairvoyant", False) and not per_row  # the batch-level oracle
        while len(finished) < len(pts):
            times = vec.t.copy()
            if per_row:  # stateless per-request policies: one call plans every env's rows
                if getattr(pols[0], "clairvoyant", False):
                    pols[0].set_row_outcomes(vec.row_outcomes())
                obs, _, dones, infos = vec.step_rows(pols[0].decide_rows(obs, vec.row_view()))
            else:
                if is_oracle:
                    acts, tok, sec = vec.action_outcomes(prefill=False)
                    for i, p in enumerate(pols):
                        p.set_outcomes(acts, tok[i], sec[i])
                decided = [p.decide(obs[i]) for i, p in enumerate(pols)]
                vec.step_async(np.array([table.index(k, w) for k, w in decided]))
                obs, _, dones, infos = vec.step_wait()
            for i, p in enumerate(pols):
                if i in finished:
                    continue
                p.observe(obs[i], infos[i])
                if record_actions:
                    acts_log[i].append((float(times[i]), infos[i]["k"], infos[i]["w"]))
                if dones[i]:
                    ld, s = pts[i]
                    finished[i] = Episode(pols[i].name, ld, s, infos[i]["episode_summary"], acts_log[i])
        episodes += [finished[i] for i in range(len(pts))]
    return episodes


def run_live(cfg: Any, policy_spec: str, loads: list[Load], seeds: list[int], make: Callable[[], Any],
             pair: Any = None, also_time: Callable[[Any], float] | None = None) -> list[Episode]:
    """The same episodes on the live env (measured time): slow, for spot checks.

    ``also_time`` (StepResult -> seconds) is evaluated on every live step beside the env's own
    clock, and its sum lands in the episode summary as ``also_time_s`` (with ``time_s``, the
    env's): validate-replay uses it to charge the cost model on exactly the live steps."""
    import specrl
    from specrl.policies.base import ActionTable

    table = ActionTable(cfg.k_choices, cfg.w_choices)
    episodes = []
    for ld in loads:
        env = specrl.make_env(episode_env_config(cfg, ld), backend="live", pair=pair)
        loop = env.unwrapped.loop
        own_time, sums = loop.time_fn, [0.0, 0.0]

        def timed(res: Any) -> float:
            dt = own_time(res)
            sums[0] += dt
            sums[1] += also_time(res) if also_time is not None else 0.0
            return dt

        loop.time_fn = timed
        for s in seeds:
            pol = make()
            pol.reset()
            obs, _ = env.reset(seed=s, options={"level": ld.level()})
            sums[:] = [0.0, 0.0]
            log = []
            per_row = getattr(pol, "per_row", False)
            while True:
                t0 = env.unwrapped.loop.t
                if per_row:  # one action per running request (SpecDecodeEnv.step_rows)
                    choice = pol.decide_rows(obs[None], env.unwrapped.row_view())[0]
                    obs, _, term, trunc, info = env.unwrapped.step_rows(choice)
                else:
                    k, w = pol.decide(obs)
                    obs, _, term, trunc, info = env.step(table.index(k, w))
                pol.observe(obs, info)
                log.append((t0, info["k"], info["w"]))
                if term or trunc:
                    summary = dict(info["episode_summary"])
                    if also_time is not None:
                        summary.update(time_s=sums[0], also_time_s=sums[1])
                    episodes.append(Episode(pol.name, ld, s, summary, log))
                    break
    return episodes


def aggregate(episodes: list[Episode]) -> dict[str, dict[str, dict[str, tuple[float, float]]]]:
    """policy -> load label -> metric -> (mean, ci95)."""
    out: dict[str, dict[str, dict[str, tuple[float, float]]]] = {}
    groups: dict[tuple[str, str], list[Episode]] = {}
    for e in episodes:
        groups.setdefault((e.policy, e.load.label), []).append(e)
    for (pol, lab), eps in groups.items():
        out.setdefault(pol, {})[lab] = {m: ci95([float(e.summary.get(m, float("nan"))) for e in eps]) for m in METRICS}
    return out


def overall(agg: dict[str, dict[str, dict[str, tuple[float, float]]]], labels: list[str]) -> dict[str, float]:
    """Geometric mean of goodput over load points, per policy."""
    res = {}
    for pol, by in agg.items():
        vals = [by[lab]["goodput"][0] for lab in labels if lab in by and by[lab]["goodput"][0] > 0]
        res[pol] = float(math.exp(np.mean(np.log(vals)))) if vals else float("nan")
    return res


def markdown_table(agg: dict, labels: list[str], policies: list[str]) -> str:
    ar = agg.get("ar", {})
    oracle = agg.get("oracle", {})
    head = ["load", "policy", "goodput (tok/s)", "speedup vs ar", "accept len", "latency p50 / p99 (s)",
            "TPOT p50 / p99 (ms)", "of oracle"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lab in labels:
        for pol in policies:
            m = agg.get(pol, {}).get(lab)
            if m is None:
                continue
            g, gci = m["goodput"]
            # "-" where the reference policy was not evaluated (not "nanx")
            sp = f"{g / ar[lab]['goodput'][0]:.2f}x" if lab in ar else "-"
            frac = f"{g / oracle[lab]['goodput'][0]:.2f}" if lab in oracle else "-"
            lines.append(
                f"| {lab} | {pol} | {g:.1f} ± {gci:.1f} | {sp} | {m['accept_len'][0]:.2f} | "
                f"{m['latency_p50'][0]:.2f} / {m['latency_p99'][0]:.2f} | "
                f"{1000 * m['tpot_p50'][0]:.0f} / {1000 * m['tpot_p99'][0]:.0f} | {frac} |"
            )
    return "\n".join(lines)


def plot_results(episodes: list[Episode], agg: dict, labels: list[str], policies: list[str], out: Path) -> list[Path]:
    """goodput vs load, actions over time, accept length by category (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    # 1. goodput vs load, one panel per arrival kind
    kinds = sorted({lab.split(":")[0] for lab in labels})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        labs = [lab for lab in labels if lab.startswith(kind)]
        xs = [float(lab.split(":")[1]) for lab in labs]
        for pol in policies:
            pts = [(x, agg[pol][lab]["goodput"]) for x, lab in zip(xs, labs) if lab in agg.get(pol, {})]
            if not pts:
                continue
            style = dict(lw=2.5, color="k") if pol == "oracle" else {}
            ax.errorbar([p[0] for p in pts], [p[1][0] for p in pts], yerr=[p[1][1] for p in pts], marker="o",
                        capsize=3, label=pol, **style)
        ax.set(xscale="log", xlabel="concurrency" if kind == "closed" else "arrival rate (req/s)",
               ylabel="goodput (tokens / s)", title=f"Goodput vs load ({kind} loop)" if kind == "closed"
               else "Goodput vs load (Poisson)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.tight_layout()
    paths.append(out / "goodput_vs_load.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    # 2. actions over time at three loads (first seed)
    show = [lab for lab in labels if lab.startswith("closed")][:: max(1, len(labels) // 3)][:3] or labels[:3]
    fig, axes = plt.subplots(1, len(show), figsize=(6 * len(show), 3.8), squeeze=False)
    for ax, lab in zip(axes[0], show):
        for pol in policies:
            eps = [e for e in episodes if e.policy == pol and e.load.label == lab]
            if eps and eps[0].actions:
                t = [a[0] for a in eps[0].actions]
                ax.step(t, [a[1] for a in eps[0].actions], where="post", label=pol, alpha=0.8)
        ax.set(xlabel="simulated time (s)", ylabel="speculation length k", title=f"Actions over time, {lab}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "actions_over_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    # 3. accept length by category (mean over loads and seeds)
    cats = sorted({c for e in episodes for c in e.summary.get("accept_by_category", {})})
    if cats:
        fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(cats)), 4))
        spec = [p for p in policies if p != "ar"]
        width = 0.8 / max(1, len(spec))
        for j, pol in enumerate(spec):
            vals = []
            for c in cats:
                xs = [e.summary.get("accept_by_category", {}).get(c, np.nan) for e in episodes if e.policy == pol]
                xs = [x for x in xs if not np.isnan(x)]
                vals.append(float(np.mean(xs)) if xs else 0.0)
            ax.bar(np.arange(len(cats)) + j * width, vals, width, label=pol)
        ax.set_xticks(np.arange(len(cats)) + 0.4 - width / 2, cats, rotation=20)
        ax.set(ylabel="mean accept length", title="Accept length by prompt category")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "accept_by_category.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def evaluate(cfg: Any, policies: list[str], loads: list[Load], seeds: list[int], out: Path | None,
             live: bool = False, progress: bool = True,
             extra: dict[str, Callable[[], Any]] | None = None) -> dict[str, Any]:
    """Run, aggregate, write table / CSV / JSON / plots; return the JSON-able result.

    ``extra`` adds policies built by factories (e.g. a learned model) under their names."""
    from tqdm import tqdm

    from specrl.envs.config import policy_context
    from specrl.policies import make_policy

    ctx = policy_context(cfg)
    episodes: list[Episode] = []
    t0 = time.perf_counter()
    for spec in policies:  # fail early on bad names, and on what the live env cannot run
        pol = make_policy(spec, ctx)
        if live and getattr(pol, "clairvoyant", False):
            raise ConfigError(f"{spec!r} reads the replay tables' future outcomes; the live env has none. "
                              "Fix: evaluate it on the replay backend (drop --live), or leave it out of --policies.")
    for spec in tqdm(policies, desc="evaluating" + (" live" if live else " replay"), disable=not progress):

        def make(spec: str = spec) -> Any:
            return make_policy(spec, ctx)

        runner = run_live if live else run_replay
        episodes += runner(cfg, spec, loads, seeds, make)
    for name, factory in (extra or {}).items():
        runner = run_live if live else run_replay
        eps = runner(cfg, name, loads, seeds, factory)
        for e in eps:
            e.policy = name
        episodes += eps
    names = list(dict.fromkeys(e.policy for e in episodes))
    labels = [ld.label for ld in loads]
    agg = aggregate(episodes)
    result = {
        "overall": overall(agg, labels),
        "by_load": {lab: {p: agg[p][lab]["goodput"][0] for p in names if lab in agg[p]} for lab in labels},
        "ci95": {lab: {p: agg[p][lab]["goodput"][1] for p in names if lab in agg[p]} for lab in labels},
        "accept_len": {p: float(np.nanmean([agg[p][lab]["accept_len"][0] for lab in labels if lab in agg[p]]))
                       for p in names},
        "seeds": seeds, "backend": "live" if live else "replay", "seconds": time.perf_counter() - t0,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        table = markdown_table(agg, labels, names)
        (out / "table.md").write_text(table + "\n")
        with (out / "results.csv").open("w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["policy", "load", "seed", *METRICS])
            for e in episodes:
                wr.writerow([e.policy, e.load.label, e.seed, *[e.summary.get(m) for m in METRICS]])
        (out / "results.json").write_text(json.dumps(result, indent=1))
        result["plots"] = [str(p) for p in plot_results(episodes, agg, labels, names, out)]
        result["table"] = str(out / "table.md")
    result["_agg"] = agg
    result["_names"] = names
    result["_labels"] = labels
    return result


def add_args(p: argparse.ArgumentParser) -> None:
    from specrl.policies import BASELINES

    p.add_argument("--env", default="envs/replay.yaml", help="env preset (replay backend for the full sweep)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a preset key")
    p.add_argument("--policies", default=None,
                   help="comma-separated policy names (controller:DIR for exported policies); default: every "
                        f"baseline and the oracle ({','.join([*BASELINES, 'oracle'])}; live: those that act per step)")
    p.add_argument("--loads", nargs="+", default=["closed:1,2,4,8,16"], help="closed:C,... and/or poisson:R,...")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--horizon", type=float, default=EVAL_HORIZON_S,
                   help=f"simulated seconds per episode (default {EVAL_HORIZON_S:g}, as training's evaluations)")
    p.add_argument("--prompts", default=None, help="prompt file (default: the preset's)")
    p.add_argument("--split", default="test", help="train | test | all (held-out prompts by default)")
    p.add_argument("--live", action="store_true", help="run on the live engine (slow; use few policies/loads)")
    p.add_argument("--out", default=None, help="output folder (default: results/eval-<time>)")
    p.add_argument("--json", action="store_true", help="final stdout line: JSON with overall and by_load")


def run(args: argparse.Namespace) -> int:
    from specrl.collect import ensure_traces
    from specrl.config import split_override
    from specrl.envs.config import load_env_config

    over = dict(split_override(s) for s in args.set)
    if args.horizon:
        over["horizon_s"] = args.horizon
    if args.prompts:
        over["prompts"] = args.prompts
    over["prompt_split"] = args.split
    cfg = load_env_config(args.env, **over)
    if cfg.backend != "replay" and not args.live:
        over["backend"] = "replay"
        cfg = load_env_config(args.env, **over)
    if not args.live:
        ensure_traces(cfg)
    if args.policies is None:
        from specrl.envs.config import policy_context
        from specrl.policies import BASELINES, make_policy

        ctx = policy_context(cfg)  # live: leave out what needs the replay tables' future (the oracle)
        args.policies = ",".join(p for p in [*BASELINES, "oracle"]
                                 if not (args.live and getattr(make_policy(p, ctx), "clairvoyant", False)))
    policies = [p.strip() for p in _split_policies(args.policies)]
    loads = parse_loads(args.loads)
    out = Path(args.out) if args.out else Path("results") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    res = evaluate(cfg, policies, loads, list(range(args.seeds)), out, live=args.live)
    print(markdown_table(res["_agg"], res["_labels"], res["_names"]))
    print(f"\ntable: {res.get('table')}\nplots: {', '.join(res.get('plots', []))}")
    if args.json:
        print(json.dumps({"overall": res["overall"], "by_load": res["by_load"]}))
    return 0


def _split_policies(text: str) -> list[str]:
    """Comma-separated names, where ``static:K,W`` and ``goodput:B1=P1,B2=P2`` keep their commas."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if out and out[-1].startswith("static:") and part.isdigit() and "," not in out[-1][7:]:
            out[-1] += "," + part
        elif out and out[-1].startswith("goodput:") and "=" in out[-1] and re.fullmatch(r"\d+=\d+", part):
            out[-1] += "," + part
        else:
            out.append(part)
    return [p for p in out if p]
