"""Draft-model drafting: a small causal LM with its own ragged KV cache proposes the tree.

The tree is drafted one depth level per forward pass: the first pass feeds the tokens the
draft has not seen yet (the root among them); pass d feeds the depth-d nodes that have
children, each attending to its own ancestors only (tree attention). After verification
``commit`` keeps in the draft cache exactly the fed nodes on the accepted path; an accepted
leaf and the bonus token are fed at the start of the next step.

``min_confidence`` (0 = off) makes the tree's depth dynamic, like transformers'
``assistant_confidence_threshold``: a node whose token the draft itself gives less than this
probability is not proposed (nor anything below it), drafting stops at the first level where no
row has a node left, and the verify pass is cut to the nodes some row still proposes. The action's
(k, w) becomes the largest tree. Lossless either way: which nodes are proposed depends on the
draft alone, never on the target; when sampling, it depends on the parent's top probability, not
on the sampled token (a proposal kept only when its own draw is likely is no longer drawn from q).
Costs one host read per drafted level (free on CPU, a synchronisation on CUDA), so it is off by
default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from specrl.drafters.base import Draft, first_token_stats, keep_parents_present, level_plan, root_tokens
from specrl.errors import ConfigError
from specrl.kvcache import RaggedKVCache, prefill
from specrl.sampling import SamplingParams, gumbel_topk, probs_from_logits
from specrl.tree import TreeShape


@dataclass
class _StepState:
    base: int  # first tentative column of this step
    pending: list[int]  # (B,) tokens fed in the first pass per row
    colmap: np.ndarray  # (n,) absolute cache column of each fed node, -1 if not fed


class ModelDrafter:
    """A draft causal LM sharing the target's tokenizer."""

    name: ClassVar[str] = "model"

    def __init__(self, model: torch.nn.Module, min_confidence: float = 0.0) -> None:
        if not 0.0 <= min_confidence < 1.0:
            raise ConfigError(f"min_confidence={min_confidence} is invalid. Allowed: 0 <= value < 1 "
                              "(0 = off). Fix: e.g. 0.4, transformers' default assistant threshold.")
        self.min_confidence = float(min_confidence)
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = RaggedKVCache()
        self.cached: list[int] = []  # (B,) sequence tokens held in the draft cache per row
        self._state: _StepState | None = None

    def join(self, seqs: list[np.ndarray]) -> None:
        prefill(self.model, self.cache, seqs, self.device)
        self.cached += [len(s) - 1 for s in seqs]

    def select_rows(self, index: list[int]) -> None:
        self.cache.select_rows(index)
        self.cached = [self.cached[i] for i in index]

    @torch.no_grad()
    def propose(
        self,
        seqs: list[np.ndarray],
        shape: TreeShape,
        present: np.ndarray,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        dev, cache = self.device, self.cache
        bsz, n = len(seqs), len(shape.paths)
        seq_len = torch.tensor([len(s) for s in seqs], device=dev)  # (B,)

        # pass 0: every token the draft has not seen, the root last
        pend = [s[c:] for s, c in zip(seqs, self.cached)]
        lens = [len(p) for p in pend]
        width = max(lens)
        ids = np.zeros((bsz, width), dtype=np.int64)
        for b, p in enumerate(pend):
            ids[b, : lens[b]] = p
        n_pend = torch.tensor(lens, device=dev)
        cols = torch.arange(width, device=dev)
        pend_ok = cols[None, :] < n_pend[:, None]  # (B, P)
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        base = cache.T
        pos = torch.tensor(self.cached, device=dev)[:, None] + cols[None, :]  # (B, P)
        logits, _ = cache.forward(
            self.model, torch.from_numpy(ids).to(dev), pos, causal[None] & pend_ok[:, None, :], base
        )
        rows = torch.arange(bsz, device=dev)
        root_logits = logits[rows, n_pend - 1]  # (B, V)

        top1, entropy = first_token_stats(root_logits)
        tokens = root_tokens(seqs, n, dev)  # (B, n)
        have = torch.from_numpy(present).to(dev).clone()
        probs = None if params.greedy else torch.zeros(bsz, n, root_logits.shape[-1], device=dev)
        node_logits: dict[int, torch.Tensor] = {0: root_logits}  # node -> (B, V) logits at that node
        colmap = np.full(n, -1, dtype=np.int64)
        fed: list[int] = []
        anc = torch.from_numpy(shape.ancestors).to(dev)

        for d in range(1, shape.max_depth + 1):
            level, parents, r_max, par_idx, rank = level_plan(shape, d, dev)
            par_logits = torch.stack([node_logits[p] for p in parents], dim=1)  # (B, m, V)
            if params.greedy:
                picks = par_logits.topk(r_max, dim=-1).indices  # (B, m, R)
            else:
                q = probs_from_logits(par_logits, params)  # (B, m, V)
                probs[:, parents] = q
                picks = gumbel_topk(q, r_max, generator)  # (B, m, R), drawn without replacement
            tokens[:, level] = picks[:, par_idx, rank]  # (B, |level|)
            if probs is not None or self.min_confidence > 0:
                if probs is None:  # greedy picks need no distribution, the threshold does
                    q = torch.softmax(par_logits.float(), dim=-1)  # (B, m, V)
                qx = q[:, par_idx].gather(-1, tokens[:, level, None])[..., 0]  # (B, |level|) draft prob. of each pick
            if probs is not None:
                have[:, level] &= qx > 0  # a zero-probability pick is no proposal
            if self.min_confidence > 0:
                parent_ok = have[:, torch.as_tensor(shape.parent[level], device=dev)]  # (B, |level|)
                # greedy: the pick's own probability (deterministic given the draft). Sampling: the
                # parent's top probability, decided before the draw; gating on the sampled token's
                # probability would make the proposal q truncated to likely tokens, which rejection
                # sampling against q skews (tests/test_sampling_engine.py caught it: p = 3e-46).
                conf = qx if probs is None else q[:, par_idx].amax(-1)  # (B, |level|)
                have[:, level] &= parent_ok & (conf >= self.min_confidence)
                if not bool(have[:, level].any()):  # nothing left at this depth: stop drafting
                    break  # deeper nodes lose their parents below
            feed = [int(c) for c in level if shape.children[c]]
            if d == shape.max_depth or not feed:
                continue
            m = len(feed)
            t_before = cache.T
            seen_nodes = torch.from_numpy(anc[feed][:, fed].cpu().numpy() if fed else np.zeros((m, 0), bool)).to(dev)
            tail = torch.cat(
                [
                    pend_ok[:, None, :].expand(bsz, m, width),  # the pending tokens (root included)
                    seen_nodes[None].expand(bsz, m, len(fed)),  # fed ancestors
                    torch.eye(m, dtype=torch.bool, device=dev)[None].expand(bsz, m, m),  # itself
                ],
                dim=-1,
            )
            pos = (seq_len - 1)[:, None] + d  # (B, 1) broadcast over the level
            logits, _ = cache.forward(self.model, tokens[:, feed], pos.expand(bsz, m), tail, base)
            for j, c in enumerate(feed):
                node_logits[c] = logits[:, j]
            colmap[feed] = t_before + np.arange(m)
            fed += feed

        keep_parents_present(have, shape)
        self._state = _StepState(base, lens, colmap)
        zeros = torch.zeros(bsz, device=dev)
        union = rows = None  # host copies of the proposed slots: the engine verifies only these
        if self.min_confidence > 0:  # the sync is worth it only when confidence cuts the trees
            rows = have.cpu().numpy()  # (B, n)
            rows[:, 0] = True  # the root is always verified
            union = rows.any(axis=0)
        return Draft(tokens, have, probs, top1, entropy, zeros, zeros, host_union=union, host_present=rows)

    def commit(self, path: np.ndarray, accept_len: np.ndarray) -> None:
        """Keep the pending tokens and the fed nodes of each row's accepted path."""
        st = self._state
        if st is None:
            return
        self._state = None
        bsz = len(st.pending)
        keep = []
        for b in range(bsz):
            cols = list(range(st.base, st.base + st.pending[b]))
            for node in path[b, 1 : accept_len[b] + 1]:
                if st.colmap[node] >= 0:
                    cols.append(int(st.colmap[node]))
            keep.append(cols)
        width = max(len(c) for c in keep)
        idx = np.full((bsz, width), st.base, dtype=np.int64)
        for b, c in enumerate(keep):
            idx[b, : len(c)] = c
        counts = [len(c) for c in keep]
        self.cache.keep(
            st.base, torch.from_numpy(idx).to(self.device), torch.tensor(counts, device=self.device), width
        )
        self.cached = [c + k for c, k in zip(self.cached, counts)]
