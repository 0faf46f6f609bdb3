"""The records one decode step exchanges: the action in, the StepResult out.

numpy only, so that the replay backend, the features and the runtime can use them without
torch. The live engine (``specrl.engine``) and the replay simulator both produce StepResults.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrl.tree import check_action


@dataclass(frozen=True)
class Action:
    """Speculation length k (tree depth, 0 = off) and tree width w (1 = chain)."""

    k: int
    w: int = 1

    def __post_init__(self) -> None:
        check_action(self.k, self.w)


@dataclass
class StepResult:
    """What one engine step did. Arrays are indexed by row (B = running batch size)."""

    rids: list[int]  # (B,) request ids of the rows stepped
    actions: list[Action]  # (B,) action each row ran with
    committed: list[np.ndarray]  # (B,) tokens committed per row (after EOS / length truncation)
    num_committed: np.ndarray  # (B,) int
    accept_len: np.ndarray  # (B,) int: accepted draft tokens committed (bonus excluded; none past EOS)
    draft_depth: np.ndarray  # (B,) int: depth of the row's drafted tree (nodes actually proposed)
    draft_top1: np.ndarray  # (B,) float: draft prob. of its first token (model drafter; n-gram: 1 if matched)
    draft_entropy: np.ndarray  # (B,) float: entropy of the first draft distribution (model drafter)
    match_len: np.ndarray  # (B,) float: n-gram match length (n-gram drafter)
    num_matches: np.ndarray  # (B,) float: earlier n-gram matches (n-gram drafter)
    context_len: np.ndarray  # (B,) int: sequence length before the step
    tree_tokens: int  # tokens per row in the verify pass (root + draft nodes after pruning)
    level_sizes: tuple[int, ...]  # nodes per depth 1..k of the verify tree (what a draft model forwards)
    prefill_rows: int  # requests admitted (prefilled) at the start of this step
    prefill_len: int  # longest prompt among them, tokens
    finished: list[int]  # request ids that finished this step
    prefill_time: float  # seconds spent admitting new requests
    draft_time: float
    verify_time: float
    step_time: float  # whole step, prefill included
    verify_tokens: int | None = None  # token rows the verify pass computed (None: batch_size * tree_tokens)

    @property
    def batch_size(self) -> int:
        return len(self.rids)

    @property
    def verify_rows(self) -> int:
        """Token rows of the verify pass: B * tree_tokens padded, fewer when it ran ragged."""
        return self.batch_size * self.tree_tokens if self.verify_tokens is None else self.verify_tokens

    def accepted_at_depth(self, depth: int) -> np.ndarray:
        """(B, depth) bool: draft token at depth d+1 was accepted."""
        return self.accept_len[:, None] > np.arange(depth)[None, :]
