"""``specrl demo``: the main job on the embedded default model, end to end.

1. prepare the replay env: record traces of the built-in prompts and profile the cost model
   (both cached: later runs skip them);
2. train the default agent (PPO, ``agents/ppo.yaml``: a behaviour clone of the ``goodput``
   rule first, then RL) on the vectorised replay env with the training prompts;
3. evaluate it beside every baseline and the oracle on the held-out prompts over a load sweep
   (3 arrival seeds), writing the table and plots;
4. export it to a runtime controller, and let the controller drive the real engine on two
   held-out prompts next to plain decoding (same tokens, measured speed).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", default="envs/replay.yaml")
    p.add_argument("--agent", default="agents/ppo.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="env or agent.* overrides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--track", action="store_true", help="log the run to wandb (offline unless logged in)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--live-prompts", type=int, default=2, help="held-out prompts for the live check (0 = skip)")


def _resolve(path: str) -> str:
    """Presets ship with the repository; fall back to the packaged copy location if run elsewhere."""
    p = Path(path)
    if p.exists():
        return str(p)
    here = Path(__file__).resolve().parents[1] / path
    return str(here) if here.exists() else path


def run(args: argparse.Namespace) -> int:
    from specrl.runtime.export import export_run
    from specrl.train import train

    t0 = time.perf_counter()
    env, agent = _resolve(args.env), _resolve(args.agent)
    print(f"[1/4] preparing the replay env ({env}): traces and cost model (cached after the first run)", flush=True)
    print("[2/4] training and [3/4] evaluating on held-out prompts", flush=True)
    summary = train(env, agent, args.set, args.seed, args.track, Path(args.run_dir) if args.run_dir else None)
    run_dir = Path(summary["run_dir"])
    print("\n[4/4] exporting the controller", flush=True)
    out = export_run(run_dir, run_dir / "export")
    ev = summary["eval"]
    ov = ev["overall"]
    best = max((v, k) for k, v in ov.items() if k not in ("learned", "oracle"))
    print(f"\nheld-out evaluation, goodput (tokens/s, geometric mean over loads): learned {ov['learned']:.1f}, best "
          f"baseline {best[1]} {best[0]:.1f} ({ov['learned'] / best[0]:.3f}x), oracle {ov['oracle']:.1f} "
          f"(learned = {ov['learned'] / ov['oracle']:.2f} of oracle)")
    print(Path(ev["table"]).read_text())
    if args.live_prompts:
        live_check(run_dir, out, args.live_prompts)
    print(f"\nrun directory: {run_dir}\n  table: {ev['table']}\n  plots: {', '.join(ev['plots'])}\n"
          f"  controller: {out}\n  total time: {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def live_check(run_dir: Path, artifact: Path, n: int) -> None:
    """The exported controller driving the real engine vs plain decoding on held-out prompts."""
    import json

    from specrl.config import from_dict
    from specrl.engine import SpecEngine
    from specrl.envs.config import EnvConfig
    from specrl.envs.live import shared_pair
    from specrl.envs.replay import replay_prompts
    from specrl.policies import PolicyContext
    from specrl.runtime.adapters import EngineController
    from specrl.runtime.policy import ControllerPolicy

    cfg = from_dict(EnvConfig, json.loads((run_dir / "config.json").read_text())["env"])
    from dataclasses import replace

    prompts = replay_prompts(replace(cfg, prompt_split="test"))[:n]
    pair = shared_pair(cfg)
    ids = [pair.encode_prompt(p.text) for p in prompts]
    rows = []
    for label in ("plain decoding (k = 0)", "exported controller"):
        eng = SpecEngine(pair, drafter=cfg.drafter)
        action = None
        if label != "plain decoding (k = 0)":
            action = EngineController(eng, ControllerPolicy(PolicyContext(cfg.k_choices, cfg.w_choices), str(artifact)))
        t = time.perf_counter()
        done = eng.generate(ids, 96, **({"action": action} if action else {}), batch_size=1)
        dt = time.perf_counter() - t
        rows.append((label, [r.output.tolist() for r in done], sum(len(r.output) for r in done) / dt))
    same = rows[0][1] == rows[1][1]
    print(f"\nlive check on {n} held-out prompts (batch 1): plain {rows[0][2]:.1f} tokens/s, controller "
          f"{rows[1][2]:.1f} tokens/s ({rows[1][2] / rows[0][2]:.2f}x), identical tokens: {same}")
