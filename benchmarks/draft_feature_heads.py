"""Feature-level draft heads vs the token-level draft, on the same distillation data.

Why: the shipped draft (2 target layers on tokens only) gains ~0.04 held-out alpha per doubling
of target-generated data, and these CPUs make ~70 tokens/s of it. A head that reads the
target's own last hidden state (EAGLE, Medusa) starts from the target's plan for the next
tokens, and needs no generation at all: teacher forcing gives features and labels for any text.
This script asks, before any engine work: at the data this machine can make, which head
predicts the target best?

Heads (each predicts the target's feature f_i from f_{i-1} and the embedding of token i, then
scores it with the target's frozen head over a shortlist; the argmax is the draft for token i+1):

* ``eagle``: fc(2H -> H) + one Llama decoder layer (causal attention over the history), as EAGLE.
* ``mlp``: fc(2H -> H) + a residual MLP, position-wise (no attention), Medusa-like.

Loss (EAGLE's): smooth-L1 on the feature + ``w_cls`` x soft cross-entropy against the target's
distribution over the shortlist. Alpha is measured as in ``specrl draft eval``: top-1 agreement
with the target's argmax over every generated token of the held-out continuations, with true
features for the prefix (a draft of k = 1 after each verify). ``alpha_step2`` feeds the head its
own predicted feature for one step (a second chained draft token; conditional on a correct first
token, and pessimistic: every history position uses predicted features).

Data: a directory written by ``specrl draft data`` (held-out greedy continuations for evaluation;
train stages except ``*-text``, whose prompt positions the feature heads already see inside the
generated sequences). Compare with the token-level draft trained on the same directory by
``specrl draft train --skip-data --data-dir DIR`` (``--compare-run``).

    python benchmarks/draft_feature_heads.py --data-dir DIR --heads mlp,eagle --epochs 4 \\
        --compare-run RUN_DIR --out bench-out/feature-heads

Writes ``OUT/feature_heads.json`` (curves, settings) and ``OUT/feature_heads.png`` (alpha vs
trained tokens, with the compared run's and the shipped draft's curves), and each head's draft-step cost as
a fraction c of a target step (:func:`head_cost`). Last line: one JSON
object ``{"<head>": alpha, ...}`` with each head's final held-out alpha.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specrl.drafttrain.data import Sequence_, load_sequences, shard_files
from specrl.drafttrain.student import shortlist_from_counts
from specrl.drafttrain.train import batches, shortlist_scores, token_counts
from specrl.errors import ConfigError

HEADS = ("eagle", "mlp")


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

    def forward(self, f_prev: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([f_prev, self.embed(tok)], -1))  # (B, L, H)
        if self.mlp is not None:
            return x + self.mlp(x)
        cos, sin = self.rotary(x, pos)
        out = self.layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))  # causal
        return out[0] if isinstance(out, tuple) else out

    def short(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.sub_w.T  # (..., S)


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


@torch.no_grad()
def evaluate(head: FeatureHead, seqs: Sequence[Sequence_], feats: Sequence[torch.Tensor], max_len: int) -> dict:
    """Held-out alpha (true features) and alpha_step2 (one own feature) per category."""
    per: dict[str, list[int]] = {}
    for idx in batches(seqs, 8192, 0, max_len):
        fin, tok, pos, _, _ = collate(seqs, feats, idx, max_len)
        fh = head(fin, tok, pos)  # column c predicts f_{c+1}, i.e. token c+2 (cropped coordinates)
        pred = head.ids[head.short(fh).argmax(-1)]  # (B, W)
        fin2 = fin.clone()
        fin2[:, 1:] = fh[:, :-1]
        pred2 = head.ids[head.short(head(fin2, tok, pos)).argmax(-1)]
        for b, i in enumerate(idx):
            s = seqs[i]
            col, ok = label_columns(s, max_len)
            tgt = s.top_i[ok, 0]
            c = per.setdefault(s.category, [0, 0, 0])
            c[0] += int((pred[b, col[ok]] == tgt).sum())
            c[1] += int((pred2[b, col[ok]] == tgt).sum())
            c[2] += int(ok.sum())
    tot = [sum(v[j] for v in per.values()) for j in range(3)]
    return {"alpha": tot[0] / max(1, tot[2]), "alpha_step2": tot[1] / max(1, tot[2]), "tokens": tot[2],
            "per_category": {k: round(v[0] / max(1, v[2]), 4) for k, v in sorted(per.items())}}


def train_head(kind: str, target: nn.Module, train: list[Sequence_], ftrain: list[torch.Tensor],
               held: list[Sequence_], fheld: list[torch.Tensor], ids: torch.Tensor, a: argparse.Namespace) -> dict:
    """One head's schedule (warmup + cosine to 10%); a held-out point every ``eval_every`` steps."""
    from tqdm.auto import tqdm

    torch.manual_seed(a.seed)
    head = FeatureHead(target, ids, kind)
    params = [p for n, p in head.named_parameters() if p.requires_grad and not n.startswith("embed")]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    per_epoch = len(batches(train, a.batch_tokens, 0, a.max_len))
    total = max(1, int(per_epoch * a.epochs))
    curve = [{"step": 0, "trained_tokens": 0, **evaluate(head.eval(), held, fheld, a.max_len)}]
    head.train()
    step, seen, t0 = 0, 0, time.time()
    bar = tqdm(total=total, desc=f"{kind} head", disable=a.no_progress)
    epoch = 0
    while step < total:
        for idx in batches(train, a.batch_tokens, a.seed * 1000 + epoch, a.max_len):
            if step >= total:
                break
            lr = a.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / total)))
            for g in opt.param_groups:
                g["lr"] = lr
            fin, tok, pos, fout, mask = collate(train, ftrain, idx, a.max_len, a.positions == "generated")
            pred = head(fin, tok, pos)[mask]  # (M, H)
            true = fout[mask]
            reg = F.smooth_l1_loss(pred, true)
            soft = torch.softmax(head.short(true), -1)  # (M, S) the target's distribution on the shortlist
            cls = -(soft * torch.log_softmax(head.short(pred), -1)).sum(-1).mean()
            loss = reg + a.w_cls * cls
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            seen += int(mask.sum())
            bar.update(1)
            if step % a.eval_every == 0 or step == total:
                point = {"step": step, "trained_tokens": seen, "minutes": (time.time() - t0) / 60,
                         **evaluate(head.eval(), held, fheld, a.max_len)}
                head.train()
                curve.append(point)
                bar.set_postfix(alpha=f"{point['alpha']:.3f}")
                print(json.dumps({"head": kind, **{k: v for k, v in point.items() if k != "per_category"}}),
                      file=sys.stderr, flush=True)
        epoch += 1
    bar.close()
    return {"curve": curve, "final": curve[-1], "steps": total, "params": sum(p.numel() for p in params), "head": head}


