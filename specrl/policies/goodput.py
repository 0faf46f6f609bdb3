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
context has a match now (``draft_top1``); (2) after ``probe_every`` steps of k = 0 it drafts
once with the cheapest speculative action, because acceptance is only measured while drafting
and a stale low estimate would otherwise keep it at k = 0 forever.
"""

from __future__ import annotations

import numpy as np

from specrl.costs import MAX_LEVELS
from specrl.errors import ConfigError
from specrl.features import ACCEPT_DEPTHS, INDEX
from specrl.policies.base import BasePolicy, PolicyContext
from specrl.tree import RANK_PRIOR, tree_shape


def expected_accepted(k: int, w: int, alpha: np.ndarray) -> float:
    """E[accepted draft tokens] of tree (k, w) for per-depth top-1 acceptance ``alpha`` (len >= k)."""
    if k == 0:
        return 0.0
    shape = tree_shape(k, w)
    prior = np.asarray(RANK_PRIOR, float)
    total = 0.0
    prob = np.ones(len(shape.paths))
    for i in range(1, len(shape.paths)):
        d, r = int(shape.depth[i]), int(shape.rank[i])
        a = float(alpha[min(d, len(alpha)) - 1])
        ratio = prior[min(r, len(prior) - 1)] / prior[0]
        q = a * ratio
        # ranks beyond 0 share what rank 0 leaves: sum_r q(d, r) <= 1
        q = min(q, max(0.0, 1.0 - a)) if r > 0 else q
        prob[i] = prob[shape.parent[i]] * q
        total += prob[i]
    return total


class GoodputArgmax(BasePolicy):
    name = "goodput"

    def __init__(self, ctx: PolicyContext, probe_every: int = 8) -> None:
        super().__init__(ctx)
        if ctx.cost_model is None:
            raise ConfigError("The 'goodput' policy needs a cost model (specrl profile). Fix: pass one in the "
                              "PolicyContext, or evaluate on an env that has one.")
        self.actions = self.table.all()
        self.probe_every = probe_every
        self._precompute()
        self.reset()

    def _precompute(self) -> None:
        """Per-action tree data for a vectorised ``scores`` (the rule runs every step of every
        evaluation and of behaviour-cloning rollouts: ~40 us instead of ~2 ms per decision)."""
        prior = np.asarray(RANK_PRIOR, float)
        n_act = len(self.actions)
        self._levels = np.zeros((n_act, MAX_LEVELS))
        self._tokens = np.ones(n_act)
        self._drafted = np.array([k > 0 for k, _ in self.actions])
        depth, ratio, ranked, owner, blocks = [], [], [], [], []
        for j, (k, w) in enumerate(self.actions):
            if k == 0:
                continue
            shape = tree_shape(k, w)
            lv = [int((shape.depth == d).sum()) for d in range(1, k + 1)]
            self._levels[j, : len(lv)] = lv
            self._tokens[j] = shape.num_nodes + 1
            d, r = shape.depth[1:], shape.rank[1:]
            depth.append(np.minimum(d, ACCEPT_DEPTHS) - 1)
            ratio.append(prior[np.minimum(r, len(prior) - 1)] / prior[0])
            ranked.append(r > 0)
            owner.append(np.full(len(d), j))
            blocks.append(shape.ancestors[1:, 1:].astype(float))  # (n, n): j on the path to i (root excluded)
        self._depth = np.concatenate(depth) if depth else np.zeros(0, int)
        self._ratio = np.concatenate(ratio) if ratio else np.zeros(0)
        self._ranked = np.concatenate(ranked) if ranked else np.zeros(0, bool)
        self._owner = np.concatenate(owner) if owner else np.zeros(0, int)
        n = len(self._depth)
        self._paths = np.zeros((n, n))  # block-diagonal over actions
        o = 0
        for b in blocks:
            self._paths[o : o + len(b), o : o + len(b)] = b
            o += len(b)

    def reset(self) -> None:
        self.zeros = 0

    def scores(self, features: np.ndarray) -> np.ndarray:
        """(A,) expected goodput (tokens/s) of every action of the table."""
        alpha = features[INDEX["accept_d1"] : INDEX["accept_d1"] + ACCEPT_DEPTHS].astype(float)
        batch = max(1, int(round(float(features[INDEX["batch_size"]]))))
        ctx = float(features[INDEX["mean_context"]])
        coverage = float(features[INDEX["draft_top1"]]) if self.ctx.drafter == "ngram" else 1.0
        # expected_accepted for every action at once: node acceptance q, path products via logs
        a = alpha[self._depth]  # (nodes,)
        q = a * self._ratio
        q = np.where(self._ranked, np.minimum(q, np.maximum(0.0, 1.0 - a)), q)
        prob = np.exp(self._paths @ np.log(np.maximum(q, 1e-300)))  # (nodes,)
        accepted = np.bincount(self._owner, prob, minlength=len(self.actions))  # (A,)
        n_act = len(self.actions)
        t = self.ctx.cost_model.step_time_batch(
            self.ctx.drafter, self._drafted, np.full(n_act, batch), self._tokens, self._levels,
            np.full(n_act, ctx), np.zeros(n_act), np.zeros(n_act))  # (A,)
        return batch * (1.0 + coverage * accepted) / t

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        k, w = self.actions[int(np.argmax(self.scores(features)))]
        if k == 0 and self.zeros >= self.probe_every:
            k, w = min((a for a in self.actions if a[0] > 0), key=lambda a: a[0] * a[1], default=(0, 1))
        self.zeros = self.zeros + 1 if k == 0 else 0
        return k, w
