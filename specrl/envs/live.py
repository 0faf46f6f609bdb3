"""``specrl/SpecDecode-v0``: the live environment (real draft/target decoding)."""

from __future__ import annotations

from typing import Any

import numpy as np

from specrl.envs.base import SpecEnvBase
from specrl.envs.config import EnvConfig, load_cost_model
from specrl.serving import LiveBackend, ServingLoop
from specrl.workload import PromptPool, Workload

_PAIRS: dict[tuple, Any] = {}


def shared_pair(cfg: EnvConfig) -> Any:
    """Load (once per process) the model pair an env config names."""
    from specrl.models import ModelPair

    key = (cfg.model, cfg.draft if cfg.drafter == "model" else None, cfg.device, cfg.dtype)
    if key not in _PAIRS:
        _PAIRS[key] = ModelPair.load(cfg.model, key[1], cfg.device, cfg.dtype)
    return _PAIRS[key]


def prompt_pool(cfg: EnvConfig, pair: Any) -> PromptPool:
    from specrl.prompts import load_prompts, split_prompts

    prompts = load_prompts(cfg.prompts, cfg.categories)
    if cfg.prompt_split != "all":
        train, test = split_prompts(prompts, cfg.held_out, cfg.split_seed)
        prompts = train if cfg.prompt_split == "train" else test
    ids = [np.asarray(pair.encode_prompt(p.text), dtype=np.int64) for p in prompts]
    return PromptPool(ids, [p.category for p in prompts])


def time_function(cfg: EnvConfig, cost_model: Any) -> Any:
    """StepResult -> seconds: measured wall clock, or the cost model's estimate."""
    if cfg.time_source == "measured":
        return lambda res: res.step_time

    def profiled(res: Any) -> float:
        ctx = float(np.mean(res.context_len)) if len(res.context_len) else 0.0
        k = max((a.k for a in res.actions), default=0)
        # tokens per row of the pass as it ran: fractional for a ragged (packed) verify
        return cost_model.step_time(cfg.drafter, k, len(res.rids), res.verify_rows / max(1, len(res.rids)),
                                    res.level_sizes, ctx, res.prefill_rows, res.prefill_len)

    return profiled


