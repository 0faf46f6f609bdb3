"""The model drafter's ``min_confidence`` (dynamic draft depth) against static chains, batch 1.

Plain decoding, static k = 1 and 2, and deeper chains/trees whose nodes the draft gives less
than a threshold are not proposed (``specrl.drafters.model``), on the embedded target with the
shipped draft. Settings run interleaved (round-robin, ``--repeats``) so machine noise hits all
alike; tokens/s include prefill. Final stdout line: JSON with the ratio of each setting to k = 0.
"""

from __future__ import annotations

import argparse
import time

from _common import final_line, machine, mixed_prompts, table

from specrl.drafters.model import ModelDrafter
from specrl.engine import Action, SpecEngine
from specrl.models import ModelPair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    pair = ModelPair.load("default", "default-draft")
    ids = [pair.encode_prompt(p.text) for p in mixed_prompts(args.prompts, offset=0)]
    settings = [("k=0", Action(0, 1), 0.0), ("k=1", Action(1, 1), 0.0), ("k=2", Action(2, 1), 0.0)]
    settings += [(f"k={k} t={t}", Action(k, 1), t) for k in (4, 8) for t in (0.3, 0.5, 0.7)]
    settings += [("k=4,w=2 t=0.5", Action(4, 2), 0.5)]
    secs = {name: 0.0 for name, _, _ in settings}
    toks, outs = {}, {}
    for _ in range(args.repeats):
        for name, act, thr in settings:
            drafter = ModelDrafter(pair.draft, min_confidence=thr) if act.k else "ngram"
            t0 = time.perf_counter()
            res = SpecEngine(pair, drafter=drafter).generate(ids, args.max_new_tokens, action=act, batch_size=1)
            secs[name] += time.perf_counter() - t0
            toks[name] = sum(len(r.output) for r in res)
            outs[name] = [r.output.tolist() for r in res]
    tps = {name: toks[name] * args.repeats / secs[name] for name in secs}
    print(f"# draft confidence threshold, {pair.target_name} + shipped draft, {machine()}, "
          f"{len(ids)} prompts x {args.max_new_tokens} tokens, batch 1, {args.repeats} interleaved repeats\n")
    print(table(["setting", "tokens/s", "vs k = 0", "output == k = 0"],
                [[n, tps[n], tps[n] / tps["k=0"], outs[n] == outs["k=0"]] for n in secs]))
    final_line({"vs_ar": {n: round(tps[n] / tps["k=0"], 3) for n in secs},
                "outputs_identical": all(o == outs["k=0"] for o in outs.values())})


if __name__ == "__main__":
    main()
