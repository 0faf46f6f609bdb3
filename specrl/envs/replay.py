"""``specrl/SpecReplay-v0``: the replay environment (recorded traces + profiled cost model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specrl.envs.base import SpecEnvBase
from specrl.envs.config import EnvConfig, load_cost_model
from specrl.errors import ConfigError, TraceError
from specrl.serving import ServingLoop
from specrl.workload import PromptPool, Workload, _as_list  # noqa: F401


def default_trace_path(cfg: EnvConfig) -> Path:
    """Where ``specrl collect`` writes (and replay looks for) the traces of an env config."""
    from specrl.models import cache_root, display_name

    src = "builtin" if cfg.prompts == "builtin" else Path(cfg.prompts).stem
    draft = f"-{Path(str(cfg.draft)).name}" if cfg.drafter == "model" else ""
    n = max(int(x) for x in _as_list(cfg.workload.max_new_tokens))
    return cache_root() / "traces" / f"{display_name(cfg.model)}-{cfg.drafter}{draft}-{cfg.dtype}-{src}-n{n}-t{cfg.temperature:g}"


def replay_prompts(cfg: EnvConfig) -> list[Any]:
    """The env's prompts (texts): source, categories and split."""
    from specrl.prompts import load_prompts, split_prompts

    prompts = load_prompts(cfg.prompts, cfg.categories)
    if cfg.prompt_split != "all":
        train, test = split_prompts(prompts, cfg.held_out, cfg.split_seed)
        prompts = train if cfg.prompt_split == "train" else test
    return prompts


def load_replay_data(cfg: EnvConfig, progress: bool = False) -> tuple[Any, PromptPool, list[int], Any]:
    """Traces, prompt pool (trace token ids), pool -> trace rows, replay tables."""
    from specrl.models import cache_root, display_name
    from specrl.replay import ReplayTables, action_table
    from specrl.traces import Traces, text_key

    path = Path(cfg.traces) if cfg.traces else default_trace_path(cfg)
    try:
        traces = Traces.load(path, expect={"target": display_name(cfg.model), "drafter": cfg.drafter})
    except TraceError as e:  # already says what to run
        raise ConfigError(str(e)) from e
    need = max(int(x) for x in _as_list(cfg.workload.max_new_tokens))
    have = int(traces.meta.get("max_new_tokens", 0))
    if need > have:
        raise ConfigError(
            f"The env asks for up to max_new_tokens={need} but the traces {str(path)!r} stop at {have} tokens. "
            f"Fix: re-collect with --max-new-tokens {need} or lower workload.max_new_tokens."
        )
    index = traces.index()
    prompts = replay_prompts(cfg)
    rows, missing = [], []
    for p in prompts:
        key = text_key(p.text)
        (rows.append(index[key]) if key in index else missing.append(p))
    if missing:
        raise ConfigError(
            f"{len(missing)} of the env's {len(prompts)} prompts have no trace in {str(path)!r} "
            f"(first: {missing[0].text[:60]!r}). Fix: collect traces for this prompt set (`specrl collect`)."
        )
    pool = PromptPool([traces.prompt_ids[r] for r in rows], [p.category for p in prompts])
    tables = ReplayTables.cached(traces, action_table(cfg.k_choices, cfg.w_choices), cfg.drafter,
                                 cache_root() / "replay", progress=progress)
    return traces, pool, rows, tables


class SpecReplayEnv(SpecEnvBase):
    """The same task as ``specrl/SpecDecode-v0`` (see its docstring for the spec), replayed.

    ## Description
    Observation, action space, rewards, info and episode logic are those of the live env: the
    same ``ServingLoop``, ``Workload`` and ``FeatureTracker``. Only the backend differs: the
    accept lengths, drafted depths, verify widths and draft statistics come from recorded
    traces (``specrl collect``) through ``ReplayTables``, and time from the profiled cost model
    (``specrl profile``). Thousands of steps per second instead of tens.

    ## Fidelity
    * Greedy: accept lengths are exact for chains and rank-path trees with the n-gram drafter
      (its tree is recomputed on the recorded sequence) and with draft models (rank paths).
    * Time: the cost model's interpolation of measured latencies (``specrl validate-replay``
      reports the goodput error against the live env).
    * Sampling (temperature > 0): approximated. The trace holds one sampled continuation and the
      accept length is the greedy rank-path match against it; real speculative sampling also
      accepts tokens that differ from that sample with the target/draft probability ratio, so
      replay under-estimates acceptance for sampling.
    * Per-request actions are not modelled (one action per step for the batch).

    ## Arguments
    As the live env; ``traces`` (default: the cached trace for model, drafter, dtype, prompt
    source, max_new_tokens and temperature) and ``cost_model`` (default: the cached profile;
    ``analytic`` for a synthetic one). ``time_source`` is always the cost model here.

    ## Version History
    * v0: initial version (feature schema 1).
    """

    def _build_loop(self) -> ServingLoop:
        from specrl.costs import CostModel
        from specrl.envs.live import time_function
        from specrl.replay import ReplayBackend

        cfg = self.cfg
        _, pool, rows, tables = load_replay_data(cfg)
        self.tables = tables
        cost = load_cost_model(cfg)
        backend = ReplayBackend(tables, rows, cfg.k_choices, cfg.w_choices, cfg.drafter,  # pool row i = trace rows[i]
                                ragged=cfg.verify == "ragged")
        self.cost_model: CostModel = cost
        profiled = EnvConfig(**{**cfg.__dict__, "time_source": "profiled"})
        return ServingLoop(backend, Workload(cfg.workload, pool), time_function(profiled, cost), cfg.horizon_s)

    def action_outcomes(self) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
        """For every action of the table: tokens the next step would commit and its seconds."""
        from specrl.step import Action

        backend = self.loop.backend
        actions = sorted({self.decode_action((i, j)) for i in range(len(self.k_choices))
                          for j in range(len(self.w_choices))})
        tokens, secs = np.zeros(len(actions)), np.zeros(len(actions))
        for a, (k, w) in enumerate(actions):
            res = backend.peek(Action(k, w))
            tokens[a] = float(np.sum(res.num_committed))
            secs[a] = self.loop.time_fn(res)
        return actions, tokens, secs
