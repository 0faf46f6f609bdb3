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

``--ragged`` adds a what-if for the fix this points to: a *ragged* verify pass (each row's
draft tree packed at its own size instead of padded to the union of the batch's trees),
charged as a padded pass of the same total tokens (the cost grid interpolated at the mean
tree size; on these CPUs the linear layers dominate and cost by total rows), and per-row
actions chosen by the same predictors (Dinkelbach iterations on tokens / step time), beside
`goodput`, the batch-level oracle and the same predictor restricted to one action per batch
(the control that isolates what per-row actions add), all in that same ragged world. Not an
engine measurement: it sizes what building the ragged verify could win. Caveat: it inherits
the profiled grid's shape, which is not monotone everywhere (e.g. where a 1-token pass takes
the few-row kernel and a 2-token pass does not), and interpolating between such points can
flatter light drafting.

Usage: python benchmarks/headroom.py [--env envs/replay.yaml] [--seeds 3] [--ragged]
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
from specrl.replay import popcount64

ML_EDGES = np.arange(1, 7)  # match length 0..6+
NM_EDGES = np.array([1, 2, 3, 5, 9])  # number of earlier matches
RUN_EDGES = np.array([1, 2, 3, 5, 9, 17])  # copy run


def copy_run(tables, a11: int) -> np.ndarray:
    """(R,) per trace row: how many tokens right before this position the 1-token n-gram lookup
    predicted in a row (0 = the previous token was not predicted)."""
    hit = tables.accept[:, a11] > 0
    run = np.zeros(len(hit), np.int64)
    for p in range(len(tables.prompt_len)):
        r = 0
        for row in range(int(tables.offsets[p]), int(tables.offsets[p + 1])):
            run[row] = r
            r = r + 1 if hit[row] else 0
    return run


