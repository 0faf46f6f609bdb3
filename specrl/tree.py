"""Rank-path draft trees.

A draft tree is described by the *rank paths* of its nodes: the node ``(r1, r2, ..., rd)``
holds the token of draft rank ``rd`` among the children of node ``(r1, ..., r(d-1))``; the root
``()`` is the last committed token, which the target has not processed yet. For greedy
verification this makes acceptance a pure function of the target tokens' draft ranks: the
accepted depth is that of the deepest node whose rank path equals the target path's ranks
(which is what the replay backend uses).

The family is indexed by (k, w): k is the depth (speculation length, 0 = no speculation) and
w the width. ``tree_shape(k, w)`` always contains the rank-0 chain of depth k (so w = 1 is
the plain chain) and adds ``(w - 1) * k`` more nodes, greedily by their prior probability of
being accepted under ``RANK_PRIOR`` (the product of per-rank acceptance along the path),
Sequoia/Medusa style. A node is only added after its parent and its lower-ranked sibling, so
the result is a valid tree of exactly ``k * w`` draft nodes.

Nodes are numbered breadth first (depth, then rank path), so parents precede children and the
nodes of one depth are contiguous: drafting proceeds one depth level per forward pass.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from specrl.errors import ConfigError

MAX_K = 16
MAX_W = 8
# Prior probability that the draft token of rank r is the target's token, used only to decide
# which nodes a (k, w) tree contains. It is a typical profile for a small draft (top-1 agreement
# 0.6, decaying tail); measured profiles can build other trees with ``TreeShape.from_paths``.
RANK_PRIOR = (0.6, 0.15, 0.08, 0.05, 0.03, 0.02, 0.015, 0.01)

Path = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class TreeShape:
    """A static tree of draft slots. Index 0 is the root (last committed token)."""

    paths: tuple[Path, ...]  # (N+1,) rank path of each node, paths[0] == ()
    parent: np.ndarray  # (N+1,) int64, parent[0] == -1
    depth: np.ndarray  # (N+1,) int64, depth[0] == 0
    rank: np.ndarray  # (N+1,) int64, rank among siblings (0 for the root)
    ancestors: np.ndarray  # (N+1, N+1) bool, ancestors[i, j]: j is i or an ancestor of i
    children: tuple[tuple[int, ...], ...]  # (N+1,) child node indices in rank order

    @property
    def num_nodes(self) -> int:
        """Number of draft nodes (the root excluded)."""
        return len(self.paths) - 1

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def max_children(self) -> int:
        return max((len(c) for c in self.children), default=0)

    @property
    def level_sizes(self) -> tuple[int, ...]:
        """Nodes per depth 1..max_depth (what a draft model forwards level by level)."""
        return tuple(int(n) for n in np.bincount(self.depth, minlength=self.max_depth + 1)[1:])

    def level(self, d: int) -> np.ndarray:
        """Node indices at depth d (contiguous by construction)."""
        return np.nonzero(self.depth == d)[0]

    def index(self) -> dict[Path, int]:
        return {p: i for i, p in enumerate(self.paths)}

    @staticmethod
    def from_paths(paths: set[Path] | list[Path]) -> TreeShape:
        """Build a shape from rank paths; every prefix of a path must be present."""
        ps = set(map(tuple, paths)) | {()}
        for p in ps:
            if p and (p[:-1] not in ps or (p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in ps)):
                raise ConfigError(
                    f"Rank path {p} has no parent or no lower-ranked sibling in the tree. "
                    "Fix: include every prefix and every lower rank of each path."
                )
        ordered = tuple(sorted(ps, key=lambda p: (len(p), p)))
        idx = {p: i for i, p in enumerate(ordered)}
        n = len(ordered)
        parent = np.array([-1] + [idx[p[:-1]] for p in ordered[1:]], dtype=np.int64)
        depth = np.array([len(p) for p in ordered], dtype=np.int64)
        rank = np.array([p[-1] if p else 0 for p in ordered], dtype=np.int64)
        anc = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(ordered):
            for d in range(len(p) + 1):
                anc[i, idx[p[:d]]] = True
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[parent[i]].append(i)  # ordered by rank because `ordered` is sorted
        return TreeShape(ordered, parent, depth, rank, anc, tuple(tuple(c) for c in kids))

    def union(self, other: TreeShape) -> TreeShape:
        return TreeShape.from_paths(set(self.paths) | set(other.paths))

    def mask_in(self, union: TreeShape) -> np.ndarray:
        """(len(union.paths),) bool: which nodes of ``union`` belong to this shape."""
        mine = set(self.paths)
        return np.array([p in mine for p in union.paths], dtype=bool)


def check_action(k: int, w: int) -> None:
    """Validate a speculation length and width with an actionable message."""
    if not isinstance(k, (int, np.integer)) or not 0 <= int(k) <= MAX_K:
        raise ConfigError(f"Speculation length k={k!r} is out of range. Allowed: integers 0..{MAX_K} (0 = off).")
    if not isinstance(w, (int, np.integer)) or not 1 <= int(w) <= MAX_W:
        raise ConfigError(f"Tree width w={w!r} is out of range. Allowed: integers 1..{MAX_W} (1 = chain).")


def parse_action(text: str, prefix: str = "") -> tuple[int, int]:
    """``"K"`` or ``"K,W"`` -> validated (k, w) (w defaults to 1). ``prefix`` is how the user spelled
    the setting (``"static:"``, ``"--setting "``), so that the error quotes it back."""
    try:
        parts = [int(x) for x in text.split(",")] if text else []
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        raise ConfigError(f"{prefix}{text} is invalid. Allowed: {prefix}K or {prefix}K,W with integers, "
                          f"e.g. {prefix}4,2.")
    k, w = parts[0], parts[1] if len(parts) == 2 else 1
    check_action(k, w)
    return k, w


@lru_cache(maxsize=256)
def tree_shape(k: int, w: int = 1) -> TreeShape:
    """The (k, w) member of the rank-path family: k * w draft nodes, depth k."""
    check_action(k, w)
    k, w = int(k), int(w)
    chain = [tuple([0] * d) for d in range(1, k + 1)]
    chosen: set[Path] = {()} | set(chain)
    budget = (w - 1) * k
    prior = RANK_PRIOR

    def score(p: Path) -> float:
        s = 1.0
        for r in p:
            s *= prior[r] if r < len(prior) else prior[-1] * 0.5 ** (r - len(prior) + 1)
        return s

    def candidates_of(p: Path) -> list[Path]:
        # Children and next sibling that could be added once p is in the tree.
        out = []
        if len(p) < k:
            out.append(p + (0,))
        if p:
            out.append(p[:-1] + (p[-1] + 1,))
        return out

    heap: list[tuple[float, int, Path]] = []
    seen: set[Path] = set()

    def push(p: Path) -> None:
        if p in chosen or p in seen:
            return
        parent_ok = p[:-1] in chosen
        sibling_ok = p[-1] == 0 or p[:-1] + (p[-1] - 1,) in chosen
        if parent_ok and sibling_ok:
            seen.add(p)
            heapq.heappush(heap, (-score(p), len(p), p))

    for p in list(chosen):
        for c in candidates_of(p):
            push(c)
    while budget > 0 and heap:
        _, _, p = heapq.heappop(heap)
        chosen.add(p)
        budget -= 1
        for c in candidates_of(p):
            push(c)
        # a sibling may have become eligible for nodes that were blocked before
        for q in list(chosen):
            for c in candidates_of(q):
                push(c)
    return TreeShape.from_paths(chosen)
