"""A learned acceptance model: model-based speculation control trained on replay counterfactuals.

``goodput`` (SmartSpec) scores every (k, w) as ``batch * (1 + E[accepted per row]) / E[step
time]`` with a hand-built acceptance model: per-depth acceptance EMAs pushed through the tree, times
the fraction of requests with an n-gram match. That model ignores features that predict the
n-gram drafter well (suffix match length, number of earlier matches, the last accept length, how
long since the last draft), and the EMAs only move while drafting. Here an MLP learns
``E[accepted draft tokens per running request | features, action]`` for every action at once, and
the policy is the same argmax with the learned term (the step time still comes from the profiled
cost model, which is exact in replay and measured on the live engine).

Why not model-free RL: the replay env knows, at every step, what *every* action would have
committed (``action_outcomes()``, what the clairvoyant oracle uses). Regressing on those
counterfactuals gives a full-information target per step instead of one sampled return per
action, so ~150k steps and two minutes of fitting find what PPO did not find in 1.5M steps. The
features stay observable: the oracle's knowledge is only the *label*.

Training (``train``) is DAgger-style: round 0 collects with ``goodput`` driving the env (with
epsilon-random actions so every action's features are seen), later rounds collect with the
current model driving (its own state distribution: after it drafts more, the acceptance EMAs
look different), and the model is refit on everything collected. Collection uses the training
prompts only.

Artifacts (``save`` / ``load``): ``accmodel.safetensors`` (the MLP) + ``accmodel.json`` (feature
schema, action table, observation normalisation, recipe, training log). Inference is numpy only,
so the policy (``accmodel:DIR`` in the policy registry) runs without torch.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specrl.errors import ConfigError
from specrl.features import FIELDS, INDEX, SCHEMA_VERSION
from specrl.policies.base import ActionTable, PolicyContext
from specrl.policies.goodput import GoodputArgmax

FORMAT = "specrl-accmodel-1"


@dataclass
class Recipe:
    """How a model was trained (saved in its card)."""

    steps: int = 2000  # env steps per collection round (each gives n_envs samples)
    rounds: int = 2  # DAgger rounds after the goodput-driven round 0
    round_steps: int = 400  # env steps per DAgger round
    n_envs: int = 64
    epsilon: float = 0.1  # random actions while collecting (coverage of every action)
    hidden: tuple[int, ...] = (128, 128)
    epochs: int = 40
    lr: float = 1e-3
    batch_size: int = 1024


def recipe_from(agent: Any) -> Recipe:
    """The recipe of an agent preset with ``algo: accmodel``: its ``hyperparams`` are Recipe
    fields, ``n_envs`` comes from the preset itself."""
    fields = {f for f in Recipe.__dataclass_fields__ if f != "n_envs"}
    bad = sorted(set(agent.hyperparams) - fields)
    if bad:
        raise ConfigError(f"algo 'accmodel' has no hyperparameter(s) {bad}. Allowed: {', '.join(sorted(fields))}. "
                          "Fix: see agents/accmodel.yaml.")
    hp = dict(agent.hyperparams)
    if "hidden" in hp:
        hp["hidden"] = tuple(hp["hidden"])
    return Recipe(**hp, n_envs=agent.n_envs)


class AcceptanceModel:
    """The MLP in numpy (tanh hidden layers, linear output): (F,) or (N, F) features -> (.., A)."""

    def __init__(self, weights: list[tuple[np.ndarray, np.ndarray]], mean: np.ndarray, std: np.ndarray) -> None:
        self.weights = [(np.asarray(w, np.float64), np.asarray(b, np.float64)) for w, b in weights]
        self.mean, self.std = np.asarray(mean, np.float64), np.asarray(std, np.float64)

    def __call__(self, features: np.ndarray) -> np.ndarray:
        h = (np.asarray(features, np.float64) - self.mean) / self.std
        for i, (w, b) in enumerate(self.weights):  # w: (out, in) as torch stores it
            h = h @ w.T + b
            if i < len(self.weights) - 1:
                h = np.tanh(h)
        return np.maximum(h, 0.0)  # accepted tokens are >= 0


class AcceptanceModelPolicy(GoodputArgmax):
    """``goodput``'s argmax with the learned acceptance term; no probing rule (``since_draft`` is
    an input, so the model decides when drafting is worth it again). Stateless."""

    name = "accmodel"

    def __init__(self, ctx: PolicyContext, model: AcceptanceModel) -> None:
        super().__init__(ctx)
        self.model = model

    def expected_accepted_per_row(self, features: np.ndarray) -> np.ndarray:
        acc = self.model(features)  # (A,)
        return np.where(self._drafted, acc, 0.0)

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        return self.actions[int(np.argmax(self.scores(features)))]


# ----- data --------------------------------------------------------------------------------------
def collect(env_cfg: Any, decide: Any, steps: int, n_envs: int, seed: int, epsilon: float,
            progress: bool = False, desc: str = "collect") -> tuple[np.ndarray, np.ndarray]:
    """Drive the vectorised replay env with ``decide(features) -> (k, w)`` (epsilon-random
    actions mixed in) and record, at every step, the observation and what every action of the
    table would have committed. Returns (obs (M, F), accepted per row (M, A)), M = steps * n_envs."""
    from tqdm.auto import tqdm

    from specrl.envs.vector import SpecReplayVecEnv

    vec = SpecReplayVecEnv(env_cfg, n_envs)
    vec.seed(seed)
    table = ActionTable(env_cfg.k_choices, env_cfg.w_choices)
    actions = table.all()
    rng = np.random.default_rng(seed)
    obs = vec.reset()  # (N, F)
    all_obs = np.empty((steps, n_envs, obs.shape[1]), np.float32)
    all_y = np.empty((steps, n_envs, len(actions)), np.float32)
    for t in tqdm(range(steps), desc=desc, disable=not progress, leave=False, mininterval=2.0):
        acts, tok, _ = vec.action_outcomes()  # tok: (N, U) committed tokens of the batch per action
        col = {a: j for j, a in enumerate(acts)}
        batch = np.maximum(obs[:, INDEX["batch_size"]], 1.0)  # (N,)
        all_obs[t] = obs
        all_y[t] = tok[:, [col[a] for a in actions]] / batch[:, None] - 1.0  # (N, A)
        chosen = np.array([table.index(*decide(o)) for o in obs])  # (N, 2)
        for i in np.flatnonzero(rng.random(n_envs) < epsilon):
            chosen[i] = table.index(*actions[rng.integers(len(actions))])
        vec.step_async(chosen)
        obs, _, _, _ = vec.step_wait()
    vec.close()
    return all_obs.reshape(-1, obs.shape[1]), np.maximum(all_y.reshape(-1, len(actions)), 0.0)


def fit(obs: np.ndarray, y: np.ndarray, recipe: Recipe, seed: int) -> tuple[AcceptanceModel, dict[str, float]]:
    """Least-squares fit of the MLP (torch, CPU); returns the numpy model and its held-back MSE
    beside the MSE of predicting the per-action mean (how much the features explain)."""
    import torch

    torch.manual_seed(seed)
    mean, std = obs.mean(0), obs.std(0) + 1e-6
    x = torch.tensor((obs - mean) / std, dtype=torch.float32)  # (M, F)
    t = torch.tensor(y, dtype=torch.float32)  # (M, A)
    layers: list[torch.nn.Module] = []
    sizes = [x.shape[1], *recipe.hidden]
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], t.shape[1]))
    opt = torch.optim.Adam(net.parameters(), recipe.lr)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=gen)
    held, train = perm[: len(x) // 10], perm[len(x) // 10 :]
    for _ in range(recipe.epochs):
        order = train[torch.randperm(len(train), generator=gen)]
        for i in range(0, len(order), recipe.batch_size):
            b = order[i : i + recipe.batch_size]
            loss = ((net(x[b]) - t[b]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        mse = float(((net(x[held]) - t[held]) ** 2).mean())
        const = float(((t[held] - t[train].mean(0)) ** 2).mean())
    lin = [m for m in net if isinstance(m, torch.nn.Linear)]
    model = AcceptanceModel([(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in lin], mean, std)
    return model, {"mse": mse, "mse_constant": const, "samples": int(len(x))}


def train(env_cfg: Any, recipe: Recipe | None = None, seed: int = 0, progress: bool = True,
          log: Any = print) -> tuple[AcceptanceModel, dict[str, Any]]:
    """Round 0 with ``goodput`` driving, then ``recipe.rounds`` DAgger rounds with the model
    driving; refit on everything after each round. Returns the model and a training log."""
    from specrl.envs.config import policy_context

    recipe = recipe or Recipe()
    if env_cfg.prompt_split == "test":
        raise ConfigError("accmodel training collects on prompt_split 'test' (the held-out prompts). Fix: "
                          "train on prompt_split 'train' and keep 'test' for the evaluation.")
    ctx = policy_context(env_cfg)
    t0 = time.perf_counter()
    obs, y = collect(env_cfg, GoodputArgmax(ctx).decide, recipe.steps, recipe.n_envs, seed, recipe.epsilon,
                     progress, "accmodel round 0 (goodput drives)")
    model, stats = fit(obs, y, recipe, seed)
    history = [{"round": 0, **stats, "seconds": time.perf_counter() - t0}]
    log(f"accmodel round 0: {stats['samples']} samples, held-back MSE {stats['mse']:.3f} "
        f"(per-action mean {stats['mse_constant']:.3f})")
    for r in range(1, recipe.rounds + 1):
        pol = AcceptanceModelPolicy(ctx, model)
        o2, y2 = collect(env_cfg, pol.decide, recipe.round_steps, recipe.n_envs, seed + 1000 * r, recipe.epsilon,
                         progress, f"accmodel round {r} (model drives)")
        obs, y = np.concatenate([obs, o2]), np.concatenate([y, y2])
        model, stats = fit(obs, y, recipe, seed + r)
        history.append({"round": r, **stats, "seconds": time.perf_counter() - t0})
        log(f"accmodel round {r}: {stats['samples']} samples, held-back MSE {stats['mse']:.3f} "
            f"(per-action mean {stats['mse_constant']:.3f})")
    return model, {"recipe": asdict(recipe), "seed": seed, "history": history}


# ----- artifacts ---------------------------------------------------------------------------------
def save(model: AcceptanceModel, out: str | Path, table: ActionTable, info: dict[str, Any]) -> Path:
    """Write ``accmodel.safetensors`` + ``accmodel.json`` into ``out``."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"obs_mean": model.mean.astype(np.float32), "obs_std": model.std.astype(np.float32)}
    for i, (w, b) in enumerate(model.weights):
        tensors[f"layer{i}.weight"] = w.astype(np.float32)
        tensors[f"layer{i}.bias"] = b.astype(np.float32)
    save_file(tensors, str(out / "accmodel.safetensors"))
    meta = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "fields": list(FIELDS),
            "k_choices": table.k_choices, "w_choices": table.w_choices, "actions": [list(a) for a in table.all()],
            "layers": len(model.weights), "activation": "tanh", **info}
    (out / "accmodel.json").write_text(json.dumps(meta, indent=1))
    return out


