"""A learned per-request acceptance table and the per-request policy that plans with it.

``rowmodel``: for every running request, E[accepted draft tokens | its bucket, action], learned
from the training prompts' replay traces; each step ``specrl.rows.plan_rows`` turns these into
one (k, w) per request for the engine's ragged verify. Buckets are what the request shows before
the step: its n-gram match length (0..6+), how often that n-gram occurred before (1, 2, 3-4,
5-8, 9+) and its copy run (how many of its latest tokens the 1-token lookup predicted: 0, 1, 2,
3-4, 5-8, 9-16, 17+); 7 x 6 x 7 = 294 buckets. Each bucket's mean is shrunk towards the global
mean by ``prior`` pseudo-counts, so rare buckets fall back to the average.

Per-request calibration (``calibration`` pseudo-tokens, 0 = off): the table predicts from what a
request shows now, but requests differ beyond that (one copies a passage, another writes new
text), which is what ``hf-heuristic`` adapts to. So each request's estimates are scaled by its
realized / predicted accepted draft tokens so far, (A + m) / (P + m) clipped to [1/4, 4]: a new
request starts at 1, and the factor moves once it has drafted a few tokens. The policy follows
requests by ``RowView.rid`` (a request's context grows by what its last step committed, so the
realized count needs no extra observation) and forgets the ones that left.

Why a table and not a network: these three numbers carry most of what predicts a row's
acceptance with the n-gram drafter (``benchmarks/headroom.py``), the table fits in seconds,
cannot extrapolate wildly, and is read by a numpy lookup at run time. The artifact is JSON
(``rowmodel.json``); no pickle.

Scope: the n-gram drafter (its buckets are n-gram statistics). Per-request policies run in the
vectorised replay env (``specrl evaluate``, ``specrl train --agent agents/rowmodel.yaml``), in the
live Gym env (``SpecDecodeEnv.row_view`` / ``step_rows``: ``specrl evaluate --live``,
``specrl validate-replay``) and, exported, on the engine (``specrl.runtime.adapters.EngineController``
with ``RowObserver``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from specrl.errors import ConfigError
from specrl.policies.base import PolicyContext
from specrl.rows import PerRowPolicy, RowView, trace_copy_runs

FORMAT = 1
ML_EDGES = [1, 2, 3, 4, 5, 6]  # n-gram match length 0..6+
NM_EDGES = [1, 2, 3, 5, 9]  # earlier matches
RUN_EDGES = [1, 2, 3, 5, 9, 17]  # copy run
ARTIFACT = "rowmodel.json"
CAL_RANGE = (0.25, 4.0)  # the per-request calibration factor's clip


def bucket_of(match_len: np.ndarray, num_matches: np.ndarray, copy_run: np.ndarray,
              edges: dict[str, list[int]] | None = None) -> np.ndarray:
    """Bucket index of every row (any shape)."""
    e = edges or {"match_len": ML_EDGES, "num_matches": NM_EDGES, "copy_run": RUN_EDGES}
    ml = np.digitize(np.nan_to_num(match_len), e["match_len"])
    nm = np.digitize(np.nan_to_num(num_matches), e["num_matches"])
    cr = np.digitize(copy_run, e["copy_run"])
    return (ml * (len(e["num_matches"]) + 1) + nm) * (len(e["copy_run"]) + 1) + cr


def num_buckets(edges: dict[str, list[int]]) -> int:
    return (len(edges["match_len"]) + 1) * (len(edges["num_matches"]) + 1) * (len(edges["copy_run"]) + 1)


def bucket_means(y: np.ndarray, buckets: np.ndarray, n: int, prior: float) -> np.ndarray:
    """(n, A) mean of ``y`` (R, A) per bucket, shrunk towards the overall mean by ``prior``
    pseudo-counts (an empty bucket gets the overall mean)."""
    cnt = np.bincount(buckets, minlength=n).astype(np.float64)
    sums = np.stack([np.bincount(buckets, y[:, a], minlength=n) for a in range(y.shape[1])], 1)  # (n, A)
    return (sums + prior * y.mean(0)) / (cnt[:, None] + prior)


def fit(tables: Any, prompts: np.ndarray, actions: list[tuple[int, int]], prior: float = 5.0,
        calibration: float = 4.0) -> dict[str, Any]:
    """Fit the table on every position of the trace prompts ``prompts`` (indices into the traces).
    ``calibration``: the per-request calibration's pseudo-tokens (module docstring), stored with it.

    Returns the artifact dict (see ``save``)."""
    if prior < 0:
        raise ConfigError(f"prior={prior} is invalid. Allowed: >= 0 pseudo-counts.")
    if calibration < 0:
        raise ConfigError(f"calibration={calibration} is invalid. Allowed: >= 0 pseudo-tokens (0 = off), e.g. 4.")
    index = {tuple(kw): a for a, kw in enumerate(tables.actions)}
    missing = [kw for kw in actions if tuple(kw) not in index]
    if missing:
        raise ConfigError(f"The replay tables have no outcomes for actions {missing}. Fix: rebuild them for the "
                          "env's k_choices / w_choices (the replay env does this when it loads).")
    cols = [index[tuple(kw)] for kw in actions]
    run = trace_copy_runs(tables)
    if run is None:
        raise ConfigError("rowmodel needs a chain action (k >= 1, w = 1) in the tables for the copy run. "
                          "Fix: include w = 1 in w_choices.")
    rows = np.concatenate([np.arange(tables.offsets[p], tables.offsets[p + 1]) for p in prompts]) if len(prompts) else \
        np.zeros(0, np.int64)
    if rows.size == 0:
        raise ConfigError("rowmodel got no trace rows to fit on. Fix: check the env's prompts and prompt_split.")
    edges = {"match_len": ML_EDGES, "num_matches": NM_EDGES, "copy_run": RUN_EDGES}
    b = bucket_of(tables.match_len[rows], tables.num_matches[rows], run[rows], edges)
    y = tables.accept[rows][:, cols].astype(np.float64)  # (R, A)
    n = num_buckets(edges)
    cnt = np.bincount(b, minlength=n)
    mean = bucket_means(y, b, n, prior)
    pred = mean[b]
    return {"format": FORMAT, "kind": "rowmodel", "actions": [list(map(int, kw)) for kw in actions],
            "edges": edges, "prior": prior, "calibration": calibration, "table": mean.round(6).tolist(), "counts": cnt.astype(int).tolist(),
            "fit": {"rows": int(rows.size), "prompts": int(len(prompts)), "buckets_seen": int((cnt > 0).sum()),
                    "mae": float(np.abs(pred - y).mean()), "mae_constant": float(np.abs(y.mean(0) - y).mean())}}


def save(art: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ARTIFACT
    path.write_text(json.dumps(art))
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read a rowmodel artifact (a directory holding rowmodel.json, or the file), checking it."""
    p = Path(path)
    if p.is_dir():
        p = p / ARTIFACT
    try:
        art = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"No rowmodel artifact at {str(path)!r}. Fix: train one with "
                          "`specrl train --agent agents/rowmodel.yaml` and pass its RUN_DIR/rowmodel.") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{str(p)!r} is not valid JSON ({e.msg}). Fix: retrain the rowmodel.") from e
    if art.get("kind") != "rowmodel" or art.get("format") != FORMAT:
        raise ConfigError(f"{str(p)!r} is not a rowmodel artifact of format {FORMAT} (kind={art.get('kind')!r}, "
                          f"format={art.get('format')!r}). Fix: retrain it with this version of specrl.")
    table = np.asarray(art["table"], float)
    if table.shape != (num_buckets(art["edges"]), len(art["actions"])):
        raise ConfigError(f"{str(p)!r}: table has shape {table.shape}, expected (buckets, actions) = "
                          f"({num_buckets(art['edges'])}, {len(art['actions'])}). Fix: retrain the rowmodel.")
    return art


