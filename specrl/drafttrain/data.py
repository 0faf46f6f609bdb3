"""Distillation data: the target's own continuations plus its top-k log-probabilities.

Why generated text: a draft is only ever asked to predict what the *target* would write next,
so the best training distribution is the target's own output on prompts like the served ones.
Why keep top-k log-probs: soft targets carry far more signal per token than the argmax, and
recording them during generation costs nothing extra (a forward hook on the target's head).

Layout under ``data_dir``::

    manifest.json                 the data config (a resumed run must match it)
    <stage>/shard-00000.pt        one generation batch: token ids + labels (atomic writes)

A *stage* is one pass over a prompt split with one decoding setting, e.g. ``heldout-greedy``,
``train-greedy``, ``train-t0.7-r1`` (sampled, temperature 0.7, round 1), or ``train-text``
(the train prompts' own text scored by the target: the "offline text" labels). Shards are planned
deterministically (prompts sorted by length, packed under a token budget), so an interrupted
run resumes by skipping the shards already on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specrl.errors import ConfigError
from specrl.prompts import Prompt, load_prompts, split_prompts

SHARD_FORMAT = 1


@dataclass(frozen=True)
class DataConfig:
    """Everything that determines the data (a resumed run must use the same values)."""

    sources: tuple[str, ...] = ("builtin",)
    held_out: float = 0.25
    split_seed: int = 0
    max_new_tokens: int = 192
    topk: int = 32
    batch_size: int = 32
    token_budget: int = 8192  # rows * (prompt + new tokens) per generation batch
    dtype: str = "bfloat16"  # target dtype used to generate (bf16 is ~3x faster on AVX512-BF16 CPUs)
    rounds: int = 2  # sampled rounds over the train prompts after the greedy one
    temperatures: tuple[float, ...] = (0.7, 1.0)
    top_p: float = 0.95
    samples: int = 1  # continuations per prompt in one generate call of a sampled stage
    text: bool = True  # the train-text stage (feature heads never read it: skip it to save its time)

    def fingerprint(self) -> dict[str, Any]:
        """The fields that change existing shards (``rounds`` and ``text`` only add or skip stages;
        ``samples`` only when it is not 1, so data made before the field existed still resumes)."""
        d = asdict(self)
        d.pop("rounds")
        d.pop("text")
        if d["samples"] == 1:
            d.pop("samples")
        d["sources"] = [_source_id(s) for s in self.sources]
        return d


def _source_id(source: str) -> str:
    """A prompt source named by content, so the same file under another path still matches."""
    if source == "builtin":
        return "builtin"
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(f"Prompt file {source!r} does not exist. Fix: pass an existing .jsonl or text file.")
    return f"{path.name}:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"


def prompt_split(cfg: DataConfig) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) prompts: all sources, deduplicated by text, split per category.

    MT-Bench rows appear both in Spec-Bench and in MT-Bench, so deduplication keeps a prompt
    from landing in both halves.
    """
    seen: set[str] = set()
    prompts: list[Prompt] = []
    for src in cfg.sources:
        for p in load_prompts(src):
            key = p.text.strip()
            if key not in seen:
                seen.add(key)
                prompts.append(p)
    return split_prompts(prompts, held_out=cfg.held_out, seed=cfg.split_seed)


@dataclass(frozen=True)
class Stage:
    """One pass over a prompt split with one decoding setting."""

    split: str  # "train" | "heldout"
    temperature: float  # 0 = greedy
    round: int = 0
    text: bool = False  # score the prompt text itself (teacher forcing) instead of generating

    @property
    def name(self) -> str:
        if self.text:
            return f"{self.split}-text"
        how = "greedy" if self.temperature == 0 else f"t{self.temperature:g}-r{self.round}"
        return f"{self.split}-{how}"

    @property
    def seed(self) -> int:
        return 1000 * self.round + int(self.temperature * 100)


def stages(cfg: DataConfig) -> list[Stage]:
    """Held-out greedy first (the learning curve needs it), then train greedy, the train prompts'
    own text (cheap: one teacher-forced pass, ~5x faster per label than generating; left out
    when ``cfg.text`` is off), then sampled rounds."""
    out = [Stage("heldout", 0.0), Stage("train", 0.0)] + ([Stage("train", 0.0, text=True)] if cfg.text else [])
    for r in range(1, cfg.rounds + 1):
        out.append(Stage("train", cfg.temperatures[(r - 1) % len(cfg.temperatures)], r))
    return out


