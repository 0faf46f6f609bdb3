"""Feature-level draft heads (EAGLE / Medusa style): train, evaluate, save and load.

Why: a token-level draft must rebuild the target's view of the text from tokens alone, and
gains ~0.04 held-out alpha per doubling of target-generated data, which these CPUs make at
~70 tokens/s. A head that reads the target's own last hidden state starts from the target's
plan for the next tokens (``benchmarks/draft_feature_heads.py`` measures the difference).

A head predicts the target's post-norm last hidden state f_i from f_{i-1} and the embedding of
token i, then scores it with the target's frozen output head over a shortlist; the argmax is
the draft for token i + 1. Kinds:

* ``mlp``: fc(2H -> H) + a residual MLP, position-wise (no attention). The engine's ``feature``
  drafter runs it: it needs no KV cache of its own, only one target feature per row.
* ``eagle``: fc(2H -> H) + one Llama decoder layer (causal attention over the history), as
  EAGLE. Benchmark only: drafting with it would need its own KV cache over the history.

Loss (EAGLE's): smooth-L1 on the feature + ``w_cls`` x soft cross-entropy against the target's
distribution over the shortlist. Alpha is measured as in ``specrl draft eval``: top-1 agreement
with the target's argmax over the generated tokens of held-out continuations, with true
features for the prefix (a draft of k = 1 after each verify); ``alpha_step2`` feeds the head its
own predicted feature for one step (a second chained draft token), and ``alpha_step2_given1``
scores that token only where the first was right (what a k = 2 chain accepts). ``unroll`` 2+
trains on those chained steps too ("training-time test").

On disk a head is ``head.safetensors`` (its own tensors in bfloat16 + the shortlist ids; the
embedding and output rows are the target's, borrowed at load time) and ``card.json``.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specrl.drafttrain.data import Sequence_, load_sequences, shard_files
from specrl.drafttrain.student import shortlist_from_counts
from specrl.drafttrain.train import batches, shortlist_scores, token_counts
from specrl.errors import ConfigError, ModelLoadError

HEADS = ("eagle", "mlp")
HEAD_WEIGHTS = "head.safetensors"
HEAD_CARD = "card.json"
_BORROWED = ("embed.", "sub_w")  # state-dict keys taken from the target at load time, never saved


class FeatureHead(nn.Module):
    """f_{i-1} (B, L, H) and token i (B, L) -> f-hat_i (B, L, H); ``short`` scores the shortlist."""

    def __init__(self, target: nn.Module, ids: torch.Tensor, kind: str) -> None:
        super().__init__()
        if kind not in HEADS:
            raise ConfigError(f"Unknown head {kind!r}. Allowed: {', '.join(HEADS)}.")
        hid = target.config.hidden_size
        self.kind = kind
        self.embed = target.get_input_embeddings()  # frozen, shared
        self.fc = nn.Linear(2 * hid, hid)
        nn.init.normal_(self.fc.weight, std=0.02)
        with torch.no_grad():  # start near "the previous feature": the fc passes f_{i-1} through
            self.fc.weight[:, :hid] += torch.eye(hid)
        nn.init.zeros_(self.fc.bias)
        self.layer: nn.Module | None = None
        self.mlp: nn.Module | None = None
        if kind == "eagle":
            # a fresh layer of the target's shape (copying a target layer starts far worse: its
            # residual stream's scale does not match post-norm features; measured while building this)
            self.layer = copy.deepcopy(target.model.layers[0]).requires_grad_(True)  # the target's are frozen
            for m in self.layer.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
            self.rotary = copy.deepcopy(target.model.rotary_emb)
        else:
            self.mlp = nn.Sequential(nn.LayerNorm(hid), nn.Linear(hid, 4 * hid), nn.SiLU(), nn.Linear(4 * hid, hid))
            nn.init.zeros_(self.mlp[-1].weight)
        self.register_buffer("ids", ids.long())  # (S,)
        self.register_buffer("sub_w", target.get_output_embeddings().weight.detach()[ids].clone())  # (S, H)

    def forward(self, f_prev: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        dt = self.fc.weight.dtype  # the head's own dtype (bfloat16 next to a float32 target on some CPUs)
        x = self.fc(torch.cat([f_prev.to(dt), self.embed(tok).to(dt)], -1))  # (B, L, H)
        if self.mlp is not None:
            return x + self.mlp(x)
        if pos is None:
            raise ConfigError("The eagle head needs position ids (it attends over the history).")
        cos, sin = self.rotary(x, pos)
        out = self.layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))  # causal
        return out[0] if isinstance(out, tuple) else out

    def short(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.sub_w.T  # (..., S)


def own_head_state(head: FeatureHead) -> dict[str, torch.Tensor]:
    """The tensors the head owns (fc, body, shortlist ids): what training updates and saving writes."""
    return {k: v for k, v in head.state_dict().items() if not k.startswith(_BORROWED)}


def save_head(head: FeatureHead, out_dir: Path, card: dict[str, Any]) -> Path:
    """Write ``head.safetensors`` (own tensors in bfloat16, ids in int32) and ``card.json``."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arch = {"kind": head.kind, "hidden_size": int(head.fc.out_features), "vocab_size": int(head.embed.num_embeddings),
            "shortlist": int(head.ids.numel())}
    tensors = {k: (v.to(torch.int32) if k == "ids" else v.detach().to(torch.bfloat16)).contiguous()
               for k, v in own_head_state(head).items()}
    save_file(tensors, str(out_dir / HEAD_WEIGHTS), metadata={"arch": json.dumps(arch)})
    (out_dir / HEAD_WEIGHTS).chmod(0o644)  # package data must be world-readable once installed
    (out_dir / HEAD_CARD).write_text(json.dumps({"arch": arch, **card}, indent=1) + "\n")
    return out_dir