class RowModelPolicy(PerRowPolicy):
    """Per-request (k, w) from a learned acceptance table (module docstring)."""

    name = "rowmodel"

    def __init__(self, ctx: PolicyContext, path: str | Path) -> None:
        super().__init__(ctx)
        if ctx.drafter != "ngram":
            raise ConfigError(f"rowmodel reads n-gram match statistics and copy runs, but the drafter is "
                              f"{ctx.drafter!r}. Fix: use it with drafter: ngram.")
        art = load(path)
        have = {tuple(kw): a for a, kw in enumerate(art["actions"])}
        missing = [tuple(map(int, kw)) for kw in self.actions_kw.tolist() if tuple(kw) not in have]
        if missing:
            raise ConfigError(f"rowmodel {str(path)!r} was trained for actions {art['actions']}, but the env also has "
                              f"{missing}. Fix: retrain it with the env's k_choices / w_choices.")
        cols = [have[tuple(kw)] for kw in self.actions_kw.tolist()]
        self.table = np.asarray(art["table"], float)[:, cols]  # (buckets, A) in the env's action order
        self.edges = art["edges"]
        self.calibration = float(art.get("calibration", 0.0))  # artifacts from before it: off
        self._last: dict[str, np.ndarray] | None = None  # the last step's rows (per-request calibration)

    def reset(self) -> None:
        self._last = None

    def expected_accepted(self, view: RowView) -> np.ndarray:
        """(N, S, A) predicted accepted draft tokens per row and action."""
        return self.table[bucket_of(view.match_len, view.num_matches, view.copy_run, self.edges)]

    def history(self, view: RowView) -> tuple[np.ndarray, np.ndarray]:
        """(N, S) realized and predicted accepted draft tokens of each running request so far
        (0 for requests new since the last call), from the last call's rows matched by ``rid``."""
        last = self._last
        zeros = np.zeros(view.valid.shape)
        if last is None or last["rid"].shape[0] != view.valid.shape[0] or last["rid"].shape[1] == 0:
            return zeros, zeros
        eq = (view.rid[:, :, None] == last["rid"][:, None, :]) & (last["rid"][:, None, :] >= 0)  # (N, S, S')
        j = eq.argmax(2)  # (N, S) the request's slot at the last call

        def was(x: np.ndarray) -> np.ndarray:
            return np.take_along_axis(x, j, 1)

        grown = view.context - was(last["context"])  # tokens its last step committed: accepted + 1
        seen = view.valid & eq.any(2) & (grown >= 1)
        drafted = was(last["drafted"])
        realized = np.where(seen, was(last["realized"]) + np.where(drafted, grown - 1, 0), 0.0)
        predicted = np.where(seen, was(last["predicted"]) + np.where(drafted, was(last["pred"]), 0.0), 0.0)
        return realized, predicted

    def decide_rows(self, features: np.ndarray, view: RowView) -> np.ndarray:
        raw = self.expected_accepted(view)  # (N, S, A)
        acc = raw
        if self.calibration > 0:
            realized, predicted = self.history(view)
            m = self.calibration
            acc = raw * np.clip((realized + m) / (predicted + m), *CAL_RANGE)[..., None]
        value = np.where(view.valid[..., None], np.minimum(acc + 1.0, view.tokens_left[..., None]), 0.0)
        choice = self.plan(value, view)
        if self.calibration > 0:
            def chosen(x: np.ndarray) -> np.ndarray:
                return np.take_along_axis(x, choice[..., None], 2)[..., 0]

            self._last = {"rid": np.where(view.valid, view.rid, -1), "context": view.context.copy(),
                          "realized": realized, "predicted": predicted, "pred": chosen(raw),
                          "drafted": view.valid & (self.actions_kw[choice, 0] > 0) & (chosen(view.row_tokens) > 1)}
        return choice


def make_policy(ctx: PolicyContext, arg: str) -> RowModelPolicy:
    if not arg:
        raise ConfigError("rowmodel: needs a directory, e.g. rowmodel:runs/rowmodel/rowmodel.")
    return RowModelPolicy(ctx, arg)