@torch.inference_mode()
def head_cost(head: FeatureHead, target: nn.Module, context: int = 256, reps: int = 30) -> dict:
    """Milliseconds of one draft step of ``head`` (1 position: fc, body, shortlist argmax) and of
    one single-token target forward over a ``context``-token KV cache, at batch 1, interleaved.

    Why: at k = 1 a draft that agrees ``alpha`` and costs ``c`` of a target step pays about
    (1 + alpha) / (v2 + c), v2 = a 2-token verify's cost; a feature head's case rests on a small c.
    The target side is transformers' own cached forward, not the engine's kernels (a ratio, not an
    engine measurement).
    """
    from specrl.kvcache import cache_kwarg

    head.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, context + 1), generator=g)
    out = target(input_ids=ids[:, :context], use_cache=True)
    kw = {cache_kwarg(target): out.past_key_values, "use_cache": True}
    f = out.logits.new_zeros(1, 1, target.config.hidden_size)
    pos = torch.tensor([[context]])
    times: dict[str, list[float]] = {"target": [], "head": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        target(input_ids=ids[:, context:], position_ids=pos, **kw)  # the cache grows by one per call: negligible
        t1 = time.perf_counter()
        head.ids[head.short(head(f, ids[:, context:], pos)).argmax(-1)]
        times["target"].append(t1 - t0)
        times["head"].append(time.perf_counter() - t1)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return {"target_step_ms": med["target"], "head_step_ms": med["head"], "c": med["head"] / med["target"]}


def plot(results: dict, compare: list[dict] | None, card_curve: list[dict] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for kind, r in results.items():
        c = r["curve"]
        ax.plot([p["trained_tokens"] for p in c], [p["alpha"] for p in c], marker="o", ms=3, label=f"{kind} head (this data)")
    if compare:
        ax.plot([p["train_tokens"] for p in compare], [p["alpha"] for p in compare], marker="s", ms=3,
                label="2-layer token draft (this data; 64-prompt eval subset before its last point)")
    if card_curve:
        ax.plot([p["train_tokens"] for p in card_curve], [p["alpha"] for p in card_curve], ls="--", color="grey",
                label="shipped 2-layer draft (GPU data, 731k unique)")
    ax.axhline(0.5, color="red", lw=0.8, ls=":", label="issue target alpha 0.5")
    ax.set_xlabel("trained tokens (with repeats)")
    ax.set_ylabel("held-out alpha (top-1 agreement)")
    ax.set_title("Draft heads: held-out alpha vs training")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a `specrl draft data` directory")
    ap.add_argument("--model", default="default", help="the target the data was made with")
    ap.add_argument("--heads", default="mlp,eagle", help=f"comma-separated, from {', '.join(HEADS)}")
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--w-cls", type=float, default=0.1, help="weight of the soft cross-entropy (EAGLE: 0.1)")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--shortlist", type=int, default=8192)
    ap.add_argument("--positions", choices=["all", "generated"], default="all",
                    help="train on every position (teacher forcing makes prompts free data) or only on generated tokens")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compare-run", type=Path, default=None, help="a `specrl draft train` run dir on the same data")
    ap.add_argument("--card", type=Path, default=Path(__file__).resolve().parents[1] / "specrl/data/drafts/smollm2-135m/card.json")
    ap.add_argument("--out", type=Path, default=Path("bench-out/feature-heads"))
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    kinds = [k.strip() for k in a.heads.split(",") if k.strip()]
    bad = [k for k in kinds if k not in HEADS]
    if bad or not kinds:
        raise ConfigError(f"--heads {a.heads!r} names unknown heads {bad}. Allowed: {', '.join(HEADS)}.")
    if a.threads:
        torch.set_num_threads(a.threads)
    from specrl.models import load_causal_lm

    held = load_sequences(shard_files(a.data_dir, "heldout"))
    train = [s for s in load_sequences(shard_files(a.data_dir, "train")) if not s.stage.endswith("-text")]
    if not held or not train:
        raise ConfigError(f"{a.data_dir} lacks held-out or training shards. Fix: run `specrl draft data --data-dir "
                          f"{a.data_dir}` first (the held-out stage comes first, then train-greedy).")
    target, _, name = load_causal_lm(a.model, torch.device("cpu"), torch.float32)
    target.requires_grad_(False)
    fheld = target_features(target, held, a.max_len, progress=not a.no_progress)
    ftrain = target_features(target, train, a.max_len, progress=not a.no_progress)
    eos = target.generation_config.eos_token_id
    always = [eos] if isinstance(eos, int) else list(eos or [])
    ids = shortlist_from_counts(shortlist_scores(token_counts(train, target.config.vocab_size)), a.shortlist, always)
    results = {}
    for k in kinds:
        results[k] = train_head(k, target, train, ftrain, held, fheld, ids, a)
        results[k]["cost"] = head_cost(results[k].pop("head"), target)
    compare = None
    if a.compare_run is not None:
        lines = (a.compare_run / "curve.jsonl").read_text().splitlines()
        compare = [json.loads(x) for x in lines if x.strip()]
    card_curve = json.loads(a.card.read_text()).get("learning_curve") if a.card.is_file() else None
    a.out.mkdir(parents=True, exist_ok=True)
    unique = sum(min(len(s.tokens), a.max_len) - 1 if a.positions == "all" else len(s.tokens) - s.prompt_len
                 for s in train)
    summary = {"target": name, "data_dir": str(a.data_dir), "train_sequences": len(train), "train_positions": unique,
               "heldout_tokens": results[kinds[0]]["final"]["tokens"], "settings": {k: str(v) for k, v in vars(a).items()},
               "heads": results, "compare_run": compare}
    (a.out / "feature_heads.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(results, compare, card_curve, a.out / "feature_heads.png")
    for k, r in results.items():
        f = r["final"]
        print(f"{k}: held-out alpha {f['alpha']:.3f} (step 2 {f['alpha_step2']:.3f}) after {f['trained_tokens']} "
              f"trained tokens over {unique} positions; {r['params'] / 1e6:.1f}M params; a draft step costs "
              f"{r['cost']['head_step_ms']:.2f} ms = {r['cost']['c']:.3f} of a target step ({r['cost']['target_step_ms']:.1f} ms)")
    if compare:
        print(f"2-layer token draft on the same data: alpha {compare[-1]['alpha']:.3f} after {compare[-1]['train_tokens']} tokens")
    print(json.dumps({k: round(r["final"]["alpha"], 4) for k, r in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
