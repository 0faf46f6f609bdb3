"""Would holding admission (to prefill joining requests together) raise goodput?

At high load the clairvoyant oracle loses to plain decoding (`ar`) in replay (README). The
suspect is prefill: the profiled cost model charges a prefill pass ``a + b * rows + c * rows x
max prompt length`` in the step where requests join, and on this CPU its fixed part ``a`` is
larger than a whole batch-16 decode step. Plain decoding keeps requests that started together
in lockstep, so they finish, and their replacements prefill, together; speculation scatters
finish times, so more steps pay the fixed part. Two questions, answered in the replay env:

1. Would an admission rule help? ``hold M/T``: a waiting request joins only when at least M
   wait, or the oldest has waited T seconds, or nothing is running (so the server never idles).
   Run with `ar`, `goodput` and the oracle's (k, w) choices; ``hold 1/0`` is today's admit-at-once.
2. Is prefill what costs the oracle its lead at high load? The same runs with the prefill term
   set to zero (a what-if, not a measurement).

Usage: python benchmarks/admission.py [--env envs/replay.yaml] [--seeds 3] [--holds 1/0,2/0.5,4/0.5,2/2]
Final line: {"best_hold": ..., "goodput_hold_over_now": ..., "oracle_over_ar_c16": ..., ...}
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import _common  # noqa: F401  (offline env vars, repo on sys.path)
import numpy as np

from specrl.envs.config import load_cost_model, load_env_config
from specrl.envs.vector import SpecReplayVecEnv
from specrl.evaluate import parse_loads, run_replay
from specrl.policies import PolicyContext, make_policy


class HoldVec(SpecReplayVecEnv):
    """The replay env with an admission rule: join when >= ``hold_min`` wait, the oldest waited
    ``hold_max_s`` seconds, or nothing runs. ``hold_min = 1`` is the env's admit-at-once."""

    hold_min = 1
    hold_max_s = 0.0

    def _admit(self, idx: np.ndarray) -> None:
        ok = []
        for i in idx:
            queued = int(self.arrived[i] - self.admitted[i])
            if queued == 0 or self.active[i].all():
                continue
            oldest = self.t[i] - self.sched_t[i][self.admitted[i]]
            if not self.active[i].any() or queued >= self.hold_min or oldest >= self.hold_max_s:
                ok.append(i)
        if ok:
            super()._admit(np.asarray(ok))


def run(cfg, ctx: PolicyContext, spec: str, loads, seeds: list[int], hold: tuple[int, float],
        no_prefill: bool) -> dict[str, float]:
    """Mean goodput per load label of policy ``spec`` under an admission rule."""

    def make_vec(env_cfg, n: int) -> HoldVec:
        vec = HoldVec(env_cfg, n)
        vec.hold_min, vec.hold_max_s = hold
        if no_prefill:
            vec.cost = replace(vec.cost, prefill=(0.0, 0.0, 0.0))
        return vec

    eps = run_replay(cfg, spec, loads, seeds, lambda: make_policy(spec, ctx), record_actions=False, make_vec=make_vec)
    return {ld.label: float(np.mean([e.summary["goodput"] for e in eps if e.load == ld])) for ld in loads}


def geomean(xs: list[float]) -> float:
    return float(np.exp(np.mean(np.log(xs))))


def parse_holds(text: str) -> list[tuple[int, float]]:
    out = []
    for item in text.split(","):
        m, _, t = item.partition("/")
        try:
            out.append((int(m), float(t or 0)))
        except ValueError as e:
            raise SystemExit(f"--holds item {item!r} is invalid. Allowed: M/T, e.g. 2/0.5 (M >= 1 waiting, "
                             "T seconds).") from e
        if out[-1][0] < 1 or out[-1][1] < 0:
            raise SystemExit(f"--holds item {item!r} is invalid. Allowed: M >= 1 and T >= 0.")
    if (1, 0.0) not in out:
        out.insert(0, (1, 0.0))  # the baseline every row is compared with
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="envs/replay.yaml")
    ap.add_argument("--loads", default="closed:1,2,4,8,16")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--horizon", type=float, default=120.0, help="simulated seconds per episode")
    ap.add_argument("--holds", default="1/0,2/0.5,4/0.5,2/2", help="admission rules M/T to compare")
    ap.add_argument("--policies", default="ar,goodput,oracle")
    args = ap.parse_args()
    cfg = replace(load_env_config(args.env), prompt_split="test", horizon_s=args.horizon)
    cost = load_cost_model(cfg)
    ctx = PolicyContext(cfg.k_choices, cfg.w_choices, cost, cfg.drafter)
    loads = parse_loads(args.loads.split())
    seeds = list(range(args.seeds))
    holds = parse_holds(args.holds)
    policies = args.policies.split(",")
    for spec in policies:
        make_policy(spec, ctx)  # fail early on a bad name
    a, b, c = cost.prefill
    print(f"held-out prompts, {args.seeds} arrival seeds, {args.horizon:.0f} s episodes, goodput in tokens/s "
          f"(replay); prefill = {a * 1e3:.1f} ms + {b * 1e3:.2f} ms/row + {c * 1e3:.2f} ms/padded token; "
          f"batch-16 single-token verify = {cost.verify_time(16, 1, 256) * 1e3:.1f} ms")
    labels = [ld.label for ld in loads]
    res: dict[tuple[str, tuple[int, float], bool], dict[str, float]] = {}
    rows = [(h, False) for h in holds] + [((1, 0.0), True)]
    print("| admission | prefill | policy | " + " | ".join(labels) + " | geometric mean |")
    print("|---" * (len(labels) + 4) + "|")
    for hold, nopf in rows:
        for spec in policies:
            got = run(cfg, ctx, spec, loads, seeds, hold, nopf)
            res[(spec, hold, nopf)] = got
            name = "at once" if hold == (1, 0.0) else f"hold {hold[0]}/{hold[1]:g} s"
            print(f"| {name} | {'zeroed' if nopf else 'profiled'} | `{spec}` | "
                  + " | ".join(f"{got[lab]:.1f}" for lab in labels) + f" | {geomean(list(got.values())):.2f} |",
                  flush=True)
    gm = {key: geomean(list(v.values())) for key, v in res.items()}
    now = (1, 0.0)
    final: dict[str, object] = {}
    if "goodput" in policies:
        best = max(holds, key=lambda h: gm[("goodput", h, False)])
        final["best_hold"] = f"{best[0]}/{best[1]:g}"
        final["goodput_hold_over_now"] = round(gm[("goodput", best, False)] / gm[("goodput", now, False)], 4)
    top = labels[-1]
    if "oracle" in policies and "ar" in policies:
        final[f"oracle_over_ar_{top}"] = round(res[("oracle", now, False)][top] / res[("ar", now, False)][top], 4)
        final[f"oracle_over_ar_{top}_no_prefill"] = round(res[("oracle", now, True)][top]
                                                          / res[("ar", now, True)][top], 4)
    print(json.dumps(final))


if __name__ == "__main__":
    main()
