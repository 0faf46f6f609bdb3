"""Verification of a draft tree against one target forward pass.

Vocabulary (used the same way in StepResult, features and metrics):

* **accepted** tokens: draft tokens the verifier keeps. They form one root-to-node path of the
  tree; their number is the **accept length** ``a`` (0 <= a <= depth of the tree).
* **bonus** token: the one token the target contributes after the accepted path: the target's
  own choice at the last accepted node (greedy: its argmax; sampling: a draw from the residual
  distribution left after every sibling was rejected, or from the target itself at a leaf).
  Every step therefore commits ``a + 1`` tokens, so k = 0 is plain autoregressive decoding.

Methods:

* **Greedy** (temperature 0): a node is accepted when its token equals the target argmax at
  its parent and its parent is accepted. The output equals the target alone, token for token.
* **Sampling**: multi-draft recursive rejection sampling (SpecInfer / Sequoia). At an accepted
  node with target distribution ``p`` the children are tried in rank order. A child ``x`` drawn
  from the draft distribution ``q`` is accepted with probability ``min(1, p(x) / q(x))``; on
  rejection ``p <- norm(max(p - q, 0))`` and, since siblings are drawn *without replacement*,
  ``q <- norm(q with x removed)``. A deterministic drafter (n-gram) is the case ``q = one-hot(x)``:
  accept with probability ``p(x)``, else ``p <- norm(p with x removed)``. If no child is
  accepted the bonus token is drawn from the final ``p``. A chain is the one-child case, i.e.
  standard speculative sampling (Leviathan et al., Chen et al. 2023). Each step's committed
  tokens are distributed exactly as target samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.sampling import SamplingParams, probs_from_logits
from specrl.tree import TreeShape


@dataclass
class TreeTensors:
    """A TreeShape's index arrays on the compute device."""

    parent: torch.Tensor  # (n,) long, parent[0] = 0 (the root points at itself)
    depth: torch.Tensor  # (n,) long
    ancestors: torch.Tensor  # (n, n) bool: ancestors[i, j] = j is i or an ancestor of i
    children: torch.Tensor  # (n, C) long, child node ids in rank order, -1 padded
    max_depth: int

    @staticmethod
    def of(shape: TreeShape, device: torch.device) -> TreeTensors:
        n = len(shape.paths)
        c = max(1, shape.max_children)
        kids = torch.full((n, c), -1, dtype=torch.long)
        for i, ch in enumerate(shape.children):
            kids[i, : len(ch)] = torch.tensor(ch, dtype=torch.long)
        parent = torch.as_tensor(shape.parent).clamp_min(0)
        return TreeTensors(
            parent.to(device),
            torch.as_tensor(shape.depth).to(device),
            torch.as_tensor(shape.ancestors).to(device),
            kids.to(device),
            shape.max_depth,
        )


@dataclass
class VerifyOutput:
    """Result of verifying a batch of trees (all on the compute device)."""

    last_node: torch.Tensor  # (B,) long: deepest accepted node (0 = root, nothing accepted)
    accept_len: torch.Tensor  # (B,) long: number of accepted draft tokens
    path: torch.Tensor  # (B, max_depth + 1) long: accepted node ids from the root, -1 padded
    bonus: torch.Tensor  # (B,) long: the target's bonus token


def _path_of(tree: TreeTensors, last: torch.Tensor) -> torch.Tensor:
    """(B,) last accepted node -> (B, max_depth + 1) node ids from the root, -1 padded."""
    n = tree.parent.shape[0]
    on_path = tree.ancestors[last]  # (B, n)
    ids = torch.arange(n, device=last.device).expand_as(on_path)
    # breadth-first numbering: sorting node ids sorts the path by depth
    ordered = torch.where(on_path, ids, n).sort(dim=-1).values[:, : tree.max_depth + 1]  # (B, D+1)
    return torch.where(ordered == n, -1, ordered)


