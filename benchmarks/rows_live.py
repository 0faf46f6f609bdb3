"""Per-request speculation on the live engine: a rowmodel controller vs batch-level rules, measured.

Replay predicts what a per-request policy wins (README, "Per-request speculation"); this script
checks it on the real engine. At each concurrency C, ``SpecEngine.generate`` keeps C held-out
prompts running (continuous batching, a new prompt joins when one finishes) under each of:
plain decoding (k = 0), the ``goodput`` rule (exported as a controller), and a ``rowmodel``
controller that gives every request its own (k, w) (``RowObserver`` builds its per-request view
from the engine; the ragged verify packs the rows' trees). Policies take turns in every round so
that machine noise hits all alike; each round uses the same prompts for every policy and checks
that all of them produce the same tokens (greedy).

Usage: python benchmarks/rows_live.py --rowmodel runs/rowmodel/rowmodel [--loads 1,4,8] [--prompts 8]
       [--rounds 2] [--max-new 96]
Final line: {"rowmodel_over_goodput": {"c1": x, ...}, "identical": true}
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import final_line, machine, table

from specrl.engine import SpecEngine
from specrl.envs.config import load_env_config
from specrl.envs.live import shared_pair
from specrl.envs.replay import replay_prompts
from specrl.runtime import Controller
from specrl.runtime.adapters import EngineController
from specrl.runtime.export import export_rule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--env", default="envs/replay.yaml", help="env preset (model, drafter, action tables, cost model)")
    ap.add_argument("--rowmodel", required=True, help="a rowmodel directory (RUN_DIR/rowmodel of agents/rowmodel.yaml)")
    ap.add_argument("--loads", default="1,4,8", help="concurrencies")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per load (one pass over them per round)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=96)
    args = ap.parse_args()
    cfg = load_env_config(args.env, prompt_split="test", backend="live")
    pair = shared_pair(cfg)
    prompts = [pair.encode_prompt(p.text) for p in replay_prompts(cfg)]
    tmp = Path(tempfile.mkdtemp(prefix="rows-live-"))
    controllers = {"goodput": Controller.load(export_rule("goodput", cfg, tmp / "goodput")),
                   "rowmodel": Controller.load(export_rule(f"rowmodel:{args.rowmodel}", cfg, tmp / "rowmodel"))}
    print(f"# per-request speculation live, {pair.target_name}, drafter {cfg.drafter}, {machine()}")
    rows, ratios, identical = [], {}, True
    for c in [int(x) for x in args.loads.split(",")]:
        rate: dict[str, list[float]] = {"plain": [], "goodput": [], "rowmodel": []}
        for rnd in range(args.rounds):
            start = (rnd * args.prompts) % len(prompts)
            ids = [prompts[(start + i) % len(prompts)] for i in range(args.prompts)]
            outs = {}
            order = list(rate) if rnd % 2 == 0 else list(rate)[::-1]
            for name in order:
                eng = SpecEngine(pair, drafter=cfg.drafter)
                action = None if name == "plain" else EngineController(eng, controllers[name])
                t0 = time.perf_counter()
                done = eng.generate(ids, args.max_new, **({"action": action} if action else {}), batch_size=c)
                dt = time.perf_counter() - t0
                outs[name] = [r.output.tolist() for r in done]
                rate[name].append(sum(len(o) for o in outs[name]) / dt)
            identical &= outs["plain"] == outs["goodput"] == outs["rowmodel"]
        med = {k: statistics.median(v) for k, v in rate.items()}
        ratios[f"c{c}"] = round(med["rowmodel"] / med["goodput"], 3)
        rows.append([c, med["plain"], med["goodput"], med["rowmodel"], med["goodput"] / med["plain"],
                     med["rowmodel"] / med["plain"], med["rowmodel"] / med["goodput"]])
        print(table(HEAD, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(HEAD, rows))
    print(f"\nsame tokens under every policy: {identical}")
    final_line({"rowmodel_over_goodput": ratios, "identical": identical})


HEAD = ["concurrency", "plain tok/s", "goodput tok/s", "rowmodel tok/s", "goodput / plain", "rowmodel / plain",
        "rowmodel / goodput"]

if __name__ == "__main__":
    main()
