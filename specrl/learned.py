"""A trained Stable-Baselines3 model used as a specrl policy (in-process evaluation).

The exported controller (``specrl.runtime``) is the deployable form; this wrapper evaluates a
model straight from its run directory with the same normalisation and frame stacking.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specrl.policies.base import BasePolicy, PolicyContext


class SB3Policy(BasePolicy):
    def __init__(self, ctx: PolicyContext, model: Any, obs_mean: np.ndarray | None, obs_var: np.ndarray | None,
                 clip_obs: float = 10.0, frame_stack: int = 1, flat_actions: list[tuple[int, int]] | None = None,
                 name: str = "learned", defer: BasePolicy | None = None) -> None:
        super().__init__(ctx)
        self.defer = defer  # the rule behind the k head's extra "defer" choice (specrl.defer)
        self.model = model
        self.mean, self.var, self.clip = obs_mean, obs_var, clip_obs
        self.frame_stack = frame_stack
        self.flat_actions = flat_actions
        self.name = name
        self.reset()

    def reset(self) -> None:
        self._stack: list[np.ndarray] = []
        if self.defer is not None:
            self.defer.reset()

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        if self.defer is not None:
            self.defer.observe(features, info)

    def normalise(self, features: np.ndarray) -> np.ndarray:
        x = np.asarray(features, np.float32)
        if self.mean is not None:
            x = np.clip((x - self.mean) / np.sqrt(self.var + 1e-8), -self.clip, self.clip).astype(np.float32)
        return x

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        x = self.normalise(features)
        if self.frame_stack > 1:
            if not self._stack:
                self._stack = [np.zeros_like(x)] * self.frame_stack
            self._stack = [*self._stack[1:], x]
            x = np.concatenate(self._stack)
        act, _ = self.model.predict(x, deterministic=True)
        if self.flat_actions is not None:
            k, w = self.flat_actions[int(act)]
            return k, w
        ki, wi = (int(a) for a in np.asarray(act).reshape(-1))
        if self.defer is not None and ki == len(self.ctx.k_choices):
            return self.snap(*self.defer.decide(features))
        return self.table.value(ki, wi)
