"""Feature-level drafting: a head on the target's own last hidden state proposes the tree.

Why: the target's post-norm last hidden state f already encodes its plan for the next tokens;
a small head that maps (f_{i-1}, token i) to f-hat_i and scores it with the target's output
rows predicts the target better than a separate small LM trained on the same data, at a
fraction of its cost (``specrl.drafttrain.feature``, ``benchmarks/draft_feature_heads.py``).

How it drafts. The engine hands the drafter, for every row, the target's feature at the
position before the row's last committed token (from the prefill, then from each verify pass
at the row's last accepted node; ``uses_target_features``). The root (the last committed
token) gets f-hat = head(f, root); each drafted node c gets f-hat_c = head(f-hat_parent, token_c)
and its children are the top (greedy) or sampled tokens of f-hat_c's scores. The ``mlp`` head is
position-wise, so the drafter keeps no KV cache: one (B, H) feature per row is its whole state.

Lossless like every drafter: verification decides. A row whose prompt is a single token has
no feature yet; it drafts from a zero feature on its first step (poor drafts, same tokens).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from specrl.drafters.base import Draft, first_token_stats, keep_parents_present, level_plan, root_tokens
from specrl.drafttrain.feature import FeatureHead
from specrl.errors import ConfigError
from specrl.sampling import SamplingParams, gumbel_topk, probs_from_logits
from specrl.tree import TreeShape


class FeatureDrafter:
    """Drafts with a position-wise ``FeatureHead`` on the target's last hidden state."""

    name: ClassVar[str] = "feature"
    uses_target_features: ClassVar[bool] = True  # the engine passes observe_features() the target's features

    def __init__(self, head: FeatureHead) -> None:
        if head.mlp is None:
            raise ConfigError(
                f"The feature drafter runs position-wise heads only (kind 'mlp'); got kind {head.kind!r}, which "
                "attends over its own history and would need a KV cache of its own. Fix: train an 'mlp' head "
                "(`specrl draft head --kind mlp`).")
        self.head = head
        self.device = head.sub_w.device
        self.vocab = int(head.embed.num_embeddings)
        self.f = head.sub_w.new_zeros(0, head.sub_w.shape[1])  # (B, H) target feature before each row's root

    def join(self, seqs: list[np.ndarray]) -> None:
        # zero until observe_features() delivers the prefill's feature (a 1-token prompt has none)
        self.f = torch.cat([self.f, self.f.new_zeros(len(seqs), self.f.shape[1])])

    def observe_features(self, hidden: torch.Tensor, start: int) -> None:
        """Rows ``start .. start + len(hidden)`` get the target features ``hidden`` (b, H)."""
        self.f[start : start + hidden.shape[0]] = hidden.to(self.f.dtype)

    def select_rows(self, index: list[int]) -> None:
        self.f = self.f[torch.as_tensor(index, dtype=torch.long, device=self.device)]

    def commit(self, path: np.ndarray, accept_len: np.ndarray) -> None:
        """Nothing to keep: the next feature comes from the target's verify pass."""

    @torch.no_grad()
    def propose(
        self,
        seqs: list[np.ndarray],
        shape: TreeShape,
        present: np.ndarray,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        head, dev = self.head, self.device
        bsz, n = len(seqs), len(shape.paths)
        tokens = root_tokens(seqs, n, dev)  # (B, n)
        root = head(self.f[:, None], tokens[:, :1])[:, 0]  # (B, H) f-hat at the root
        feat = {0: root}  # node -> (B, H) its predicted feature
        short = {0: head.short(root)}  # node -> (B, S) scores of its children over the shortlist
        top1, entropy = first_token_stats(short[0])

        have = torch.from_numpy(present).to(dev).clone()  # (B, n)
        probs = None if params.greedy else torch.zeros(bsz, n, self.vocab, device=dev)
        for d in range(1, shape.max_depth + 1):
            level, parents, r_max, par_idx, rank = level_plan(shape, d, dev)
            par = torch.stack([short[p] for p in parents], dim=1)  # (B, m, S)
            if probs is None:
                picks = head.ids[par.topk(r_max, dim=-1).indices]  # (B, m, R) vocabulary ids
                tokens[:, level] = picks[:, par_idx, rank]
            else:
                full = par.new_full((bsz, len(parents), self.vocab), float("-inf"))  # (B, m, V)
                full[..., head.ids] = par  # q is zero outside the shortlist: still a distribution
                q = probs_from_logits(full, params)  # (B, m, V)
                probs[:, parents] = q
                picks = gumbel_topk(q, r_max, generator)  # (B, m, R), drawn without replacement
                tokens[:, level] = picks[:, par_idx, rank]
                qx = q[:, par_idx].gather(-1, tokens[:, level, None])[..., 0]  # (B, |level|)
                have[:, level] &= qx > 0  # a zero-probability pick is no proposal
            feed = [int(c) for c in level if shape.children[c]]
            if not feed:
                continue
            f_par = torch.stack([feat[int(shape.parent[c])] for c in feed], dim=1)  # (B, m, H)
            f_new = head(f_par, tokens[:, feed])  # (B, m, H)
            s_new = head.short(f_new)  # (B, m, S)
            for j, c in enumerate(feed):
                feat[c], short[c] = f_new[:, j], s_new[:, j]
        keep_parents_present(have, shape)
        zeros = torch.zeros(bsz, device=dev)
        return Draft(tokens, have, probs, top1, entropy, zeros, zeros)
