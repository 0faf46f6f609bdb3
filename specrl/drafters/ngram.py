"""Prompt-lookup (n-gram) drafting: propose what followed earlier occurrences of the suffix.

No model and no KV cache: the draft is a deterministic function of the token ids so far, which
is also why the replay backend can rerun it exactly on recorded sequences. With width > 1 the
continuations of several earlier matches are merged into a trie, so siblings are distinct
tokens; sibling rank = order of preference (longer n-gram first, then the most recent match).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specrl.drafters.base import Draft
from specrl.errors import ConfigError
from specrl.sampling import SamplingParams
from specrl.tree import TreeShape

# Longest suffix n-gram looked up. Longer matches are both more precise (prefer them) and a
# finer confidence signal for policies: on held-out built-in prompts, k = 8 chains accept 5.2
# tokens after an 8-gram match, 2.8 after a 3-gram, 0.7 after a 1-gram.
MAX_NGRAM = 8
MIN_NGRAM = 1
TREE_CONTINUATIONS = 16  # a tree is filled from at most this many distinct continuations


@dataclass
class Lookup:
    """Result of one prompt-lookup search."""

    continuations: list[np.ndarray]  # distinct continuations, most preferred first, each <= k tokens
    match_len: int  # n of the longest suffix n-gram that matched (0 = no match)
    num_matches: int  # earlier occurrences of that n-gram


def lookup(tokens: np.ndarray, k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM,
           max_continuations: int = 8) -> Lookup:
    """Find continuations of the longest suffix n-gram of ``tokens`` (1-D int array) seen before."""
    length = len(tokens)
    conts: list[np.ndarray] = []
    seen: set[bytes] = set()
    best_n = count = 0
    if k <= 0 or length < 2:
        return Lookup(conts, 0, 0)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # (length - n, n): starts with a successor
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size == 0:
            continue
        if best_n == 0:
            best_n, count = n, int(hits.size)
        for i in hits[::-1]:  # most recent first
            cont = tokens[i + n : i + n + k]
            key = cont.tobytes()
            if key not in seen:
                seen.add(key)
                conts.append(cont)
                if len(conts) >= max_continuations:
                    return Lookup(conts, best_n, count)
    return Lookup(conts, best_n, count)


def fill_tree(continuations: list[np.ndarray], shape: TreeShape) -> tuple[np.ndarray, np.ndarray]:
    """Map continuations onto rank-path slots via a trie.

    Returns (tokens (n,) int64 with tokens[0] unset, present (n,) bool). Node ``(r1..rd)`` holds
    the r_d-th distinct next token (in preference order) after the trie node ``(r1..r(d-1))``.
    """
    children: dict[tuple[int, ...], list[int]] = {(): []}
    for cont in continuations:
        prefix: tuple[int, ...] = ()
        for t in cont.tolist():
            nxt = prefix + (t,)
            if nxt not in children:
                children[prefix].append(t)
                children[nxt] = []
            prefix = nxt
    n = len(shape.paths)
    tokens = np.zeros(n, dtype=np.int64)
    present = np.zeros(n, dtype=bool)
    present[0] = True
    trie_path: list[tuple[int, ...] | None] = [()] + [None] * (n - 1)
    for i in range(1, n):
        parent_path = trie_path[shape.parent[i]]
        if parent_path is None:
            continue
        kids = children[parent_path]
        r = shape.rank[i]
        if r < len(kids):
            tokens[i] = kids[r]
            present[i] = True
            trie_path[i] = parent_path + (kids[r],)
    return tokens, present


def ngram_tree(
    seq: np.ndarray, shape: TreeShape, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The n-gram drafter's whole decision for one sequence (shared with the replay backend).

    Returns (tokens (n,), present (n,), match_len, num_matches); tokens[0] is the root.
    """
    # a chain needs one continuation; a tree may need one per node to fill deeper branches
    want = 1 if shape.max_children <= 1 else min(TREE_CONTINUATIONS, shape.num_nodes)
    found = lookup(seq, shape.max_depth, max_ngram, min_ngram, max_continuations=want)
    tokens, present = fill_tree(found.continuations, shape)
    tokens[0] = seq[-1]
    return tokens, present, found.match_len, found.num_matches


