"""Ragged (packed) verify vs padded verify, measured side by side on the real model.

When the rows of a batch ask for different trees (per-request actions: one row k = 0, another
a k = 4 chain), the padded verify runs every row at the union tree's size; the ragged verify
packs only the nodes each row asked for into one pass (``SpecEngine(ragged=True)``, the
default). This script runs two engines on the same prompts and the same per-row actions, one
of each kind, stepping them alternately so that machine noise hits both alike, and reports the
verify pass's time per step for several batch sizes and action mixes. It also checks that both
commit the same tokens (greedy), and includes a uniform mix as a control (nothing to pack:
both take the same path, so its ratio shows the noise floor). The last column is the ratio the
replay env's cost model charges for the same passes (a ragged pass of N token rows over B rows
at N / B tokens per row), when a profile for the target is cached: where it matches the
measured ratio, replay prices per-request actions right.

The draft model drafter fills every node a row asks for, so those trees are the sizes asked for.
The last mix is one batch-level action with the n-gram drafter: there the packing comes from rows
whose lookup found nothing (the token rows column shows the mean over the measured steps).

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

MIXES: dict[str, tuple[str, list[Action]]] = {
    # drafter, and the actions each mix cycles over the rows in this order
    "half k0 / half k4": ("model", [Action(0, 1), Action(4, 1)]),
    "one k8, rest k1": ("model", [Action(8, 1)] + [Action(1, 1)] * 7),
    "half k1 / half (4,2) tree": ("model", [Action(1, 1), Action(4, 2)]),
    "one (8,4) tree, rest k1": ("model", [Action(8, 4)] + [Action(1, 1)] * 7),
    "uniform k4 (control)": ("model", [Action(4, 1)]),
    # one action for the batch; rows whose n-gram lookup finds nothing verify their root only
    "n-gram, uniform k4": ("ngram", [Action(4, 1)]),
}


HEAD = ["batch", "mix", "token rows padded", "token rows packed", "padded verify ms", "packed verify ms",
        "padded / packed", "cost model predicts"]


def row_actions(mix: list[Action], bsz: int) -> list[Action]:
    return [mix[i % len(mix)] for i in range(bsz)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--batch", default="4,8,16", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per engine and case")
    ap.add_argument("--mixes", default=None, help="semicolon-separated mix names (default: all)")
    args = ap.parse_args()
    pair = ModelPair.load(args.model, draft=args.draft)
    cost = None
    try:  # the replay env's cost model for this target (verify grid; the drafter does not change it)
        from specrl.envs.config import load_cost_model, load_env_config

        cost = load_cost_model(load_env_config(None, backend="replay", model=args.model, drafter="ngram"))
    except Exception as e:  # noqa: BLE001 - the measurement stands without it
        print(f"(no cost model column: {e})")
    print(f"# ragged vs padded verify, {pair.target_name} + {pair.draft_name}, {machine()}")
    rows, speedup, identical = [], {}, True
    for bsz in [int(x) for x in args.batch.split(",")]:
        prompts = [pair.encode_prompt(p.text) for p in mixed_prompts(bsz)]
        for name, (drafter, mix) in MIXES.items():
            if args.mixes and name not in args.mixes.split(";"):
                continue
            acts = row_actions(mix, bsz)
            # no EOS: every row stays for the whole measurement, so the per-row actions keep their rows
            engines = {r: SpecEngine(pair, drafter=drafter, ragged=r, eos_token_ids=()) for r in (False, True)}
            times: dict[bool, list[float]] = {False: [], True: []}
            modelled: dict[bool, list[float]] = {False: [], True: []}
            tokens: dict[bool, float] = {}
            for eng in engines.values():
                for p in prompts:
                    eng.add_request(p, 10 * (args.steps + 2))
                eng.step(acts)  # warm-up: prefill + first step
            for _ in range(args.steps):
                outs = {}
                for r, eng in engines.items():
                    res = eng.step(acts)
                    times[r].append(res.verify_time)
                    if cost is not None:  # what the replay env charges for this pass
                        modelled[r].append(cost.verify_time(res.batch_size, res.verify_rows / res.batch_size,
                                                            float(res.context_len.mean())))
                    tokens[r] = tokens.get(r, 0) + res.verify_rows / args.steps
                    outs[r] = [c.tolist() for c in res.committed]
                identical &= outs[False] == outs[True]
            pad, rag = statistics.median(times[False]), statistics.median(times[True])
            speedup[f"B={bsz} {name}"] = round(pad / rag, 3)
            pred = (statistics.median(modelled[False]) / statistics.median(modelled[True])) if cost is not None else \
                float("nan")
            rows.append([bsz, name, round(tokens[False], 1), round(tokens[True], 1), 1e3 * pad, 1e3 * rag, pad / rag,
                         pred])
            print(table(HEAD, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(HEAD, rows))
    print(f"\nsame committed tokens in every step: {identical}")
    final_line({"verify_speedup": speedup, "identical": identical})


if __name__ == "__main__":
    main()
