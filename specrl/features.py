"""The observation schema (version 2) shared by the envs, the baselines and the runtime.

numpy only: the runtime controller imports this module in serving processes that have no
torch. ``FeatureTracker`` is fed what happened (load, step statistics) and returns the
observation vector the policy sees *before* the next draft round.

Fields of schema version 2 (float32, in this order):

Load
  batch_size       running requests that the next step will decode
  queue_len        requests waiting for a batch slot
  arrival_rate     EMA estimate of request arrivals per second (simulated/serving time)
  mean_context     mean sequence length (prompt + generated) of the running requests, tokens
  max_context      longest running sequence, tokens
Acceptance (from the previous steps)
  accept_d1..d8    EMA of the conditional acceptance rate at draft depth d: P(token at depth d
                   accepted | depth d-1 accepted and depth d drafted); prior 0.5, updated only
                   by rows that drafted that depth
  last_accept_len  mean accept length over the batch in the last step
  draft_top1       what the drafter can tell before drafting: model drafters, the mean draft
                   probability of the first token in the last draft round; n-gram, the fraction
                   of running requests whose context has a match *now* (a cheap lookup)
  draft_entropy    mean entropy (nats) of the first draft distribution (model drafters, last round)
  match_len        mean n-gram suffix match length of the current contexts (n-gram drafter)
  num_matches      mean log(1 + earlier matches) of the current contexts (n-gram drafter)
Previous action
  prev_k, prev_w   the action of the previous step (0, 1 before the first step)
  since_draft      consecutive previous steps that drafted nothing (k = 0), capped at
                   ``SINCE_DRAFT_CAP``; 0 before the first step and after a drafting step.
                   Acceptance is measured only while drafting, so rules re-measure it
                   periodically (``goodput`` probes after 16 steps without a draft); as a
                   feature the probe is a function of the observation, which a policy can
                   learn and clone (schema v1 kept the count inside the rule)

Bump ``SCHEMA_VERSION`` whenever a field is added, removed, reordered or redefined: artifacts
record it and refuse to run on another version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 2
SINCE_DRAFT_CAP = 64
ACCEPT_DEPTHS = 8
LOAD_FIELDS = ("batch_size", "queue_len", "arrival_rate", "mean_context", "max_context")
ACCEPT_FIELDS = tuple(f"accept_d{d}" for d in range(1, ACCEPT_DEPTHS + 1))
DRAFT_FIELDS = ("last_accept_len", "draft_top1", "draft_entropy", "match_len", "num_matches")
ACTION_FIELDS = ("prev_k", "prev_w", "since_draft")
FIELDS: tuple[str, ...] = LOAD_FIELDS + ACCEPT_FIELDS + DRAFT_FIELDS + ACTION_FIELDS
NUM_FEATURES = len(FIELDS)
INDEX = {name: i for i, name in enumerate(FIELDS)}


def schema() -> dict[str, Any]:
    """The schema as stored in artifacts: version and ordered field names."""
    return {"version": SCHEMA_VERSION, "fields": list(FIELDS)}


def arrival_ema(rate: np.ndarray, count: np.ndarray, window: np.ndarray, ema: float) -> np.ndarray:
    """(N,) time-aware EMA of the arrival rate: a window of w seconds weighs like w updates."""
    w = np.maximum(window, 1e-12)
    alpha = 1.0 - (1.0 - ema) ** np.minimum(w, 50.0)
    return np.where(window > 0, (1 - alpha) * rate + alpha * (count / w), rate)


def update_load_batch(vec: np.ndarray, batch: np.ndarray, queue: np.ndarray, ctx_mean: np.ndarray,
                      ctx_max: np.ndarray) -> None:
    """In place on (N, F) observations."""
    vec[:, INDEX["batch_size"]] = batch
    vec[:, INDEX["queue_len"]] = queue
    vec[:, INDEX["mean_context"]] = ctx_mean
    vec[:, INDEX["max_context"]] = ctx_max


def update_step_batch(
    vec: np.ndarray,  # (N, F) observations, updated in place
    valid: np.ndarray,  # (N, S) bool: rows that took part in the step
    accept_len: np.ndarray,  # (N, S)
    draft_depth: np.ndarray,  # (N, S)
    k: np.ndarray,  # (N,)
    w: np.ndarray,  # (N,)
    stats: np.ndarray,  # (N, S, 4) [top1, entropy, match_len, num_matches]; NaN = not measured
    ema: float,
) -> None:
    """The acceptance / draft part of the schema for N envs at once (also used for N = 1)."""
    n_env = valid.shape[0]
    acc_i = np.where(valid, accept_len, 0).astype(np.int64)
    dep = np.where(valid, draft_depth, 0).astype(np.int64)
    n_rows = valid.sum(axis=1)  # (N,)
    has = n_rows > 0
    # A row reaches and drafts depth d for d = 1..min(depth, accept + 1), and is accepted there
    # for d = 1..min(depth, accept): histogram those bounds, then count rows with bound >= d.
    top = ACCEPT_DEPTHS + 1
    offs = np.arange(n_env)[:, None] * top
    reach = np.minimum(np.minimum(dep, acc_i + 1), ACCEPT_DEPTHS)
    hit = np.minimum(np.minimum(dep, acc_i), ACCEPT_DEPTHS)
    n_el = np.bincount((offs + reach)[valid], minlength=n_env * top).reshape(n_env, top)
    hits = np.bincount((offs + hit)[valid], minlength=n_env * top).reshape(n_env, top)
    n_el = n_el[:, ::-1].cumsum(axis=1)[:, ::-1][:, 1:]  # (N, D): rows with bound >= d
    hits = hits[:, ::-1].cumsum(axis=1)[:, ::-1][:, 1:]
    rate = hits / np.maximum(n_el, 1)
    acc = acc_i.astype(np.float64)
    base = INDEX["accept_d1"]
    cur = vec[:, base : base + ACCEPT_DEPTHS].astype(np.float64)
    vec[:, base : base + ACCEPT_DEPTHS] = np.where(n_el > 0, (1 - ema) * cur + ema * rate, cur)
    mean_acc = acc.sum(axis=1) / np.maximum(n_rows, 1)
    vec[:, INDEX["last_accept_len"]] = np.where(has, mean_acc, vec[:, INDEX["last_accept_len"]])
    update_draft_batch(vec, valid, stats)
    vec[:, INDEX["prev_k"]] = k
    vec[:, INDEX["prev_w"]] = w
    since = vec[:, INDEX["since_draft"]]
    vec[:, INDEX["since_draft"]] = np.where(np.asarray(k) > 0, 0.0, np.minimum(since + 1.0, SINCE_DRAFT_CAP))


DRAFT_COLS = [INDEX["draft_top1"], INDEX["draft_entropy"], INDEX["match_len"], INDEX["num_matches"]]


def update_draft_batch(vec: np.ndarray, valid: np.ndarray, stats: np.ndarray) -> None:
    """Means over valid rows of (N, S, 4) draft statistics into the draft fields; NaN entries are
    "not measured" and a column with nothing measured keeps its value."""
    st = stats.astype(np.float64).copy()
    st[..., 3] = np.log1p(st[..., 3])
    ok = valid[:, :, None] & ~np.isnan(st)  # (N, S, 4)
    cnt = ok.sum(axis=1)  # (N, 4)
    mean = np.where(ok, st, 0.0).sum(axis=1) / np.maximum(cnt, 1)
    vec[:, DRAFT_COLS] = np.where(cnt > 0, mean, vec[:, DRAFT_COLS])


@dataclass
class FeatureTracker:
    """Turns raw serving statistics into schema-v2 observations (one env / serving engine).

    Feed it with ``update_load`` (before each decision) and ``update_step`` (after each step,
    or ``observe(step_result)`` with a specrl StepResult). Cheap: a few numpy ops per step. The
    math lives in the ``*_batch`` functions above, which the vectorised replay env calls for
    N envs at once, so both compute bit-identical features.
    """

    ema: float = 0.2  # weight of the newest observation in the acceptance / rate EMAs
    prior_accept: float = 0.5
    _vec: np.ndarray = field(init=False, repr=False)
    _rate: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._vec = initial_features(1, self.prior_accept)
        self._rate = np.zeros(1)

    def record_arrivals(self, count: int, now: float, window: float) -> None:
        """``count`` requests arrived during the last ``window`` seconds ending at ``now``."""
        self._rate = arrival_ema(self._rate, np.array([count], float), np.array([window], float), self.ema)
        self._vec[0, INDEX["arrival_rate"]] = self._rate[0]

    def update_load(self, batch_size: int, queue_len: int, context_lens: np.ndarray | list[int]) -> None:
        ctx = np.asarray(context_lens, dtype=np.float32)
        mean = float(ctx.astype(np.float64).sum() / ctx.size) if ctx.size else 0.0
        update_load_batch(self._vec, np.array([batch_size]), np.array([queue_len]), np.array([mean]),
                          np.array([float(ctx.max()) if ctx.size else 0.0]))

    def update_step(
        self,
        accept_len: np.ndarray,  # (B,) accepted draft tokens per row
        draft_depth: np.ndarray,  # (B,) depth each row drafted (0 = no draft)
        k: int,
        w: int,
        draft_top1: np.ndarray | None = None,  # (B,)
        draft_entropy: np.ndarray | None = None,  # (B,)
        match_len: np.ndarray | None = None,  # (B,)
        num_matches: np.ndarray | None = None,  # (B,)
    ) -> None:
        acc = np.asarray(accept_len)
        b = acc.size
        nan = np.full(b, np.nan)
        stats = np.stack([np.asarray(x, np.float64) if x is not None else nan
                          for x in (draft_top1, draft_entropy, match_len, num_matches)], axis=-1)  # (B, 4)
        update_step_batch(self._vec, np.ones((1, b), bool), acc[None], np.asarray(draft_depth)[None],
                          np.array([k]), np.array([w]), stats[None], self.ema)

    def update_probe(self, stats: np.ndarray | None) -> None:
        """Draft statistics known before the next draft round: (B, 4) [top1, entropy, match_len,
        num_matches] per running request (NaN = unknown, keeps the previous value)."""
        if stats is None or len(stats) == 0:
            return
        update_draft_batch(self._vec, np.ones((1, len(stats)), bool), np.asarray(stats, np.float64)[None])

    def observe(self, result: Any) -> None:
        """Update from a StepResult-like object (duck-typed: no torch import needed)."""
        k = max((x.k for x in result.actions), default=0)
        w = max((x.w for x in result.actions), default=1)
        self.update_step(
            result.accept_len, result.draft_depth, k, w,
            result.draft_top1, result.draft_entropy, result.match_len, result.num_matches,
        )

    def vector(self) -> np.ndarray:
        """The current observation (a copy), float32 of length NUM_FEATURES."""
        return self._vec[0].copy()


def initial_features(n: int, prior_accept: float = 0.5) -> np.ndarray:
    """(n, F) observations before any step: acceptance at its prior, previous action (0, 1)."""
    vec = np.zeros((n, NUM_FEATURES), dtype=np.float32)
    vec[:, INDEX["accept_d1"] : INDEX["accept_d1"] + ACCEPT_DEPTHS] = prior_accept
    vec[:, INDEX["prev_w"]] = 1.0
    return vec
