"""Drafts that ship inside the package (``ModelPair.load(target, draft="default-draft")``).

A shipped draft stores only the layers it owns (``specrl/data/drafts/<name>/``); at load time
it borrows the target's embedding and output head, so it costs a few MB in the wheel and
loads offline in well under a second.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from specrl.errors import ModelLoadError

# target display name -> directory under specrl/data/drafts
SHIPPED: dict[str, str] = {"SmolLM2-135M-Instruct": "smollm2-135m"}
# target display name -> directory of its feature head (the `feature` drafter's default)
SHIPPED_HEADS: dict[str, str] = {"SmolLM2-135M-Instruct": "smollm2-135m-feature"}


def shipped_dir(target_name: str) -> Path:
    """The packaged draft directory for ``target_name`` (raises if none ships)."""
    if target_name not in SHIPPED:
        raise ModelLoadError(
            f"No shipped draft for target {target_name!r} (shipped: {sorted(SHIPPED)}). "
            "Fix: use the default target, pass --draft DIR (e.g. one written by `specrl draft export`), "
            "or train one with `specrl draft train`."
        )
    return _packaged(SHIPPED[target_name])


def _packaged(name: str) -> Path:
    """``specrl/data/drafts/<name>`` inside the installed package."""
    return Path(str(resources.files("specrl") / "data" / "drafts" / name))


def shipped_head_dir(target_name: str) -> Path:
    """The packaged feature-head directory for ``target_name`` (raises if none ships)."""
    d = SHIPPED_HEADS.get(target_name)
    path = None if d is None else _packaged(d)
    if path is None or not path.is_dir():
        raise ModelLoadError(
            f"No shipped feature head for target {target_name!r} (shipped: {sorted(SHIPPED_HEADS)}). "
            "Fix: pass head=DIR to the feature drafter (a directory written by `specrl draft head`), "
            "or use the default target.")
    return path


def runtime_dtype(target: torch.nn.Module, card: dict) -> torch.dtype:
    """The dtype to run the draft in: the card's CPU choice if the CPU has fast bfloat16, else the target's.

    Why not always the target's: on CPUs with AVX512-BF16 a bfloat16 draft reads half the bytes
    per step and drafting is memory-bound; the draft's precision never affects exactness.
    """
    dt = next(target.parameters()).dtype
    want = card.get("arch", {}).get("cpu_dtype")
    on_cpu = next(target.parameters()).device.type == "cpu"
    if want == "bfloat16" and on_cpu and dt == torch.float32 and _cpu_has_bf16():
        return torch.bfloat16
    return dt


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_shipped_draft(target_model: torch.nn.Module, target_name: str) -> torch.nn.Module:
    """The packaged draft for ``target_name`` as a ``LlamaForCausalLM`` on the target's device."""
    from specrl.drafttrain.student import CARD, load_draft

    d = shipped_dir(target_name)
    if not (d / CARD).is_file():
        raise ModelLoadError(f"The shipped draft directory {d} is incomplete (no {CARD}). Fix: reinstall specrl.")
    card = json.loads((d / CARD).read_text())
    return load_draft(d, target_model, dtype=runtime_dtype(target_model, card))
