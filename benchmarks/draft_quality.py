"""Quality and speed of a trained draft on held-out prompts, per Spec-Bench category.

For every held-out Spec-Bench prompt (the split of ``specrl draft``: never trained on):

1. the target's greedy continuation with the engine at k = 0 (timed: the AR baseline);
2. alpha: the draft's top-1 / top-4 agreement with that continuation (teacher forcing: the
   continuation *is* the target's argmax at every position);
3. mean accept length of the engine with the draft at chains k = 2 and k = 4;
4. the engine with the best static (k, w), picked on calibration prompts from the train split,
   timed side by side with (1): AR and speculative runs alternate per prompt so both see the
   same machine load. The ratio of wall times is the batch-1 speedup (outputs are identical).

``--drafter feature`` measures a feature head (``specrl draft head``) through the engine's
``feature`` drafter instead of a draft LM; its alpha reads the target's true features.

Also reports the draft cost ratio c (one draft step / one target step). The final stdout line
is one JSON object with at least ``alpha`` and ``speedup_bs1``. ``--card PATH`` merges the
results into a draft card's ``benchmark`` section.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import final_line, machine, table

from specrl.drafters import make_drafter
from specrl.drafters.base import Drafter
from specrl.drafters.feature import FeatureDrafter
from specrl.drafttrain.data import DataConfig, prompt_split
from specrl.drafttrain.feature import FeatureHead, load_head
from specrl.drafttrain.shipped import runtime_dtype, shipped_dir, shipped_head_dir
from specrl.drafttrain.student import CARD, load_draft
from specrl.engine import Action, SpecEngine
from specrl.models import ModelPair
from specrl.profiling import forward_grid
from specrl.prompts import load_prompts

# the prompt sets next to the checkout (../shared/data), never committed into the project
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SPEC_BENCH = SHARED_DATA / "spec_bench" / "question.jsonl"
MT_BENCH = SHARED_DATA / "mt_bench" / "question.jsonl"
# per-category sums: top-1 / top-4 hits, positions, accept lengths k=2 / k=4, AR / spec seconds, AR tokens,
# prompts, spec tokens (equal to AR tokens whenever outputs are identical, i.e. always in float32)
KEYS = ("a1", "a4", "pos", "acc2", "acc4", "ar_s", "sp_s", "tok", "n", "sp_tok")
SPEC_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def spec_category(cat: str) -> str:
    """Spec-Bench reports its 80 MT-Bench rows as one category."""
    return cat if cat in SPEC_CATEGORIES else "mt_bench"


def heldout_selection(held: list, spec_texts: set[str], per_category: int) -> list:
    """Up to ``per_category`` held-out Spec-Bench prompts per category (MT-Bench: one per sub-category in turn)."""
    groups: dict[str, dict[str, list]] = {}
    for p in held:
        if spec_texts and p.text not in spec_texts:
            continue  # built-in prompts are held out too, but are not Spec-Bench
        groups.setdefault(spec_category(p.category), {}).setdefault(p.category, []).append(p)
    out = []
    for cat in sorted(groups):
        subs = list(groups[cat].values())
        order = [subs[j][i] for i in range(max(map(len, subs))) for j in range(len(subs)) if i < len(subs[j])]
        out += order[:per_category]
    return out


def run_engine(pair: ModelPair, ids: list[int], n: int, action: Action,
               drafter: str | Callable[[], Drafter]) -> tuple[list[int], float, float]:
    """(output, seconds, mean accept length) of one request at batch 1 (``drafter``: a name or a factory)."""
    eng = SpecEngine(pair, drafter=drafter if isinstance(drafter, str) else drafter())
    t0 = time.perf_counter()
    (r,) = eng.generate([ids], n, action=action, batch_size=1)
    return r.output.tolist(), time.perf_counter() - t0, r.accepted / max(1, r.steps)


@torch.inference_mode()
def agreement(draft: torch.nn.Module, prompt: list[int], out: list[int]) -> tuple[float, float, int]:
    """(top-1 hits, top-4 hits, positions) of the draft on the target's greedy continuation."""
    x = torch.tensor([prompt + out])
    logits = draft(x).logits[0, len(prompt) - 1 : len(prompt) + len(out) - 1]  # (G, V)
    top4 = logits.topk(4, dim=-1).indices
    y = torch.tensor(out)
    return float((top4[:, 0] == y).sum()), float((top4 == y[:, None]).any(-1).sum()), len(out)


