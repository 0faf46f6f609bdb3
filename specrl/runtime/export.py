"""``specrl export``: a trained run (or a baseline rule) -> a controller artifact directory.

Needs torch / stable-baselines3 (to read the run); the artifact it writes needs numpy and
safetensors only (``specrl.runtime.Controller``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from specrl.errors import ArtifactError, ConfigError
from specrl.features import schema
from specrl.runtime.controller import FORMAT, FORMAT_VERSION


def _activation(module: Any) -> str:
    name = type(module).__name__.lower()
    if name in ("tanh", "relu"):
        return name
    raise ArtifactError(f"Activation {type(module).__name__} cannot be exported (allowed: Tanh, ReLU).")


def extract_mlp(model: Any) -> tuple[list[tuple[np.ndarray, np.ndarray, str]], tuple[np.ndarray, np.ndarray]]:
    """Hidden layers [(W, b, activation)] and the action head (W, b) of an SB3 PPO/A2C/DQN model."""
    import torch.nn as nn

    pol = model.policy
    if hasattr(pol, "mlp_extractor"):  # actor-critic: the actor branch + action_net
        seq, head = pol.mlp_extractor.policy_net, pol.action_net
        feat = pol.features_extractor
    elif hasattr(pol, "q_net"):  # DQN: the online Q network
        mods = list(pol.q_net.q_net)
        seq, head, feat = nn.Sequential(*mods[:-1]), mods[-1], pol.q_net.features_extractor
    else:
        raise ArtifactError(f"Policy {type(pol).__name__} is not an MLP actor-critic or Q network.")
    if type(feat).__name__ != "FlattenExtractor":
        raise ArtifactError(f"Features extractor {type(feat).__name__} cannot be exported (only the flat MLP one).")
    layers = []
    mods = list(seq)
    for i, m in enumerate(mods):
        if isinstance(m, nn.Linear):
            act = _activation(mods[i + 1]) if i + 1 < len(mods) else "identity"
            layers.append((m.weight.detach().cpu().numpy(), m.bias.detach().cpu().numpy(), act))
    return layers, (head.weight.detach().cpu().numpy(), head.bias.detach().cpu().numpy())


def write_artifact(out: Path, meta: dict[str, Any], tensors: dict[str, np.ndarray] | None) -> Path:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    if tensors is not None:
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(out / "policy.safetensors"))
    (out / "controller.json").write_text(json.dumps(meta, indent=1))
    return out


def export_run(run_dir: Path, out: Path, fallback: str | None = None, margin: float = 0.25) -> Path:
    """Export a ``specrl train`` run directory (its final model and statistics)."""
    from specrl.envs.config import load_cost_model
    from specrl.train import FlatActions, load_model, load_run_config, load_stats

    env_cfg, agent, saved = load_run_config(run_dir)
    if agent.algo in ("accmodel", "rowmodel"):  # numpy already: the model's own files travel in a rule artifact
        return export_rule(f"{agent.algo}:{run_dir / agent.algo}", env_cfg, out)
    model = load_model(run_dir, agent)
    layers, (hw, hb) = extract_mlp(model)
    tensors: dict[str, np.ndarray] = {}
    arch_layers = []
    for i, (w, b, act) in enumerate(layers):
        tensors[f"layer{i}.weight"], tensors[f"layer{i}.bias"] = w, b
        arch_layers.append({"weight": f"layer{i}.weight", "bias": f"layer{i}.bias", "activation": act})
    tensors["head.weight"], tensors["head.bias"] = hw, hb
    if agent.algo == "dqn":
        flat = FlatActions(env_cfg.k_choices, env_cfg.w_choices).actions
        actions = {"kind": "flat", "k_choices": env_cfg.k_choices, "w_choices": env_cfg.w_choices,
                   "flat": [list(a) for a in flat]}
        sizes = [len(flat)]
        rule = "argmax over the Q values of the flattened (k, w) table"
    else:
        actions = {"kind": "multidiscrete", "k_choices": env_cfg.k_choices, "w_choices": env_cfg.w_choices}
        sizes = [len(env_cfg.k_choices), len(env_cfg.w_choices)]
        rule = "argmax of each head's logits (k head, then w head); k = 0 ignores w"
        if agent.defer:
            actions["defer"] = agent.defer
            sizes[0] += 1
            rule += f"; the k head's last choice hands the step to the {agent.defer!r} rule (on the raw features)"
    stats = load_stats(run_dir / "obs_stats.json") if agent.normalize_obs else None
    rng_path = run_dir / "obs_range.json"
    low = high = None
    if rng_path.is_file():
        r = json.loads(rng_path.read_text())
        low, high = guard_range(r["low"], r["high"], margin)
    try:
        cost = load_cost_model(env_cfg).to_json()
    except Exception:  # noqa: BLE001 - a controller without a cost model falls back to `ar`
        cost = None
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "mlp", "schema": schema(),
        "architecture": {"layers": arch_layers, "head": {"weight": "head.weight", "bias": "head.bias", "sizes": sizes}},
        "normalization": None if stats is None else {"mean": stats["mean"].tolist(), "var": stats["var"].tolist(),
                                                      "clip": 10.0, "eps": 1e-8},
        "frame_stack": agent.frame_stack,
        "actions": actions,
        "action_rule": rule,
        "guard": {"feature_low": low, "feature_high": high, "margin": margin,
                  "fallback": fallback or ("goodput" if cost is not None else "ar")},
        "cost_model": cost,
        "provenance": {"target": env_cfg.model, "draft": env_cfg.draft, "drafter": env_cfg.drafter,
                       "env_preset": saved.get("env_preset"), "agent_preset": saved.get("agent_preset"),
                       "algo": agent.algo, "run": saved.get("name"), "steps": summary.get("steps"),
                       "metrics": summary.get("eval", {}).get("overall"), "exported": time.strftime("%Y-%m-%d %H:%M:%S")},
    }
    return write_artifact(out, meta, tensors)


def guard_range(low: Any, high: Any, margin: float) -> tuple[list[float], list[float]]:
    """The guard's feature range: the training range widened by ``margin`` x its span (span >= 1)."""
    lo, hi = np.asarray(low, float), np.asarray(high, float)
    span = np.maximum(hi - lo, 1.0)
    return (lo - margin * span).tolist(), (hi + margin * span).tolist()


