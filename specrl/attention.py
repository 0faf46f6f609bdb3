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
        # a ragged verify pass (RaggedKVCache.forward(pack=...)): the N packed query tokens go
        # back to their rows' (B, n) tree layout for attention against the per-row cache
        rows, nodes, bsz, n = pack
        q = query.new_zeros(bsz, query.shape[1], n, query.shape[3])  # (B, H, n, D)
        q[rows, :, nodes] = query[0].transpose(0, 1)  # (N, H, D)
        out, _ = _attention(module, q, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
        return out[rows, nodes][None], None  # (B, n, H, D) -> (1, N, H, D)
    groups = getattr(module, "num_key_value_groups", 1)
    if query.device.type == "cpu" and groups > 1 and attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]  # boolean or additive, as transformers
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                             scale=scaling, enable_gqa=True)  # (B, H, n, D)
        return out.transpose(1, 2).contiguous(), None  # (B, n, H, D) as transformers expects
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


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
