"""``specrl demo``: the main job on the embedded default model.

For now: decode held-out built-in prompts with plain decoding (k = 0) and with speculative
decoding (n-gram drafter) side by side, check the outputs are identical, and print the speedup.
"""

from __future__ import annotations

import argparse
import time

from specrl.generate import add_model_args


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--limit", type=int, default=8, help="number of built-in prompts (one per category first)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--w", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    from specrl.engine import Action, SpecEngine
    from specrl.models import ModelPair
    from specrl.prompts import load_prompts

    pair = ModelPair.load(args.model, None, args.device, args.dtype)
    prompts = load_prompts("builtin")
    # one prompt per category first, so a short demo still covers every task
    seen, order = set(), []
    for p in prompts:
        if p.category not in seen:
            seen.add(p.category)
            order.append(p)
    order += [p for p in prompts if p not in order]
    chosen = order[: args.limit]
    ids = [pair.encode_prompt(p.text) for p in chosen]
    results = {}
    for label, action in (("plain (k=0)", Action(0, 1)), (f"speculative (k={args.k}, w={args.w})", Action(args.k, args.w))):
        engine = SpecEngine(pair, drafter=args.drafter)
        t0 = time.perf_counter()
        done = engine.generate(ids, args.max_new_tokens, action=action, batch_size=1)
        wall = time.perf_counter() - t0
        ntok = sum(len(r.output) for r in done)
        acc = sum(r.accepted for r in done) / max(1, sum(r.steps for r in done))
        results[label] = (done, ntok / wall, acc)
        print(f"{label:<28} {ntok} tokens in {wall:6.2f} s = {ntok / wall:6.1f} tokens/s, mean accept length {acc:.2f}")
    (plain, r0, _), (spec, r1, _) = results.values()
    same = all(a.output.tolist() == b.output.tolist() for a, b in zip(plain, spec))
    print(f"speedup {r1 / r0:.2f}x; outputs identical to plain decoding: {same}")
    return 0 if same else 1