def match_order(seq: np.ndarray, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
                ) -> tuple[np.ndarray, int, int]:
    """Every earlier match of ``seq``'s suffix n-grams, in ``lookup``'s order of preference, from
    one vectorised pass (``lookup`` scans once per n).

    Returns (starts, match_len, num_matches): ``starts`` (M,) are the positions where each match's
    continuation begins, longer n-gram first, then most recent; a position appears once, at its
    longest match (``lookup`` meets it again at shorter n, and drops it as a duplicate)."""
    length = len(seq)
    n_max = min(max_ngram, length - 1)
    if n_max < max(min_ngram, 1):
        return np.zeros(0, np.int64), 0, 0
    s = np.arange(1, length)  # (L-1,) candidate continuation starts
    back = s[:, None] - 1 - np.arange(n_max)[None, :]  # (L-1, n) token j back from the match's end
    eq = (back >= 0) & (seq[np.maximum(back, 0)] == seq[length - 1 - np.arange(n_max)][None, :])
    mlen = np.cumprod(eq, axis=1).sum(axis=1)  # (L-1,) suffix n-gram length matched ending at s - 1
    ok = mlen >= min_ngram
    if not ok.any():
        return np.zeros(0, np.int64), 0, 0
    s, mlen = s[ok], mlen[ok]
    order = np.lexsort((-s, -mlen))  # longest match first, then most recent
    best = int(mlen.max())
    return s[order], best, int((mlen >= best).sum())


def tree_sizes(
    seq: np.ndarray, shapes: list[TreeShape | None], max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
) -> tuple[np.ndarray, int, int, int]:
    """Verify tokens (root included) of ``ngram_tree(seq, shape)`` for every shape (None: k = 0, 1
    token), from one ``match_order`` pass shared by all of them instead of one lookup each.

    Why: a per-request policy asks, every step and for every row, how big each action's tree would
    be; 22 separate lookups per row cost ~1 ms each on these CPUs. Exact (tested against
    ``ngram_tree``): a (k, w) tree takes the first min(16, k * w) distinct continuations in
    ``lookup``'s order, so one trie per depth k over the first 16, each node labelled with the
    continuation that created it, holds every smaller trie too (the nodes labelled below the
    count; along a child list labels only grow, so those are a prefix).
    Returns (sizes (len(shapes),), match_len, num_matches, the 1-token lookup's prediction or -1)."""
    length = len(seq)
    sizes = np.ones(len(shapes), np.int64)
    starts, best_n, count = match_order(seq, max_ngram, min_ngram)
    if starts.size == 0:
        return sizes, 0, 0, -1
    first = int(starts[0])
    tries: dict[int, dict[tuple[int, ...], list[tuple[int, int]]]] = {}
    for a, shape in enumerate(shapes):
        if shape is None:
            continue
        k, nodes, chain, parent, rank = _shape_info(shape)
        if nodes == 0:
            continue
        if chain:  # a chain: the most preferred continuation only
            sizes[a] = 1 + min(k, length - first)
            continue
        trie = tries.get(k)
        if trie is None:
            trie = tries[k] = _labelled_trie(seq, starts, k, TREE_CONTINUATIONS)
        want = min(TREE_CONTINUATIONS, nodes)  # as ngram_tree asks lookup
        at: list[tuple[int, ...] | None] = [()] + [None] * nodes  # trie path of each filled node
        filled = 1
        for i in range(1, nodes + 1):
            pp = at[parent[i]]
            if pp is None:
                continue
            kids = trie.get(pp, ())
            r = rank[i]
            if r < len(kids) and kids[r][1] < want:
                at[i] = pp + (kids[r][0],)
                filled += 1
        sizes[a] = filled
    return sizes, best_n, count, int(seq[first])


@lru_cache(maxsize=512)
def _shape_info(shape: TreeShape) -> tuple[int, int, bool, list[int], list[int]]:
    """(depth k, draft nodes, is a chain, parent list, rank list) of a shape, computed once."""
    return (shape.max_depth, shape.num_nodes, shape.max_children <= 1, shape.parent.tolist(), shape.rank.tolist())


