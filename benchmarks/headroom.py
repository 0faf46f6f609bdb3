"""How much of the oracle's lead over `goodput` could a better acceptance predictor win?

The clairvoyant oracle leads the `goodput` rule by several percent in replay (README).
`goodput` plans with the same cost model that charges the time, so its only weakness is its
acceptance estimate: per-depth EMAs of the batch, scaled by
the fraction of rows with an n-gram match. This benchmark replaces that estimate with a
per-row predictor fitted on the *training* prompts' traces and plugs it into the same
myopic argmax, on held-out prompts:

* ``pred:match``: E[accepted | match length, number of matches] per row and action (what the
  observation's n-gram fields carry, but per row instead of as a batch mean);
* ``pred:match+run``: also the row's copy run (how many of its latest tokens the 1-token
  lookup predicted: the "earlier success rate" of the match, observable from history);

E[committed tokens] of an action = sum over rows of min(E[accepted] + 1, tokens left), step
time from the cost model (decode work only: the newcomers' prefill is the same for every action,
as for the oracle) with the drafted tree the rows actually propose (observable: the
n-gram drafter knows what it drafted before the verify). If even these per-row predictors
stay near `goodput`, the gap to the oracle is unpredictable noise for a batch-level (k, w)
action, and no observation feature will close it.

The ragged-verify what-if this benchmark once carried (``--ragged``) is real now: the engine
verifies per-request trees in one packed pass, the replay env charges it (``verify: ragged``), and
the per-request policies ``goodput-rows``, ``rowmodel:DIR`` and ``oracle-rows`` are evaluated by
``specrl evaluate`` (README, "Per-request speculation"). ``--verify padded`` reproduces the numbers
of the padded engine this study was first run on.

Usage: python benchmarks/headroom.py [--env envs/replay.yaml] [--seeds 3] [--verify ragged|padded]
Final line: {"goodput": g, "pred_match_run": p, "oracle": o, "pred_over_goodput": p / g, ...}
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import _common  # noqa: F401  (offline env vars, repo on sys.path)
import numpy as np

from specrl.envs.config import load_env_config
from specrl.envs.replay import load_replay_data
from specrl.envs.vector import SpecReplayVecEnv
from specrl.evaluate import episode_env_config, evaluate, parse_loads
from specrl.rowmodel import ML_EDGES, NM_EDGES, RUN_EDGES, bucket_means, bucket_of, num_buckets
from specrl.rows import copy_runs


def copy_run(tables, a11: int) -> np.ndarray:
    """(R,) per trace row: how many tokens right before this position the 1-token n-gram lookup
    predicted in a row (0 = the previous token was not predicted)."""
    return copy_runs(tables.offsets, tables.accept[:, a11] > 0)


def bucket_ids(tables, run: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(R,) bucket of every trace row and the number of buckets (``run=None``: no copy-run axis)."""
    edges = {"match_len": ML_EDGES, "num_matches": NM_EDGES, "copy_run": RUN_EDGES if run is not None else []}
    ids = bucket_of(tables.match_len, tables.num_matches, np.zeros(len(tables.match_len)) if run is None else run,
                    edges)
    return ids, num_buckets(edges)


def fit(tables, train_rows: np.ndarray, ids: np.ndarray, n: int, prior: float = 5.0) -> np.ndarray:
    """(R, A) predicted accepted tokens per row and action: bucket means over the training
    prompts' rows, shrunk towards the global mean by ``prior`` pseudo-counts."""
    return bucket_means(tables.accept[train_rows].astype(np.float64), ids[train_rows], n, prior)[ids]  # (R, A)


