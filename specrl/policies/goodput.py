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
        self.reset()

    def reset(self) -> None:
        self.zeros = 0

    def scores(self, features: np.ndarray) -> np.ndarray:
        alpha = features[INDEX["accept_d1"] : INDEX["accept_d1"] + ACCEPT_DEPTHS].astype(float)
        batch = max(1, int(round(float(features[INDEX["batch_size"]]))))
        ctx = float(features[INDEX["mean_context"]])
        coverage = float(features[INDEX["draft_top1"]]) if self.ctx.drafter == "ngram" else 1.0
        out = np.zeros(len(self.actions))
        for j, (k, w) in enumerate(self.actions):
            tokens = 1.0 + coverage * expected_accepted(k, w, alpha)
            shape = tree_shape(k, w)
            levels = [int((shape.depth == d).sum()) for d in range(1, k + 1)]
            t = self.ctx.cost_model.step_time(self.ctx.drafter, k, batch, shape.num_nodes + 1, levels, ctx)
            out[j] = batch * tokens / t
        return out

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        k, w = self.actions[int(np.argmax(self.scores(features)))]
        if k == 0 and self.zeros >= self.probe_every:
            k, w = min((a for a in self.actions if a[0] > 0), key=lambda a: a[0] * a[1], default=(0, 1))
        self.zeros = self.zeros + 1 if k == 0 else 0
        return k, w
