"""Deferring to a rule: one extra choice on the agent's k head hands the step to a baseline rule.

Why: the learned policy has to beat strong rules at *every* load, and PPO started from a
behaviour clone of ``goodput`` drifts away from it where the rule was already right (concurrency
8 in the README: 0.99x of ``goodput`` for every seed). With a ``defer`` choice the clone is the
rule exactly (one action, "defer", instead of ~96% agreement over the whole (k, w) table), and RL
only has to learn *where* to overrule it: residual policy learning (Silver et al., 2018) in a
discrete action space, or "choose among heuristics" controllers in systems work.

The same mapping runs in training (``VecDefer``, innermost wrapper of the replay VecEnv, so the
rule sees raw features), in-process evaluation (``specrl.learned.SB3Policy``) and the exported
numpy controller (``actions.defer`` in controller.json). In all three the rule ``decide``s only
on the steps handed to it and ``observe``s every step, so its state (e.g. ``goodput``'s probe
counter) evolves the same way everywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specrl.errors import ConfigError

NOT_DEFERRABLE = ("oracle",)


def check_rule(rule: str) -> None:
    """Refuse unknown rules and rules that cannot decide from the features alone."""
    from specrl.errors import unknown_name
    from specrl.policies import REGISTRY, SPEC_FORMS

    name = rule.partition(":")[0]
    if name not in REGISTRY:
        raise unknown_name("policy", rule, [*REGISTRY, *SPEC_FORMS])
    if name in NOT_DEFERRABLE:
        raise ConfigError(f"defer={rule!r}: the oracle decides from the replay's future outcomes, which a deployed "
                          "policy does not have. Allowed: a rule that decides from the features (goodput, sglang-ema, "
                          "hf-heuristic, static:K,W, ...).")


def make_rules(rule: str, ctx: Any, n: int) -> list[Any]:
    """``n`` independent instances of ``rule`` (one per stream: rules keep per-stream state)."""
    from specrl.policies import make_policy

    check_rule(rule)
    return [make_policy(rule, ctx) for _ in range(n)]


def make_vec_defer(venv: Any, rule: str, ctx: Any) -> Any:
    """Wrap a MultiDiscrete([K, W]) VecEnv into MultiDiscrete([K + 1, W]); k index K = defer to ``rule``."""
    from gymnasium import spaces
    from stable_baselines3.common.vec_env import VecEnvWrapper

    from specrl.policies.base import ActionTable

    class VecDefer(VecEnvWrapper):
        def __init__(self) -> None:
            nk, nw = (int(n) for n in venv.action_space.nvec)
            super().__init__(venv, action_space=spaces.MultiDiscrete([nk + 1, nw]))
            self.defer_index = nk
            self.table = ActionTable(list(ctx.k_choices), list(ctx.w_choices))
            self.rules = make_rules(rule, ctx, venv.num_envs)
            self._obs: np.ndarray | None = None  # (N, F) raw features the next actions decide on
            self._deferred = np.zeros(venv.num_envs, bool)
            self.actions = np.zeros((venv.num_envs, 2), np.int64)  # (N, 2) the last step's action indices, resolved

        def reset(self) -> np.ndarray:
            for r in self.rules:
                r.reset()
            self._obs = self.venv.reset()
            return self._obs

        def step_async(self, actions: np.ndarray) -> None:
            a = np.array(actions, np.int64).reshape(self.num_envs, 2)  # (N, 2) k index, w index
            self._deferred = a[:, 0] == self.defer_index
            for i in np.flatnonzero(self._deferred):
                a[i] = self.table.index(*self.rules[i].decide(self._obs[i]))
            self.actions = a
            self.venv.step_async(a)

        def step_wait(self) -> Any:
            obs, rew, done, infos = self.venv.step_wait()
            for i, (r, info) in enumerate(zip(self.rules, infos)):
                info["deferred"] = bool(self._deferred[i])
                if done[i]:  # obs[i] already starts the next episode (VecEnv auto-reset)
                    r.reset()
                else:
                    r.observe(obs[i], info)
            self._obs = obs
            return obs, rew, done, infos

    return VecDefer()


def defer_labels(actions: np.ndarray, num_k: int) -> np.ndarray:
    """Behaviour-cloning labels for a clone of the deferred-to rule itself: every step is 'defer'
    (k index ``num_k``); the w index keeps the rule's, which the env ignores when deferring."""
    out = np.array(actions, np.int64).reshape(-1, 2)  # (T, 2)
    out[:, 0] = num_k
    return out
