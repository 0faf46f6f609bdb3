"""The drafter protocol: what the engine asks of anything that proposes draft trees.

A drafter mirrors the engine's batch rows. The engine calls, in order:

* ``join(seqs)`` when requests enter (rows appended at the end, ``seqs`` = full token ids so
  far, prompt included); a model drafter prefills its own KV cache here;
* ``propose(seqs, shape, present)`` once per step with k >= 1, returning a ``Draft`` that fills
  the rank-path ``shape`` (``present[b]`` marks the nodes row b asked for);
* ``commit(path, accept_len)`` after verification with host copies of the accepted paths, so
  a model drafter keeps exactly the accepted nodes in its cache;
* ``select_rows(index)`` when requests leave (row ``i`` becomes old row ``index[i]``).

A drafter that sets ``uses_target_features = True`` (the feature drafter) also gets
``observe_features(hidden, start)``: the target's post-norm last hidden state (b, H) at the
position before each row's last committed token, for the joining rows after their prefill
(``start`` = the first new row) and for every row after each verify pass (``start`` = 0), before
any row leaves. The engine computes these only for such drafters.

Optionally ``probe(seqs) -> (B, 4)`` returns [top1, entropy, match_len, num_matches] without
drafting; the engine calls it on k = 0 steps so a policy that stopped speculating still sees
whether drafting would pay (the n-gram drafter implements it; a model drafter would need a
forward pass, so its statistics are NaN = "not measured" on such steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

import numpy as np
import torch

from specrl.sampling import SamplingParams
from specrl.tree import TreeShape


@dataclass
class Draft:
    """A batch of filled draft trees (on the compute device unless noted)."""

    tokens: torch.Tensor  # (B, n) long: node tokens, tokens[:, 0] = root (last committed token)
    present: torch.Tensor  # (B, n) bool: node holds a real proposal (absent nodes are never accepted)
    probs: torch.Tensor | None  # (B, n, V) draft distribution from which each node's children were drawn;
    #                             None for deterministic drafters or greedy mode
    top1: torch.Tensor  # (B,) float: draft probability of its first token (1.0 for n-gram matches)
    entropy: torch.Tensor  # (B,) float: entropy (nats) of the first-token draft distribution (0 for n-gram)
    match_len: torch.Tensor  # (B,) float: n-gram length of the match used (0 for model drafters)
    num_matches: torch.Tensor  # (B,) float: number of earlier matches found (0 for model drafters)
    host_union: np.ndarray | None = None  # (n,) bool on the host: slots filled in any row, when the
    #                                        drafter knows it without a device sync (n-gram); lets the
    #                                        engine drop slots nobody filled
    host_present: np.ndarray | None = None  # (B, n) bool on the host: ``present`` itself, when known
    #                                          without a sync (n-gram); the engine's ragged verify then
    #                                          computes only these nodes (a row with no match: its root)


class Drafter(Protocol):
    """Anything that proposes draft trees; see the module docstring for the call order."""

    name: ClassVar[str]

    def join(self, seqs: list[np.ndarray]) -> None: ...

    def select_rows(self, index: list[int]) -> None: ...

    def propose(
        self,
        seqs: list[np.ndarray],
        shape: TreeShape,
        present: np.ndarray,  # (B, n) bool
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft: ...

    def commit(self, path: np.ndarray, accept_len: np.ndarray) -> None: ...


# ----- helpers shared by the drafters that draft a tree level by level from scores ------------
def root_tokens(seqs: list[np.ndarray], n: int, device: torch.device) -> torch.Tensor:
    """(B, n) long node tokens: the root (each row's last committed token) filled, the rest zero."""
    tokens = torch.zeros(len(seqs), n, dtype=torch.long, device=device)
    tokens[:, 0] = torch.tensor([int(s[-1]) for s in seqs], device=device)
    return tokens


def first_token_stats(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V') root scores -> ((B,) top-1 probability, (B,) entropy in nats) of the first draft token."""
    p1 = torch.softmax(scores.float(), dim=-1)
    return p1.max(dim=-1).values, -(p1 * torch.log(p1.clamp_min(1e-30))).sum(-1)


class LevelPlan(NamedTuple):
    """Which parents one depth level of a rank-path tree draws its children from."""

    level: np.ndarray  # (|level|,) node ids at this depth
    parents: list[int]  # distinct parents, ascending: the m rows of the stacked parent scores
    r_max: int  # most children any parent has: how many picks to draw per parent
    par_idx: torch.Tensor  # (|level|,) long: each node's parent as an index into ``parents``
    rank: torch.Tensor  # (|level|,) long: each node's draft rank among its siblings


def level_plan(shape: TreeShape, depth: int, device: torch.device) -> LevelPlan:
    level = shape.level(depth)
    parents = sorted({int(shape.parent[c]) for c in level})
    slot = {p: j for j, p in enumerate(parents)}
    return LevelPlan(level, parents, max(len(shape.children[p]) for p in parents),
                     torch.tensor([slot[int(shape.parent[c])] for c in level], device=device),
                     torch.as_tensor(shape.rank[level], device=device))


def keep_parents_present(have: torch.Tensor, shape: TreeShape) -> None:
    """In place on (B, n) ``have``: a node stays present only if its parent is (breadth-first ids)."""
    for i in range(1, have.shape[1]):
        have[:, i] &= have[:, shape.parent[i]]

