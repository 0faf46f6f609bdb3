"""The student (draft) model: a few target layers on the target's own frozen embedding and head.

Why this shape: the embedding and output head are most of a small LM's parameters (SmolLM2-135M:
28M of 135M) and already map tokens to the target's representation space, so the draft borrows
them and owns only a few transformer layers (plus the final norm), initialised from target
layers so distillation starts from features the head understands.

Why a shortlist head: on a CPU a draft step is memory-bound, and the full 49,152 x 576 head
is most of the bytes a 2-layer draft reads per token. The draft only needs to rank the tokens
the target actually writes, so it scores a frequency shortlist (e.g. 8k ids) and gives every
other id the lowest logit. The model stays a ``LlamaForCausalLM`` with full-vocabulary logits,
so the engine's ``ModelDrafter`` and ``generate(assistant_model=...)`` use it unchanged (a
draft that never proposes a token is still lossless: verification decides).

On disk a draft is ``draft.safetensors`` (its own layers, norm and shortlist ids, bfloat16) and
``card.json`` (``arch`` describes how to rebuild it; the rest documents the recipe).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specrl.errors import ConfigError, ModelLoadError

WEIGHTS = "draft.safetensors"
CARD = "card.json"


class ShortlistHead(nn.Module):
    """Output head scoring only ``ids``; every other vocabulary entry gets the dtype's minimum.

    ``weight`` is the target's full (V, H) head (shared, frozen; kept so that code asking for
    ``get_output_embeddings().weight`` sees the real vocabulary size); ``sub_weight`` (S, H) is
    a contiguous copy of its ``ids`` rows, the only bytes read per forward.
    """

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, rank: Sequence[int] | None = None) -> None:
        super().__init__()
        vocab = weight.shape[0]
        if ids.numel() == 0 or int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise ConfigError(f"Shortlist ids must lie in [0, {vocab}) and be non-empty; got {ids.numel()} ids.")
        if rank is not None and sorted(int(i) for i in rank) != ids.tolist():
            raise ConfigError("shortlist rank must be a permutation of the head's shortlist ids.")
        # the ids most-useful first (or None): saved with the draft so a cheaper head can be cut later
        self.rank: list[int] | None = None if rank is None else [int(i) for i in rank]
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.register_buffer("ids", ids.long().clone(), persistent=False)  # (S,)
        self.register_buffer("sub_weight", weight.detach()[ids].clone(), persistent=False)  # (S, H)

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def short_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., S) logits over the shortlist only (what training uses)."""
        return hidden @ self.sub_weight.to(hidden.dtype).T

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V) logits, lowest value outside the shortlist."""
        short = self.short_logits(hidden)  # (..., S)
        full = short.new_full((*short.shape[:-1], self.vocab_size), torch.finfo(short.dtype).min)
        full[..., self.ids] = short
        return full


def shortlist_from_counts(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent ids (plus ``always``, e.g. EOS), sorted ascending. counts: (V,)."""
    if not 0 < size:
        raise ConfigError(f"shortlist size {size} is invalid. Allowed: > 0 (0 means the full head elsewhere).")
    size = min(size, counts.numel())
    top = set(counts.float().topk(size).indices.tolist())
    extra = [int(a) for a in always if int(a) not in top]
    chosen = sorted(top)
    # drop the rarest chosen ids to make room for the forced ones, keeping the size exact
    if extra:
        rare = sorted(chosen, key=lambda i: float(counts[i]))[: len(extra)]
        chosen = sorted((set(chosen) - set(rare)) | set(extra))
    return torch.tensor(chosen, dtype=torch.long)


def _retarget_layer(layer: nn.Module, idx: int) -> nn.Module:
    """A copied decoder layer must write its KV cache slot under its new index."""
    attn = getattr(layer, "self_attn", None)
    if attn is not None and hasattr(attn, "layer_idx"):
        attn.layer_idx = idx
    return layer


