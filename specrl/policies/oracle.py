"""The clairvoyant oracle (replay only): the upper bound to report learned policies against.

What it optimises, exactly: at every step it knows, for every action of the table, how many
tokens the running batch would commit and how long the step would take (from the traces and
the cost model: ``action_outcomes()`` of the replay envs), and picks the action with the
highest goodput *of that step* (tokens / seconds). It is myopic: it does not plan for
acceptance statistics or queueing effects of later steps, so a policy can in principle beat
it over an episode, but per step it is the best possible choice.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specrl.errors import ConfigError
from specrl.policies.base import BasePolicy, PolicyContext


class Oracle(BasePolicy):
    name = "oracle"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._outcomes: tuple[list[tuple[int, int]], np.ndarray, np.ndarray] | None = None

    def set_outcomes(self, actions: list[tuple[int, int]], tokens: np.ndarray, seconds: np.ndarray) -> None:
        """What each action would do at this step (called by the harness before ``decide``)."""
        self._outcomes = (actions, np.asarray(tokens, float), np.asarray(seconds, float))

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        if self._outcomes is None:
            raise ConfigError("The oracle needs the replay env's action outcomes at every step. Fix: evaluate it "
                              "with `specrl evaluate` on a replay env (it is not available live).")
        actions, tokens, seconds = self._outcomes
        self._outcomes = None
        return actions[int(np.argmax(tokens / np.maximum(seconds, 1e-12)))]

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        pass