@torch.inference_mode()
def feature_agreement(head: FeatureHead, target: torch.nn.Module, prompt: list[int], out: list[int]
                      ) -> tuple[float, float, int]:
    """As :func:`agreement` for a feature head: token t is drafted from head(f_{t-2}, token t-1), the
    target's true feature before the previous token (a k = 1 draft after each verify)."""
    x = torch.tensor([prompt + out])
    f = target.model(input_ids=x).last_hidden_state  # (1, L, H)
    p = len(prompt)
    lo = max(p, 2)  # token t needs f_{t-2}: the first generated token of a 1-token prompt has none
    fh = head(f[:, lo - 2 : p + len(out) - 2], x[:, lo - 1 : p + len(out) - 1])  # (1, G', H)
    top4 = head.ids[head.short(fh)[0].topk(4, dim=-1).indices]  # (G', 4)
    y = torch.tensor(out[lo - p :])
    return float((top4[:, 0] == y).sum()), float((top4 == y[:, None]).any(-1).sum()), len(out)


@torch.inference_mode()
def head_step_ms(head: FeatureHead, reps: int = 30) -> float:
    """Median ms of one batch-1 draft step of a feature head (fc, body, shortlist argmax)."""
    f = head.sub_w.new_zeros(1, 1, head.sub_w.shape[1])
    tok = torch.zeros(1, 1, dtype=torch.long, device=f.device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        head.ids[head.short(head(f, tok)).argmax(-1)]
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


class DraftUnderTest:
    """What :func:`measure` needs of a draft: a fresh drafter per engine, agreement, step cost."""

    def __init__(self, pair: ModelPair, head: FeatureHead | None = None) -> None:
        self.pair, self.head = pair, head

    def make(self) -> Drafter:
        return FeatureDrafter(self.head) if self.head is not None else make_drafter("model", self.pair)

    def agreement(self, prompt: list[int], out: list[int]) -> tuple[float, float, int]:
        if self.head is not None:
            return feature_agreement(self.head, self.pair.target, prompt, out)
        return agreement(self.pair.draft, prompt, out)

    def step_ms(self) -> float:
        return head_step_ms(self.head) if self.head is not None else step_ms(self.pair.draft)[0]


def step_ms(model: torch.nn.Module, tokens: tuple[int, ...] = (1,), ctx: int = 256, reps: int = 15) -> list[float]:
    """Median ms of one cached batch-1 forward of n tokens after ctx tokens, for each n in ``tokens``
    (the profiler's interleaved timing, on the engine's cache path)."""
    dev = next(model.parameters()).device
    grid = forward_grid(model, dev, [1], list(tokens), [ctx], reps, model.config.vocab_size)  # (1, n, 1) seconds
    return [1000 * float(x) for x in grid[0, :, 0]]


def load_pair(model: str, dtype: str, draft_dir: Path | None, draft_dtype: str,
              shortlist: int | None = None) -> ModelPair:
    pair = ModelPair.load(model, device="cpu", dtype=dtype)
    d = draft_dir or shipped_dir(pair.target_name)
    card = json.loads((d / CARD).read_text())
    dt = runtime_dtype(pair.target, card) if draft_dtype == "auto" else getattr(torch, draft_dtype)
    draft = load_draft(d, pair.target, dtype=dt, shortlist=shortlist)
    return ModelPair.from_models(pair.target, draft, tokenizer=pair.tokenizer, target_name=pair.target_name,
                                 draft_name=str(d))


def measure(pair: ModelPair, held: list, calib: list, n: int, grid: list[Action], log,
            draft: DraftUnderTest | None = None) -> dict:
    """Everything for one dtype; see the module docstring."""
    draft = draft or DraftUnderTest(pair)
    enc = [pair.encode_prompt(p.text) for p in held]
    cal = [pair.encode_prompt(p.text) for p in calib]
    rates = {}
    for a in grid:  # calibration: tokens/s of each static action on train-split prompts
        toks = secs = 0.0
        for ids in cal:
            out, dt, _ = run_engine(pair, ids, n, a, draft.make)
            toks, secs = toks + len(out), secs + dt
        rates[a] = toks / secs
    best = max(rates, key=rates.get)
    log(table(["k", "w", "tokens/s (calibration)"], [[a.k, a.w, rates[a]] for a in grid]))
    per: dict[str, dict[str, float]] = {}
    same = True
    for p, ids in zip(held, enc):
        c = per.setdefault(spec_category(p.category), dict.fromkeys(KEYS, 0.0))
        ref, t_ar, _ = run_engine(pair, ids, n, Action(0, 1), "ngram")  # AR: no draft prefill
        out, t_sp, _ = run_engine(pair, ids, n, best, draft.make)
        same &= out == ref
        o2, _, l2 = run_engine(pair, ids, n, Action(2, 1), draft.make)
        o4, _, l4 = run_engine(pair, ids, n, Action(4, 1), draft.make)
        same &= o2 == ref and o4 == ref
        h1, h4, m = draft.agreement(ids, ref)
        for k, v in zip(KEYS, (h1, h4, m, l2, l4, t_ar, t_sp, len(ref), 1, len(out))):
            c[k] += v
    rows, cats = [], {}
    for cat in sorted(per):
        c = per[cat]
        speedup = (c["sp_tok"] / c["sp_s"]) / (c["tok"] / c["ar_s"])  # tokens/s ratio
        cats[cat] = {"alpha": c["a1"] / c["pos"], "alpha_top4": c["a4"] / c["pos"], "accept_len_k2": c["acc2"] / c["n"],
                     "accept_len_k4": c["acc4"] / c["n"], "speedup_bs1": speedup, "prompts": int(c["n"])}
        rows.append([cat, *[cats[cat][k] for k in ("alpha", "alpha_top4", "accept_len_k2", "accept_len_k4",
                                                    "speedup_bs1")], int(c["n"])])
    tot = {k: sum(c[k] for c in per.values()) for k in KEYS}
    td = draft.step_ms()
    t1, *tv = step_ms(pair.target, (1, 3, 4, 5))
    res = {
        "alpha": tot["a1"] / tot["pos"], "alpha_top4": tot["a4"] / tot["pos"],
        "accept_len_k2": tot["acc2"] / tot["n"], "accept_len_k4": tot["acc4"] / tot["n"],
        "speedup_bs1": (tot["sp_tok"] / tot["sp_s"]) / (tot["tok"] / tot["ar_s"]), "best_action": [best.k, best.w],
        "ar_tokens_per_s": tot["tok"] / tot["ar_s"], "spec_tokens_per_s": tot["sp_tok"] / tot["sp_s"],
        "target_step_ms": t1, "draft_step_ms": td, "draft_cost_ratio": td / t1,
        "verify_cost_ratio": {f"{m}": t / t1 for m, t in zip((3, 4, 5), tv)},
        "outputs_identical": bool(same), "per_category": cats,
    }
    log(table(["category", "alpha", "alpha top-4", "accept k=2", "accept k=4", "speedup bs1", "prompts"], rows))
    log(f"best static action {best}; AR {res['ar_tokens_per_s']:.1f} tok/s, spec {res['spec_tokens_per_s']:.1f} tok/s; "
        f"draft step {td:.2f} ms / target step {t1:.2f} ms (c = {td / t1:.3f})")
    return res


def parse_actions(text: str) -> list[Action]:
    """'1:1,1:2' -> [Action(1, 1), Action(1, 2)], with a fix on bad input."""
    try:
        return [Action(*(int(x) for x in item.split(":"))) for item in text.split(",") if item.strip()]
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--actions {text!r} is invalid ({e}). Fix: comma-separated k:w pairs, e.g. 1:1,1:2,2:2.") from e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", choices=["model", "feature"], default="model",
                    help="model: a draft LM (--draft); feature: a feature head on the target's hidden state (--head)")
    ap.add_argument("--draft", type=Path, default=None, help="draft directory (default: the shipped draft)")
    ap.add_argument("--head", type=Path, default=None, help="feature head directory (default: the shipped head)")
    ap.add_argument("--draft-dtype", default="auto", help="auto (the card's choice), float32 or bfloat16")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="target dtypes to measure, comma-separated")
    ap.add_argument("--sources", action="append", default=None,
                    help="prompt sources of the training split (default: builtin + Spec-Bench + MT-Bench)")
    ap.add_argument("--per-category", type=int, default=3, help="held-out prompts per Spec-Bench category")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shortlist", type=int, default=None,
                    help="keep only the draft's top-N shortlist ids (a cheaper head; needs a stored ranking)")
    ap.add_argument("--card", type=Path, default=None, help="merge results into this card.json's 'benchmark'")
    ap.add_argument("--actions", default=None,
                    help="static actions to calibrate over, as k:w pairs, e.g. 1:1,1:2,2:2 (default: 1:1,2:1,3:1,4:1,2:2)")
    ap.add_argument("--quick", action="store_true", help="1 prompt per category, 48 tokens, float32 only")
    args = ap.parse_args()
    if args.quick:
        args.per_category, args.max_new_tokens, args.dtypes = 1, 48, "float32"
    if args.threads:
        torch.set_num_threads(args.threads)
    sources = args.sources or ["builtin", str(SPEC_BENCH), str(MT_BENCH)]
    train, held = prompt_split(DataConfig(sources=tuple(sources)))
    spec_texts = {p.text for p in load_prompts(str(SPEC_BENCH))} if SPEC_BENCH.exists() else set()
    held_sel = heldout_selection(held, spec_texts, args.per_category)
    calib = [p for p in train if not spec_texts or p.text in spec_texts][:: max(1, len(train) // 3)][:3]
    if args.quick:
        calib = calib[:2]
    grid = [Action(k, w) for k, w in ((1, 1), (2, 1), (3, 1), (4, 1), (2, 2))]
    if args.actions:
        grid = parse_actions(args.actions)
    elif args.quick:
        grid = [Action(2, 1), Action(3, 1), Action(4, 1)]
    print(f"# draft quality, {machine()}, {len(held_sel)} held-out prompts x {args.max_new_tokens} tokens")
    results = {}
    for dt in args.dtypes.split(","):
        if args.drafter == "feature":
            pair = ModelPair.load(args.model, device="cpu", dtype=dt)
            head = load_head(args.head or shipped_head_dir(pair.target_name), pair.target)
            draft = DraftUnderTest(pair, head)
            print(f"\n## target {dt}, feature head {args.head or shipped_head_dir(pair.target_name)}\n")
        else:
            pair = load_pair(args.model, dt, args.draft, args.draft_dtype, args.shortlist)
            draft = DraftUnderTest(pair)
            print(f"\n## target {dt}, draft {next(pair.draft.parameters()).dtype}\n")
        results[dt] = measure(pair, held_sel, calib, args.max_new_tokens, grid, print, draft)
    first = results[args.dtypes.split(",")[0]]
    out = {"alpha": first["alpha"], "alpha_top4": first["alpha_top4"], "speedup_bs1": first["speedup_bs1"],
           "accept_len_k2": first["accept_len_k2"], "accept_len_k4": first["accept_len_k4"],
           "best_action": first["best_action"], "draft_cost_ratio": first["draft_cost_ratio"],
           "drafter": args.drafter, "dtype": args.dtypes.split(",")[0], "by_dtype": results, "prompts": len(held_sel),
           "max_new_tokens": args.max_new_tokens, "machine": machine()}
    if "bfloat16" in results and args.dtypes.split(",")[0] != "bfloat16":
        out["speedup_bs1_bf16"] = results["bfloat16"]["speedup_bs1"]
    if args.card:
        card = json.loads(args.card.read_text())
        argv = [a for a in sys.argv[1:] if a != "--card" and a != str(args.card)]
        card["benchmark"] = {"command": " ".join(["python benchmarks/draft_quality.py", *argv]),
                             **{k: v for k, v in out.items()}}
        args.card.write_text(json.dumps(card, indent=1) + "\n")
    print()
    final_line(out)


if __name__ == "__main__":
    main()
