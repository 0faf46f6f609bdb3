"""The Gymnasium environment shared by the live and the replay backends."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from specrl.envs.config import EnvConfig, load_env_config
from specrl.features import FIELDS, NUM_FEATURES
from specrl.serving import ServingLoop, StepReport


class SpecEnvBase(gym.Env):
    """Common spec: see ``specrl.envs.live.SpecDecodeEnv`` for the full documentation."""

    metadata = {"render_modes": []}

    def __init__(self, config: str | dict | EnvConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        self.cfg = load_env_config(config, **overrides)
        self.k_choices = tuple(self.cfg.k_choices)
        self.w_choices = tuple(self.cfg.w_choices)
        self.action_space = spaces.MultiDiscrete([len(self.k_choices), len(self.w_choices)])
        # finite bounds (no feature comes near 1e6) keep checkers and normalisers happy
        self.observation_space = spaces.Box(0.0, 1e6, shape=(NUM_FEATURES,), dtype=np.float32)
        self.feature_names = FIELDS
        self.loop: ServingLoop = self._build_loop()
        self._prev: tuple[int, int] | None = None

    # subclasses build the serving loop around their backend
    def _build_loop(self) -> ServingLoop:
        raise NotImplementedError

    def decode_action(self, action: Any) -> tuple[int, int]:
        """MultiDiscrete indices -> (k, w). k = 0 ignores w (plain decoding)."""
        a = np.asarray(action).reshape(-1)
        if a.shape != (2,) or not self.action_space.contains(a.astype(self.action_space.dtype)):
            raise ValueError(
                f"Action {action!r} is outside the action space {self.action_space}. "
                f"Fix: pass [k_index, w_index] with k_index < {len(self.k_choices)}, w_index < {len(self.w_choices)}."
            )
        k, w = self.k_choices[int(a[0])], self.w_choices[int(a[1])]
        return (k, 1) if k == 0 else (k, w)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        episode_seed = int(self.np_random.integers(0, 2**31 - 1))
        level = (options or {}).get("level")
        self.loop.reset(episode_seed, level)
        self._prev = None
        obs = self.loop.observation()
        return obs, {"level": dict(self.loop.workload.level), "time": self.loop.t}

    def _reward(self, rep: StepReport, kw: tuple[int, int]) -> float:
        cfg = self.cfg
        if cfg.reward == "throughput":
            r = float(rep.tokens) - self._time_penalty(rep) * rep.dt
            if cfg.reward_per_row:
                r /= max(1, len(rep.result.rids))
        elif cfg.reward == "latency":
            r = -rep.system_time
        else:
            r = float(rep.slo_tokens) - cfg.slo_penalty * rep.new_violations
        if cfg.switch_cost and self._prev is not None and kw != self._prev:
            r -= cfg.switch_cost
        return r * cfg.reward_scale

    cost_model: Any = None  # set by backends that have one (replay, profiled live)

    def _time_penalty(self, rep: StepReport) -> float:
        """rho (tokens/s) charged per step second by the throughput reward."""
        tp = self.cfg.time_penalty
        if tp == "none":
            return 0.0
        if tp != "ar":
            return float(tp)
        if self.cost_model is None:
            from specrl.errors import ConfigError

            raise ConfigError("time_penalty='ar' needs a cost model (replay backend, or time_source='profiled').")
        res = rep.result
        b = len(res.rids)
        ctx = float(np.mean(res.context_len)) if b else 0.0
        return b / self.cost_model.step_time(self.cfg.drafter, 0, b, 1, (), ctx)

    def step(self, action: Any):
        from specrl.engine import Action

        kw = self.decode_action(action)
        return self._step(Action(*kw), kw)

    def _step(self, action: Any, kw: tuple[int, int]):
        """One serving step with ``action`` (one Action, or one per running request); ``kw`` is
        what the reward's switch cost and ``info`` report (the deepest row's for per-request)."""
        rep = self.loop.step(action)
        reward = self._reward(rep, kw)
        self._prev = kw
        obs = self.loop.observation()
        res = rep.result
        info = {
            "tokens": rep.tokens,
            "dt": rep.dt,
            "time": self.loop.t,
            "k": kw[0],
            "w": kw[1],
            "batch_size": len(res.rids),
            "queue_len": len(self.loop.queue),
            "accept_len_mean": float(np.mean(res.accept_len)) if len(res.rids) else 0.0,
            "tree_tokens": res.tree_tokens,
            "finished": len(rep.finished),
            "arrivals": rep.arrivals,
            "level": dict(self.loop.workload.level),
        }
        done = self.loop.done
        terminated = self.loop.exhausted  # the workload ran out (e.g. a finite trace)
        truncated = done and not terminated  # the time limit
        if done:
            info["episode_summary"] = self.loop.summary()
        return obs, reward, terminated, truncated, info
