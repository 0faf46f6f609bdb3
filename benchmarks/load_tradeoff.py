"""Why the speculation choice must depend on load: speedup over engine AR per (k, w) and batch.

For each batch size B, a closed loop keeps B requests running (a new prompt joins when one
finishes) over the same prompt queue, for every (k, w) in {0,1,2,4,8} x {1,2,4}. Greedy
decoding makes every setting produce the same tokens, so the settings differ only in steps and
time. Reported: throughput speedup over k = 0 at the same batch size and mean accept length.
The settings run interleaved (round-robin, several repeats) so machine noise hits all alike.
The final stdout line is one JSON object: {"best_speedup": {"1": x, "4": y, "8": z}, ...}.
"""

from __future__ import annotations

import argparse

from _common import final_line, machine, mixed_prompts, table

from specrl.engine import Action, SpecEngine
from specrl.models import ModelPair


def run_closed_loop(pair: ModelPair, ids: list[list[int]], n: int, batch: int, action: Action, drafter: str):
    """Returns (tokens, mean accept length, decode seconds). Prefill is the same for every
    setting and is excluded, so the speedups are those of the decode phase."""
    eng = SpecEngine(pair, drafter=drafter)
    decode = [0.0]

    def on_step(r):
        decode[0] += r.step_time - r.prefill_time

    done = eng.generate(ids, n, action=action, batch_size=batch, on_step=on_step)
    tokens = sum(len(r.output) for r in done)
    accepted = sum(r.accepted for r in done)
    steps = sum(r.steps for r in done)
    return tokens, accepted / max(1, steps), decode[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--requests-per-slot", type=int, default=2, help="prompts in the queue = this x batch size")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    ks, ws = (0, 1, 2, 4, 8), (1, 2, 4)
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        ks, ws, batches, args.max_new_tokens, args.requests_per_slot = (0, 2, 4), (1, 2), [1, 4], 24, 1
    pair = ModelPair.load(args.model, args.draft, dtype=args.dtype)
    print(f"# load trade-off on {pair.target_name} ({args.drafter} drafter), {machine()}, dtype {pair.dtype}")
    settings = [Action(0, 1)] + [Action(k, w) for k in ks if k > 0 for w in ws]
    best: dict[str, float] = {}
    best_setting: dict[str, list[int]] = {}
    all_rows = []
    for b in batches:
        ids = [pair.encode_prompt(p.text) for p in mixed_prompts(b * args.requests_per_slot, offset=3 * b)]
        secs = {a: 0.0 for a in settings}
        acc = {}
        toks = {}
        for _ in range(args.repeats):
            for a in settings:
                t, al, dt = run_closed_loop(pair, ids, args.max_new_tokens, b, a, args.drafter)
                secs[a] += dt
                toks[a], acc[a] = t, al
        tps = {a: toks[a] * args.repeats / secs[a] for a in settings}
        base = tps[Action(0, 1)]
        rows = [[b, a.k, a.w, tps[a], tps[a] / base, acc[a]] for a in settings]  # decode tokens/s
        all_rows += rows
        top = max(settings, key=lambda a: tps[a])
        best[str(b)] = tps[top] / base
        best_setting[str(b)] = [top.k, top.w]
        print(f"\nbatch {b}: {len(ids)} requests x {args.max_new_tokens} new tokens\n")
        print(table(["batch", "k", "w", "decode tokens/s", "speedup vs k=0", "mean accept len"], rows))
    print()
    final_line({"best_speedup": best, "best_setting": best_setting, "drafter": args.drafter,
                "dtype": str(pair.dtype).replace("torch.", "")})


if __name__ == "__main__":
    main()
