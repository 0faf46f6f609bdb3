"""Attention for verify passes: grouped-query attention without copying the KV cache.

transformers' SDPA integration handles a grouped-query model (SmolLM2: 9 query heads share 3
KV heads) with an explicit mask and more than one query token by *repeating* K and V per
query head (``repeat_kv``): at batch 16 and 768 cached tokens that copy made a 2-token verify
pass 5x slower than a 1-token step (845 vs 164 ms). The engine's ragged cache always passes a
mask (rows have holes and different lengths), even for one query token, so specrl registers
``specrl_sdpa``: on CPU it asks PyTorch's SDPA to broadcast the KV heads itself
(``enable_gqa=True``, no copy; a plain k = 0 step at batch 1 went from ~58 to ~47 ms);
elsewhere (CUDA kernels prefer unmasked GQA) it defers to transformers' own SDPA function.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "specrl_sdpa"
_registered = False


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pack = kwargs.pop("specrl_pack", None)
    if pack is not None:
        rows, nodes, bsz, n, runs = pack
        if runs is None:
            # a ragged verify pass (RaggedKVCache.forward(pack=...)): the N packed query tokens go
            # back to their rows' (B, n) tree layout for one attention call against the per-row cache
            q = query.new_zeros(bsz, query.shape[1], n, query.shape[3])  # (B, H, n, D)
            q[rows, :, nodes] = query[0].transpose(0, 1)  # (N, H, D)
            out, _ = _attention(module, q, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
            return out[rows, nodes][None], None  # (B, n, H, D) -> (1, N, H, D)
        return _attention_runs(module, query, key, value, attention_mask, scaling, runs), None

    groups = getattr(module, "num_key_value_groups", 1)
    if query.device.type == "cpu" and groups > 1 and attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]  # boolean or additive, as transformers
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                             scale=scaling, enable_gqa=True)  # (B, H, n, D)
        return out.transpose(1, 2).contiguous(), None  # (B, n, H, D) as transformers expects
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _attention_runs(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor, scaling: float | None, runs: list) -> torch.Tensor:
    """Attention of a packed pass, one call per run of consecutive rows that asked for the same
    nodes: each query attends only to its own row's cache, with no padded queries.

    Why: padding every row's queries to the union tree (the one-call path) makes attention cost
    B x n query rows against the whole context; with one (8, 4) tree (33 nodes) among k = 1 rows
    at batch 8 that padding cost more than the linear layers saved (measured by
    ``benchmarks/ragged_verify.py``). The packed tokens of a row are contiguous (row-major), so a
    run's queries are a slice. ``runs``: (first row, end row, packed offset, nodes per row, node
    ids (c,)) per run."""
    heads, dim = query.shape[1], query.shape[3]
    kv_len = key.shape[-2]
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    out = query.new_empty(1, query.shape[2], heads, dim)  # (1, N, H, D)
    for b0, b1, off, c, node_ids in runs:
        nb = b1 - b0
        q = query[0, :, off : off + nb * c].reshape(heads, nb, c, dim).transpose(0, 1)  # (nb, H, c, D)
        mask = attention_mask[b0:b1, :, node_ids, :kv_len]  # (nb, 1, c, T + n)
        o = F.scaled_dot_product_attention(q, key[b0:b1], value[b0:b1], attn_mask=mask, dropout_p=0.0,
                                           scale=scaling, **({"enable_gqa": True} if gqa else {}))  # (nb, H, c, D)
        out[0, off : off + nb * c] = o.permute(0, 2, 1, 3).reshape(nb * c, heads, dim)
    return out


def use_specrl_attention(model: torch.nn.Module) -> None:
    """Switch a transformers model from ``sdpa`` to ``specrl_sdpa`` (no-op for other kernels)."""
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not _registered:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
