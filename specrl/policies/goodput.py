"""Goodput-argmax (SmartSpec; vLLM's dynamic speculative decoding), extended to trees.

For every (k, w) of the table: expected committed tokens per request from the per-depth
acceptance EMAs in the features, expected step time from the profiled cost model at the
current batch size and context; pick the argmax of ``batch * E[tokens] / E[time]`` (k = 0
included, so it stops speculating when the verify pass gets expensive).

Expected accepted tokens of a rank-path tree: a node is accepted iff every step of its path is,
and siblings exclude each other, so E[accepted] = sum over nodes of the product, along the
path, of q(d, r) = P(the target's token at depth d is the draft's rank-r token). q(d, 0) is
the feature ``accept_d{d}``; other ranks follow the tree prior's rank profile (``RANK_PRIOR``),
scaled so that sum_r q(d, r) <= 1.

Two details keep the rule honest with the n-gram drafter: (1) the acceptance EMAs only count
requests that had a draft, so expected tokens are scaled by the fraction of requests whose
context has a match now (``draft_top1``); (2) after ``probe_every`` steps of k = 0 (the
feature ``since_draft``) it drafts once with the cheapest speculative action, because acceptance
is only measured while drafting and a stale low estimate would otherwise keep it at k = 0 forever.

The rule keeps no state: everything it reads is in the features, so a behaviour clone can
reproduce it and the exported controller runs it from the same vector. The probe period may depend
on the batch size (``probe_by_batch``, spec ``goodput:1=4,8=16``), which the features also carry:
at small batches a wasted probe is cheap and a missed speculation window is expensive, at large
batches the opposite. ``probe_every = 16`` was
chosen on validation episodes (``benchmarks/probe_period.py``: training prompts, arrival seeds 1000-1002, 120 s, concurrency
1-16; geometric mean of goodput 64.01 / 64.04 / 64.10 / 64.00 / 63.87 tokens/s at 8 / 12 / 16 /
24 / 32; the held-out prompts were not used to choose it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from specrl.costs import MAX_LEVELS
from specrl.errors import ConfigError
from specrl.features import ACCEPT_DEPTHS, INDEX, SINCE_DRAFT_CAP
from specrl.policies.base import BasePolicy, PolicyContext
from specrl.rows import PerRowPolicy, RowView
from specrl.tree import RANK_PRIOR, TreeShape, tree_shape


class PathTables:
    """Node arrays of one or more rank-path trees, for expected accepted tokens without a Python
    loop over nodes: per node its depth, rank ratio to the top-1 prior, whether it is a sibling
    (rank > 0), which tree owns it, and a block-diagonal path matrix (node j on the path to i)."""

    def __init__(self, shapes: list[TreeShape | None]) -> None:  # None: no draft (k = 0)
        prior = np.asarray(RANK_PRIOR, float)
        self.num_trees = len(shapes)
        depth, ratio, ranked, owner, blocks = [], [], [], [], []
        for j, shape in enumerate(shapes):
            if shape is None or shape.num_nodes == 0:
                continue
            d, r = shape.depth[1:], shape.rank[1:]
            depth.append(d)
            ratio.append(prior[np.minimum(r, len(prior) - 1)] / prior[0])
            ranked.append(r > 0)
            owner.append(np.full(len(d), j))
            blocks.append(shape.ancestors[1:, 1:])  # (n, n), root excluded
        self.depth = np.concatenate(depth) if depth else np.zeros(0, int)  # (nodes,)
        self.ratio = np.concatenate(ratio) if ratio else np.zeros(0)
        self.ranked = np.concatenate(ranked) if ranked else np.zeros(0, bool)
        self.owner = np.concatenate(owner) if owner else np.zeros(0, int)
        self.paths = np.zeros((len(self.depth), len(self.depth)))  # (nodes, nodes)
        o = 0
        for blk in blocks:
            self.paths[o : o + len(blk), o : o + len(blk)] = blk
            o += len(blk)

    def expected_accepted(self, alpha: np.ndarray) -> np.ndarray:
        """(num_trees,) E[accepted draft tokens] per tree for per-depth top-1 acceptance ``alpha``.

        A node is accepted iff every step of its path is: q(d, r) = alpha[d] * ratio(r), and
        ranks beyond 0 share what rank 0 leaves (sum_r q(d, r) <= 1). Path products as sums of
        logs (a zero q gives exp(-690) = 0)."""
        a = np.asarray(alpha, float)[np.minimum(self.depth, len(alpha)) - 1]  # (nodes,)
        q = a * self.ratio
        q = np.where(self.ranked, np.minimum(q, np.maximum(0.0, 1.0 - a)), q)
        prob = np.exp(self.paths @ np.log(np.maximum(q, 1e-300)))  # (nodes,)
        return np.bincount(self.owner, prob, minlength=self.num_trees)


def expected_accepted(k: int, w: int, alpha: np.ndarray) -> float:
    """E[accepted draft tokens] of tree (k, w) for per-depth top-1 acceptance ``alpha`` (len >= k)."""
    return float(PathTables([tree_shape(k, w) if k > 0 else None]).expected_accepted(alpha)[0])


class GoodputArgmax(BasePolicy):
    name = "goodput"

    def __init__(self, ctx: PolicyContext, probe_every: int = 16,
                 probe_by_batch: Mapping[int, int] | None = None) -> None:
        super().__init__(ctx)
        schedule = dict(probe_by_batch) if probe_by_batch else {1: probe_every}
        if 1 not in schedule or any(b < 1 for b in schedule):
            raise ConfigError(f"probe_by_batch={schedule} must start at batch size 1 and list batch sizes >= 1 "
                              "(each entry holds from its batch size up to the next one). Fix: e.g. {1: 4, 8: 16}.")
        for b, p in schedule.items():
            if not 1 <= p <= SINCE_DRAFT_CAP:
                raise ConfigError(f"probe_every={p} (batch size {b}) is outside 1..{SINCE_DRAFT_CAP} (the feature "
                                  f"since_draft saturates at {SINCE_DRAFT_CAP}). Fix: e.g. probe_every=16.")
        if ctx.cost_model is None:
            raise ConfigError("The 'goodput' policy needs a cost model (specrl profile). Fix: pass one in the "
                              "PolicyContext, or evaluate on an env that has one.")
        self.actions = self.table.all()
        self._probe_from = np.array(sorted(schedule))  # (S,) batch sizes where a period starts
        self._probe_period = np.array([schedule[b] for b in self._probe_from])  # (S,)
        self._precompute()

    def probe_period(self, batch: int) -> int:
        """Steps at k = 0 before a probe draft at this batch size (the entry with the largest
        listed batch size <= batch)."""
        return int(self._probe_period[np.searchsorted(self._probe_from, max(1, batch), side="right") - 1])

    def _precompute(self) -> None:
        """Per-action tree data for a vectorised ``scores`` (the rule runs every step of every
        evaluation and of behaviour-cloning rollouts: ~0.1 ms instead of ~2.4 ms per decision)."""
        shapes = [tree_shape(k, w) if k > 0 else None for k, w in self.actions]
        self._paths = PathTables(shapes)
        self._levels = np.zeros((len(shapes), MAX_LEVELS))  # (A, L) verify-tree nodes per depth
        for j, shape in enumerate(shapes):
            if shape is not None:
                self._levels[j, : shape.max_depth] = shape.level_sizes
        self._tokens = np.array([1.0 if sh is None else sh.num_nodes + 1.0 for sh in shapes])
        self._drafted = np.array([k > 0 for k, _ in self.actions])

    def expected_accepted_per_row(self, features: np.ndarray) -> np.ndarray:
        """(A,) expected accepted draft tokens per running request for every action: the tree
        model on the acceptance EMAs, times the fraction of requests that have a draft now.
        (``specrl.accmodel`` learns this from replay outcomes instead.)"""
        alpha = features[INDEX["accept_d1"] : INDEX["accept_d1"] + ACCEPT_DEPTHS].astype(float)
        coverage = float(features[INDEX["draft_top1"]]) if self.ctx.drafter == "ngram" else 1.0
        return coverage * self._paths.expected_accepted(alpha)  # (A,)

    def step_times(self, features: np.ndarray) -> np.ndarray:
        """(A,) step time (s) of every action at the current batch size and context (cost model)."""
        n_act = len(self.actions)
        return self.ctx.cost_model.step_time_batch(
            self.ctx.drafter, self._drafted, np.full(n_act, _batch(features)), self._tokens, self._levels,
            np.full(n_act, float(features[INDEX["mean_context"]])), np.zeros(n_act), np.zeros(n_act))

    def scores(self, features: np.ndarray) -> np.ndarray:
        """(A,) expected goodput (tokens/s) of every action of the table."""
        return _batch(features) * (1.0 + self.expected_accepted_per_row(features)) / self.step_times(features)

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        k, w = self.actions[int(np.argmax(self.scores(features)))]
        if k == 0 and features[INDEX["since_draft"]] >= self.probe_period(_batch(features)):
            k, w = min((a for a in self.actions if a[0] > 0), key=lambda a: a[0] * a[1], default=(0, 1))
        return k, w


def _batch(features: np.ndarray) -> int:
    """The running batch size in the features, as the cost model's integer (at least 1)."""
    return max(1, int(round(float(features[INDEX["batch_size"]]))))