def build_student(
    target: nn.Module, layers: Sequence[int], shortlist: torch.Tensor | None = None,
    dtype: torch.dtype | None = None, rank: Sequence[int] | None = None,
) -> nn.Module:
    """A ``LlamaForCausalLM`` with copies of target ``layers`` on the target's embedding and head.

    The embedding (and the head, shared or shortlisted) are the target's tensors, frozen; only
    the copied layers and the final norm are trainable. ``dtype`` converts the draft's own
    weights (default: the target's); the shared tensors are converted only if they differ.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    n_target = len(target.model.layers)
    bad = [i for i in layers if not 0 <= i < n_target]
    if not layers or bad:
        raise ConfigError(
            f"Student layers {list(layers)} are invalid for a target with {n_target} layers (bad: {bad}). "
            f"Fix: pass indices in [0, {n_target}), e.g. --layers 0,1."
        )
    tcfg = target.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "architectures", "layer_types", "transformers_version"):
        tcfg.pop(key, None)
    tcfg.update(num_hidden_layers=len(layers), tie_word_embeddings=False)
    cfg = LlamaConfig(**tcfg)
    cfg._attn_implementation = target.config._attn_implementation or "sdpa"
    dt = dtype or next(target.parameters()).dtype
    with torch.device("meta"):
        student = LlamaForCausalLM(cfg)  # no memory for the throwaway embedding / head
    embed = target.get_input_embeddings()
    head = target.get_output_embeddings()
    if embed.weight.dtype != dt:
        embed = nn.Embedding.from_pretrained(embed.weight.detach().to(dt), freeze=True)
    student.model.embed_tokens = embed
    student.model.layers = nn.ModuleList(
        _retarget_layer(copy.deepcopy(target.model.layers[i]).to(dt), j) for j, i in enumerate(layers)
    )
    student.model.norm = copy.deepcopy(target.model.norm).to(dt)
    student.model.rotary_emb = copy.deepcopy(target.model.rotary_emb)
    hw = head.weight if head.weight.dtype == dt else head.weight.detach().to(dt)
    if shortlist is None:
        lm = nn.Linear(hw.shape[1], hw.shape[0], bias=False, device=hw.device, dtype=dt)
        lm.weight = hw if isinstance(hw, nn.Parameter) else nn.Parameter(hw, requires_grad=False)
        student.lm_head = lm
    else:
        student.lm_head = ShortlistHead(hw, shortlist.to(hw.device), rank)
    student.model.embed_tokens.weight.requires_grad_(False)
    student.lm_head.weight.requires_grad_(False)
    student.generation_config = copy.deepcopy(target.generation_config)
    return student.eval()


def own_state(student: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the draft owns (layers + final norm): what training updates and export saves."""
    return {k: v for k, v in student.state_dict().items() if k.startswith(("model.layers.", "model.norm."))}


def save_draft(student: nn.Module, out_dir: Path, arch: dict[str, Any], card: dict[str, Any]) -> Path:
    """Write ``draft.safetensors`` (own tensors in bfloat16 + shortlist) and ``card.json``.

    A shortlist head's ranking (ids most-useful first) is stored as ``shortlist_rank`` so that a
    cheaper head (a prefix of it) can be cut later without the training run (``load_draft(shortlist=N)``).
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in own_state(student).items()}
    head = student.lm_head
    if isinstance(head, ShortlistHead):
        tensors["shortlist"] = head.ids.to(torch.int32).contiguous()
        if head.rank is not None:
            tensors["shortlist_rank"] = torch.tensor(head.rank, dtype=torch.int32)
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"arch": json.dumps(arch)})
    (out_dir / WEIGHTS).chmod(0o644)  # package data must be world-readable once installed
    (out_dir / CARD).write_text(json.dumps({"arch": arch, **card}, indent=1) + "\n")
    return out_dir


def load_draft(draft_dir: Path, target: nn.Module, dtype: torch.dtype | None = None,
               shortlist: int | None = None) -> nn.Module:
    """Rebuild a saved draft on ``target``'s embedding and head (offline, < 1 s).

    ``shortlist`` keeps only the top-N ids of a stored ``shortlist_rank`` (a cheaper head; the
    layers do not depend on which ids the head scores).
    """
    from safetensors import safe_open

    path = Path(draft_dir) / WEIGHTS
    if not path.is_file():
        raise ModelLoadError(
            f"No draft weights at {path}. Fix: pass a directory written by `specrl draft export` "
            "(it holds draft.safetensors and card.json)."
        )
    with safe_open(str(path), framework="pt") as f:
        arch = json.loads((f.metadata() or {}).get("arch", "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    if "layers" not in arch:
        raise ModelLoadError(f"{path} has no 'arch' metadata. Fix: re-export the draft with `specrl draft export`.")
    hidden = target.get_input_embeddings().weight.shape[1]
    if int(arch.get("hidden_size", hidden)) != hidden or int(arch.get("vocab_size", 0)) not in (
        0, target.get_output_embeddings().weight.shape[0]
    ):
        raise ModelLoadError(
            f"Draft {draft_dir} was trained for hidden size {arch.get('hidden_size')} / vocabulary "
            f"{arch.get('vocab_size')}, but the target has {hidden} / "
            f"{target.get_output_embeddings().weight.shape[0]}. Fix: load it with the target it was trained for "
            f"({arch.get('target', 'see card.json')})."
        )
    ids = tensors.pop("shortlist", None)
    stored_rank = tensors.pop("shortlist_rank", None)
    rank = None if stored_rank is None else stored_rank.tolist()
    if shortlist is not None and ids is not None and shortlist < ids.numel():
        if rank is None or not 0 < shortlist:
            raise ConfigError(
                f"Cannot cut draft {draft_dir} to a {shortlist}-id shortlist: "
                f"{'it stores no shortlist ranking' if rank is None else 'the size must be > 0'}. "
                f"Fix: load it whole (shortlist=None), or re-export it with a current `specrl draft export`."
            )
        rank = rank[:shortlist]
        ids = torch.tensor(sorted(rank), dtype=torch.long)
    dt = dtype or next(target.parameters()).dtype
    device = next(target.parameters()).device
    student = build_student(target, arch["layers"], None if ids is None else ids.long(), dtype=dt, rank=rank)
    missing = set(own_state(student)) - set(tensors)
    if missing:
        raise ModelLoadError(f"Draft {draft_dir} lacks tensors {sorted(missing)[:4]}. Fix: re-export it.")
    student.load_state_dict({k: v.to(dt) for k, v in tensors.items()}, strict=False)
    return student.to(device).eval()
