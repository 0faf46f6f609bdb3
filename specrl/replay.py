"""Replay backend: the engine's step outcomes computed from traces instead of models.

``ReplayTables`` precompute, for every trace position and every action of the env's action
table, what the live engine would do there (greedy): the accept length, the depth actually
drafted, which tree nodes were proposed (a bitmask; the live engine drops slots no row filled,
so the verify width of a batch is 1 + popcount(OR of the rows' masks)) and the draft
statistics the features use. ``ReplayBackend`` then steps a batch with table lookups only.

* n-gram drafter: ``ngram_tree`` (the live drafter's own function) runs on the recorded
  sequence, and the path that matches the recorded continuation is accepted: exact.
* model drafter: the accepted depth is that of the deepest node whose rank path equals the
  recorded draft ranks of the target's tokens (Sequoia-style rank paths): exact for greedy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrl.errors import ConfigError
from specrl.step import Action, StepResult
from specrl.traces import Traces
from specrl.tree import TreeShape, tree_shape

TABLE_FORMAT = 1


def action_table(k_choices: list[int], w_choices: list[int]) -> list[tuple[int, int]]:
    """Flattened (k, w) per action index a = k_index * len(w_choices) + w_index (k = 0 -> w = 1)."""
    return [(k, 1 if k == 0 else w) for k in k_choices for w in w_choices]


def node_bits(shape: TreeShape, present: np.ndarray) -> int:
    """Bitmask of the present draft nodes (bit i-1 = node i; the root is not a bit)."""
    idx = np.flatnonzero(present[1:])
    return int(np.bitwise_or.reduce(np.left_shift(np.uint64(1), idx.astype(np.uint64)))) if idx.size else 0


def _accept_along(shape: TreeShape, tokens: np.ndarray, present: np.ndarray, truth: np.ndarray) -> int:
    """Greedy acceptance: follow the children whose token equals the next true token."""
    node, depth = 0, 0
    while depth < len(truth):
        nxt = -1
        for c in shape.children[node]:
            if present[c] and tokens[c] == truth[depth]:
                nxt = c
                break
        if nxt < 0:
            break
        node, depth = nxt, depth + 1
    return depth


@dataclass
class ReplayTables:
    """Per (trace row, action) outcomes. Rows: ``offsets[i] + g`` = prompt i after g tokens."""

    actions: list[tuple[int, int]]  # (A,) (k, w) per action index
    offsets: np.ndarray  # (N + 1,) first row of each prompt
    prompt_len: np.ndarray  # (N,)
    cont_len: np.ndarray  # (N,)
    accept: np.ndarray  # (R, A) uint8 accepted draft tokens
    depth: np.ndarray  # (R, A) uint8 depth actually drafted
    mask: np.ndarray  # (R, A) uint64 proposed nodes (bit i-1 = node i of the action's shape)
    top1: np.ndarray  # (R,) float32 (NaN where not measured)
    entropy: np.ndarray  # (R,)
    match_len: np.ndarray  # (R,)
    num_matches: np.ndarray  # (R,)
    bit_depth: np.ndarray  # (A, 64) int8: depth of node bit j in action a's shape (0 = unused bit)

    def __post_init__(self) -> None:
        # packed copies for the vectorised env: one flat take per quantity
        self.stats = np.stack([self.top1, self.entropy, self.match_len, self.num_matches], axis=-1)  # (R, 4)
        self.accept_flat = self.accept.astype(np.int64).ravel()  # (R * A,)
        self.depth_flat = self.depth.astype(np.int64).ravel()
        self.mask_flat = self.mask.ravel()

    @staticmethod
    def build(traces: Traces, actions: list[tuple[int, int]], drafter: str, max_ngram: int | None = None,
              min_ngram: int | None = None, progress: bool = True) -> ReplayTables:
        from tqdm import tqdm

        from specrl.drafters.ngram import MAX_NGRAM, MIN_NGRAM, lookup, ngram_tree

        max_ngram = MAX_NGRAM if max_ngram is None else max_ngram
        min_ngram = MIN_NGRAM if min_ngram is None else min_ngram
        n_act = len(actions)
        shapes = [tree_shape(k, w) for k, w in actions]
        if max(s.num_nodes for s in shapes) > 64:
            raise ConfigError("Replay supports trees of at most 64 draft nodes (k * w <= 64).")
        lens = np.array([len(c) for c in traces.continuations])
        offsets = np.concatenate([[0], np.cumsum(lens)])
        rows = int(offsets[-1])
        accept = np.zeros((rows, n_act), np.uint8)
        depth = np.zeros((rows, n_act), np.uint8)
        mask = np.zeros((rows, n_act), np.uint64)
        top1 = np.full(rows, np.nan, np.float32)
        entropy = np.full(rows, np.nan, np.float32)
        match_len = np.full(rows, np.nan, np.float32)
        num_matches = np.full(rows, np.nan, np.float32)
        if drafter == "model" and traces.ranks is None:
            raise ConfigError("These traces have no draft ranks (recorded for the n-gram drafter). "
                              "Fix: `specrl collect --drafter model --draft ...`.")
        path_sets = [set(s.paths) for s in shapes]
        full_bits = [node_bits(s, np.ones(len(s.paths), bool)) for s in shapes]
        for i in tqdm(range(len(traces)), desc="replay tables", disable=not progress, unit="prompt"):
            seq = np.concatenate([traces.prompt_ids[i], traces.continuations[i]])
            p, c = len(traces.prompt_ids[i]), len(traces.continuations[i])
            for g in range(c):
                row = offsets[i] + g
                truth = traces.continuations[i][g:]
                if drafter == "ngram":
                    ctx = seq[: p + g]
                    found = lookup(ctx, 1, max_ngram, min_ngram, max_continuations=1)
                    match_len[row], num_matches[row] = found.match_len, found.num_matches
                    top1[row], entropy[row] = float(found.match_len > 0), 0.0
                    for a, shape in enumerate(shapes):
                        if shape.num_nodes == 0:
                            continue
                        toks, present, _, _ = ngram_tree(ctx, shape, max_ngram, min_ngram)
                        accept[row, a] = _accept_along(shape, toks, present, truth[: shape.max_depth])
                        depth[row, a] = int(shape.depth[present].max())
                        mask[row, a] = node_bits(shape, present)
                else:
                    ranks = traces.ranks[i][g:]  # type: ignore[index]
                    top1[row], entropy[row] = traces.top1[i][g], traces.entropy[i][g]  # type: ignore[index]
                    match_len[row] = num_matches[row] = 0.0  # what the model drafter reports
                    for a, shape in enumerate(shapes):
                        if shape.num_nodes == 0:
                            continue
                        d = 0
                        while d < min(shape.max_depth, len(ranks)) and tuple(int(r) for r in ranks[: d + 1]) in path_sets[a]:
                            d += 1
                        accept[row, a], depth[row, a], mask[row, a] = d, shape.max_depth, full_bits[a]
        bit_depth = np.zeros((n_act, 64), np.int8)
        for a, s in enumerate(shapes):
            bit_depth[a, : s.num_nodes] = s.depth[1:]
        return ReplayTables(actions, offsets, np.array([len(x) for x in traces.prompt_ids]), lens, accept, depth,
                            mask, top1, entropy, match_len, num_matches, bit_depth)

    # ----- cache on disk (npz, no pickle) ----------------------------------------------------
    def save(self, path: str | Path) -> None:
        np.savez_compressed(Path(path), actions=np.asarray(self.actions, np.int64), offsets=self.offsets,
                            prompt_len=self.prompt_len, cont_len=self.cont_len, accept=self.accept, depth=self.depth,
                            mask=self.mask, top1=self.top1, entropy=self.entropy, match_len=self.match_len,
                            num_matches=self.num_matches, bit_depth=self.bit_depth, format=np.int64(TABLE_FORMAT))

    @staticmethod
    def load(path: str | Path) -> ReplayTables | None:
        try:
            with np.load(Path(path), allow_pickle=False) as z:
                if int(z["format"]) != TABLE_FORMAT:
                    return None
                return ReplayTables([tuple(map(int, a)) for a in z["actions"]], z["offsets"], z["prompt_len"],
                                    z["cont_len"], z["accept"], z["depth"], z["mask"], z["top1"], z["entropy"],
                                    z["match_len"], z["num_matches"], z["bit_depth"])
        except (OSError, KeyError, ValueError):
            return None

    @staticmethod
    def cached(traces: Traces, actions: list[tuple[int, int]], drafter: str, cache_dir: Path,
               progress: bool = True) -> ReplayTables:
        """Build once per (trace, action table, drafter); later loads take milliseconds."""
        from specrl.drafters.ngram import MAX_NGRAM, MIN_NGRAM

        # everything the tables depend on: the trace, the action table and the drafter's settings
        key = hashlib.sha1(f"{traces.meta.get('sha256')}|{actions}|{drafter}|{MAX_NGRAM},{MIN_NGRAM}|"
                           f"{TABLE_FORMAT}".encode()).hexdigest()[:16]
        path = cache_dir / f"replay-{key}.npz"
        hit = ReplayTables.load(path) if path.exists() else None
        if hit is not None:
            return hit
        tables = ReplayTables.build(traces, actions, drafter, progress=progress)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tables.save(path)
        return tables


def popcount64(x: np.ndarray) -> np.ndarray:
    """Bits set per uint64 element."""
    return np.bitwise_count(np.asarray(x, np.uint64)).astype(np.int64)


class ReplayBackend:
    """A DecodeBackend that steps requests through ReplayTables (see module docstring)."""

    def __init__(self, tables: ReplayTables, pool_rows: list[int], k_choices: list[int], w_choices: list[int],
                 drafter: str, ragged: bool = True) -> None:
        self.t = tables
        self.ragged = ragged  # as SpecEngine(ragged=...): verify tokens = each row's own tree
        self.pool_rows = pool_rows  # prompt-pool index -> trace index
        self.index = {kw: a for a, kw in enumerate(action_table(k_choices, w_choices))}
        self.drafter = drafter
        self.reset()

    def reset(self) -> None:
        self.rids: list[int] = []
        self.trace: list[int] = []
        self.pos: list[int] = []  # generated tokens so far
        self.max_new: list[int] = []
        self.new: list[bool] = []

    def add(self, rid: int, prompt: int, max_new_tokens: int) -> None:
        self.rids.append(rid)
        self.trace.append(self.pool_rows[prompt])
        self.pos.append(0)
        self.max_new.append(max_new_tokens)
        self.new.append(True)

    def context_lens(self) -> np.ndarray:
        return np.array([self.t.prompt_len[i] + g for i, g in zip(self.trace, self.pos)], dtype=np.float32)

    def probe(self) -> np.ndarray | None:
        """As the live n-gram drafter's lookup on the current contexts; None for model drafters."""
        if self.drafter != "ngram":
            return None
        rows = self.t.offsets[np.asarray(self.trace, np.int64)] + np.asarray(self.pos, np.int64)
        return self.t.stats[rows]

    def step(self, action: Action) -> StepResult:
        result, new_pos, done = self._outcome(action)
        result.finished = [r for r, d in zip(self.rids, done) if d]
        keep = ~done
        self.rids = [r for r, k in zip(self.rids, keep) if k]
        self.trace = [t for t, k in zip(self.trace, keep) if k]
        self.pos = [int(p) for p, k in zip(new_pos, keep) if k]
        self.max_new = [m for m, k in zip(self.max_new, keep) if k]
        self.new = [False] * len(self.rids)
        return result

    def peek(self, action: Action) -> StepResult:
        """What ``step(action)`` would return, without changing any state (for the oracle)."""
        return self._outcome(action)[0]

    def _outcome(self, action: Action) -> tuple[StepResult, np.ndarray, np.ndarray]:
        kw = (action.k, 1 if action.k == 0 else action.w)
        if kw not in self.index:
            raise ConfigError(f"Action {kw} is not in the replay action table. Fix: use the env's k_choices/w_choices.")
        a = self.index[kw]
        tb = self.t
        trace, pos = np.asarray(self.trace), np.asarray(self.pos)
        rows = tb.offsets[trace] + pos  # (B,)
        acc = tb.accept[rows, a].astype(np.int64)
        dep = tb.depth[rows, a].astype(np.int64)
        union = np.bitwise_or.reduce(tb.mask[rows, a]) if len(rows) else np.uint64(0)
        bits = np.unpackbits(np.asarray([union], np.uint64).view(np.uint8), bitorder="little").astype(bool)
        node_depths = tb.bit_depth[a][bits]
        levels = tuple(int((node_depths == d).sum()) for d in range(1, kw[0] + 1)) if kw[0] else ()
        while levels and levels[-1] == 0:
            levels = levels[:-1]
        remaining = np.minimum(tb.cont_len[trace], np.asarray(self.max_new)) - pos
        committed = np.minimum(acc + 1, remaining)
        acc = np.minimum(acc, committed)  # as the engine: drafts past the end are not counted
        context = tb.prompt_len[trace] + pos
        new = np.asarray(self.new)
        prefill_rows = int(new.sum())
        prefill_len = int(tb.prompt_len[trace][new].max()) if prefill_rows else 0
        # like the live engine: a k = 0 step with a model drafter measures no draft statistics
        stats_nan = kw[0] == 0 and self.drafter != "ngram"
        nanv = np.full(len(rows), np.nan, np.float32)
        result = StepResult(
            rids=list(self.rids), actions=[Action(*kw)] * len(rows),
            committed=[np.zeros(int(c), np.int64) for c in committed],  # replay knows counts, not ids
            num_committed=committed, accept_len=acc, draft_depth=dep,
            draft_top1=nanv if stats_nan else tb.top1[rows], draft_entropy=nanv if stats_nan else tb.entropy[rows],
            match_len=nanv if stats_nan else tb.match_len[rows],
            num_matches=nanv if stats_nan else tb.num_matches[rows],
            context_len=context, tree_tokens=1 + int(bits.sum()), level_sizes=levels,
            verify_tokens=int(np.sum(1 + popcount64(tb.mask[rows, a]))) if self.ragged and kw[0] else None,
            prefill_rows=prefill_rows, prefill_len=prefill_len, finished=[],
            prefill_time=0.0, draft_time=0.0, verify_time=0.0, step_time=0.0,
        )
        new_pos = pos + committed
        done = new_pos >= np.minimum(tb.cont_len[trace], np.asarray(self.max_new))
        result.finished = [r for r, d in zip(self.rids, done) if d]
        return result, new_pos, done
