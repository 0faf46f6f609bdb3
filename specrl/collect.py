"""``specrl collect``: record the traces a replay env needs (see specrl/traces.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", default=None, help="env preset (YAML): models, drafter, prompts, max_new_tokens")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a preset key")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoded together while recording")
    p.add_argument("-o", "--output", default=None, help="trace path (default: where the replay env looks)")


def ensure_traces(cfg: Any, batch_size: int = 8, output: str | None = None, progress: bool = True) -> Path:
    """Record traces for every prompt of ``cfg``'s source (both splits, every category) unless they
    exist: the trace file is named by the source alone, so an env that keeps a few ``categories``
    must not leave a file that lacks the others' prompts for the next env."""
    from specrl.envs.live import shared_pair
    from specrl.envs.replay import default_trace_path
    from specrl.prompts import load_prompts
    from specrl.traces import collect_traces
    from specrl.workload import _as_list

    out = Path(output) if output else (Path(cfg.traces) if cfg.traces else default_trace_path(cfg))
    if out.with_suffix(".json").exists():
        return out
    pair = shared_pair(cfg)
    prompts = load_prompts(cfg.prompts)
    n = max(int(x) for x in _as_list(cfg.workload.max_new_tokens))
    collect_traces(pair, prompts, cfg.drafter, max_new_tokens=n, batch_size=batch_size,
                   temperature=cfg.temperature, progress=progress, out=out)
    return out


def run(args: argparse.Namespace) -> int:
    from specrl.config import split_override
    from specrl.envs.config import load_env_config
    from specrl.traces import Traces

    cfg = load_env_config(args.env, **dict(split_override(s) for s in args.set))
    out = ensure_traces(cfg, args.batch_size, args.output)
    t = Traces.load(out)
    tokens = sum(len(c) for c in t.continuations)
    print(f"traces: {out} ({len(t)} prompts, {tokens} target tokens, drafter {t.meta['drafter']})")
    return 0