def export_rule(rule: str, env_cfg: Any, out: Path, margin: float = 0.25) -> Path:
    """Any baseline rule as an artifact, so a runtime uses one interface for everything.

    A learned ``accmodel:DIR`` rule travels with its files and gets the same guard as an exported
    network: the training feature range (widened by ``margin``), outside which ``goodput`` (or
    ``ar`` without a cost model) answers. Hand-written rules have no training range."""
    from specrl.envs.config import load_cost_model
    from specrl.policies import PolicyContext, make_policy

    try:
        cost = load_cost_model(env_cfg)
    except Exception:  # noqa: BLE001
        cost = None
    make_policy(rule, PolicyContext(env_cfg.k_choices, env_cfg.w_choices, cost, env_cfg.drafter, env_cfg.verify))
    guard: dict[str, Any] = {"fallback": "ar"}
    if rule.startswith("rowmodel:"):  # a per-request table travels inside the artifact
        import shutil

        out.mkdir(parents=True, exist_ok=True)
        src = Path(rule.partition(":")[2])
        shutil.copyfile(src / "rowmodel.json" if src.is_dir() else src, out / "rowmodel.json")
        rule = "rowmodel:."
        guard = {"fallback": "goodput" if cost is not None else "ar"}  # a runtime that calls decide() only
    if rule.startswith("accmodel:"):  # a learned network travels inside the artifact
        import shutil

        out.mkdir(parents=True, exist_ok=True)
        for name in ("accmodel.json", "accmodel.safetensors"):
            shutil.copyfile(Path(rule.partition(":")[2]) / name, out / name)
        rule = "accmodel:."  # resolved against the artifact directory when loaded
        rng = json.loads((out / "accmodel.json").read_text()).get("feature_range")
        if rng is not None:
            low, high = guard_range(rng["low"], rng["high"], margin)
            guard = {"feature_low": low, "feature_high": high, "margin": margin,
                     "fallback": "goodput" if cost is not None else "ar"}
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "rule", "rule": rule, "schema": schema(),
        "actions": {"kind": "multidiscrete", "k_choices": env_cfg.k_choices, "w_choices": env_cfg.w_choices},
        "action_rule": f"the {rule} rule", "guard": guard,
        "cost_model": None if cost is None else cost.to_json(), "verify": env_cfg.verify,
        "provenance": {"target": env_cfg.model, "drafter": env_cfg.drafter, "exported": time.strftime("%Y-%m-%d %H:%M:%S")},
    }
    return write_artifact(out, meta, None)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", default=None, help="a `specrl train` run directory")
    p.add_argument("-o", "--output", default=None, help="artifact directory (default: RUN_DIR/export)")
    p.add_argument("--rule", default=None, help="export a rule instead (e.g. goodput, static:4,2, "
                   "accmodel:DIR or rowmodel:DIR: a learned model, copied into the artifact)")
    p.add_argument("--env", default="envs/replay.yaml", help="env preset for --rule (action tables, cost model)")
    p.add_argument("--fallback", default=None, help="guard fallback rule (default: goodput if a cost model exists, else ar)")


def run(args: argparse.Namespace) -> int:
    from specrl.envs.config import load_env_config
    from specrl.runtime.controller import Controller

    if args.rule:
        if not args.output:
            raise ConfigError("--rule needs -o DIR.")
        out = export_rule(args.rule, load_env_config(args.env), Path(args.output))
    elif args.run_dir:
        out = export_run(Path(args.run_dir), Path(args.output) if args.output else Path(args.run_dir) / "export",
                         args.fallback)
    else:
        raise ConfigError("Pass a run directory (specrl export RUN_DIR) or --rule NAME -o DIR.")
    ctl = Controller.load(out)  # round trip: what we wrote loads
    print(f"controller written to {out} ({ctl.kind}, fallback {ctl.fallback_name})")
    return 0