def verify_greedy(
    tree: TreeTensors,
    tokens: torch.Tensor,  # (B, n) long, tokens[:, 0] = root
    present: torch.Tensor,  # (B, n) bool, absent nodes are never accepted
    target_logits: torch.Tensor | None,  # (B, n, V)
    target_choice: torch.Tensor | None = None,  # (B, n) its argmax, when the caller has it already
) -> VerifyOutput:
    choice = target_logits.argmax(dim=-1) if target_choice is None else target_choice  # (B, n): the target's token after each node
    match = (tokens == choice[:, tree.parent]) & present  # (B, n)
    match[:, 0] = True
    # a node is accepted iff every node on its root path matches
    misses = (~match).to(torch.float32) @ tree.ancestors.T.to(torch.float32)  # (B, n)
    depth_if_ok = torch.where(misses == 0, tree.depth, -1)  # (B, n)
    last = depth_if_ok.argmax(dim=-1)  # (B,) deepest accepted node (lowest rank on ties)
    return VerifyOutput(
        last_node=last,
        accept_len=tree.depth[last],
        path=_path_of(tree, last),
        bonus=choice.gather(1, last[:, None])[:, 0],
    )


def _renorm(p: torch.Tensor, fallback: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """Normalise rows of p; rows with at most ``eps`` mass fall back to ``fallback``."""
    s = p.sum(dim=-1, keepdim=True)
    return torch.where(s > eps, p / s.clamp_min(1e-30), fallback)


def verify_sampling(
    tree: TreeTensors,
    tokens: torch.Tensor,  # (B, n) long
    present: torch.Tensor,  # (B, n) bool
    target_logits: torch.Tensor,  # (B, n, V)
    draft_probs: torch.Tensor | None,  # (B, n, V): q from which node i's children were drawn; None = deterministic
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyOutput:
    p_all = probs_from_logits(target_logits, params)  # (B, n, V)
    bsz = tokens.shape[0]
    rows = torch.arange(bsz, device=tokens.device)
    cur = torch.zeros(bsz, dtype=torch.long, device=tokens.device)
    alive = torch.ones(bsz, dtype=torch.bool, device=tokens.device)
    final_p = p_all[:, 0]  # (B, V), overwritten where a row stops
    for _ in range(tree.max_depth):
        kids = tree.children[cur]  # (B, C)
        p_res = p_all[rows, cur]  # (B, V)
        q_res = draft_probs[rows, cur] if draft_probs is not None else None
        nxt = cur.clone()
        moved = torch.zeros_like(alive)
        for i in range(kids.shape[1]):
            c = kids[:, i]
            cc = c.clamp_min(0)
            x = tokens[rows, cc]  # (B,)
            valid = alive & ~moved & (c >= 0) & present[rows, cc]
            px = p_res.gather(1, x[:, None])[:, 0]
            if q_res is None:
                ratio = px
            else:
                qx = q_res.gather(1, x[:, None])[:, 0]
                valid &= qx > 0
                ratio = px / qx.clamp_min(1e-30)
            u = torch.rand(bsz, generator=generator, device=tokens.device)
            acc = valid & (u < ratio)
            nxt = torch.where(acc, c, nxt)
            moved |= acc
            rej = (valid & ~acc)[:, None]
            if q_res is None:
                p_new = _renorm(p_res.scatter(1, x[:, None], 0.0), p_res)
            else:
                p_new = _renorm((p_res - q_res).clamp_min(0.0), p_res)
                # q after removing x: renormalised whatever mass is left. A confident draft leaves
                # < 1e-9 (q(x) ~ 1); keeping the raw tail there accepted every later sibling.
                q_new = _renorm(q_res.scatter(1, x[:, None], 0.0), q_res, eps=0.0)
                q_res = torch.where(rej, q_new, q_res)
            p_res = torch.where(rej, p_new, p_res)
        stop = alive & ~moved
        final_p = torch.where(stop[:, None], p_res, final_p)
        alive = alive & moved
        cur = nxt
    # rows that reached a leaf sample the bonus from the target at that leaf
    final_p = torch.where(alive[:, None], p_all[rows, cur], final_p)
    bonus = torch.multinomial(final_p.double(), 1, generator=generator)[:, 0]  # float64: tails of a 49k vocab
    return VerifyOutput(last_node=cur, accept_len=tree.depth[cur], path=_path_of(tree, cur), bonus=bonus)


def verify(
    tree: TreeTensors,
    tokens: torch.Tensor,
    present: torch.Tensor,
    target_logits: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    target_choice: torch.Tensor | None = None,
) -> VerifyOutput:
    """Dispatch on the sampling mode (see the module docstring for the method). Greedy needs only
    the target's argmax per node: ``target_choice`` (B, n) may replace ``target_logits``."""
    if params.greedy:
        return verify_greedy(tree, tokens, present, target_logits, target_choice)
    return verify_sampling(tree, tokens, present, target_logits, draft_probs, params, generator)
