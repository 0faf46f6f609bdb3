"""Warm start: behaviour-clone a baseline rule into the agent's policy before RL.

Why: from a uniform initial policy over the (k, w) table, PPO first sees mostly bad speculative
actions at high batch sizes (k = 8, w = 4 at batch 8 costs far more than it gains) and can lock
into "never speculate above batch 4" before it finds the cheap actions that do pay there; one
fresh-clone demo run ended at 0.79x of the best baseline at concurrency 4 that way. Starting
from a strong rule (``goodput`` by default) puts exploration where the good actions are and
makes runs repeatable; RL then only has to learn where the rule is wrong (kickstarting /
imitation pre-training, as in AlphaStar or the DAgger family).

Only the policy head is fitted (cross-entropy on the rule's (k, w) indices); the observation
normaliser is initialised from the rule's own rollouts so that the features the clone saw are
normalised exactly as the RL phase will normalise them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specrl.errors import ConfigError


@dataclass
class Demonstrations:
    obs: np.ndarray  # (T, F) raw (unnormalised) features the rule decided on
    actions: np.ndarray  # (T, 2) MultiDiscrete indices (k index, w index)
    goodput: float  # tokens / simulated second over the rollouts (sanity number for logs)


def collect(env_cfg: Any, rule: str, n_envs: int, steps: int, seed: int) -> Demonstrations:
    """Roll ``rule`` out on the vectorised replay env for ``steps`` env steps in total: every step
    handed to it through the ``specrl.defer`` wrapper, the one place that drives a rule per env
    (decide on the raw features, observe every step, reset at episode ends)."""
    from specrl.defer import make_vec_defer
    from specrl.envs.config import policy_context
    from specrl.envs.vector import SpecReplayVecEnv

    if rule == "oracle":
        raise ConfigError(f"pretrain: {rule!r} cannot be cloned: it decides from the replay's future outcomes, not "
                          "the features. Allowed: a rule that decides from the features (goodput, sglang-ema, "
                          "hf-heuristic, static:K,W, controller:DIR, ...).")
    vec = make_vec_defer(SpecReplayVecEnv(env_cfg, n_envs), rule, policy_context(env_cfg))
    vec.seed(seed)
    obs = vec.reset()  # (N, F)
    defer = np.tile([vec.defer_index, 0], (n_envs, 1))  # (N, 2): every step to the rule
    rounds = max(1, steps // n_envs)
    all_obs = np.empty((rounds, n_envs, obs.shape[1]), np.float32)
    all_act = np.empty((rounds, n_envs, 2), np.int64)
    tokens = secs = 0.0
    for t in range(rounds):
        all_obs[t] = obs
        obs, _, _, infos = vec.step(defer)
        all_act[t] = vec.actions  # (N, 2) the rule's action indices
        tokens += sum(float(info.get("tokens", 0.0)) for info in infos)
        secs += sum(float(info.get("dt", 0.0)) for info in infos)
    vec.close()
    return Demonstrations(all_obs.reshape(-1, obs.shape[1]), all_act.reshape(-1, 2), tokens / max(secs, 1e-9))


def clone(model: Any, obs_norm: np.ndarray, actions: np.ndarray, epochs: int, batch_size: int = 256,
          lr: float = 1e-3, seed: int = 0, smoothing: float = 0.0) -> list[float]:
    """Fit ``model.policy``'s action distribution to ``actions``; returns the mean loss per epoch.

    ``obs_norm`` (T, F) must already be normalised the way the model's env normalises.
    ``smoothing`` (label smoothing, per head) leaves that much probability on the other choices:
    a clone fitted to a loss of ~0 (a rule that is one action, as with ``defer``) is so
    deterministic that PPO never tries anything else.
    """
    import torch

    pol = model.policy
    pol.set_training_mode(True)
    opt = torch.optim.Adam(pol.parameters(), lr=lr)
    x = torch.as_tensor(obs_norm, dtype=torch.float32)
    y = torch.as_tensor(actions, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        total, n = 0.0, 0
        for s in range(0, len(x), batch_size):
            idx = perm[s : s + batch_size]
            dist = pol.get_distribution(x[idx])
            loss = -dist.log_prob(y[idx]).mean()  # log-prob summed over both heads, (b,) -> ()
            if smoothing:
                heads = dist.distribution if isinstance(dist.distribution, list) else [dist.distribution]
                uniform = sum(h.logits.mean(-1) for h in heads)  # (b,) mean log-prob over each head's choices
                loss = (1.0 - smoothing) * loss - smoothing * uniform.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            n += len(idx)
        losses.append(total / max(n, 1))
    pol.set_training_mode(False)
    return losses


def agreement(model: Any, obs_norm: np.ndarray, actions: np.ndarray, defer_index: int | None = None) -> float:
    """Fraction of states where the clone's deterministic action equals the rule's. Where the label
    is the k head's ``defer_index`` (``specrl.defer``) the w head is ignored, as the env ignores it."""
    pred = np.asarray(model.predict(obs_norm, deterministic=True)[0]).reshape(-1, 2)  # (T, 2)
    same = pred == actions
    if defer_index is not None:
        same[:, 1] |= actions[:, 0] == defer_index
    return float(np.mean(np.all(same, axis=1)))