class SpecDecodeEnv(SpecEnvBase):
    """Choose the speculation length k and tree width w of every decode step of a serving engine.

    ## Description
    A serving workload (``workload``: closed loop, Poisson, bursty, phase-shifting or trace
    arrivals; FIFO queue; at most ``max_batch_size`` running) drives a real speculative-decoding
    engine: target ``model`` verifies, in one forward pass per step, the draft trees that
    ``drafter`` proposes for every running request. One env step is one engine step for the
    whole running batch. The best (k, w) depends on the load (at large batch the verify pass is
    compute-bound and k = 0 wins) and on acceptance (how well the draft predicts this text).
    Decoding is lossless: the committed tokens do not depend on the actions.

    ## Action Space
    ``MultiDiscrete([len(k_choices), len(w_choices)])``: indices into the named tables
    (default k in (0, 1, 2, 3, 4, 6, 8), w in (1, 2, 3, 4)). k = 0 is plain decoding (w ignored);
    w = 1 is a chain; (k, w) is the rank-path tree of depth k with k * w draft nodes.

    ## Observation Space
    ``Box(0, 1e6, (21,), float32)``: feature schema version 2 (``specrl.features``): load
    (batch size, queue length, arrival-rate estimate, mean / max context), EMA acceptance rate
    per draft depth 1..8, last mean accept length, draft confidence (top-1 probability, entropy;
    n-gram match length and count), previous action. Computed before the step's draft round.

    ## Rewards
    * ``throughput``: tokens committed in the step. Episodes have a fixed simulated-time
      horizon, so the return is throughput x horizon (a per-step tokens/second ratio would
      reward short steps and is not used).
    * ``latency``: -(request-seconds spent in the system during the step); the return is minus
      the total time requests spend in the system (Little's law), i.e. mean latency x count.
    * ``slo``: tokens of requests still within their TTFT / TPOT SLO minus ``slo_penalty`` per
      request whose SLO breaks.
    ``switch_cost`` is subtracted when the action changes; everything is scaled by ``reward_scale``.

    ## Starting State
    ``reset(seed)`` seeds the workload: the load level (one of ``concurrency`` / ``rate`` when
    given as lists; ``options={"level": {...}}`` pins it), the arrivals and the prompt order.
    Requests arriving at t = 0 are admitted; the clock starts at the first arrival.

    ## Episode End
    Truncated when the simulated clock passes ``horizon_s``; terminated if the workload runs
    out first (a finite trace). ``max_episode_steps`` from the registration caps steps.

    ## Arguments
    ``gym.make("specrl/SpecDecode-v0", config="envs/closed-loop.yaml", **overrides)`` or any
    ``EnvConfig`` field as a keyword (dotted keys such as ``**{"workload.rate": 4.0}``);
    ``pair=`` passes an already loaded ``ModelPair``. ``time_source``: ``measured`` (wall clock,
    CUDA events on GPU) or ``profiled`` (the cost model: deterministic time for a seed).

    ## Per-request actions
    Besides ``step`` (one (k, w) for the whole batch), ``row_view()`` returns what a per-request
    policy sees of every running request (``specrl.rows.RowView``, one env, rows in the engine's
    order; n-gram drafter statistics computed as the replay tables do) and ``step_rows(actions)``
    takes one action index (into ``specrl.replay.action_table(k_choices, w_choices)``) per running
    request; the engine verifies their trees ragged. ``info["k"], info["w"]`` then report the
    deepest row's action, as the replay vector env does. Outside the Gym API, as the replay vector
    env's ``step_rows``: ``env.unwrapped.step_rows``.

    ## Version History
    * v0: initial version (feature schema 1).
    """

    def __init__(self, config: Any = None, pair: Any = None, **overrides: Any) -> None:
        self._pair = pair
        super().__init__(config, **overrides)

    def _build_loop(self) -> ServingLoop:
        from specrl.engine import SpecEngine
        from specrl.replay import action_table
        from specrl.sampling import SamplingParams

        cfg = self.cfg
        pair = self._pair or shared_pair(cfg)
        self.pair = pair
        pool = prompt_pool(cfg, pair)
        engine = SpecEngine(pair, drafter=cfg.drafter, sampling=SamplingParams(cfg.temperature, cfg.top_p),
                            ragged=cfg.verify == "ragged")
        cost = load_cost_model(cfg) if cfg.time_source == "profiled" or cfg.time_penalty == "ar" else None
        self.cost_model = cost
        self.engine = engine
        # (A, 2) the (k, w) of every per-request action index (the replay tables' order)
        self.actions_kw = np.asarray(action_table(list(self.k_choices), list(self.w_choices)))
        self._observer: Any = None
        return ServingLoop(LiveBackend(engine, pool.ids), Workload(cfg.workload, pool), time_function(cfg, cost),
                           cfg.horizon_s)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._observer = None  # its per-request history is keyed by request ids, which restart at 0
        return super().reset(seed=seed, options=options)

    # ----- per-request actions ------------------------------------------------------------------
    def row_view(self) -> Any:
        """The running requests' ``RowView`` (one env: arrays of shape (1, B)) for the next step.

        Admits waiting requests first (their prefill is charged to the next step), so the rows
        are the ones ``step_rows`` will run."""
        from specrl.runtime.adapters import RowObserver

        if self._observer is None:
            self._observer = RowObserver(self.engine, self.actions_kw)
        self.engine.admit()
        return self._observer.view()

    def step_rows(self, actions: Any):
        """One step with one action index per running request (engine row order, as ``row_view``);
        returns what ``step`` returns."""
        from specrl.engine import Action
        from specrl.errors import ConfigError

        self.engine.admit()
        idx = np.asarray(actions).reshape(-1)
        kw_all = self.actions_kw
        n = len(self.engine.rows)
        if idx.size != n or not np.issubdtype(idx.dtype, np.integer) or (idx.size and (idx.min() < 0 or
                                                                                         idx.max() >= len(kw_all))):
            raise ConfigError(f"step_rows got actions {idx.tolist()!r} for {n} running requests. Allowed: {n} integer "
                              f"indices in [0, {len(kw_all)}) into action_table(k_choices, w_choices). Fix: pass "
                              "one index per row of row_view(), in its order.")
        acts = [Action(int(k), 1 if k == 0 else int(w)) for k, w in kw_all[idx]]
        deepest = max(((a.k, a.w) for a in acts), default=(0, 1))
        return self._step(acts, deepest)
