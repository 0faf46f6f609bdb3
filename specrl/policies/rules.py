"""Hand-built speculation rules from serving engines and the literature.

Each rule documents where it comes from and what, exactly, it does here; the logic is tested
on hand-written inputs in tests/test_policies.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from specrl.features import INDEX
from specrl.policies.base import BasePolicy, PolicyContext
from specrl.tree import MAX_K


class Static(BasePolicy):
    """A fixed (k, w): ``static:K[,W]``; ``ar`` is ``static:0``."""

    def __init__(self, ctx: PolicyContext, k: int, w: int = 1) -> None:
        super().__init__(ctx)
        self.k, self.w = k, w
        self.name = "ar" if k == 0 else f"static:{k},{w}"

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        return self.k, self.w


class HFHeuristic(BasePolicy):
    """transformers' ``num_assistant_tokens_schedule="heuristic"``: start at its default of 20
    draft tokens (clipped to the table), k += 2 after a step where every draft token was
    accepted, else k = max(1, k - 1). Chains only. For a batch, "every token accepted" means
    the batch's mean accept length reached k."""

    name = "hf-heuristic"

    def __init__(self, ctx: PolicyContext, start: int = 20) -> None:
        super().__init__(ctx)
        self.start = min(start, max(ctx.k_choices))
        self.k = self.start

    def reset(self) -> None:
        self.k = self.start

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        return self.snap(self.k, 1)

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        k = info.get("k", self.k)
        if k <= 0:
            return
        if info.get("accept_len_mean", 0.0) >= k - 1e-9:
            self.k = min(self.k + 2, MAX_K)
        else:
            self.k = max(1, self.k - 1)


class HFConfidence(BasePolicy):
    """transformers' dynamic speculation length (``assistant_confidence_threshold``): the draft
    stops as soon as its token probability falls below a threshold (0.4 at first), refit online
    from the ROC curve of (confidence, accepted) pairs with cost ``fpr + 3 * fnr``.

    specrl decides k before drafting, so the stop point is predicted: with first-token
    confidence p (feature ``draft_top1``), the i-th token's confidence is taken as p^i and k is
    the largest table value with p^k >= threshold (0 if p < threshold). The refit uses one pair
    per step: the batch's mean first-token confidence and whether the first token was accepted
    (mean accept length >= 0.5)."""

    name = "hf-confidence"

    def __init__(self, ctx: PolicyContext, threshold: float = 0.4, refit_every: int = 20) -> None:
        super().__init__(ctx)
        self.threshold0 = threshold
        self.refit_every = refit_every
        self.reset()

    def reset(self) -> None:
        self.threshold = self.threshold0
        self.pairs: list[tuple[float, bool]] = []
        self._last_conf: float | None = None

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        p = float(features[INDEX["draft_top1"]])
        self._last_conf = p
        ks = sorted(k for k in self.ctx.k_choices if k > 0)
        if not ks or p < self.threshold:
            return (0, 1) if 0 in self.ctx.k_choices else (min(self.ctx.k_choices), 1)
        best = ks[0]
        for k in ks:
            if p**k >= self.threshold:
                best = k
        return best, 1

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        if info.get("k", 0) <= 0 or self._last_conf is None:
            return
        self.pairs.append((self._last_conf, info.get("accept_len_mean", 0.0) >= 0.5))
        if len(self.pairs) % self.refit_every == 0:
            self.threshold = roc_threshold(self.pairs, self.threshold)


def roc_threshold(pairs: list[tuple[float, bool]], current: float) -> float:
    """The confidence threshold minimising fpr + 3 * fnr (transformers' choice of costs).

    Positives are accepted drafts: a threshold above their confidence drops them (false
    negatives); negatives above the threshold are drafted for nothing (false positives)."""
    conf = np.array([c for c, _ in pairs], float)
    ok = np.array([a for _, a in pairs], bool)
    if ok.all() or (~ok).all():
        return current
    best, best_cost = current, math.inf
    for th in np.unique(np.concatenate([conf, [current]])):
        keep = conf >= th
        fpr = (keep & ~ok).sum() / max(1, (~ok).sum())
        fnr = (~keep & ok).sum() / max(1, ok.sum())
        cost = fpr + 3 * fnr
        if cost < best_cost:
            best, best_cost = float(th), cost
    return best


class SGLangEMA(BasePolicy):
    """An EMA rule after SGLang's adaptive speculative decoding: an EMA (alpha 0.2) of the
    accepted draft tokens per step, a warm-up of ``warmup`` steps at the tier's default, a
    re-decision every ``interval`` steps, hysteresis (k moves only when the EMA says a k at least
    ``margin`` away), and per batch-size tiers capping k (large batches speculate less).

    Target k = round(EMA accept length + 1): speculate one token beyond what is being accepted."""

    name = "sglang-ema"
    TIERS = ((1, 8), (2, 6), (4, 4), (8, 2), (10**9, 1))  # (max batch size, max k)

    def __init__(self, ctx: PolicyContext, alpha: float = 0.2, warmup: int = 8, interval: int = 4,
                 margin: float = 1.0) -> None:
        super().__init__(ctx)
        self.alpha, self.warmup, self.interval, self.margin = alpha, warmup, interval, margin
        self.reset()

    def reset(self) -> None:
        self.ema: float | None = None
        self.steps = 0
        self.k: int | None = None

    def cap(self, batch: float) -> int:
        return next(kmax for bmax, kmax in self.TIERS if batch <= bmax)

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        cap = self.cap(float(features[INDEX["batch_size"]]))
        if self.k is None or self.steps < self.warmup or self.ema is None:
            self.k = min(4, cap)
        elif self.steps % self.interval == 0:
            target = min(cap, int(round(self.ema + 1)))
            if abs(target - self.k) >= self.margin:
                self.k = target
        self.k = min(self.k, cap)
        return self.snap(self.k, 1)

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        self.steps += 1
        if info.get("k", 0) > 0:
            a = float(info.get("accept_len_mean", 0.0))
            self.ema = a if self.ema is None else (1 - self.alpha) * self.ema + self.alpha * a


class UCB(BasePolicy):
    """Context-free UCB1 over every (k, w) of the table, rewarded with the step's goodput
    (tokens per second, normalised by the best seen), as in BanditSpec / TapOut. The
    exploration weight ``c`` = 0.2 (UCB1's sqrt(2 ln t / n) bonus scaled down: with ~20 arms the
    textbook c = 1 spends most of an episode exploring)."""

    name = "ucb"

    def __init__(self, ctx: PolicyContext, c: float = 0.2) -> None:
        super().__init__(ctx)
        self.arms = self.table.all()
        self.c = c
        self.reset()

    def reset(self) -> None:
        self.n = np.zeros(len(self.arms))
        self.mean = np.zeros(len(self.arms))
        self.t = 0
        self.scale = 1e-9
        self._arm = 0

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        self.t += 1
        untried = np.flatnonzero(self.n == 0)
        if untried.size:
            self._arm = int(untried[0])
        else:
            bonus = self.c * np.sqrt(2 * np.log(self.t) / self.n)
            self._arm = int(np.argmax(self.mean / self.scale + bonus))
        return self.arms[self._arm]

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        dt = info.get("dt", 0.0)
        if dt <= 0:
            return
        g = info.get("tokens", 0) / dt
        self.scale = max(self.scale, g)  # rewards compared on a [0, 1] scale: best goodput seen = 1
        i = self._arm
        self.n[i] += 1
        self.mean[i] += (g - self.mean[i]) / self.n[i]