def parse_probe_spec(arg: str) -> dict[int, int]:
    """The argument of ``goodput:ARG``: ``P`` (one probe period) or ``B1=P1,B2=P2,...`` (period P_i
    from batch size B_i up to the next listed one; B1 must be 1). Returns {batch size: period}."""
    allowed = "goodput:P (one probe period, 1..64) or goodput:B1=P1,B2=P2,... (period by batch size, from B1=1)"
    try:
        if "=" not in arg:
            return {1: int(arg)}
        pairs = [part.split("=") for part in arg.split(",")]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(arg)
        out = {int(b): int(p) for b, p in pairs}
        if len(out) != len(pairs):
            raise ValueError(arg)
        return out
    except ValueError:
        raise ConfigError(f"goodput:{arg} is invalid. Allowed: {allowed}. Fix: e.g. goodput:16 or "
                          "goodput:1=4,8=16.") from None


class GoodputRows(PerRowPolicy):
    """``goodput``'s acceptance estimate, made per request: the hand-built reference for the
    per-request policies (what per-request actions and the ragged verify give without learning).

    Every row whose n-gram lookup finds a match now is expected to accept what the per-depth
    acceptance EMAs predict through the tree model (the EMAs only count rows that drafted); a row
    without a match proposes nothing, so it expects 0 (a draft model: every row is covered). The
    per-row planner (``specrl.rows.plan_rows``) then picks one (k, w) per row. The probe rule is
    goodput's: after ``probe_every`` steps in which no row drafted, the rows with a match draft
    once with the cheapest speculative action, so stale EMAs get measured again."""

    name = "goodput-rows"

    def __init__(self, ctx: PolicyContext, probe_every: int = 16) -> None:
        super().__init__(ctx)
        if not 1 <= probe_every <= SINCE_DRAFT_CAP:
            raise ConfigError(f"probe_every={probe_every} is outside 1..{SINCE_DRAFT_CAP}. Fix: e.g. 16.")
        self.probe_every = probe_every
        self._paths = PathTables([tree_shape(int(k), int(w)) if k > 0 else None for k, w in self.actions_kw])
        spec = [a for a, (k, w) in enumerate(self.actions_kw.tolist()) if k > 0]
        self._probe = min(spec, key=lambda a: self.actions_kw[a, 0] * self.actions_kw[a, 1]) if spec else None

    def decide_rows(self, features: np.ndarray, view: RowView) -> np.ndarray:
        feats = np.atleast_2d(features).astype(float)  # (N, F)
        alpha = feats[:, INDEX["accept_d1"] : INDEX["accept_d1"] + ACCEPT_DEPTHS]
        per_action = np.stack([self._paths.expected_accepted(a) for a in alpha])  # (N, A)
        covered = view.match_len > 0 if self.ctx.drafter == "ngram" else np.ones_like(view.valid)
        acc = np.where(covered[..., None], per_action[:, None, :], 0.0)  # (N, S, A)
        value = np.where(view.valid[..., None], np.minimum(acc + 1.0, view.tokens_left[..., None]), 0.0)
        choice = self.plan(value, view)
        if self._probe is not None:
            idle = ~(view.valid & (self.actions_kw[choice, 0] > 0)).any(1)
            probe = idle & (feats[:, INDEX["since_draft"]] >= self.probe_every)
            choice = np.where(probe[:, None] & covered & view.valid, self._probe, choice)
        return choice
