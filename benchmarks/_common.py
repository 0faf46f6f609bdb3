"""Shared helpers for the benchmark scripts (not part of the package API)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specrl.prompts import Prompt, load_prompts  # noqa: E402


def machine() -> str:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU x{torch.get_num_threads()} threads"
    return f"{platform.machine()} {dev}, torch {torch.__version__}"


def mixed_prompts(n: int, offset: int = 0, source: str = "builtin") -> list[Prompt]:
    """n prompts cycling through the categories (offset selects a disjoint slice)."""
    prompts = load_prompts(source)
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    cats = sorted(by_cat)
    out = []
    i = offset
    while len(out) < n:
        cat = cats[i % len(cats)]
        items = by_cat[cat]
        out.append(items[(i // len(cats)) % len(items)])
        i += 1
    return out


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A markdown table."""
    def fmt(x: object) -> str:
        return f"{x:.2f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def final_line(obj: dict) -> None:
    print(json.dumps(obj), flush=True)
