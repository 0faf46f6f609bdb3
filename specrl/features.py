"""The observation schema (version 1) shared by the envs, the baselines and the runtime.

numpy only: the runtime controller imports this module in serving processes that have no
torch. ``FeatureTracker`` is fed what happened (load, step statistics) and returns the
observation vector the policy sees *before* the next draft round.

Fields of schema version 1 (float32, in this order):

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
  draft_top1       mean draft probability of its first token in the last draft round
                   (model drafters; n-gram: fraction of rows with a match)
  draft_entropy    mean entropy (nats) of the first draft distribution (model drafters)
  match_len        mean n-gram suffix match length (n-gram drafter; 0 otherwise)
  num_matches      mean log(1 + earlier matches) (n-gram drafter)
Previous action
  prev_k, prev_w   the action of the previous step (0, 1 before the first step)

Bump ``SCHEMA_VERSION`` whenever a field is added, removed, reordered or redefined: artifacts
record it and refuse to run on another version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 1
ACCEPT_DEPTHS = 8
LOAD_FIELDS = ("batch_size", "queue_len", "arrival_rate", "mean_context", "max_context")
ACCEPT_FIELDS = tuple(f"accept_d{d}" for d in range(1, ACCEPT_DEPTHS + 1))
DRAFT_FIELDS = ("last_accept_len", "draft_top1", "draft_entropy", "match_len", "num_matches")
ACTION_FIELDS = ("prev_k", "prev_w")
FIELDS: tuple[str, ...] = LOAD_FIELDS + ACCEPT_FIELDS + DRAFT_FIELDS + ACTION_FIELDS
NUM_FEATURES = len(FIELDS)
INDEX = {name: i for i, name in enumerate(FIELDS)}


def schema() -> dict[str, Any]:
    """The schema as stored in artifacts: version and ordered field names."""
    return {"version": SCHEMA_VERSION, "fields": list(FIELDS)}


def _nanmean(x: np.ndarray | None) -> float | None:
    if x is None:
        return None
    arr = np.asarray(x, dtype=np.float32)
    ok = ~np.isnan(arr)
    return float(arr[ok].mean()) if ok.any() else None


@dataclass
class FeatureTracker:
    """Turns raw serving statistics into schema-v1 observations.

    Feed it with ``update_load`` (before each decision) and ``update_step`` (after each step,
    or ``observe(step_result)`` with a specrl StepResult). Cheap: a few numpy ops per step.
    """

    ema: float = 0.2  # weight of the newest observation in the acceptance / rate EMAs
    prior_accept: float = 0.5
    _vec: np.ndarray = field(init=False, repr=False)
    _rate: float = field(init=False, default=0.0)
    _last_arrival_t: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._vec = np.zeros(NUM_FEATURES, dtype=np.float32)
        self._vec[INDEX["accept_d1"] : INDEX["accept_d1"] + ACCEPT_DEPTHS] = self.prior_accept
        self._vec[INDEX["prev_w"]] = 1.0
        self._rate = 0.0
        self._last_arrival_t = None

    # ----- load ------------------------------------------------------------------------------
    def record_arrivals(self, count: int, now: float, window: float) -> None:
        """``count`` requests arrived during the last ``window`` seconds ending at ``now``."""
        if window <= 0:
            return
        inst = count / window
        # time-aware EMA: a long window weighs more, like averaging per second
        alpha = 1.0 - (1.0 - self.ema) ** min(window, 50.0)
        self._rate = (1 - alpha) * self._rate + alpha * inst
        self._vec[INDEX["arrival_rate"]] = self._rate

    def update_load(self, batch_size: int, queue_len: int, context_lens: np.ndarray | list[int]) -> None:
        ctx = np.asarray(context_lens, dtype=np.float32)
        v = self._vec
        v[INDEX["batch_size"]] = batch_size
        v[INDEX["queue_len"]] = queue_len
        v[INDEX["mean_context"]] = float(ctx.mean()) if ctx.size else 0.0
        v[INDEX["max_context"]] = float(ctx.max()) if ctx.size else 0.0

    # ----- steps -------------------------------------------------------------------------------
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
        v = self._vec
        acc = np.asarray(accept_len, dtype=np.float32)
        dep = np.asarray(draft_depth)
        if acc.size:
            base = INDEX["accept_d1"]
            for d in range(1, min(ACCEPT_DEPTHS, int(dep.max(initial=0))) + 1):
                eligible = (dep >= d) & (acc >= d - 1)  # drafted depth d and reached it
                if eligible.any():
                    rate = float((acc[eligible] >= d).mean())
                    v[base + d - 1] = (1 - self.ema) * v[base + d - 1] + self.ema * rate
            v[INDEX["last_accept_len"]] = float(acc.mean())
            # NaN means "not measured this step" (e.g. k = 0 with a model drafter): keep the old value
            for name, x in (("draft_top1", draft_top1), ("draft_entropy", draft_entropy),
                            ("match_len", match_len)):
                m = _nanmean(x)
                if m is not None:
                    v[INDEX[name]] = m
            m = _nanmean(None if num_matches is None else np.log1p(np.asarray(num_matches, dtype=np.float32)))
            if m is not None:
                v[INDEX["num_matches"]] = m
        v[INDEX["prev_k"]] = k
        v[INDEX["prev_w"]] = w

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
        return self._vec.copy()