def run_predictor(cfg, loads, seeds: list[int], pred: np.ndarray) -> dict[str, float]:
    """Goodput (tokens / s) per load label of the myopic argmax with per-row predictions."""
    out: dict[str, float] = {}
    for ld in loads:
        vec = SpecReplayVecEnv(episode_env_config(cfg, ld), len(seeds))
        vec.set_levels([ld.level() for _ in seeds])
        vec.seed_each(seeds)
        vec.reset()
        n_act = len(vec.actions_kw)
        n_w = len(cfg.w_choices)
        done_eps: dict[int, float] = {}
        while len(done_eps) < len(seeds):
            valid = vec.active
            rows = np.where(valid, vec.tables.offsets[vec.trow] + vec.pos, 0)  # (N, S)
            left = vec.limit - vec.pos
            score = np.zeros((vec.num_envs, n_act))
            for a in range(n_act):
                dt = vec._outcome(np.full(vec.num_envs, a), prefill=False)["dt"]
                tok = np.where(valid, np.minimum(pred[rows, a] + 1.0, left), 0.0).sum(1)
                score[:, a] = tok / np.maximum(dt, 1e-12)
            best = score.argmax(1)
            vec.step_async(np.stack([best // n_w, best % n_w], 1))
            _, _, dones, infos = vec.step_wait()
            for i in np.flatnonzero(dones):
                if int(i) not in done_eps:
                    done_eps[int(i)] = infos[i]["episode_summary"]["goodput"]
        out[ld.label] = float(np.mean(list(done_eps.values())))
    return out


def geomean(xs: list[float]) -> float:
    return float(np.exp(np.mean(np.log(xs))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="envs/replay.yaml")
    ap.add_argument("--loads", default="closed:1,2,4,8,16")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--horizon", type=float, default=120.0,
                    help="simulated seconds per episode (the eval's, specrl.train.AgentConfig.eval_horizon_s)")
    ap.add_argument("--verify", default=None, choices=["ragged", "padded"],
                    help="the env's verify mode (default: the preset's; padded = the engine this study was run on)")
    args = ap.parse_args()
    base = load_env_config(args.env, **({"verify": args.verify} if args.verify else {}))
    if base.drafter != "ngram":
        raise SystemExit(f"drafter={base.drafter!r}: this analysis models the n-gram drafter's match statistics. "
                         "Fix: use an n-gram env preset (envs/replay.yaml).")
    test_cfg = replace(base, prompt_split="test", horizon_s=args.horizon)
    _, _, train_prompt_rows, tables = load_replay_data(replace(base, prompt_split="train"))
    train_rows = np.concatenate([np.arange(tables.offsets[r], tables.offsets[r + 1]) for r in train_prompt_rows])
    a11 = tables.actions.index((1, 1))
    run = copy_run(tables, a11)
    loads = parse_loads(args.loads.split())
    seeds = list(range(args.seeds))
    res = evaluate(test_cfg, ["goodput", "oracle"], loads, seeds, None, progress=False)
    by_load = {lab: dict(v) for lab, v in res["by_load"].items()}
    preds = {}
    for name, use_run in (("pred:match", False), ("pred:match+run", True)):
        ids, n = bucket_ids(tables, run if use_run else None)
        preds[name] = fit(tables, train_rows, ids, n)
        got = run_predictor(test_cfg, loads, seeds, preds[name])
        for lab, g in got.items():
            by_load[lab][name] = g
    names = ["goodput", "pred:match", "pred:match+run", "oracle"]
    print(f"held-out prompts, {args.seeds} arrival seeds, goodput in tokens/s (replay); "
          f"predictors fitted on {len(train_rows)} training-prompt positions")
    print("| load | " + " | ".join(f"`{n}`" for n in names) + " | match+run / goodput | oracle / goodput |")
    print("|---" * (len(names) + 3) + "|")
    for lab in by_load:
        row = by_load[lab]
        print(f"| {lab} | " + " | ".join(f"{row[n]:.2f}" for n in names)
              + f" | {row['pred:match+run'] / row['goodput']:.3f} | {row['oracle'] / row['goodput']:.3f} |")
    gm = {n: geomean([by_load[lab][n] for lab in by_load]) for n in names}
    print("| geometric mean | " + " | ".join(f"{gm[n]:.2f}" for n in names)
          + f" | {gm['pred:match+run'] / gm['goodput']:.3f} | {gm['oracle'] / gm['goodput']:.3f} |")
    final = {"goodput": round(gm["goodput"], 3), "pred_match": round(gm["pred:match"], 3),
             "pred_match_run": round(gm["pred:match+run"], 3), "oracle": round(gm["oracle"], 3),
             "pred_over_goodput": round(gm["pred:match+run"] / gm["goodput"], 4)}
    print(json.dumps(final))


if __name__ == "__main__":
    main()
