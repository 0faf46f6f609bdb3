"""Turn a training run into a shippable draft (safetensors + JSON card) and evaluate drafts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specrl.drafttrain.data import count_tokens, load_sequences, shard_files
from specrl.drafttrain.student import CARD, WEIGHTS, ShortlistHead, build_student, load_draft, save_draft
from specrl.drafttrain.train import evaluate, iter_curve
from specrl.errors import ConfigError


def student_from_run(
    target: torch.nn.Module, run_dir: Path, shortlist: int | None = None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The run's latest student (float32) and its config.

    ``shortlist`` keeps only the top-ranked ids of the trained shortlist: the layers do not
    depend on which ids the head scores, so a cheaper head needs no retraining.
    """
    ckpt, cfg_path = run_dir / "ckpt.pt", run_dir / "config.json"
    if not ckpt.is_file() or not cfg_path.is_file():
        raise ConfigError(f"No checkpoint in {run_dir}. Fix: run `specrl draft train --run NAME` first (same --run).")
    cfg = json.loads(cfg_path.read_text())
    state = torch.load(ckpt, weights_only=False, map_location="cpu")
    ids = state["shortlist"]
    rank = state.get("shortlist_rank")
    if shortlist is not None and ids is not None and shortlist < ids.numel():
        if rank is None:
            raise ConfigError(f"Run {run_dir} has no shortlist ranking. Fix: export without --shortlist.")
        rank = rank[:shortlist]
        ids = torch.tensor(sorted(rank), dtype=torch.long)
    student = build_student(target, cfg["layers"], ids, dtype=torch.float32, rank=rank if ids is not None else None)
    student.load_state_dict(state["student"], strict=False)
    return student.eval(), {**cfg, "step": state["step"], "trained_tokens": state["tokens"]}


def evaluate_draft(pair: Any, data_dir: Path, run_dir: Path | None, draft_dir: Path | None,
                   shortlist: int | None = None) -> dict[str, Any]:
    """Held-out top-1 / top-4 agreement (teacher forcing on the target's greedy continuations)."""
    held = load_sequences(shard_files(data_dir, "heldout"))
    if not held:
        raise ConfigError(f"No held-out data in {data_dir}. Fix: run `specrl draft data` with the same --prompts first.")
    if draft_dir is not None:
        student = load_draft(draft_dir, pair.target, dtype=torch.float32, shortlist=shortlist)
    elif run_dir is not None:
        student, _ = student_from_run(pair.target, run_dir, shortlist)
    else:
        raise ConfigError("Nothing to evaluate. Fix: pass --run NAME or --draft DIR.")
    return evaluate(student, held)


def export_run(pair: Any, data_dir: Path, run_dir: Path, out_dir: Path, cpu_dtype: str = "bfloat16",
               shortlist: int | None = None) -> Path:
    """Evaluate the run on all held-out data and write draft.safetensors + card.json to ``out_dir``.

    A ``benchmark`` section already in ``out_dir/card.json`` (written by
    ``benchmarks/draft_quality.py --card``) is kept. ``cpu_dtype`` is the dtype the draft runs
    in next to a float32 CPU target when the CPU has fast bfloat16 (see ``shipped.runtime_dtype``).
    """
    student, cfg = student_from_run(pair.target, run_dir, shortlist)
    res = evaluate(student, load_sequences(shard_files(data_dir, "heldout")))
    manifest_path = data_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    shortlist = student.lm_head.ids.numel() if hasattr(student.lm_head, "ids") else 0
    arch = {
        "target": pair.target_name,
        "layers": list(cfg["layers"]),
        "hidden_size": int(pair.target.get_input_embeddings().weight.shape[1]),
        "vocab_size": int(pair.vocab_size),
        "shortlist": int(shortlist),
        "stored_dtype": "bfloat16",
        "cpu_dtype": cpu_dtype,
    }
    old: dict[str, Any] = {}
    if (out_dir / CARD).exists():
        old = json.loads((out_dir / CARD).read_text())
    curve = [{"train_tokens": r["train_tokens"], "alpha": round(r["alpha"], 4), "alpha_top4": round(r["alpha_top4"], 4)}
             for r in iter_curve(run_dir)]
    card = {
        "description": (
            f"Draft for {pair.target_name}: {len(cfg['layers'])} transformer layers initialised from target layers "
            f"{list(cfg['layers'])}, on the target's frozen embedding and output head"
            f"{f' scoring a {shortlist}-token shortlist' if shortlist else ''}; distilled on the target's own "
            "continuations with soft top-k targets. Loads with specrl.drafttrain.student.load_draft or "
            "ModelPair.load(target, draft='default-draft')."
        ),
        "recipe": {k: cfg[k] for k in cfg if k not in ("step",)},
        "data": {
            "sources": manifest.get("sources"),
            "generated_tokens_per_stage": count_tokens(data_dir),
            "held_out_fraction": manifest.get("held_out"),
            "split_seed": manifest.get("split_seed"),
            "max_new_tokens": manifest.get("max_new_tokens"),
            "topk": manifest.get("topk"),
            "generation_dtype": manifest.get("dtype"),
        },
        "heldout": {"alpha": round(res["alpha"], 4), "alpha_top4": round(res["alpha_top4"], 4), "tokens": res["tokens"],
                    "per_category": {k: {kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()}
                                     for k, v in res["per_category"].items()}},
        "learning_curve": curve,
    }
    if "benchmark" in old:
        card["benchmark"] = old["benchmark"]
    save_draft(student, out_dir, arch, card)
    size = (out_dir / WEIGHTS).stat().st_size
    if size > 20 * 2**20:
        print(f"warning: {out_dir / WEIGHTS} is {size / 2**20:.1f} MiB (> 20 MiB budget for the shipped draft)")
    return out_dir


def export_draft(target: torch.nn.Module, src: Path, out_dir: Path, shortlist: int | None = None) -> Path:
    """Re-export an exported draft, optionally keeping only its top-``shortlist`` head ids.

    Why: a cheaper head is a prefix of the stored ranking and needs neither the run nor its data
    (a draft trained on a GPU comes back as its export alone). The card is kept, with
    ``arch.shortlist`` updated and a note; its held-out alpha was measured with the source head,
    so rerun ``benchmarks/draft_quality.py --card`` for the cut one.
    """
    src, out_dir = Path(src), Path(out_dir)
    if src.resolve() == out_dir.resolve():
        raise ConfigError(f"--out {out_dir} is the source draft. Fix: export to a new directory.")
    card = json.loads((src / CARD).read_text()) if (src / CARD).is_file() else {}
    student = load_draft(src, target, dtype=torch.float32, shortlist=shortlist)
    head = student.lm_head
    arch = dict(card.pop("arch", {}))
    if isinstance(head, ShortlistHead):
        n = head.ids.numel()
        if int(arch.get("shortlist", n)) != n:
            card.setdefault("notes", []).append(
                f"shortlist cut from {arch.get('shortlist')} to {n} ids (top of the stored ranking); "
                "heldout alpha above is the uncut head's.")
        arch["shortlist"] = n
    save_draft(student, out_dir, arch, card)
    return out_dir