def load(path: str | Path, table: ActionTable | None = None) -> tuple[AcceptanceModel, dict[str, Any]]:
    """Read a saved model (safetensors + JSON, no pickle) and check it fits this schema and table."""
    from safetensors.numpy import load_file

    d = Path(path)
    js, st = d / "accmodel.json", d / "accmodel.safetensors"
    if not js.is_file() or not st.is_file():
        raise ConfigError(f"accmodel:{path}: {d} must hold accmodel.json and accmodel.safetensors. Fix: point at a "
                          "directory written by `python benchmarks/acceptance_model.py` (runs/accmodel-s<seed>).")
    meta = json.loads(js.read_text())
    if meta.get("format") != FORMAT or meta.get("schema_version") != SCHEMA_VERSION or meta.get("fields") != list(FIELDS):
        raise ConfigError(f"accmodel:{path} was written for format {meta.get('format')!r}, feature schema "
                          f"v{meta.get('schema_version')}; this specrl reads {FORMAT!r}, schema v{SCHEMA_VERSION}. "
                          "Fix: retrain it with this version.")
    if table is not None and meta["actions"] != [list(a) for a in table.all()]:
        raise ConfigError(f"accmodel:{path} predicts actions {meta['actions']}, but this env's table is "
                          f"{[list(a) for a in table.all()]}. Fix: retrain it on this env's k_choices / w_choices.")
    t = load_file(str(st))
    layers = [(t[f"layer{i}.weight"], t[f"layer{i}.bias"]) for i in range(int(meta["layers"]))]
    return AcceptanceModel(layers, t["obs_mean"], t["obs_std"]), meta


def make_policy(ctx: PolicyContext, path: str) -> AcceptanceModelPolicy:
    """``accmodel:DIR`` in the policy registry."""
    if not path:
        raise ConfigError("accmodel: needs a directory, e.g. accmodel:runs/accmodel-s0.")
    model, _ = load(path, ActionTable(ctx.k_choices, ctx.w_choices))
    pol = AcceptanceModelPolicy(ctx, model)
    pol.name = f"accmodel:{path}"
    return pol
