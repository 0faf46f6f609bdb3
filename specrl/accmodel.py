"""Networks fit on replay counterfactuals: a learned acceptance model and a decision network.

``goodput`` (SmartSpec) scores every (k, w) as ``batch * (1 + E[accepted per row]) / E[step
time]`` with a hand-built acceptance model: per-depth acceptance EMAs pushed through the tree, times
the fraction of requests with an n-gram match. That model ignores features that predict the
n-gram drafter well (suffix match length, number of earlier matches, the last accept length, how
long since the last draft), and the EMAs only move while drafting.

Two learners share the data, the training loop and the artifacts here (``Recipe.objective``):

* ``acceptance`` (agents/accmodel.yaml): an MLP learns ``E[accepted draft tokens per running
  request | features, action]`` for every action at once, and the policy is goodput's argmax with
  the learned term (the step time still comes from the profiled cost model).
* ``decision`` (agents/decision.yaml): the MLP scores the actions directly and the policy is its
  argmax. It is trained to maximise the expected relative goodput of a step under its softmax.
  A regression spends its capacity on every action's acceptance, and an argmax over imperfect
  predictions then picks their over-estimates; this objective spends it on the choice. Measured:
  held-out 1.037x of ``goodput`` against 1.018x for the acceptance model (10 arrival seeds,
  training seed 0 of each, same data budget; README for the 3-seed numbers).

Why not model-free RL: the replay env knows, at every step, what *every* action would have
committed and how long its decode work would take (``action_outcomes()``, what the clairvoyant
oracle uses). Fitting those counterfactuals gives a full-information target per step instead of
one sampled return per action, so ~180k steps and a few minutes of fitting find what PPO did not
find in 1.5M steps. The features stay observable: the oracle's knowledge is only the *label*.
Both objectives are myopic, like ``goodput`` and the oracle: a step's value is its own goodput.

Training (``train``) is DAgger-style: round 0 collects with ``goodput`` driving the env (with
epsilon-random actions so every action's features are seen), later rounds collect with the
current model driving (its own state distribution: after it drafts more, the acceptance EMAs
look different), and the model is refit on everything collected. Collection uses the training
prompts only.

Artifacts (``save`` / ``load``): ``accmodel.safetensors`` (the MLP) + ``accmodel.json`` (feature
schema, action table, objective, observation normalisation, recipe, training log). Inference is
numpy only, so the policy (``accmodel:DIR`` in the policy registry, either objective) runs
without torch.
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
from specrl.policies.base import ActionTable, BasePolicy, PolicyContext
from specrl.policies.goodput import GoodputArgmax

FORMAT = "specrl-accmodel-1"
OBJECTIVES = ("acceptance", "decision")


@dataclass
class Recipe:
    """How a model was trained (saved in its card)."""

    steps: int = 2000  # env steps per collection round (each gives n_envs samples)
    rounds: int = 2  # DAgger rounds after the goodput-driven round 0
    round_steps: int = 400  # env steps per DAgger round
    n_envs: int = 64
    epsilon: float = 0.1  # random actions while collecting (coverage of every action)
    hidden: tuple[int, ...] = (128, 128)
    objective: str = "acceptance"  # "acceptance": predict accepted tokens; "decision": score actions directly
    epochs: int = 40
    lr: float = 1e-3
    batch_size: int = 1024

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"algo 'accmodel': objective={self.objective!r} is not one of {list(OBJECTIVES)}. Fix: "
                              "objective: acceptance (agents/accmodel.yaml) or objective: decision "
                              "(agents/decision.yaml).")


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
    return Recipe(**hp, n_envs=agent.n_envs)  # Recipe checks the objective


class AcceptanceModel:
    """The MLP in numpy (tanh hidden layers, linear output): (F,) or (N, F) features -> (.., A).

    ``clip``: outputs are accepted tokens, so >= 0 (objective "acceptance"); action scores of
    the "decision" objective are not clipped (an argmax over all-negative scores must survive)."""

    def __init__(self, weights: list[tuple[np.ndarray, np.ndarray]], mean: np.ndarray, std: np.ndarray,
                 clip: bool = True) -> None:
        self.weights = [(np.asarray(w, np.float64), np.asarray(b, np.float64)) for w, b in weights]
        self.mean, self.std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
        self.clip = clip

    def __call__(self, features: np.ndarray) -> np.ndarray:
        h = (np.asarray(features, np.float64) - self.mean) / self.std
        for i, (w, b) in enumerate(self.weights):  # w: (out, in) as torch stores it
            h = h @ w.T + b
            if i < len(self.weights) - 1:
                h = np.tanh(h)
        return np.maximum(h, 0.0) if self.clip else h


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


class DecisionPolicy(BasePolicy):
    """Objective "decision": the network scores every action directly and the policy takes the
    argmax. Trained to maximise the expected goodput of a step under its softmax (see ``fit``),
    so it needs no acceptance or cost model at run time: the profiled step times it was trained
    on are inside its weights, like an RL policy's. Stateless."""

    name = "accmodel"

    def __init__(self, ctx: PolicyContext, model: AcceptanceModel) -> None:
        super().__init__(ctx)
        self.model = model
        self.actions = self.table.all()

    def scores(self, features: np.ndarray) -> np.ndarray:
        """(A,) the network's action scores (logits of its softmax)."""
        return self.model(features)

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        return self.actions[int(np.argmax(self.model(features)))]


