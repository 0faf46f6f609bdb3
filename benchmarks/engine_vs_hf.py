"""Engine vs transformers on the same prompts and model, measured side by side.

1. ``ar_vs_generate``: engine with k = 0 vs ``model.generate`` (greedy), tokens/s ratio.
2. ``spec_vs_assisted``: engine with the n-gram drafter at its best static (k, w) vs
   transformers' prompt-lookup assisted generation (``prompt_lookup_num_tokens``, the same kind
   of draft) at its best number of draft tokens. With ``--draft`` (a draft model), also engine
   ``drafter=model`` vs ``generate(assistant_model=draft)``: ``spec_vs_assisted_model``.

Best settings are picked on calibration prompts disjoint from the measured ones, for both
sides. Batch 1 (transformers' assisted generation only supports batch 1). Runs alternate
between the two sides to spread machine noise evenly. The final stdout line is one JSON object.
"""

from __future__ import annotations

import argparse

import torch
from _common import final_line, machine, mixed_prompts, table, timed

from specrl.engine import Action, SpecEngine
from specrl.models import ModelPair
from specrl.tree import parse_action


def hf_generate(pair: ModelPair, ids: list[list[int]], n: int, **kw) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for p in ids:
            x = torch.tensor([p], device=pair.device)
            y = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                     pad_token_id=2, **kw)
            outs.append(y[0, len(p):].tolist())
    return outs


def engine_generate(pair: ModelPair, ids: list[list[int]], n: int, action: Action, drafter: str) -> list[list[int]]:
    eng = SpecEngine(pair, drafter=drafter)
    return [r.output.tolist() for r in eng.generate(ids, n, action=action, batch_size=1)]


def ntokens(outs: list[list[int]]) -> int:
    return sum(len(o) for o in outs)


def best_of(label: str, candidates: dict, run, calib: list[list[int]], n: int) -> tuple[object, list]:
    rows = []
    for name, cfg in candidates.items():
        outs, dt = timed(lambda: run(calib, n, cfg))
        rows.append([label, name, ntokens(outs) / dt])
    best = max(rows, key=lambda r: r[2])
    return candidates[best[1]], rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default=None, help="draft model for the model-drafter comparison")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer prompts and settings (smoke run)")
    ap.add_argument("--setting", default=None, metavar="K,W",
                    help="engine n-gram setting to use instead of calibrating (e.g. a previous run's best)")
    ap.add_argument("--lookup", type=int, default=None,
                    help="prompt_lookup_num_tokens to use instead of calibrating")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_new_tokens, args.repeats = 3, 32, 1

    pair = ModelPair.load(args.model, args.draft, dtype=args.dtype)
    measure = [pair.encode_prompt(p.text) for p in mixed_prompts(args.prompts, offset=0)]
    calib = [pair.encode_prompt(p.text) for p in mixed_prompts(3, offset=40)]
    n = args.max_new_tokens
    print(f"# engine vs transformers on {pair.target_name}, {machine()}, dtype {pair.dtype}")

    grid = {f"k={k},w={w}": Action(k, w) for k in (1, 2, 4, 6, 8) for w in (1, 2, 4)}
    lookup = {f"prompt_lookup_num_tokens={k}": k for k in (1, 2, 4, 6, 10)}
    if args.quick:
        grid = {k: v for k, v in grid.items() if k in ("k=4,w=1", "k=4,w=2")}
        lookup = {"prompt_lookup_num_tokens=4": 4}
    if args.setting:
        grid = {f"k={args.setting}": Action(*parse_action(args.setting, prefix="--setting "))}
    if args.lookup:
        lookup = {f"prompt_lookup_num_tokens={args.lookup}": args.lookup}
    best_act, calib_rows = best_of("engine ngram", grid, lambda c, m, a: engine_generate(pair, c, m, a, "ngram"),
                                   calib, n)
    best_pl, rows2 = best_of("transformers lookup", lookup,
                             lambda c, m, k: hf_generate(pair, c, m, prompt_lookup_num_tokens=k), calib, n)
    calib_rows += rows2
    print("\nCalibration (tokens/s, picks the best static setting of each side):\n")
    print(table(["side", "setting", "tokens/s"], calib_rows))

    sides = {
        "engine k=0": lambda: engine_generate(pair, measure, n, Action(0, 1), "ngram"),
        "transformers generate": lambda: hf_generate(pair, measure, n),
        f"engine ngram {best_act.k},{best_act.w}": lambda: engine_generate(pair, measure, n, best_act, "ngram"),
        f"transformers prompt lookup {best_pl}": lambda: hf_generate(pair, measure, n, prompt_lookup_num_tokens=best_pl),
    }
    if pair.draft is not None:
        best_model, _ = best_of("engine model", grid, lambda c, m, a: engine_generate(pair, c, m, a, "model"),
                                calib, n)
        sides[f"engine model {best_model.k},{best_model.w}"] = lambda: engine_generate(pair, measure, n, best_model,
                                                                                      "model")
        sides["transformers assistant_model"] = lambda: hf_generate(pair, measure, n, assistant_model=pair.draft)
    secs = {k: 0.0 for k in sides}
    outs: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, fn in sides.items():  # interleaved: every side sees the same machine state
            o, dt = timed(fn)
            secs[name] += dt
            outs[name] = o
    tps = {k: ntokens(outs[k]) * args.repeats / secs[k] for k in sides}
    ref = outs["engine k=0"]
    same = {k: outs[k] == ref for k in sides}
    print(f"\nMeasured on {len(measure)} prompts x {n} new tokens, {args.repeats} interleaved repeats:\n")
    print(table(["side", "tokens/s", "output == engine k=0"], [[k, tps[k], same[k]] for k in sides]))
    names = list(sides)
    result = {
        "ar_vs_generate": tps[names[0]] / tps[names[1]],
        "spec_vs_assisted": tps[names[2]] / tps[names[3]],
        "spec_vs_ar": tps[names[2]] / tps[names[0]],
        "best_engine_ngram": [best_act.k, best_act.w],
        "best_prompt_lookup_tokens": best_pl,
        "outputs_identical": all(same.values()),
    }
    if pair.draft is not None:
        result["spec_vs_assisted_model"] = tps[names[4]] / tps[names[5]]
    print()
    final_line(result)


if __name__ == "__main__":
    main()
