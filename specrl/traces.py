"""Decode traces: what the replay backend needs to reproduce the live engine without models.

For every prompt a trace holds the target's own continuation and, when a draft model is used,
at every continuation position the draft rank of the target's token given the correct prefix
(capped at ``RANK_CAP``; ``RANK_CAP`` itself means "not in the top ranks"), the draft's top-1
probability and its entropy. Recording costs one target generation plus one teacher-forced
draft pass per prompt.

Why this is enough (greedy): a rank-path tree accepts exactly the deepest node whose rank path
equals the target path's ranks, and the n-gram drafter is a deterministic function of the
sequence, so replay reruns it on the recorded tokens. Sampling is approximated (see
``specrl.envs.replay``).

Files: ``<name>.safetensors`` (flat arrays + offsets) and ``<name>.json`` (metadata with the
models, tokenizer fingerprint, drafter, temperature, versions and the sha256 of the tensors).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specrl.errors import TraceError

TRACE_FORMAT = 1
RANK_CAP = 32


def text_key(text: str) -> str:
    """Identity of a prompt text: replay finds a prompt's trace without a tokenizer."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


@dataclass
class Traces:
    """Recorded sequences (prompt + target continuation) and per-position draft statistics."""

    prompt_ids: list[np.ndarray]  # per prompt (P_i,) int64
    continuations: list[np.ndarray]  # per prompt (C_i,) int64, the target's tokens
    ended_eos: np.ndarray  # (N,) bool: the continuation ended with EOS (else it hit max_new_tokens)
    categories: list[str]
    ranks: list[np.ndarray] | None = None  # per prompt (C_i,) uint8 draft rank of each target token
    top1: list[np.ndarray] | None = None  # per prompt (C_i,) float32 draft top-1 prob. before token i
    entropy: list[np.ndarray] | None = None  # per prompt (C_i,) float32
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def index(self) -> dict[str, int]:
        """text key -> trace row."""
        return {k: i for i, k in enumerate(self.meta.get("text_keys", []))}

    # ----- persistence --------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.numpy import save_file

        path = Path(path).with_suffix("")
        path.parent.mkdir(parents=True, exist_ok=True)
        seqs = [np.concatenate([p, c]) for p, c in zip(self.prompt_ids, self.continuations)]
        tensors = {
            "tokens": np.concatenate(seqs).astype(np.int32),
            "prompt_lens": np.array([len(p) for p in self.prompt_ids], np.int32),
            "cont_lens": np.array([len(c) for c in self.continuations], np.int32),
            "ended_eos": self.ended_eos.astype(np.uint8),
        }
        if self.ranks is not None:
            tensors["ranks"] = np.concatenate(self.ranks).astype(np.uint8)
            tensors["top1"] = np.concatenate(self.top1).astype(np.float32)  # type: ignore[arg-type]
            tensors["entropy"] = np.concatenate(self.entropy).astype(np.float32)  # type: ignore[arg-type]
        st = path.with_suffix(".safetensors")
        save_file(tensors, str(st))
        meta = {**self.meta, "format": TRACE_FORMAT, "categories": self.categories, "count": len(self),
                "sha256": hashlib.sha256(st.read_bytes()).hexdigest()}
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1))
        return st

    @staticmethod
    def load(path: str | Path, expect: dict[str, Any] | None = None) -> Traces:
        """Load and check a trace; ``expect`` keys (target, tokenizer, drafter, ...) must match."""
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        base = Path(path).with_suffix("")
        st, js = base.with_suffix(".safetensors"), base.with_suffix(".json")
        if not st.is_file() or not js.is_file():
            raise TraceError(f"Trace {str(base)!r} is missing ({st.name} and {js.name} are both needed). "
                             "Fix: record it with `specrl collect --env <preset>`.")
        try:
            meta = json.loads(js.read_text())
        except json.JSONDecodeError as e:
            raise TraceError(f"Trace metadata {str(js)!r} is not valid JSON ({e.msg}). Fix: re-run `specrl collect`.") from e
        if meta.get("format") != TRACE_FORMAT:
            raise TraceError(f"Trace {str(base)!r} has format {meta.get('format')!r}, expected {TRACE_FORMAT}. "
                             "Fix: re-run `specrl collect`.")
        digest = hashlib.sha256(st.read_bytes()).hexdigest()
        if digest != meta.get("sha256"):
            raise TraceError(f"Trace {str(st)!r} does not match its metadata checksum (truncated or modified). "
                             "Fix: re-run `specrl collect`.")
        for key, want in (expect or {}).items():
            if want is not None and meta.get(key) != want:
                raise TraceError(
                    f"Trace {str(base)!r} was recorded with {key}={meta.get(key)!r}, but {want!r} is needed. "
                    "Fix: record a trace for these models with `specrl collect --env <preset>`."
                )
        try:
            t = load_file(str(st))
        except (SafetensorError, OSError, ValueError) as e:
            raise TraceError(f"Trace {str(st)!r} cannot be read ({e}). Fix: re-run `specrl collect`.") from e
        plen, clen = t["prompt_lens"].astype(np.int64), t["cont_lens"].astype(np.int64)
        if plen.sum() + clen.sum() != len(t["tokens"]) or len(plen) != meta.get("count"):
            raise TraceError(f"Trace {str(st)!r} is inconsistent (lengths do not add up). Fix: re-run `specrl collect`.")
        starts = np.concatenate([[0], np.cumsum(plen + clen)[:-1]])
        prompts = [t["tokens"][s : s + p].astype(np.int64) for s, p in zip(starts, plen)]
        conts = [t["tokens"][s + p : s + p + c].astype(np.int64) for s, p, c in zip(starts, plen, clen)]
        cstarts = np.concatenate([[0], np.cumsum(clen)[:-1]])

        def split(name: str) -> list[np.ndarray] | None:
            if name not in t:
                return None
            return [t[name][s : s + c] for s, c in zip(cstarts, clen)]

        return Traces(prompts, conts, t["ended_eos"].astype(bool), list(meta["categories"]), split("ranks"),
                      split("top1"), split("entropy"), meta)