def load_head(head_dir: Path, target: nn.Module, dtype: torch.dtype | None = None) -> FeatureHead:
    """Rebuild a saved head on ``target``'s embedding and output rows (offline, well under a second).

    ``dtype`` (default: the target's) converts the head's own tensors (fc, body, shortlist rows),
    never the embedding: that is the target's own module. Why the target's dtype by default: on this
    CPU a bfloat16 head through ``nn.Linear`` took ~32 ms a step against ~1.6 ms in float32 (the
    shipped draft's bfloat16 path uses ``specrl.kernels``, which the head does not yet).
    """
    from safetensors import safe_open

    path = Path(head_dir) / HEAD_WEIGHTS
    if not path.is_file():
        raise ModelLoadError(f"No feature head at {path}. Fix: pass a directory written by `specrl draft head` "
                             f"(it holds {HEAD_WEIGHTS} and {HEAD_CARD}).")
    with safe_open(str(path), framework="pt") as f:
        arch = json.loads((f.metadata() or {}).get("arch", "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    hidden = target.get_input_embeddings().weight.shape[1]
    vocab = target.get_output_embeddings().weight.shape[0]
    if arch.get("hidden_size") != hidden or arch.get("vocab_size") != vocab:
        raise ModelLoadError(
            f"Feature head {head_dir} was trained for hidden size {arch.get('hidden_size')} / vocabulary "
            f"{arch.get('vocab_size')}, but the target has {hidden} / {vocab}. Fix: load it with the target it "
            "was trained for (see its card.json), or train one with `specrl draft head`.")
    if "ids" not in tensors:
        raise ModelLoadError(f"{path} lacks its shortlist ids. Fix: re-save it with `specrl draft head`.")
    head = FeatureHead(target, tensors["ids"].long(), arch.get("kind", "?"))
    missing = set(own_head_state(head)) - set(tensors)
    if missing:
        raise ModelLoadError(f"Feature head {head_dir} lacks tensors {sorted(missing)[:4]}. Fix: re-save it.")
    head.load_state_dict({k: v.long() if k == "ids" else v for k, v in tensors.items()}, strict=False)
    head.requires_grad_(False)
    ref = next(target.parameters())
    dt = ref.dtype if dtype is None else dtype
    head = head.to(device=ref.device, dtype=ref.dtype)  # a no-op on the shared embedding
    for name, mod in head.named_children():
        if name not in ("embed", "rotary"):
            mod.to(dt)
    head.sub_w = head.sub_w.to(dt)
    return head.eval()


@torch.inference_mode()
def target_features(target: nn.Module, seqs: Sequence[Sequence_], max_len: int, budget: int = 8192,
                    progress: bool = True) -> list[torch.Tensor]:
    """Per sequence: (n, H) float16 post-norm last hidden states of the target (teacher forced).

    Sequences longer than ``max_len`` keep their end (the generated part), as ``specrl draft train``'s
    collation does.
    """
    from tqdm.auto import tqdm

    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    groups: list[list[int]] = [[]]
    for i in order:
        w = min(len(seqs[i].tokens), max_len)
        if groups[-1] and w * (len(groups[-1]) + 1) > budget:
            groups.append([])
        groups[-1].append(i)
    device = next(target.parameters()).device
    bar = tqdm(total=sum(min(len(s.tokens), max_len) for s in seqs), unit="tok", desc="target features",
               disable=not progress)
    for grp in groups:
        lens = [min(len(seqs[i].tokens), max_len) for i in grp]
        x = torch.zeros(len(grp), max(lens), dtype=torch.long)  # right padding: causal rows ignore it
        for b, i in enumerate(grp):
            x[b, : lens[b]] = seqs[i].tokens[-lens[b]:]
        h = target.model(input_ids=x.to(device)).last_hidden_state  # (B, W, H)
        for b, i in enumerate(grp):
            out[i] = h[b, : lens[b]].half().cpu()
        bar.update(sum(lens))
    bar.close()
    return out  # type: ignore[return-value]


def collate(seqs: Sequence[Sequence_], feats: Sequence[torch.Tensor], idx: Sequence[int], max_len: int,
            generated_only: bool = False):
    """Inputs (f_{i-1}, token i, position i) and targets f_i for i = 1..n-1 of each sequence.

    ``generated_only`` keeps in ``mask`` only the positions that label a generated token (what
    the token-level draft is trained on; prompts then serve only as context)."""
    lens = [min(len(seqs[i].tokens), max_len) for i in idx]
    w, hid = max(lens) - 1, feats[idx[0]].shape[1]
    fin = torch.zeros(len(idx), w, hid)
    fout = torch.zeros(len(idx), w, hid)
    tok = torch.zeros(len(idx), w, dtype=torch.long)
    pos = torch.zeros(len(idx), w, dtype=torch.long)
    mask = torch.zeros(len(idx), w, dtype=torch.bool)
    for b, (i, n) in enumerate(zip(idx, lens)):
        f, t = feats[i].float(), seqs[i].tokens[-n:]
        start = len(seqs[i].tokens) - n
        fin[b, : n - 1], fout[b, : n - 1], tok[b, : n - 1] = f[: n - 1], f[1:n], t[1:n]
        pos[b, : n - 1] = torch.arange(start + 1, start + n)
        # column c's target f_{c+1} labels token c+2: generated tokens only, or every position
        # (the last column's target, f_{n-1}, labels no token of the data: kept only with every position)
        if generated_only:
            mask[b, max(0, seqs[i].prompt_len - 2 - start) : n - 2] = True
        else:
            mask[b, : n - 1] = True
    return fin, tok, pos, fout, mask


def label_columns(s: Sequence_, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(G,) column of :func:`collate`'s output that predicts each generated token, and whether it exists.

    Column c holds f-hat for position start + c + 1, whose argmax is the draft for token
    start + c + 2; generated token g is token prompt_len + g.
    """
    n = min(len(s.tokens), max_len)
    start = len(s.tokens) - n
    col = s.prompt_len + torch.arange(s.top_i.shape[0]) - 2 - start
    return col, (col >= 0) & (col < n - 1)


def chain_counts(r1: torch.Tensor, r2: torch.Tensor) -> tuple[int, int]:
    """(chains whose token 1 is right, of those the ones whose token 2 is right too).

    r1 / r2 (G,) bool: per consecutive generated token g, whether the head drafts it right as a
    chain's token 1 (true feature) / token 2 (its own feature). The chain that drafts token g
    as its token 1 drafts token g + 1 as its token 2, so its 2nd token is r2[g + 1]; the last
    token's chain has no scored token 2.
    """
    return int(r1[:-1].sum()), int((r1[:-1] & r2[1:]).sum())


@torch.no_grad()
def evaluate(head: FeatureHead, seqs: Sequence[Sequence_], feats: Sequence[torch.Tensor], max_len: int) -> dict:
    """Held-out agreement of the first two chained draft tokens, overall and per category.

    ``alpha``: token 1 from the target's true feature (k = 1 after each verify). ``alpha_step2``:
    token 2 from the head's own predicted feature, scored alone. ``alpha_step2_given1``: token 2
    right among the chains whose token 1 was right, the rate a k = 2 chain accepts its 2nd token
    at (a head trained with ``unroll`` 2 targets it).
    """
    per: dict[str, list[int]] = {}
    both = [0, 0]  # chains with token 1 right, and of those token 2 right too
    dev = head.sub_w.device
    for idx in batches(seqs, 8192, 0, max_len):
        fin, tok, pos, _, _ = (x.to(dev) for x in collate(seqs, feats, idx, max_len))
        fh = head(fin, tok, pos)  # column c predicts f_{c+1}, i.e. token c+2 (cropped coordinates)
        pred = head.ids[head.short(fh).argmax(-1)]  # (B, W)
        fin2 = fin.clone()
        fin2[:, 1:] = fh[:, :-1]
        pred2 = head.ids[head.short(head(fin2, tok, pos)).argmax(-1)]
        for b, i in enumerate(idx):
            s = seqs[i]
            col, ok = label_columns(s, max_len)
            tgt = s.top_i[ok, 0]
            r1 = pred[b, col[ok]].cpu() == tgt  # (G',) per generated token, consecutive columns
            r2 = pred2[b, col[ok]].cpu() == tgt
            c = per.setdefault(s.category, [0, 0, 0])
            c[0] += int(r1.sum())
            c[1] += int(r2.sum())
            c[2] += int(ok.sum())
            n1, n2 = chain_counts(r1, r2)
            both[0] += n1
            both[1] += n2
    tot = [sum(v[j] for v in per.values()) for j in range(3)]
    return {"alpha": tot[0] / max(1, tot[2]), "alpha_step2": tot[1] / max(1, tot[2]),
            "alpha_step2_given1": both[1] / max(1, both[0]), "tokens": tot[2],
            "per_category": {k: round(v[0] / max(1, v[2]), 4) for k, v in sorted(per.items())}}


@dataclass(frozen=True)
class HeadConfig:
    """One head's training schedule (defaults: the measured 8-epoch mlp recipe of the README)."""

    kind: str = "mlp"
    epochs: float = 8.0
    lr: float = 1e-3
    w_cls: float = 0.1  # weight of the soft cross-entropy (EAGLE: 0.1)
    batch_tokens: int = 4096
    max_len: int = 2048
    shortlist: int = 8192
    positions: str = "generated"  # "all": also train on prompt positions (measured worse held-out)
    unroll: int = 1  # chained steps per position: 2+ also trains on the head's own predicted features
    unroll_weight: float = 0.5  # loss weight of each chained step after the first
    eval_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in HEADS:
            raise ConfigError(f"Unknown head kind {self.kind!r}. Allowed: {', '.join(HEADS)}.")
        if self.positions not in ("all", "generated"):
            raise ConfigError(f"positions={self.positions!r} is invalid. Allowed: 'all' or 'generated'.")
        if self.unroll < 1 or not self.unroll_weight >= 0:
            raise ConfigError(f"unroll={self.unroll}, unroll_weight={self.unroll_weight} is invalid. Allowed: "
                              "unroll >= 1 (1 = true features only) and unroll_weight >= 0. Fix: e.g. unroll=2.")
        if self.kind == "eagle" and self.unroll > 1:
            raise ConfigError("unroll > 1 is implemented for the position-wise mlp head only (an eagle head's "
                              "chained step would attend over predicted features). Fix: kind='mlp' or unroll=1.")
        if not self.epochs > 0 or not self.lr > 0 or self.batch_tokens < 1 or self.eval_every < 1:
            raise ConfigError(f"Invalid head schedule {asdict(self)}: epochs, lr, batch_tokens and eval_every "
                              "must be positive. Fix: e.g. epochs=8, lr=1e-3, batch_tokens=4096, eval_every=50.")


def head_loss(pred: torch.Tensor, true: torch.Tensor, head: FeatureHead, w_cls: float,
              soft: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE's loss on (M, H) features: smooth-L1 + ``w_cls`` x soft CE over the shortlist.

    ``soft``: (M, S) the target's distribution on the shortlist, when the caller already has it."""
    reg = F.smooth_l1_loss(pred, true)
    if soft is None:
        soft = torch.softmax(head.short(true), -1)  # (M, S) the target's distribution on the shortlist
    cls = -(soft * torch.log_softmax(head.short(pred), -1)).sum(-1).mean()
    return reg + w_cls * cls


def unrolled_loss(head: FeatureHead, fin: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, fout: torch.Tensor,
                  mask: torch.Tensor, cfg: HeadConfig) -> torch.Tensor:
    """The loss of ``cfg.unroll`` chained steps ("training-time test", as in HASS / EAGLE-3).

    Why: at draft time the second token of a chain reads the head's own predicted feature, not
    the target's, and a head trained on true features only agrees 0.22 there against 0.37 at the
    first. Step j feeds column c the prediction step j-1 made at column c-1, so column c then
    sits j own predictions from a true feature, exactly like the j-th token of a drafted chain
    (the position-wise head makes this one extra pass per step). Columns c < j cannot be that
    far from a true feature and leave step j's loss. Gradients flow through the fed-back
    features, so the head learns features that chain, not only features that score.

    fin / fout (B, W, H), tok / pos (B, W), mask (B, W) bool.
    """
    fh = head(fin, tok, pos)  # (B, W, H)
    true = fout[mask]  # (M, H)
    soft = torch.softmax(head.short(true), -1)  # (M, S): every step scores against these rows
    loss = head_loss(fh[mask], true, head, cfg.w_cls, soft)
    for j in range(1, cfg.unroll):
        fh = head(torch.cat([fin[:, :1], fh[:, :-1]], 1), tok, pos)  # column c reads step j-1's f-hat at c-1
        m = mask.clone()
        m[:, :j] = False
        keep = m[mask]  # (M,) which of the step-1 rows step j scores (same row-major order as fh[m])
        if keep.any():
            loss = loss + cfg.unroll_weight * head_loss(fh[m], true[keep], head, cfg.w_cls, soft[keep])
    return loss


def train_head(target: nn.Module, train: list[Sequence_], ftrain: list[torch.Tensor], held: list[Sequence_],
               fheld: list[torch.Tensor], ids: torch.Tensor, cfg: HeadConfig, progress: bool = True,
               log: Callable[[str], None] | None = None) -> dict:
    """One head's schedule (warmup + cosine to 10%); a held-out point every ``eval_every`` steps.

    Returns {"curve", "final", "steps", "params", "head"}.
    """
    from tqdm.auto import tqdm

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    torch.manual_seed(cfg.seed)
    dev = next(target.parameters()).device
    head = FeatureHead(target, ids.to(dev), cfg.kind).to(dev)
    params = [p for n, p in head.named_parameters() if p.requires_grad and not n.startswith("embed")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    per_epoch = len(batches(train, cfg.batch_tokens, 0, cfg.max_len))
    total = max(1, int(per_epoch * cfg.epochs))
    curve = [{"step": 0, "trained_tokens": 0, **evaluate(head.eval(), held, fheld, cfg.max_len)}]
    head.train()
    step, seen, t0 = 0, 0, time.time()
    bar = tqdm(total=total, desc=f"{cfg.kind} head", disable=not progress)
    epoch = 0
    while step < total:
        for idx in batches(train, cfg.batch_tokens, cfg.seed * 1000 + epoch, cfg.max_len):
            if step >= total:
                break
            lr = cfg.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / total)))
            for g in opt.param_groups:
                g["lr"] = lr
            fin, tok, pos, fout, mask = (x.to(dev) for x in collate(train, ftrain, idx, cfg.max_len,
                                                                     cfg.positions == "generated"))
            loss = unrolled_loss(head, fin, tok, pos, fout, mask, cfg)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            seen += int(mask.sum())
            bar.update(1)
            if step % cfg.eval_every == 0 or step == total:
                point = {"step": step, "trained_tokens": seen, "minutes": (time.time() - t0) / 60,
                         **evaluate(head.eval(), held, fheld, cfg.max_len)}
                head.train()
                curve.append(point)
                bar.set_postfix(alpha=f"{point['alpha']:.3f}")
                log(json.dumps({"head": cfg.kind, **{k: v for k, v in point.items() if k != "per_category"}}))
        epoch += 1
    bar.close()
    head.eval().requires_grad_(False)
    return {"curve": curve, "final": curve[-1], "steps": total, "params": sum(p.numel() for p in params), "head": head}


def check_data_dir(data_dir: Path) -> None:
    """Refuse a directory without held-out and training shards (cheap: call it before loading a model)."""
    if not shard_files(Path(data_dir), "heldout") or not shard_files(Path(data_dir), "train"):
        raise ConfigError(f"{data_dir} lacks held-out or training shards. Fix: run `specrl draft data --data-dir "
                          f"{data_dir}` first (the held-out stage comes first, then train-greedy).")


def load_data(target: nn.Module, data_dir: Path, max_len: int, shortlist: int, progress: bool = True
              ) -> tuple[list[Sequence_], list[torch.Tensor], list[Sequence_], list[torch.Tensor], torch.Tensor]:
    """(train, train features, held-out, held-out features, shortlist ids) of a ``specrl draft data`` dir.

    Train stages ``*-text`` are left out: their prompt positions are already context inside the
    generated sequences, and teacher-forced text lowered held-out alpha (README, feature-level heads).
    """
    check_data_dir(data_dir)
    held = load_sequences(shard_files(data_dir, "heldout"))
    train = [s for s in load_sequences(shard_files(data_dir, "train")) if not s.stage.endswith("-text")]
    if not train:
        raise ConfigError(f"{data_dir} holds only teacher-forced text for training. Fix: run `specrl draft data "
                          f"--data-dir {data_dir}` until its train-greedy stage has shards.")
    fheld = target_features(target, held, max_len, progress=progress)
    ftrain = target_features(target, train, max_len, progress=progress)
    eos = target.generation_config.eos_token_id
    always = [eos] if isinstance(eos, int) else list(eos or [])
    ids = shortlist_from_counts(shortlist_scores(token_counts(train, target.config.vocab_size)), shortlist, always)
    return train, ftrain, held, fheld, ids


def head_from_data(pair: Any, data_dir: Path, out_dir: Path, cfg: HeadConfig, progress: bool = True) -> dict:
    """``specrl draft head``: train one head on a data directory and save it with its card."""
    check_data_dir(data_dir)
    target = pair.target.requires_grad_(False)
    if next(target.parameters()).dtype != torch.float32:
        raise ConfigError("Feature heads train next to a float32 target (their features are its hidden states). "
                          "Fix: load the target with dtype='float32'.")
    train, ftrain, held, fheld, ids = load_data(target, data_dir, cfg.max_len, cfg.shortlist, progress)
    t0 = time.time()
    res = train_head(target, train, ftrain, held, fheld, ids, cfg, progress)
    final = res["final"]
    card = {
        "target": pair.target_name, "kind": cfg.kind, "recipe": asdict(cfg),
        "data": {"data_dir": str(data_dir), "train_sequences": len(train),
                 "train_generated_tokens": sum(len(s.tokens) - s.prompt_len for s in train),
                 "heldout_sequences": len(held), "heldout_tokens": final["tokens"]},
        "alpha": final["alpha"], "alpha_step2": final["alpha_step2"],
        "alpha_step2_given1": final["alpha_step2_given1"], "per_category": final["per_category"],
        "params": res["params"], "train_minutes": (time.time() - t0) / 60,
        "learning_curve": [{k: v for k, v in p.items() if k != "per_category"} for p in res["curve"]],
    }
    save_head(res["head"], Path(out_dir), card)
    return {"out": str(out_dir), "alpha": final["alpha"], "alpha_step2": final["alpha_step2"],
            "alpha_step2_given1": final["alpha_step2_given1"],
            "trained_tokens": final["trained_tokens"], "params": res["params"]}
