"""Ragged (packed) verify vs padded verify, measured side by side on the real model.

When the rows of a batch ask for different trees (per-request actions: one row k = 0, another
a k = 4 chain), the padded verify runs every row at the union tree's size; the ragged verify
packs only the nodes each row asked for into one pass (``SpecEngine(ragged=True)``, the
default). This script runs two engines on the same prompts and the same per-row actions, one
of each kind, stepping them alternately so that machine noise hits both alike, and reports the
verify pass's time per step for several batch sizes and action mixes. It also checks that both
commit the same tokens (greedy), and includes a uniform mix as a control (nothing to pack:
both take the same path, so its ratio shows the noise floor).

The draft model drafter fills every node a row asks for, so the trees are the sizes asked for.

Usage: python benchmarks/ragged_verify.py [--batch 4,8,16] [--steps 8]
Final line: {"verify_speedup": {"B=8 half k0 / half k4": x, ...}, "identical": true}
"""

from __future__ import annotations

import argparse
import statistics

from _common import final_line, machine, mixed_prompts, table

from specrl.engine import SpecEngine
from specrl.models import ModelPair
from specrl.step import Action

MIXES: dict[str, list[Action]] = {
    # each mix cycles over the rows in this order
    "half k0 / half k4": [Action(0, 1), Action(4, 1)],
    "one k8, rest k1": [Action(8, 1)] + [Action(1, 1)] * 7,
    "half k1 / half (4,2) tree": [Action(1, 1), Action(4, 2)],
    "uniform k4 (control)": [Action(4, 1)],
}


def row_actions(mix: list[Action], bsz: int) -> list[Action]:
    return [mix[i % len(mix)] for i in range(bsz)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--batch", default="4,8,16", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per engine and case")
    args = ap.parse_args()
    pair = ModelPair.load(args.model, draft=args.draft)
    print(f"# ragged vs padded verify, {pair.target_name} + {pair.draft_name}, {machine()}")
    rows, speedup, identical = [], {}, True
    for bsz in [int(x) for x in args.batch.split(",")]:
        prompts = [pair.encode_prompt(p.text) for p in mixed_prompts(bsz)]
        for name, mix in MIXES.items():
            acts = row_actions(mix, bsz)
            # no EOS: every row stays for the whole measurement, so the per-row actions keep their rows
            engines = {r: SpecEngine(pair, drafter="model", ragged=r, eos_token_ids=()) for r in (False, True)}
            times: dict[bool, list[float]] = {False: [], True: []}
            tokens: dict[bool, int] = {}
            for eng in engines.values():
                for p in prompts:
                    eng.add_request(p, 10 * (args.steps + 2))
                eng.step(acts)  # warm-up: prefill + first step
            for _ in range(args.steps):
                outs = {}
                for r, eng in engines.items():
                    res = eng.step(acts)
                    times[r].append(res.verify_time)
                    tokens[r] = res.verify_rows
                    outs[r] = [c.tolist() for c in res.committed]
                identical &= outs[False] == outs[True]
            pad, rag = statistics.median(times[False]), statistics.median(times[True])
            speedup[f"B={bsz} {name}"] = round(pad / rag, 3)
            rows.append([bsz, name, tokens[False], tokens[True], 1e3 * pad, 1e3 * rag, pad / rag])
            print(table(["batch", "mix", "rows padded", "rows packed", "padded ms", "packed ms", "speedup"], rows[-1:])
                  .splitlines()[-1], flush=True)
    print()
    print(table(["batch", "mix", "token rows padded", "token rows packed", "padded verify ms", "packed verify ms",
                 "padded / packed"], rows))
    print(f"\nsame committed tokens in every step: {identical}")
    final_line({"verify_speedup": speedup, "identical": identical})


if __name__ == "__main__":
    main()