def plan_shards(lengths: Sequence[int], cfg: DataConfig, copies: int = 1) -> list[list[int]]:
    """Prompt indices per generation batch: sorted by length (little padding), token-budgeted.

    ``copies``: rows each prompt becomes (sampled stages generate ``cfg.samples`` continuations
    per prompt in one call); ``batch_size`` and ``token_budget`` count rows."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    shards: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = lengths[i] + cfg.max_new_tokens
        rows = (len(cur) + 1) * copies
        if cur and (rows > cfg.batch_size or rows * width > cfg.token_budget):
            shards.append(cur)
            cur = []
        cur.append(i)
    if cur:
        shards.append(cur)
    return shards


class _HeadRecorder:
    """Forward hook on the target's output layer: top-k log-probs of the last position per call.

    ``generate`` calls the model once per new token, so the k-th record holds the target's
    distribution over the k-th generated token, before any sampling warper touched it.
    """

    def __init__(self, topk: int) -> None:
        self.topk = topk
        self.vals: list[torch.Tensor] = []  # per call (B, K) float16 log-probs
        self.idx: list[torch.Tensor] = []  # per call (B, K) int32 token ids

    def __call__(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        last = output[:, -1].float()  # (B, V)
        logp = torch.log_softmax(last, dim=-1)
        v, i = logp.topk(self.topk, dim=-1)  # (B, K)
        self.vals.append(v.half())
        self.idx.append(i.int())


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    cfg: DataConfig,
    temperature: float,
    seed: int,
    eos_ids: Sequence[int],
    pad_id: int,
    samples: int = 1,
) -> dict[str, torch.Tensor]:
    """Continue ``prompts`` with the target; return flat tokens and per-position labels.

    Returns ``tokens`` (sum of lengths,) int32, ``seq_len`` / ``prompt_len`` (S,) int32 and
    ``top_i`` (M, K) int32 / ``top_v`` (M, K) float16 for the M generated tokens in order: row
    m holds the target's log-probs over the token that was generated at that position.

    ``samples`` > 1 (sampling only): that many continuations per prompt in the same call
    (sequence s continues prompt s // samples). Why: a generate call costs one sequential step
    per new token whatever its rows, so on a GPU more rows per call is nearly free throughput;
    distinct prompts run out long before the rows do (~420 training prompts here).
    """
    if samples > 1 and temperature <= 0:
        raise ConfigError(f"samples={samples} needs sampling (temperature > 0): greedy continuations of one prompt "
                          "are identical. Fix: samples=1 for greedy stages.")
    bsz, width = len(prompts), max(len(p) for p in prompts)
    x = torch.full((bsz, width), pad_id, dtype=torch.long)
    am = torch.zeros((bsz, width), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: generation continues every row at the right edge
        x[b, width - len(p):] = torch.tensor(list(p))
        am[b, width - len(p):] = 1
    device = next(model.parameters()).device
    x, am = x.to(device), am.to(device)
    rec = _HeadRecorder(cfg.topk)
    handle = model.get_output_embeddings().register_forward_hook(rec)
    torch.manual_seed(seed)
    kw: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        kw = {"do_sample": True, "temperature": temperature, "top_p": cfg.top_p, "top_k": 0,
              "num_return_sequences": samples}
    try:
        out = model.generate(x, attention_mask=am, max_new_tokens=cfg.max_new_tokens, pad_token_id=pad_id,
                             eos_token_id=list(eos_ids) or None, **kw)
    finally:
        handle.remove()
    gen = out[:, width:].cpu()  # (B * samples, G)
    vals = torch.stack(rec.vals[: gen.shape[1]], dim=1).cpu()  # (B * samples, G, K)
    idx = torch.stack(rec.idx[: gen.shape[1]], dim=1).cpu()
    eos = set(eos_ids)
    tokens, seq_len, prompt_len, top_v, top_i = [], [], [], [], []
    for b in range(gen.shape[0]):
        p = prompts[b // samples]
        g = gen[b].tolist()
        n = next((j + 1 for j, t in enumerate(g) if t in eos), len(g))  # keep the EOS itself
        tokens += list(p) + g[:n]
        seq_len.append(len(p) + n)
        prompt_len.append(len(p))
        top_v.append(vals[b, :n])
        top_i.append(idx[b, :n])
    return _pack(tokens, seq_len, prompt_len, top_v, top_i)


@torch.inference_mode()
def score_batch(model: torch.nn.Module, seqs: Sequence[Sequence[int]], topk: int, pad_id: int,
                chunk: int = 512) -> dict[str, torch.Tensor]:
    """Teacher-forced target labels for existing text (the "offline text" half of the data).

    Same layout as :func:`generate_batch` with ``prompt_len = 1``: every token after the first
    is labelled with the target's top-k log-probs at the position before it.
    """
    bsz, width = len(seqs), max(len(q) for q in seqs)
    x = torch.full((bsz, width), pad_id, dtype=torch.long)
    am = torch.zeros((bsz, width), dtype=torch.long)
    for b, q in enumerate(seqs):  # right padding: positions are plain 0..n-1
        x[b, : len(q)] = torch.tensor(list(q))
        am[b, : len(q)] = 1
    device = next(model.parameters()).device
    x, am = x.to(device), am.to(device)
    hidden = model.model(input_ids=x, attention_mask=am).last_hidden_state  # (B, L, H)
    head = model.get_output_embeddings()
    tokens, seq_len, prompt_len, top_v, top_i = [], [], [], [], []
    for b, q in enumerate(seqs):
        h = hidden[b, : len(q) - 1]  # (n-1, H)
        for c in range(0, h.shape[0], chunk):  # full-vocabulary logits a chunk at a time
            logp = torch.log_softmax(head(h[c : c + chunk]).float(), dim=-1)  # (c, V)
            v, i = logp.topk(topk, dim=-1)
            top_v.append(v.half().cpu())
            top_i.append(i.int().cpu())
        tokens += list(q)
        seq_len.append(len(q))
        prompt_len.append(1)
    return _pack(tokens, seq_len, prompt_len, top_v, top_i)


def _pack(tokens: list[int], seq_len: list[int], prompt_len: list[int],
          top_v: list[torch.Tensor], top_i: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One shard's flat layout: sequences back to back, labels for every non-first token."""
    return {
        "tokens": torch.tensor(tokens, dtype=torch.int32),
        "seq_len": torch.tensor(seq_len, dtype=torch.int32),
        "prompt_len": torch.tensor(prompt_len, dtype=torch.int32),
        "top_v": torch.cat(top_v),
        "top_i": torch.cat(top_i),
    }


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` via a temporary file and a rename: a killed run never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def check_manifest(data_dir: Path, cfg: DataConfig, target_name: str) -> None:
    """Write the manifest on first use; refuse to mix shards made with another config."""
    # a JSON round trip makes tuples lists, as they are when read back
    want = json.loads(json.dumps({"format": SHARD_FORMAT, "target": target_name, **cfg.fingerprint()}))
    path = data_dir / "manifest.json"
    if path.exists():
        have = json.loads(path.read_text())
        # `samples` is written only when it is not 1 (older manifests lack it): compare it always
        have.setdefault("samples", 1)
        want = {**want, "samples": cfg.samples}
        diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
        if diff:
            raise ConfigError(
                f"Data in {data_dir} was made with another config ({', '.join(f'{k}: {a!r} != {b!r}' for k, (a, b) in diff.items())}). "
                "Fix: pass the same data options as before, or a new --data-dir."
            )
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(want, indent=1))


def build_data(
    pair: Any, cfg: DataConfig, data_dir: Path, token_limit: int | None = None, progress: bool = True
) -> dict[str, int]:
    """Generate every missing shard of every stage (resumable). Returns tokens per stage.

    ``pair``: a ``ModelPair`` whose target generates (its dtype should be ``cfg.dtype``).
    ``token_limit`` stops after that many generated tokens in total (shards on disk count).
    """
    from tqdm import tqdm

    check_manifest(data_dir, cfg, pair.target_name)
    train, held = prompt_split(cfg)
    eos = sorted(pair.eos_token_ids) or [pair.tokenizer.eos_token_id]
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else eos[0]
    enc = {id(p): pair.encode_prompt(p.text) for p in train + held}
    limit = pair.max_context - cfg.max_new_tokens
    done_tokens = count_tokens(data_dir)
    for stage in stages(cfg):
        plist = held if stage.split == "heldout" else train
        ids = [enc[id(p)][-limit:] for p in plist]  # very long prompts keep their end
        if stage.text:
            ids = [i for i in ids if len(i) >= 2]
            plist = [p for p in plist if len(enc[id(p)][-limit:]) >= 2]
        copies = cfg.samples if stage.temperature > 0 and not stage.text else 1
        shards = plan_shards([len(i) for i in ids], replace(cfg, max_new_tokens=0) if stage.text else cfg, copies)
        todo = [s for s in range(len(shards)) if not _shard_path(data_dir, stage, s).exists()]
        if not todo:
            continue
        bar = tqdm(total=len(shards), initial=len(shards) - len(todo), desc=f"data {stage.name}",
                   unit="batch", disable=not progress, dynamic_ncols=True)
        t0, new = time.perf_counter(), 0
        for s in todo:
            if token_limit is not None and sum(done_tokens.values()) >= token_limit:
                bar.close()
                _log_rate(stage.name, new, time.perf_counter() - t0)
                return done_tokens
            rows = shards[s]
            if stage.text:
                out = score_batch(pair.target, [ids[i] for i in rows], cfg.topk, pad)
            else:
                out = generate_batch(pair.target, [ids[i] for i in rows], cfg, stage.temperature,
                                     stage.seed * 100_003 + s, eos, pad, copies)
            out["category"] = [plist[i].category for i in rows for _ in range(copies)]
            out["qid"] = [plist[i].qid for i in rows for _ in range(copies)]
            out["stage"] = stage.name
            out["format"] = SHARD_FORMAT
            atomic_save(out, _shard_path(data_dir, stage, s))
            done_tokens[stage.name] = done_tokens.get(stage.name, 0) + int(out["top_i"].shape[0])
            new += int(out["top_i"].shape[0])
            bar.update(1)
            bar.set_postfix(tokens=sum(done_tokens.values()))
        bar.close()
        _log_rate(stage.name, new, time.perf_counter() - t0)
    return done_tokens


def _log_rate(stage: str, tokens: int, seconds: float) -> None:
    """One line per stage on stderr: the labelled-token rate is what sizes a data budget."""
    if tokens:
        print(f"data {stage}: {tokens} labelled tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.0f}/s)",
              file=sys.stderr, flush=True)


def _shard_path(data_dir: Path, stage: Stage, s: int) -> Path:
    return data_dir / stage.name / f"shard-{s:05d}.pt"


def shard_files(data_dir: Path, split: str) -> list[Path]:
    """Shards of one split on disk, in a stable order."""
    return sorted(data_dir.glob(f"{split}-*/shard-*.pt"))


def count_tokens(data_dir: Path) -> dict[str, int]:
    """Generated tokens per stage already on disk (reads only the shapes it needs)."""
    out: dict[str, int] = {}
    for f in sorted(data_dir.glob("*/shard-*.pt")):
        d = torch.load(f, weights_only=False)
        out[f.parent.name] = out.get(f.parent.name, 0) + int(d["top_i"].shape[0])
    return out


@dataclass
class Sequence_:
    """One training sequence: prompt + generated tokens and the labels of the generated part."""

    tokens: torch.Tensor  # (L,) int64
    prompt_len: int
    top_i: torch.Tensor  # (G, K) int64: label m is the target's view of tokens[prompt_len + m]
    top_v: torch.Tensor  # (G, K) float32 log-probs
    category: str
    stage: str


def load_sequences(files: Sequence[Path]) -> list[Sequence_]:
    """Unpack shards into per-sequence records."""
    seqs: list[Sequence_] = []
    for f in files:
        d = torch.load(f, weights_only=False)
        t0 = m0 = 0
        for j, (sl, pl) in enumerate(zip(d["seq_len"].tolist(), d["prompt_len"].tolist())):
            g = sl - pl
            seqs.append(Sequence_(d["tokens"][t0 : t0 + sl].long(), pl, d["top_i"][m0 : m0 + g].long(),
                                  d["top_v"][m0 : m0 + g].float(), d["category"][j], d["stage"]))
            t0 += sl
            m0 += g
    return seqs
