"""``specrl demo``: the main job on the embedded default model, end to end.

1. prepare the replay env: record traces of the built-in prompts and profile the cost model
   (both cached: later runs skip them);
2. train the agents (PPO, ``agents/ppo.yaml``: a behaviour clone of the ``goodput`` rule first,
   then 500k RL steps in the demo; and the per-request acceptance table, ``agents/rowmodel.yaml``,
   which plans one (k, w) per request for the ragged verify; ``--agent agents/decision.yaml`` or
   ``agents/accmodel.yaml`` train the batch-level networks fit on replay counterfactuals)
   on the vectorised replay env with the training prompts;
3. evaluate each beside every baseline and the oracle on the held-out prompts over a load sweep
   (3 arrival seeds), writing the table and plots;
4. export each to a runtime controller, and let it drive the real engine on two
   held-out prompts next to plain decoding (same tokens, measured speed).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

DEMO_SB3_TIMESTEPS = 500_000
"""SB3 agents train this many steps in the demo (their presets: 1.5M), see ``demo_overrides``."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", default="envs/replay.yaml")
    p.add_argument("--agent", default="agents/ppo.yaml,agents/rowmodel.yaml",
                   help="agent preset(s), comma-separated: each is trained, evaluated, exported")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="env or agent.* overrides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--track", action="store_true", help="log the run to wandb (offline unless logged in)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--live-prompts", type=int, default=2, help="held-out prompts for the live check (0 = skip)")
    p.add_argument("--sb3-timesteps", type=int, default=DEMO_SB3_TIMESTEPS,
                   help="training steps for SB3 agents in the demo (0 = the preset's own total_timesteps)")


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
    env = _resolve(args.env)
    agents = [_resolve(a.strip()) for a in args.agent.split(",") if a.strip()]
    print(f"[1/4] preparing the replay env ({env}): traces and cost model (cached after the first run)", flush=True)
    done = []
    for agent in agents:
        print(f"[2/4] training {agent} and [3/4] evaluating it on held-out prompts", flush=True)
        run_dir = Path(args.run_dir) / Path(agent).stem if args.run_dir and len(agents) > 1 else args.run_dir
        summary = train(env, agent, demo_overrides(agent, args.set, args.sb3_timesteps), args.seed, args.track,
                        Path(run_dir) if run_dir else None)
        run_dir = Path(summary["run_dir"])
        print(f"\n[4/4] exporting {agent} as a controller", flush=True)
        out = export_run(run_dir, run_dir / "export")
        done.append((Path(agent).stem, run_dir, out, summary["eval"]))
        ov = summary["eval"]["overall"]
        best = max((v, k) for k, v in ov.items() if k != "learned" and not k.startswith("oracle"))
        rows_ref = (f", per-request oracle {ov['oracle-rows']:.1f} (learned = {ov['learned'] / ov['oracle-rows']:.2f} of it)"
                    if "oracle-rows" in ov else "")
        print(f"\n{Path(agent).stem}, held-out evaluation, goodput (tokens/s, geometric mean over loads): learned "
              f"{ov['learned']:.1f}, best baseline {best[1]} {best[0]:.1f} ({ov['learned'] / best[0]:.3f}x), oracle "
              f"{ov['oracle']:.1f} (learned = {ov['learned'] / ov['oracle']:.2f} of oracle){rows_ref}")
        print(Path(summary["eval"]["table"]).read_text())
        if args.live_prompts:
            live_check(run_dir, out, args.live_prompts)
    if len(done) > 1:
        print(comparison(done))
    for name, run_dir, out, ev in done:
        print(f"\n{name} run directory: {run_dir}\n  table: {ev['table']}\n  plots: {', '.join(ev['plots'])}\n"
              f"  controller: {out}")
    print(f"\ntotal time: {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def demo_overrides(agent: str, overrides: list[str], sb3_timesteps: int) -> list[str]:
    """The demo's budget: SB3 agents train ``sb3_timesteps`` steps unless the user set
    ``agent.total_timesteps`` (the demo must fit in 20 minutes on 2 cores with an empty cache;
    PPO's validations peaked at 250k of 1.5M steps in the README's runs, and ``keep: best``
    keeps the best)."""
    from specrl.train import load_agent_config

    if not sb3_timesteps or any(o.startswith("agent.total_timesteps=") for o in overrides):
        return list(overrides)
    if load_agent_config(agent).algo in ("accmodel", "rowmodel"):
        return list(overrides)
    return [*overrides, f"agent.total_timesteps={sb3_timesteps}"]


def comparison(done: list[tuple[str, Path, Path, dict]]) -> str:
    """One table: every trained agent beside the best baseline and the oracle, per load (held-out)."""
    ev0 = done[0][3]
    names = [d[0] for d in done]
    lines = ["\nheld-out goodput (tokens/s) per load: the agents side by side (same episodes)",
             "| load | best baseline | " + " | ".join(f"{n} (/ best)" for n in names) + " | oracle |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for load in [*ev0["by_load"], "overall"]:
        g0 = ev0["overall"] if load == "overall" else ev0["by_load"][load]
        bv, bk = max((v, k) for k, v in g0.items() if k != "learned" and not k.startswith("oracle"))
        cells = []
        for _, _, _, ev in done:
            v = (ev["overall"] if load == "overall" else ev["by_load"][load])["learned"]
            cells.append(f"{v:.1f} ({v / bv:.3f})")
        lines.append(f"| {load} | `{bk}` {bv:.1f} | " + " | ".join(cells) + f" | {g0['oracle']:.1f} |")
    return "\n".join(lines)


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
