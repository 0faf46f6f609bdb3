"""The clairvoyant oracle (replay only): the upper bound to report learned policies against.

What it optimises, exactly: at every step it knows, for every action of the table, how many
tokens the running batch would commit and how long the step's decode work would take (from the
traces and the cost model: ``action_outcomes(prefill=False)`` of the replay envs), and picks the
action with the highest goodput of that work (tokens / seconds). It is myopic: it does not plan
for acceptance statistics or queueing effects of later steps, so a policy can in principle beat
it over an episode.

Why the newcomers' prefill is left out of the seconds: it is paid in that step whatever the
action, and a ratio that counts it, tokens / (prefill + decode), makes speculation look cheap in
the steps that admit a request: there the extra verify tokens cost a smaller share of a longer
step, although they cost the same seconds as in any other step. That oracle speculated most where
newcomers arrive, which at concurrency 8 and 16 (a newcomer in most steps) made it lose to
`goodput`. Measured on the held-out prompts, 10 arrival seeds x 120 s: counting the prefill, the
oracle scored 0.973x / 0.942x of `goodput` at concurrency 8 / 16 (1.055x overall); leaving it out,
1.003x / 1.012x (1.082x overall). ``goodput`` and the learned policies leave it out too (their
step times have no newcomers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specrl.errors import ConfigError
from specrl.policies.base import BasePolicy, PolicyContext


class Oracle(BasePolicy):
    name = "oracle"
    clairvoyant = True  # reads the replay env's future outcomes: never live

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
