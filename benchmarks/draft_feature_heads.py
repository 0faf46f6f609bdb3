"""Feature-level draft heads vs the token-level draft, on the same distillation data.

Why: the shipped draft (2 target layers on tokens only) gains ~0.04 held-out alpha per doubling
of target-generated data, and these CPUs make ~70 tokens/s of it. A head that reads the
target's own last hidden state (EAGLE, Medusa) starts from the target's plan for the next
tokens, and needs no generation at all: teacher forcing gives features and labels for any text.
This script asks, before any engine work: at the data this machine can make, which head
predicts the target best?

Heads (``specrl.drafttrain.feature``; each predicts the target's feature f_i from f_{i-1} and the
embedding of token i, then scores it with the target's frozen head over a shortlist; the argmax
is the draft for token i+1):

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
import json
import time
from pathlib import Path

import torch
from torch import nn

from specrl.drafttrain.feature import HEADS, FeatureHead, HeadConfig, check_data_dir, load_data, train_head
from specrl.errors import ConfigError


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
        ax.plot([p["trained_tokens"] for p in c], [p["alpha"] for p in c], marker="o", ms=3, label=f"{kind} head (this data)" if kind in HEADS else kind)
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

    check_data_dir(a.data_dir)

    target, _, name = load_causal_lm(a.model, torch.device("cpu"), torch.float32)
    target.requires_grad_(False)
    train, ftrain, held, fheld, ids = load_data(target, a.data_dir, a.max_len, a.shortlist, progress=not a.no_progress)
    results = {}
    for k in kinds:
        cfg = HeadConfig(kind=k, epochs=a.epochs, lr=a.lr, w_cls=a.w_cls, batch_tokens=a.batch_tokens, max_len=a.max_len,
                         shortlist=a.shortlist, positions=a.positions, eval_every=a.eval_every, seed=a.seed)
        results[k] = train_head(target, train, ftrain, held, fheld, ids, cfg, progress=not a.no_progress)
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
        print(f"{k}: held-out alpha {f['alpha']:.3f} (step 2 {f['alpha_step2']:.3f}, {f['alpha_step2_given1']:.3f} after a right step 1) after {f['trained_tokens']} "
              f"trained tokens over {unique} positions; {r['params'] / 1e6:.1f}M params; a draft step costs "
              f"{r['cost']['head_step_ms']:.2f} ms = {r['cost']['c']:.3f} of a target step ({r['cost']['target_step_ms']:.1f} ms)")
    if compare:
        print(f"2-layer token draft on the same data: alpha {compare[-1]['alpha']:.3f} after {compare[-1]['train_tokens']} tokens")
    print(json.dumps({k: round(r["final"]["alpha"], 4) for k, r in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