def _labelled_trie(seq: np.ndarray, starts: np.ndarray, k: int, limit: int
                   ) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Trie of the first ``limit`` distinct k-token continuations at ``starts`` (in order): trie
    path -> [(token, index of the continuation that created the child)] in insertion order."""
    children: dict[tuple[int, ...], list[tuple[int, int]]] = {(): []}
    seen: set[bytes] = set()
    for st in starts.tolist():
        cont = seq[st : st + k]
        key = cont.tobytes()
        if key in seen:
            continue
        label = len(seen)
        seen.add(key)
        prefix: tuple[int, ...] = ()
        for t in cont.tolist():
            nxt = prefix + (t,)
            if nxt not in children:
                children[prefix].append((t, label))
                children[nxt] = []
            prefix = nxt
        if len(seen) >= limit:
            break
    return children


class NGramDrafter:
    """Model-free prompt-lookup drafter (the CPU default)."""

    name: ClassVar[str] = "ngram"

    def __init__(self, device: torch.device | str = "cpu", max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(
                f"n-gram sizes min_ngram={min_ngram}, max_ngram={max_ngram} are invalid. "
                "Allowed: 1 <= min_ngram <= max_ngram. Fix: e.g. min_ngram=1, max_ngram=8."
            )
        self.device = torch.device(device)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def join(self, seqs: list[np.ndarray]) -> None:  # stateless
        pass

    def select_rows(self, index: list[int]) -> None:
        pass

    def commit(self, path: np.ndarray, accept_len: np.ndarray) -> None:
        pass

    def probe(self, seqs: list[np.ndarray]) -> torch.Tensor:
        """(B, 4) [top1, entropy, match_len, num_matches] without drafting (for k = 0 steps)."""
        out = np.zeros((len(seqs), 4), dtype=np.float32)
        for b, seq in enumerate(seqs):
            found = lookup(seq, 1, self.max_ngram, self.min_ngram, max_continuations=1)
            out[b] = (float(found.match_len > 0), 0.0, found.match_len, found.num_matches)
        return torch.from_numpy(out).to(self.device)

    def propose(
        self,
        seqs: list[np.ndarray],
        shape: TreeShape,
        present: np.ndarray,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        bsz, n = len(seqs), len(shape.paths)
        tokens = np.zeros((bsz, n), dtype=np.int64)
        have = np.zeros((bsz, n), dtype=bool)
        stats = np.zeros((bsz, 2), dtype=np.float32)
        # each row drafts its own shape (the nodes it asked for), not the batch's union: the trie
        # depends on the tree's depth and on how many continuations it takes, so a (1, 2) row beside
        # a (4, 1) row would otherwise get other branches than it gets alone (and than replay has)
        own: dict[bytes, tuple[TreeShape, np.ndarray]] = {}
        for b, seq in enumerate(seqs):
            key = present[b].tobytes()
            if key not in own:
                asked = np.flatnonzero(present[b])
                if asked.size == n:
                    own[key] = (shape, np.arange(n))
                else:
                    sub = TreeShape.from_paths([shape.paths[i] for i in asked])
                    where = shape.index()
                    own[key] = (sub, np.array([where[p] for p in sub.paths]))
            sub, slots = own[key]
            if sub.num_nodes == 0:  # a k = 0 row: nothing to draft, but its match statistics as a probe's
                found = lookup(seq, 1, self.max_ngram, self.min_ngram, max_continuations=1)
                tokens[b, 0], have[b, 0] = seq[-1], True
                stats[b] = (found.match_len, found.num_matches)
                continue
            t, h, match_len, num_matches = ngram_tree(seq, sub, self.max_ngram, self.min_ngram)
            tokens[b, slots], have[b, slots] = t, h
            stats[b] = (match_len, num_matches)
        st = torch.from_numpy(stats).to(self.device)
        zeros = torch.zeros(bsz, device=self.device)
        have &= present
        have[:, 0] = True  # the root is always verified
        return Draft(
            tokens=torch.from_numpy(tokens).to(self.device),
            present=torch.from_numpy(have).to(self.device),
            probs=None,
            top1=(st[:, 0] > 0).float(),
            entropy=zeros,
            match_len=st[:, 0],
            num_matches=st[:, 1],
            host_union=have.any(axis=0),
            host_present=have,
        )