def policy_for(ctx: PolicyContext, model: AcceptanceModel, objective: str) -> AcceptanceModelPolicy | DecisionPolicy:
    """The policy of a fitted model: goodput's argmax with it ("acceptance"), or its own argmax."""
    return DecisionPolicy(ctx, model) if objective == "decision" else AcceptanceModelPolicy(ctx, model)


# ----- data --------------------------------------------------------------------------------------
def collect(env_cfg: Any, decide: Any, steps: int, n_envs: int, seed: int, epsilon: float,
            progress: bool = False, desc: str = "collect") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drive the vectorised replay env with ``decide(features) -> (k, w)`` (epsilon-random
    actions mixed in) and record, at every step, the observation and what every action of the
    table would have done. Returns obs (M, F), accepted tokens per row (M, A) and the goodput of
    the step's decode work, tokens / seconds (M, A; newcomers' prefill left out, as the oracle
    ranks), M = steps * n_envs."""
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
    all_g = np.empty((steps, n_envs, len(actions)), np.float32)
    for t in tqdm(range(steps), desc=desc, disable=not progress, leave=False, mininterval=2.0):
        acts, tok, sec = vec.action_outcomes(prefill=False)  # (N, U) committed tokens and seconds per action
        cols = [acts.index(a) for a in actions]
        batch = np.maximum(obs[:, INDEX["batch_size"]], 1.0)  # (N,)
        all_obs[t] = obs
        all_y[t] = tok[:, cols] / batch[:, None] - 1.0  # (N, A)
        all_g[t] = tok[:, cols] / np.maximum(sec[:, cols], 1e-12)  # (N, A)
        chosen = np.array([table.index(*decide(o)) for o in obs])  # (N, 2)
        for i in np.flatnonzero(rng.random(n_envs) < epsilon):
            chosen[i] = table.index(*actions[rng.integers(len(actions))])
        vec.step_async(chosen)
        obs, _, _, _ = vec.step_wait()
    vec.close()
    m = steps * n_envs
    return (all_obs.reshape(m, -1), np.maximum(all_y.reshape(m, -1), 0.0), all_g.reshape(m, -1))


def fit(obs: np.ndarray, y: np.ndarray, recipe: Recipe, seed: int, goodput: np.ndarray | None = None,
        progress: bool = False, desc: str = "fit") -> tuple[AcceptanceModel, dict[str, float]]:
    """Fit the MLP (torch, CPU) and return the numpy model and held-back statistics.

    Objective "acceptance": least squares on ``y`` (accepted tokens per row, (M, A)); stats are
    the held-back MSE beside the MSE of predicting the per-action mean (how much the features
    explain). Objective "decision": maximise the expected relative goodput of a step under the
    network's softmax, ``sum_a softmax(z)_a * goodput_a / max_b goodput_b`` (``goodput`` (M, A)
    required). Every action's outcome is known (full-information feedback), so this is the exact
    expected reward, not a sampled policy gradient, and it spends the network on the choices
    that matter instead of on accepted tokens of actions that never win (an argmax over
    imperfect predictions picks their over-estimates). Stats: held-back regret of the argmax
    (1 - its relative goodput) beside that of the best constant action."""
    import torch
    from tqdm.auto import tqdm

    if recipe.objective == "decision" and goodput is None:
        raise ValueError("fit(objective='decision') needs the per-action goodput (collect returns it)")
    torch.manual_seed(seed)
    mean, std = obs.mean(0), obs.std(0) + 1e-6
    x = torch.tensor((obs - mean) / std, dtype=torch.float32)  # (M, F)
    if recipe.objective == "decision":
        t = torch.tensor(goodput / np.maximum(goodput.max(1, keepdims=True), 1e-12), dtype=torch.float32)  # (M, A)
    else:
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

    def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if recipe.objective == "decision":
            return -(torch.softmax(out, 1) * target).sum(1).mean()
        return ((out - target) ** 2).mean()

    for _ in tqdm(range(recipe.epochs), desc=desc, disable=not progress, leave=False, mininterval=2.0):
        order = train[torch.randperm(len(train), generator=gen)]
        for i in range(0, len(order), recipe.batch_size):
            b = order[i : i + recipe.batch_size]
            loss = loss_of(net(x[b]), t[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        out = net(x[held])
        if recipe.objective == "decision":
            picked = t[held].gather(1, out.argmax(1, keepdim=True))
            stats = {"regret": float(1 - picked.mean()),
                     "regret_constant": float(1 - t[held][:, int(t[train].mean(0).argmax())].mean())}
        else:
            stats = {"mse": float(((out - t[held]) ** 2).mean()),
                     "mse_constant": float(((t[held] - t[train].mean(0)) ** 2).mean())}
    lin = [m for m in net if isinstance(m, torch.nn.Linear)]
    model = AcceptanceModel([(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in lin], mean, std,
                            clip=recipe.objective != "decision")
    return model, {**stats, "samples": int(len(x))}


def _fit_line(stats: dict[str, float]) -> str:
    if "regret" in stats:
        return (f"{stats['samples']} samples, held-back regret {stats['regret']:.4f} "
                f"(best constant action {stats['regret_constant']:.4f})")
    return f"{stats['samples']} samples, held-back MSE {stats['mse']:.3f} (per-action mean {stats['mse_constant']:.3f})"


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
    obs, y, g = collect(env_cfg, GoodputArgmax(ctx).decide, recipe.steps, recipe.n_envs, seed, recipe.epsilon,
                        progress, "accmodel round 0 (goodput drives)")
    model, stats = fit(obs, y, recipe, seed, g, progress, "accmodel round 0 (fit)")
    history = [{"round": 0, **stats, "seconds": time.perf_counter() - t0}]
    log(f"accmodel round 0: {_fit_line(stats)}")
    for r in range(1, recipe.rounds + 1):
        pol = policy_for(ctx, model, recipe.objective)
        o2, y2, g2 = collect(env_cfg, pol.decide, recipe.round_steps, recipe.n_envs, seed + 1000 * r,
                             recipe.epsilon, progress, f"accmodel round {r} (model drives)")
        obs, y, g = np.concatenate([obs, o2]), np.concatenate([y, y2]), np.concatenate([g, g2])
        model, stats = fit(obs, y, recipe, seed + r, g, progress, f"accmodel round {r} (fit)")
        history.append({"round": r, **stats, "seconds": time.perf_counter() - t0})
        log(f"accmodel round {r}: {_fit_line(stats)}")
    feature_range = {"low": obs.min(0).tolist(), "high": obs.max(0).tolist()}  # for the controller's guard
    return model, {"recipe": asdict(recipe), "seed": seed, "objective": recipe.objective, "history": history,
                   "feature_range": feature_range}


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
            "layers": len(model.weights), "activation": "tanh", "output": "relu" if model.clip else "linear",
            "objective": info.get("objective", "acceptance"), **info}
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
    if meta.get("objective", "acceptance") not in OBJECTIVES:
        raise ConfigError(f"accmodel:{path} has objective {meta.get('objective')!r}; this specrl knows "
                          f"{list(OBJECTIVES)}. Fix: retrain it with this version.")
    t = load_file(str(st))
    layers = [(t[f"layer{i}.weight"], t[f"layer{i}.bias"]) for i in range(int(meta["layers"]))]
    return AcceptanceModel(layers, t["obs_mean"], t["obs_std"], clip=meta.get("output", "relu") == "relu"), meta


def make_policy(ctx: PolicyContext, path: str) -> AcceptanceModelPolicy | DecisionPolicy:
    """``accmodel:DIR`` in the policy registry (either objective: the artifact says which)."""
    if not path:
        raise ConfigError("accmodel: needs a directory, e.g. accmodel:runs/accmodel-s0.")
    model, meta = load(path, ActionTable(ctx.k_choices, ctx.w_choices))
    pol = policy_for(ctx, model, meta.get("objective", "acceptance"))
    pol.name = f"accmodel:{path}"
    return pol
