"""Prompt sources: the built-in set, Spec-Bench / MT-Bench style jsonl, and plain text files.

Formats (detected per file):

* ``.jsonl`` with ``turns`` (Spec-Bench, MT-Bench): the first user turn is the prompt, and
  ``category`` / ``question_id`` are kept. Rows with ``prompt`` or ``text`` keys also work.
* anything else: one prompt per non-empty line.

``builtin`` names the project's own 96-prompt set (``specrl/data/prompts.jsonl``; 8 task
categories, 12 prompts each) that ships with the package.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specrl.errors import ConfigError, did_you_mean

BUILTIN = "builtin"


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str = "default"
    qid: str = ""


def builtin_path() -> Path:
    return Path(str(resources.files("specrl") / "data" / "prompts.jsonl"))


def _parse_jsonl(path: Path) -> list[Prompt]:
    out = []
    for ln, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{ln} is not valid JSON ({e.msg}). Fix: one JSON object per line.") from e
        if "turns" in row and row["turns"]:
            text = row["turns"][0]
        elif "prompt" in row or "text" in row:
            text = row.get("prompt", row.get("text"))
        else:
            raise ConfigError(
                f"{path}:{ln} has none of the keys 'turns', 'prompt', 'text' (keys: {sorted(row)}). "
                "Fix: use Spec-Bench style rows {\"turns\": [\"...\"], \"category\": \"...\"}."
            )
        out.append(Prompt(str(text), str(row.get("category", "default")), str(row.get("question_id", ln))))
    return out


def load_prompts(
    source: str | Path = BUILTIN, categories: Sequence[str] | None = None, limit: int | None = None
) -> list[Prompt]:
    """Load prompts from ``builtin`` or a file, optionally filtered by category."""
    path = builtin_path() if str(source) == BUILTIN else Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"Prompt file {str(source)!r} does not exist. Fix: pass an existing .jsonl (Spec-Bench style) or "
            f"text file (one prompt per line), or {BUILTIN!r} for the built-in set."
        )
    if path.suffix == ".jsonl":
        prompts = _parse_jsonl(path)
    else:
        prompts = [Prompt(line.strip(), "default", str(i)) for i, line in enumerate(path.read_text().splitlines(), 1)
                   if line.strip()]
    if not prompts:
        raise ConfigError(f"Prompt file {str(path)!r} holds no prompts. Fix: add at least one non-empty line.")
    if categories:
        have = sorted({p.category for p in prompts})
        for c in categories:
            if c not in have:
                raise ConfigError(
                    f"Category {c!r} is not in {path.name}.{did_you_mean(c, have)} Available: {', '.join(have)}."
                )
        prompts = [p for p in prompts if p.category in set(categories)]
    if limit is not None:
        prompts = prompts[:limit]
    return prompts


def split_prompts(prompts: Sequence[Prompt], held_out: float = 0.25, seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """Deterministic train / held-out split, stratified by category (balanced categories)."""
    import random

    rng = random.Random(seed)
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    train, test = [], []
    for cat in sorted(by_cat):
        items = list(by_cat[cat])
        rng.shuffle(items)
        n_test = max(1, round(len(items) * held_out)) if len(items) > 1 else 0
        test += items[:n_test]
        train += items[n_test:]
    return train, test