def bucket_ids(tables, run: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(R,) bucket of every trace row and the number of buckets."""
    ml = np.digitize(np.nan_to_num(tables.match_len), ML_EDGES)
    nm = np.digitize(np.nan_to_num(tables.num_matches), NM_EDGES)
    ids = ml * (len(NM_EDGES) + 1) + nm
    n = (len(ML_EDGES) + 1) * (len(NM_EDGES) + 1)
    if run is not None:
        ids = ids * (len(RUN_EDGES) + 1) + np.digitize(run, RUN_EDGES)
        n *= len(RUN_EDGES) + 1
    return ids, n


def fit(tables, train_rows: np.ndarray, ids: np.ndarray, n: int, prior: float = 5.0) -> np.ndarray:
    """(R, A) predicted accepted tokens per row and action: bucket means over the training
    prompts' rows, shrunk towards the global mean by ``prior`` pseudo-counts."""
    y = tables.accept[train_rows].astype(np.float64)  # (T, A)
    b = ids[train_rows]
    cnt = np.bincount(b, minlength=n).astype(np.float64)
    sums = np.stack([np.bincount(b, y[:, a], minlength=n) for a in range(y.shape[1])], 1)  # (n, A)
    means = (sums + prior * y.mean(0)) / (cnt[:, None] + prior)
    return means[ids]  # (R, A)


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


class RaggedVec(SpecReplayVecEnv):
    """The replay env with a ragged verify and, when ``row_actions`` is set, one action per row.

    Only ``_outcome`` changes: a row's verify tokens are its own tree (1 + its proposed nodes;
    1 when its n-gram lookup found nothing), and the step pays a padded pass of the same total
    tokens (interpolated between the integer grid points around the mean tree size)."""

    row_actions: np.ndarray | None = None  # (N, S) action index per row, used once

    def _outcome(self, a_idx: np.ndarray, prefill: bool = True) -> dict[str, np.ndarray]:
        tb, n_act = self.tables, len(self.actions_kw)
        a_row = self.row_actions if self.row_actions is not None else np.broadcast_to(a_idx[:, None], self.active.shape)
        self.row_actions = None
        valid = self.active.copy()  # (N, S)
        rows = np.where(valid, tb.offsets[self.trow] + self.pos, 0)
        flat = rows * n_act + a_row  # (N, S)
        acc = np.where(valid, tb.accept_flat.take(flat), 0)
        masks = np.where(valid, tb.mask_flat.take(flat), np.uint64(0))
        row_tokens = np.where(valid, 1 + popcount64(masks), 0)  # (N, S)
        committed = np.where(valid, np.minimum(acc + 1, self.limit - self.pos), 0)
        batch = valid.sum(1)
        mean_tok = row_tokens.sum(1) / np.maximum(batch, 1)
        ctx = np.where(valid, self.plen + self.pos, 0).astype(np.float64)
        ctx_mean = ctx.sum(1) / np.maximum(batch, 1)
        newv = self.new & valid if prefill else np.zeros_like(valid)
        drafted = (self.actions_kw[a_row, 0] > 0).any(1)  # lookups are paid even when they find nothing
        lo, frac = np.floor(mean_tok), mean_tok - np.floor(mean_tok)
        levels = np.zeros((self.num_envs, self.depth_masks.shape[1]))  # n-gram drafter: unused

        def cost(tokens: np.ndarray) -> np.ndarray:
            return self.cost.step_time_batch(self.cfg.drafter, drafted, batch, np.maximum(tokens, 1), levels,
                                             ctx_mean, newv.sum(1), np.where(newv, self.plen, 0).max(1))

        dt = cost(lo) * (1 - frac) + cost(lo + 1) * frac
        return {"valid": valid, "rows": rows, "flat": flat, "acc": np.minimum(acc, committed),
                "committed": committed, "tree_tokens": np.rint(mean_tok).astype(np.int64), "batch": batch,
                "dt": dt, "ctx_mean": ctx_mean}


def row_choice(vec: RaggedVec, value: np.ndarray, iters: int = 4) -> np.ndarray:
    """(N, S) per-row actions maximising sum(value) / step time (Dinkelbach on a linearised cost).

    ``value`` (N, S, A): expected (or, for the clairvoyant, actual) committed tokens per row and
    action. Each iteration: lambda = goodput of the current choice, marginal seconds per verify
    token from the cost model, every row picks argmax value - lambda * seconds * its tree tokens;
    the best exactly-timed candidate wins; every batch-level action (all rows alike) is a
    candidate too, so a per-row choice never scores below the batch-level argmax."""
    tb, n_env = vec.tables, vec.num_envs
    valid = vec.active
    rows = np.where(valid, tb.offsets[vec.trow] + vec.pos, 0)
    row_tok = (1 + popcount64(tb.mask[rows])).astype(np.float64)  # (N, S, A)
    a0 = int(np.flatnonzero(vec.actions_kw[:, 0] == 0)[0])
    choice = np.full(valid.shape, a0)
    best_val, best = np.full(n_env, -1.0), choice.copy()
    batch = np.maximum(valid.sum(1), 1)
    for a in range(len(vec.actions_kw)):  # the batch-level candidates
        vec.row_actions = np.full(valid.shape, a)
        dt = vec._outcome(np.zeros(n_env, np.int64), prefill=False)["dt"]
        g = np.where(valid, value[..., a], 0.0).sum(1) / np.maximum(dt, 1e-12)
        better = g > best_val
        best_val = np.where(better, g, best_val)
        best[better] = a
    for _ in range(iters + 1):
        vec.row_actions = choice
        dt = vec._outcome(np.zeros(n_env, np.int64), prefill=False)["dt"]
        tot = np.where(valid, np.take_along_axis(value, choice[..., None], 2)[..., 0], 0.0).sum(1)
        g = tot / np.maximum(dt, 1e-12)
        better = g > best_val
        best_val = np.where(better, g, best_val)
        best[better] = choice[better]
        mean_tok = np.where(valid, np.take_along_axis(row_tok, choice[..., None], 2)[..., 0], 0).sum(1) / batch
        ctx = np.where(valid, vec.plen + vec.pos, 0).sum(1) / batch
        t0 = vec.cost.verify_time(batch, np.clip(np.floor(mean_tok), 1, 64), ctx)
        t1 = vec.cost.verify_time(batch, np.clip(np.floor(mean_tok) + 1, 1, 65), ctx)
        per_tok = np.maximum(t1 - t0, 0.0) / batch  # seconds per extra verify token of one row
        choice = np.argmax(value - (g * per_tok)[:, None, None] * row_tok, axis=2)
        choice = np.where(valid, choice, a0)
    return best


def run_ragged(cfg, loads, seeds: list[int], decide) -> dict[str, float]:
    """Goodput per load label in the ragged world; ``decide(vec, obs)`` returns (N,) batch actions
    (indices into the action table) or (N, S) row actions."""
    out: dict[str, float] = {}
    n_w = len(cfg.w_choices)
    for ld in loads:
        vec = RaggedVec(episode_env_config(cfg, ld), len(seeds))  # standard episodes: every category
        vec.set_levels([ld.level() for _ in seeds])
        vec.seed_each(seeds)
        obs = vec.reset()
        done_eps: dict[int, float] = {}
        while len(done_eps) < len(seeds):
            a = decide(vec, obs)
            if a.ndim == 2:
                vec.row_actions, batch_a = a, a.max(1)  # the env logs one (k, w); rows use their own
            else:
                batch_a = a
            rows_kept = vec.row_actions
            vec.step_async(np.stack([batch_a // n_w, batch_a % n_w], 1))
            vec.row_actions = rows_kept
            obs, _, dones, infos = vec.step_wait()
            for i in np.flatnonzero(dones):
                done_eps.setdefault(int(i), infos[i]["episode_summary"]["goodput"])
        out[ld.label] = float(np.mean(list(done_eps.values())))
    return out


def ragged_section(test_cfg, loads, seeds: list[int], preds: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Goodput per load and policy in the ragged what-if world."""
    from specrl.envs.config import load_cost_model
    from specrl.policies import PolicyContext, make_policy

    ctx = PolicyContext(test_cfg.k_choices, test_cfg.w_choices, load_cost_model(test_cfg), test_cfg.drafter)
    res: dict[str, dict[str, float]] = {}

    def rule(spec: str):
        pols: list = []

        def decide(vec: RaggedVec, obs: np.ndarray) -> np.ndarray:
            if not pols:
                pols.extend(make_policy(spec, ctx) for _ in range(vec.num_envs))
            acts = []
            for i, p in enumerate(pols):
                k, w = p.decide(obs[i])
                acts.append([tuple(x) for x in vec.actions_kw.tolist()].index((k, 1 if k == 0 else w)))
            return np.array(acts)
        return decide

    def batch_oracle(vec: RaggedVec, obs: np.ndarray) -> np.ndarray:
        n_act = len(vec.actions_kw)
        score = np.zeros((vec.num_envs, n_act))
        for a in range(n_act):
            o = vec._outcome(np.full(vec.num_envs, a), prefill=False)
            score[:, a] = o["committed"].sum(1) / np.maximum(o["dt"], 1e-12)
        return score.argmax(1)

    def per_row(pred: np.ndarray | None, iters: int = 4):
        def decide(vec: RaggedVec, obs: np.ndarray) -> np.ndarray:
            valid = vec.active
            rows = np.where(valid, vec.tables.offsets[vec.trow] + vec.pos, 0)
            left = (vec.limit - vec.pos)[..., None]
            base = vec.tables.accept[rows].astype(np.float64) if pred is None else pred[rows]  # (N, S, A)
            return row_choice(vec, np.where(valid[..., None], np.minimum(base + 1.0, left), 0.0), iters)
        return decide

    policies = {"goodput": rule("goodput"), "oracle (batch)": batch_oracle}
    policies.update({f"batch {name}": per_row(p, iters=-1) for name, p in preds.items()})  # control: one action
    policies.update({f"per-row {name}": per_row(p) for name, p in preds.items()})
    policies["per-row clairvoyant"] = per_row(None)
    for name, fn in policies.items():
        for lab, g in run_ragged(test_cfg, loads, seeds, fn).items():
            res.setdefault(lab, {})[name] = g
    return res


def geomean(xs: list[float]) -> float:
    return float(np.exp(np.mean(np.log(xs))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="envs/replay.yaml")
    ap.add_argument("--loads", default="closed:1,2,4,8,16")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--horizon", type=float, default=120.0,
                    help="simulated seconds per episode (the eval's, specrl.train.AgentConfig.eval_horizon_s)")
    ap.add_argument("--ragged", action="store_true", help="also the ragged-verify what-if (per-row actions)")
    args = ap.parse_args()
    base = load_env_config(args.env)
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
    if args.ragged:
        rag = ragged_section(test_cfg, loads, seeds, {"match+run": preds["pred:match+run"]})
        names_r = list(next(iter(rag.values())))
        print("\nragged-verify what-if (cost model, not measured): goodput in tokens/s; "
              "last columns: per-row match+run / `goodput` in the same world, and / today's padded `goodput`")
        print("| load | " + " | ".join(f"`{n}`" for n in names_r) + " | / ragged goodput | / padded goodput |")
        print("|---" * (len(names_r) + 3) + "|")
        for lab, row in rag.items():
            r = row["per-row match+run"]
            print(f"| {lab} | " + " | ".join(f"{row[n]:.2f}" for n in names_r)
                  + f" | {r / row['goodput']:.3f} | {r / by_load[lab]['goodput']:.3f} |")
        gr = {n: geomean([rag[lab][n] for lab in rag]) for n in names_r}
        print("| geometric mean | " + " | ".join(f"{gr[n]:.2f}" for n in names_r)
              + f" | {gr['per-row match+run'] / gr['goodput']:.3f} | {gr['per-row match+run'] / gm['goodput']:.3f} |")
        final.update({"ragged_goodput": round(gr["goodput"], 3), "ragged_per_row": round(gr["per-row match+run"], 3),
                      "ragged_per_row_clairvoyant": round(gr["per-row clairvoyant"], 3)})
    print(json.dumps(final))


if __name__ == "__main__":
    main()