def collect_traces(
    pair: Any, prompts: list[Any], drafter: str, max_new_tokens: int = 256, batch_size: int = 8,
    temperature: float = 0.0, seed: int = 0, progress: bool = True, out: str | Path | None = None,
) -> Traces:
    """Record traces for ``prompts`` (``specrl.prompts.Prompt``): target continuations with the
    engine (greedy unless ``temperature`` > 0), then one teacher-forced draft pass."""
    import torch
    from tqdm import tqdm

    from specrl.engine import Action, SpecEngine
    from specrl.models import tokenizer_fingerprint
    from specrl.sampling import SamplingParams

    ids = [np.asarray(pair.encode_prompt(p.text), dtype=np.int64) for p in prompts]
    keys = [text_key(p.text) for p in prompts]
    eng = SpecEngine(pair, drafter="ngram", sampling=SamplingParams(temperature), seed=seed)
    conts: list[np.ndarray | None] = [None] * len(ids)
    eos = np.zeros(len(ids), dtype=bool)
    # resumable: finished continuations are appended to a side file as they complete
    partial = Path(str(Path(out).with_suffix("")) + ".partial.jsonl") if out is not None else None
    done_before: dict[str, tuple[list[int], bool]] = {}
    if partial is not None and partial.is_file():
        for line in partial.read_text().splitlines():
            try:
                row = json.loads(line)
                done_before[row["key"]] = (row["tokens"], row["eos"])
            except (json.JSONDecodeError, KeyError):
                continue  # a line cut short by an interruption
    for i, k in enumerate(keys):
        if k in done_before:
            conts[i] = np.asarray(done_before[k][0], dtype=np.int64)
            eos[i] = done_before[k][1]
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
    sink = partial.open("a") if partial is not None else None
    with tqdm(total=len(ids), desc="target continuations", disable=not progress, unit="prompt",
              initial=sum(c is not None for c in conts)) as bar:
        # greedy continuations are identical for any action: speculate to record faster
        action = Action(4, 1) if temperature == 0 else Action(0, 1)
        todo = [i for i in range(len(ids)) if conts[i] is None]
        rid_to_i: dict[int, int] = {}
        while todo or eng.has_work():
            while todo and len(eng.rows) + len(eng.waiting) < batch_size:
                i = todo.pop(0)
                rid_to_i[eng.add_request(ids[i], max_new_tokens)] = i
            eng.step(action)
            for r in eng.pop_finished():
                i = rid_to_i[r.rid]
                conts[i] = r.output.copy()
                eos[i] = r.finish_reason == "eos"
                if sink is not None:
                    sink.write(json.dumps({"key": keys[i], "tokens": conts[i].tolist(), "eos": bool(eos[i])}) + "\n")
                    sink.flush()
                bar.update(1)
    if sink is not None:
        sink.close()
    ranks = top1 = ent = None
    if drafter == "model":
        if pair.draft is None:
            raise TraceError("drafter='model' traces need a draft model. Fix: load the pair with a draft.")
        ranks, top1, ent = [], [], []
        with torch.inference_mode():
            for p, c in tqdm(list(zip(ids, conts)), desc="draft ranks", disable=not progress, unit="prompt"):
                seq = torch.as_tensor(np.concatenate([p, c]), device=pair.device)[None]
                logits = pair.draft(seq).logits[0, len(p) - 1 : len(p) - 1 + len(c)].float()  # (C, V)
                true = torch.as_tensor(c, device=pair.device)
                mine = logits.gather(1, true[:, None])
                rank = (logits > mine).sum(1).clamp_max(RANK_CAP)
                probs = torch.softmax(logits, -1)
                ranks.append(rank.cpu().numpy().astype(np.uint8))
                top1.append(probs.max(-1).values.cpu().numpy().astype(np.float32))
                ent.append((-(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)).cpu().numpy().astype(np.float32))
    meta = {
        "target": pair.target_name, "draft": pair.draft_name if drafter == "model" else None, "drafter": drafter,
        "tokenizer": tokenizer_fingerprint(pair.tokenizer) if pair.tokenizer is not None else None,
        "dtype": str(pair.dtype).replace("torch.", ""), "temperature": temperature, "seed": seed,
        "max_new_tokens": max_new_tokens, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "text_keys": keys,
    }
    traces = Traces(ids, [c for c in conts if c is not None], eos, [p.category for p in prompts], ranks, top1, ent,
                    meta)
    if out is not None:
        traces.save(out)
        if partial is not None:
            partial.unlink(missing_ok=True)
    return traces
