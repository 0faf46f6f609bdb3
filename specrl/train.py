"""``specrl train``: RL on the vectorised replay env with Stable-Baselines3, tracked in wandb.

A run = env preset + agent preset + ``--set`` overrides + seed. The run directory holds the
resolved config (``config.json``, also copied next to every checkpoint), checkpoints, the final
model with its observation-normalisation statistics, and the evaluation of the learned policy
beside every baseline and the oracle on held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specrl.config import apply_overrides, from_dict, load_yaml, split_override
from specrl.errors import ConfigError, unknown_name
from specrl.evaluate import EVAL_HORIZON_S

ALGOS = ("ppo", "a2c", "dqn", "accmodel", "rowmodel")
"""SB3 algorithms; ``accmodel``: a network fit on the replay env's counterfactual outcomes,
either an acceptance model under goodput's argmax or a direct decision network (``specrl.accmodel``,
``objective``; its ``hyperparams`` are ``accmodel.Recipe`` fields); ``rowmodel``: a per-request
acceptance table fit on the training prompts' traces, planning one (k, w) per request
(``specrl.rowmodel``; hyperparams: ``prior``, ``calibration``)."""
ROWMODEL_HYPERPARAMS = ("prior", "calibration")
SCHEDULED = ("learning_rate", "clip_range")
"""Hyperparameters that may be a linear schedule, written ``lin_<start>`` as in rl-zoo: the value
falls linearly from ``start`` at the first step to 0 at ``total_timesteps``."""
KEEP = ("last", "best")
VALIDATION_SEED0 = 1000
"""Arrival seeds of the periodic evaluations start here: they run on the *training* prompts, in
episodes that neither training (its own seeds) nor the final held-out evaluation (seeds 0, 1, ...)
uses, so choosing a checkpoint by them never looks at the held-out prompts."""


@dataclass
class AgentConfig:
    algo: str = "ppo"
    """ppo | a2c | dqn (dqn acts on the flattened (k, w) table)."""
    n_envs: int = 64
    """Parallel episodes in the vectorised replay env."""
    total_timesteps: int = 1_500_000
    """Env steps (summed over the parallel envs)."""
    net_arch: list[int] = field(default_factory=lambda: [64, 64])
    """Hidden layers of the policy (and value) MLP."""
    frame_stack: int = 1
    """Stack the last N observations (1 = none)."""
    normalize_obs: bool = True
    """Running mean/var normalisation of observations (VecNormalize); exported with the policy."""
    normalize_reward: bool = True
    """Scale rewards by a running estimate of the return's std (training only)."""
    reward_scale: float = 1.0
    """Multiplies the env reward (for algorithms without reward normalisation)."""
    eval_every: int = 250_000
    """Evaluate on validation episodes (training prompts, arrival seeds from ``VALIDATION_SEED0``)
    every N steps and log the ratio to the best baseline per load (0 = off: only the final
    held-out evaluation)."""
    keep: str = "last"
    """The policy a run ends with (evaluated, saved as model.zip, exported): 'last' (the final
    weights) or 'best' (the periodic evaluation, the final weights included, with the highest
    validation goodput)."""
    checkpoint_every: int = 250_000
    """Save a checkpoint every N steps."""
    eval_loads: list[str] = field(default_factory=lambda: ["closed:1,2,4,8,16"])
    """Load points of the evaluations (specrl evaluate syntax)."""
    eval_seeds: int = 3
    """Arrival seeds per load point in the evaluations."""
    eval_horizon_s: float = EVAL_HORIZON_S
    """Simulated seconds per evaluation episode (see ``specrl.evaluate.EVAL_HORIZON_S``: why 120)."""
    pretrain: str | None = None
    """Behaviour-clone this baseline rule (e.g. ``goodput``) into the policy before RL (null = off);
    see ``specrl.pretrain``. PPO and A2C without frame stacking."""
    pretrain_steps: int = 64_000
    """Env steps of the rule's rollouts used as demonstrations."""
    pretrain_epochs: int = 30
    """Passes of supervised fitting over the demonstrations."""
    pretrain_smoothing: float = 0.0
    """Label smoothing of the clone (probability left on the other choices of each head), so that
    PPO still explores from it (see ``specrl.pretrain.clone``)."""
    defer: str | None = None
    """Add a choice to the k head that hands the step to this rule (e.g. ``goodput``; null = off):
    residual RL over a rule, see ``specrl.defer``. With ``pretrain`` set to the same rule the clone
    is the rule exactly. PPO and A2C."""
    hyperparams: dict[str, Any] = field(default_factory=dict)
    """Passed as keyword arguments to the Stable-Baselines3 algorithm."""

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise unknown_name("algo", self.algo, ALGOS)
        if self.keep not in KEEP:
            raise unknown_name("keep", self.keep, KEEP)
        if self.keep == "best" and not self.eval_every:
            raise ConfigError("keep='best' chooses among the periodic evaluations, but eval_every is 0. Fix: set "
                              "eval_every > 0 (e.g. 250000) or keep: last.")
        if self.n_envs < 1 or self.total_timesteps < 1 or self.frame_stack < 1:
            raise ConfigError("n_envs, total_timesteps and frame_stack must be >= 1.")
        if self.algo == "accmodel":
            from specrl.accmodel import recipe_from

            if self.pretrain or self.defer or self.frame_stack > 1:
                raise ConfigError(f"algo 'accmodel' is not an SB3 agent: pretrain={self.pretrain!r}, defer="
                                  f"{self.defer!r}, frame_stack={self.frame_stack} do not apply. Fix: set pretrain: "
                                  "null, defer: null, frame_stack: 1 (see agents/accmodel.yaml).")
            recipe_from(self)  # refuse unknown hyperparams now, not after the traces are collected
        if self.algo == "rowmodel":
            if self.pretrain or self.defer or self.frame_stack > 1:
                raise ConfigError(f"algo 'rowmodel' is not an SB3 agent: pretrain={self.pretrain!r}, defer="
                                  f"{self.defer!r}, frame_stack={self.frame_stack} do not apply. Fix: set pretrain: "
                                  "null, defer: null, frame_stack: 1 (see agents/rowmodel.yaml).")
            unknown = sorted(set(self.hyperparams) - set(ROWMODEL_HYPERPARAMS))
            if unknown:
                raise ConfigError(f"algo 'rowmodel' has no hyperparams {unknown}. Allowed: {list(ROWMODEL_HYPERPARAMS)}. "
                                  "Fix: remove them (see agents/rowmodel.yaml).")
            return
        if self.pretrain and (self.algo == "dqn" or self.frame_stack > 1):
            raise ConfigError(f"pretrain={self.pretrain!r} works with algo ppo or a2c and frame_stack 1 (got algo="
                              f"{self.algo!r}, frame_stack={self.frame_stack}). Fix: set pretrain: null or change those.")
        if not 0.0 <= self.pretrain_smoothing < 1.0:
            raise ConfigError(f"pretrain_smoothing={self.pretrain_smoothing} is outside [0, 1). Fix: e.g. 0.1 (10% of "
                              "each head's probability spread over its other choices) or 0 (off).")
        if self.defer:
            from specrl.defer import check_rule

            if self.algo == "dqn":
                raise ConfigError(f"defer={self.defer!r} extends the k head of a MultiDiscrete policy; algo 'dqn' acts "
                                  "on a flattened table. Fix: use algo ppo or a2c, or set defer: null.")
            check_rule(self.defer)
        resolve_hyperparams(self.hyperparams)  # refuses a malformed schedule string now, not at build time


@dataclass(frozen=True)
class LinearSchedule:
    """An SB3 schedule that falls linearly from ``start`` to 0 over the run.

    Annealing the step size is rl-zoo's usual PPO recipe: a constant rate keeps the policy
    moving where the advantage signal is weak (concurrency 8 here), so the last weights wander.
    A module-level class rather than a lambda, so a saved model reloads it by name.
    """

    start: float

    def __call__(self, progress_remaining: float) -> float:  # SB3 passes 1 at the start, 0 at the end
        return progress_remaining * self.start

    @classmethod
    def parse(cls, key: str, text: str) -> LinearSchedule:
        try:
            start = float(text[len("lin_"):]) if text.startswith("lin_") else float("nan")
        except ValueError:
            start = float("nan")
        if not start > 0:
            raise ConfigError(f"hyperparams.{key}={text!r} is not a schedule. Allowed: a number, or 'lin_<start>' "
                              f"with start > 0 (falls linearly to 0 over the run). Fix: e.g. {key}: lin_0.0003.")
        return cls(start)


def resolve_hyperparams(hyperparams: dict[str, Any]) -> dict[str, Any]:
    """The SB3 keyword arguments: ``lin_<start>`` strings become :class:`LinearSchedule` objects."""
    kw = dict(hyperparams)
    for key in SCHEDULED:
        if isinstance(kw.get(key), str):
            kw[key] = LinearSchedule.parse(key, kw[key])
    return kw


def load_run_config(run_dir: Path) -> tuple[Any, AgentConfig, dict[str, Any]]:
    """(env config, agent config, the whole saved config.json) of a ``specrl train`` run directory."""
    from specrl.envs.config import EnvConfig

    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a specrl run directory (no config.json). "
                          "Fix: pass the run directory printed by `specrl train`.")
    saved = json.loads(path.read_text())
    return from_dict(EnvConfig, saved["env"]), from_dict(AgentConfig, saved["agent"]), saved


def load_agent_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> AgentConfig:
    data = load_yaml(path) if path else {}
    return from_dict(AgentConfig, apply_overrides(data, overrides or {}))


class FlatActions:
    """Discrete(n) <-> the env's MultiDiscrete indices, over the distinct (k, w) of the table."""

    def __init__(self, k_choices: list[int], w_choices: list[int]) -> None:
        from specrl.policies.base import ActionTable

        self.table = ActionTable(k_choices, w_choices)
        self.actions = self.table.all()
        self.indices = np.array([self.table.index(k, w) for k, w in self.actions])


def make_vec_env(env_cfg: Any, agent: AgentConfig, seed: int, stats: dict[str, np.ndarray] | None = None):
    """The training VecEnv stack: replay env -> (defer | flat actions) -> VecNormalize -> (frame stack)."""
    from gymnasium import spaces
    from stable_baselines3.common.vec_env import VecEnvWrapper, VecFrameStack, VecNormalize

    from specrl.envs.vector import SpecReplayVecEnv

    if env_cfg.backend != "replay":
        raise ConfigError("specrl train runs on the replay backend (set backend: replay in the env preset); "
                          "the live env is for validation and spot checks.")
    vec = SpecReplayVecEnv(env_cfg, agent.n_envs)
    vec.seed(seed)
    if agent.defer:  # innermost: the rule decides on raw features
        from specrl.defer import make_vec_defer
        from specrl.envs.config import policy_context

        vec = make_vec_defer(vec, agent.defer, policy_context(env_cfg))
    if agent.algo == "dqn":
        flat = FlatActions(env_cfg.k_choices, env_cfg.w_choices)

        class _Flat(VecEnvWrapper):
            def __init__(self, venv: Any) -> None:
                super().__init__(venv, action_space=spaces.Discrete(len(flat.actions)))

            def reset(self) -> Any:
                return self.venv.reset()

            def step_async(self, actions: np.ndarray) -> None:
                self.venv.step_async(flat.indices[np.asarray(actions, int).reshape(-1)])

            def step_wait(self) -> Any:
                return self.venv.step_wait()

        vec = _Flat(vec)
    vec = VecNormalize(vec, norm_obs=agent.normalize_obs, norm_reward=agent.normalize_reward, gamma=float(
        agent.hyperparams.get("gamma", 0.99)), clip_obs=10.0)
    if stats is not None:
        set_obs_stats(vec, stats)
    if agent.frame_stack > 1:
        vec = VecFrameStack(vec, agent.frame_stack)
    return vec


def _normalizer(vec: Any) -> Any:
    from stable_baselines3.common.vec_env import VecNormalize

    while not isinstance(vec, VecNormalize):
        vec = vec.venv
    return vec


def build_model(agent: AgentConfig, vec: Any, seed: int, run_dir: Path) -> Any:
    from stable_baselines3 import A2C, DQN, PPO

    cls = {"ppo": PPO, "a2c": A2C, "dqn": DQN}[agent.algo]
    kw = resolve_hyperparams(agent.hyperparams)
    kw.setdefault("policy_kwargs", {})["net_arch"] = list(agent.net_arch)
    return cls("MlpPolicy", vec, seed=seed, device="cpu", verbose=0, **kw)


def obs_stats(vec: Any) -> dict[str, np.ndarray]:
    rms = _normalizer(vec).obs_rms
    return {"mean": np.asarray(rms.mean, np.float64), "var": np.asarray(rms.var, np.float64),
            "count": np.asarray(rms.count, np.float64)}


def set_obs_stats(vec: Any, stats: dict[str, np.ndarray]) -> None:
    """The inverse of :func:`obs_stats`: load normalisation statistics into ``vec``'s VecNormalize."""
    rms = _normalizer(vec).obs_rms
    rms.mean = np.asarray(stats["mean"], np.float64)
    rms.var = np.asarray(stats["var"], np.float64)
    rms.count = float(stats["count"])


def save_stats(stats: dict[str, np.ndarray], path: Path) -> None:
    """Observation statistics as JSON (no pickle): they travel to the exported controller."""
    path.write_text(json.dumps({k: np.asarray(v).tolist() for k, v in stats.items()}))


def load_stats(path: Path) -> dict[str, np.ndarray]:
    d = json.loads(path.read_text())
    return {k: np.asarray(v, np.float64) for k, v in d.items()}


def learned_policy(run_dir: Path, env_cfg: Any, agent: AgentConfig, model: Any = None, name: str = "learned") -> Any:
    """The run's policy as a specrl policy (deterministic actions)."""
    from specrl.envs.config import policy_context
    from specrl.learned import SB3Policy
    from specrl.policies import make_policy

    if agent.algo == "accmodel":
        from specrl.accmodel import make_policy as make_accmodel

        pol = make_accmodel(policy_context(env_cfg), str(run_dir / "accmodel"))
        pol.name = name
        return pol
    if agent.algo == "rowmodel":
        from specrl.rowmodel import RowModelPolicy

        pol = RowModelPolicy(policy_context(env_cfg), run_dir / "rowmodel")
        pol.name = name
        return pol
    if model is None:
        model = load_model(run_dir, agent)
    stats = load_stats(run_dir / "obs_stats.json") if agent.normalize_obs else None
    ctx = policy_context(env_cfg)
    flat = FlatActions(env_cfg.k_choices, env_cfg.w_choices).actions if agent.algo == "dqn" else None
    defer = make_policy(agent.defer, ctx) if agent.defer else None
    return SB3Policy(ctx, model, None if stats is None else stats["mean"].astype(np.float32),
                     None if stats is None else stats["var"].astype(np.float32), 10.0, agent.frame_stack, flat, name,
                     defer=defer)


def load_model(run_dir: Path, agent: AgentConfig, path: Path | None = None) -> Any:
    from stable_baselines3 import A2C, DQN, PPO

    cls = {"ppo": PPO, "a2c": A2C, "dqn": DQN}[agent.algo]
    # Schedules come from the config, not from the zip's pickled copy (resume keeps annealing);
    # SB3's load rebuilds lr_schedule and the clip schedule from these.
    sched = {k: v for k, v in resolve_hyperparams(agent.hyperparams).items() if isinstance(v, LinearSchedule)}
    return cls.load(str(path or run_dir / "model.zip"), device="cpu", custom_objects=sched or None)


# ----- callbacks -------------------------------------------------------------------------------
def make_callbacks(run_dir: Path, env_cfg: Any, agent: AgentConfig, tracker: Any, baseline_goodput: dict | None):
    from stable_baselines3.common.callbacks import BaseCallback

    class SpecCallback(BaseCallback):
        """spec/ metrics from the env infos, checkpoints, periodic held-out evaluation."""

        def __init__(self) -> None:
            super().__init__()
            self.acc: list[float] = []
            self.ks: list[int] = []
            self.ws: list[int] = []
            self.deferred = 0  # steps handed to agent.defer's rule (specrl.defer)
            self.tokens = 0.0
            self.secs = 0.0
            self.next_ckpt = agent.checkpoint_every
            self.next_eval = agent.eval_every if agent.eval_every else None
            best = run_dir / "best.json"  # a resumed run competes with the best validated before
            self.best = json.loads(best.read_text())["goodput"] if best.is_file() else -np.inf
            self.low: np.ndarray | None = None  # feature range seen in training (the controller's guard)
            self.high: np.ndarray | None = None

        def _on_training_end(self) -> None:
            if self.low is not None:
                prev = json.loads((run_dir / "obs_range.json").read_text()) if (run_dir / "obs_range.json").is_file() else None
                low, high = self.low, self.high
                if prev is not None:  # a resumed run keeps the range seen before
                    low, high = np.minimum(low, prev["low"]), np.maximum(high, prev["high"])
                (run_dir / "obs_range.json").write_text(json.dumps({"low": low.tolist(), "high": high.tolist()}))

        def _on_step(self) -> bool:
            raw = _normalizer(self.training_env).get_original_obs()  # (n_envs, F) unnormalised features
            self.low = np.minimum(self.low, raw.min(0)) if self.low is not None else raw.min(0)
            self.high = np.maximum(self.high, raw.max(0)) if self.high is not None else raw.max(0)
            for info in self.locals.get("infos", []):
                self.acc.append(info["accept_len_mean"])
                self.ks.append(info["k"])
                self.ws.append(info["w"])
                self.deferred += bool(info.get("deferred", False))
                self.tokens += info["tokens"]
                self.secs += info["dt"]
            if self.next_ckpt and self.num_timesteps >= self.next_ckpt:
                save_checkpoint(run_dir, self.model, env_cfg, agent, self.num_timesteps)
                self.next_ckpt += agent.checkpoint_every
            if self.next_eval is not None and self.num_timesteps >= self.next_eval:
                self.next_eval += agent.eval_every
                self._evaluate()
            return True

        def _on_rollout_end(self) -> None:
            if not self.acc:
                return
            self.logger.record("spec/accept_len", float(np.mean(self.acc)))
            self.logger.record("perf/tokens_per_s", self.tokens / max(self.secs, 1e-9))
            hist = np.bincount(np.asarray(self.ks), minlength=max(env_cfg.k_choices) + 1)
            for k in env_cfg.k_choices:
                self.logger.record(f"spec/action_k{k}", float(hist[k] / hist.sum()))
            if agent.defer:
                self.logger.record("spec/deferred", self.deferred / len(self.ks))
            if tracker is not None:
                tracker.histogram("spec/k", self.ks, self.num_timesteps)
            self.acc, self.ks, self.ws, self.tokens, self.secs, self.deferred = [], [], [], 0.0, 0.0, 0

        def _evaluate(self) -> dict[str, Any]:
            """Validation episodes (training prompts, unused arrival seeds); keeps the best weights.
            Returns the entry it appended to validation.jsonl."""
            stats = obs_stats(self.training_env)
            save_stats(stats, run_dir / "obs_stats.json")
            pol = learned_policy(run_dir, env_cfg, agent, self.model)
            res = quick_eval(env_cfg, agent, pol, split="train", seed0=VALIDATION_SEED0)
            entry: dict[str, Any] = {"step": int(self.num_timesteps), "goodput": res["overall"]["learned"],
                                     "by_load": {ld: g["learned"] for ld, g in res["by_load"].items()}}
            for load, g in res["by_load"].items():
                self.logger.record(f"eval/goodput_{load}", g["learned"])
                if baseline_goodput and load in baseline_goodput:
                    entry.setdefault("vs_best_baseline", {})[load] = g["learned"] / baseline_goodput[load]
                    self.logger.record(f"eval/vs_best_baseline_{load}", g["learned"] / baseline_goodput[load])
            self.logger.record("eval/goodput_overall", res["overall"]["learned"])
            if res["overall"]["learned"] > self.best:
                self.best = res["overall"]["learned"]
                self.model.save(str(run_dir / "best_model.zip"))
                save_stats(stats, run_dir / "best_obs_stats.json")
                (run_dir / "best.json").write_text(json.dumps(entry, indent=1))
            with (run_dir / "validation.jsonl").open("a") as f:
                f.write(json.dumps(entry) + "\n")
            return entry

    return SpecCallback()


def quick_eval(env_cfg: Any, agent: AgentConfig, policy: Any, policies: list[str] = (), seeds: int | None = None,
               out: Path | None = None, split: str = "test", seed0: int = 0) -> dict[str, Any]:
    """The learned policy (None = none) and optionally baselines over the eval loads: on held-out
    prompts by default; ``split='train', seed0=VALIDATION_SEED0`` for validation episodes."""
    from dataclasses import replace

    from specrl.evaluate import evaluate, parse_loads

    cfg = replace(env_cfg, prompt_split=split, horizon_s=agent.eval_horizon_s)
    loads = parse_loads(list(agent.eval_loads))
    extra = {}
    if policy is not None:
        policy.reset()
        extra = {"learned": lambda: _fresh(policy)}
    return evaluate(cfg, list(policies), loads, list(range(seed0, seed0 + (seeds or agent.eval_seeds))), out,
                    progress=False, extra=extra)


def validation_baselines(env_cfg: Any, agent: AgentConfig) -> dict[str, float]:
    """Best baseline goodput per load on the validation episodes (what the periodic evaluations compare to)."""
    from specrl.policies import BASELINES

    res = quick_eval(env_cfg, agent, None, list(BASELINES), split="train", seed0=VALIDATION_SEED0)
    return {load: max(g.values()) for load, g in res["by_load"].items()}


def _fresh(policy: Any) -> Any:
    import copy

    p = copy.copy(policy)
    if getattr(p, "defer", None) is not None:  # a rule's per-stream state must not be shared
        p.defer = copy.deepcopy(p.defer)
    p.reset()
    return p


def save_checkpoint(run_dir: Path, model: Any, env_cfg: Any, agent: AgentConfig, steps: int) -> Path:
    ck = run_dir / "checkpoints" / f"step_{steps:09d}"
    ck.mkdir(parents=True, exist_ok=True)
    model.save(str(ck / "model.zip"))
    save_stats(obs_stats(model.get_env()), ck / "obs_stats.json")
    shutil.copy(run_dir / "config.json", ck / "config.json")
    return ck


def latest_checkpoint(run_dir: Path) -> Path | None:
    cks = sorted((run_dir / "checkpoints").glob("step_*"))
    return cks[-1] if cks else None


# ----- wandb ---------------------------------------------------------------------------------------
class WandbTracker:
    """Optional wandb logging; offline unless the user has logged in. Imported only with --track."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        import os

        import wandb

        if "WANDB_MODE" not in os.environ and not _wandb_logged_in():
            os.environ["WANDB_MODE"] = "offline"
        self.wandb = wandb
        self.run = wandb.init(project="specrl", name=name, config=config, dir=str(run_dir), reinit=True)

    def log(self, values: dict[str, Any], step: int) -> None:
        self.run.log(values, step=step)

    def histogram(self, key: str, values: list[int], step: int) -> None:
        self.run.log({key: self.wandb.Histogram(values)}, step=step)

    def image(self, key: str, path: Path) -> None:
        self.run.log({key: self.wandb.Image(str(path))})

    def table(self, key: str, rows: list[list[Any]], columns: list[str]) -> None:
        self.run.log({key: self.wandb.Table(columns=columns, data=rows)})

    def finish(self) -> None:
        self.run.finish()


def _wandb_logged_in() -> bool:
    import netrc
    import os

    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def _logger(run_dir: Path, tracker: WandbTracker | None) -> Any:
    from stable_baselines3.common.logger import CSVOutputFormat, KVWriter, Logger

    formats: list[Any] = [CSVOutputFormat(str(run_dir / "progress.csv"))]
    if tracker is not None:

        class _W(KVWriter):
            def write(self, key_values: dict, key_excluded: dict, step: int = 0) -> None:
                tracker.log({k: v for k, v in key_values.items() if isinstance(v, (int, float, np.floating))}, step)

            def close(self) -> None:
                pass

        formats.append(_W())
    return Logger(str(run_dir), formats)


# ----- the run ---------------------------------------------------------------------------------------
def prepare(env_cfg: Any, progress: bool = True) -> None:
    """Collect traces and profile costs if the replay env lacks them (cached)."""
    from specrl.collect import ensure_traces
    from specrl.costs import cost_path

    ensure_traces(env_cfg, progress=progress)
    if env_cfg.cost_model is None and not cost_path(env_cfg.model, env_cfg.draft, env_cfg.drafter, env_cfg.dtype,
                                                     env_cfg.device).exists():
        from specrl.envs.live import shared_pair
        from specrl.profiling import profile_costs

        print("no cost model for these models on this machine yet: profiling (cached for later runs)")
        cm = profile_costs(shared_pair(env_cfg), env_cfg.drafter, progress=progress)
        cm.save(cost_path(env_cfg.model, env_cfg.draft, env_cfg.drafter, env_cfg.dtype, env_cfg.device))


def train(env_path: str | None, agent_path: str | None, overrides: list[str], seed: int = 0, track: bool = False,
          run_dir: Path | None = None, resume: Path | None = None, progress: bool = True,
          final_eval: bool = True) -> dict[str, Any]:
    """Train (or resume) a run; returns a summary with the run directory and evaluation."""
    from specrl.envs.config import load_env_config

    if resume is not None:
        env_cfg, agent, saved = load_run_config(resume)
        seed, run_dir = saved["seed"], resume
        name = saved["name"]
    else:
        env_over: dict[str, Any] = {}
        agent_over: dict[str, Any] = {}
        for item in overrides:
            key, value = split_override(item)
            if key.startswith("agent."):
                agent_over[key[len("agent."):]] = value
            else:
                env_over[key.removeprefix("env.")] = value
        env_cfg = load_env_config(env_path, **env_over)
        agent = load_agent_config(agent_path, agent_over)
        if agent.reward_scale != 1.0:
            env_cfg = load_env_config(env_cfg, reward_scale=env_cfg.reward_scale * agent.reward_scale)
        name = (f"{Path(env_path).stem if env_path else 'env'}-{Path(agent_path).stem if agent_path else agent.algo}"
                f"-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir = run_dir or Path("runs") / name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(
            {"name": name, "seed": seed, "env": asdict(env_cfg), "agent": asdict(agent),
             "env_preset": env_path, "agent_preset": agent_path, "overrides": overrides}, indent=1))
    prepare(env_cfg, progress)
    import torch

    # a 64x64 MLP gains nothing from threads, and OpenMP thread hand-offs on a busy 2-core
    # machine cost ~1 ms per tiny matmul
    torch.set_num_threads(1)
    tracker = WandbTracker(run_dir, name, json.loads((run_dir / "config.json").read_text())) if track else None
    if agent.algo == "accmodel":
        return _train_accmodel(env_cfg, agent, seed, run_dir, tracker, progress, final_eval)
    if agent.algo == "rowmodel":
        return _train_rowmodel(env_cfg, agent, run_dir, tracker, final_eval)
    ck = latest_checkpoint(run_dir) if resume is not None else None
    stats = load_stats(ck / "obs_stats.json") if ck is not None else None
    vec = make_vec_env(env_cfg, agent, seed, stats)
    if ck is not None:
        model = load_model(run_dir, agent, ck / "model.zip")
        model.set_env(vec)
        done = model.num_timesteps
    else:
        model = build_model(agent, vec, seed, run_dir)
        done = 0
    model.set_logger(_logger(run_dir, tracker))
    warm = warm_start(model, vec, env_cfg, agent, seed, progress) if agent.pretrain and ck is None else None
    base = validation_baselines(env_cfg, agent) if agent.eval_every else None
    callback = make_callbacks(run_dir, env_cfg, agent, tracker, base)
    if warm is not None and agent.keep == "best":  # the clone itself is a candidate (step 0)
        callback.init_callback(model)
        callback._evaluate()
    t0 = time.perf_counter()
    remaining = max(0, agent.total_timesteps - done)
    if remaining:
        model.learn(total_timesteps=remaining, callback=callback, reset_num_timesteps=ck is None,
                    progress_bar=progress)
    train_s = time.perf_counter() - t0
    model.save(str(run_dir / "model.zip"))
    save_stats(obs_stats(vec), run_dir / "obs_stats.json")
    save_checkpoint(run_dir, model, env_cfg, agent, model.num_timesteps)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "steps": int(model.num_timesteps), "train_seconds": train_s,
                               "steps_per_s": remaining / max(train_s, 1e-9)}
    if agent.keep == "best":
        model = keep_best(run_dir, model, agent, callback, summary)
    if warm is not None:
        summary["pretrain"] = warm
    if final_eval:
        _final_eval(run_dir, env_cfg, agent, learned_policy(run_dir, env_cfg, agent, model), tracker, summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    if tracker is not None:
        tracker.finish()
    return summary


def _train_accmodel(env_cfg: Any, agent: AgentConfig, seed: int, run_dir: Path, tracker: Any, progress: bool,
                    final_eval: bool) -> dict[str, Any]:
    """``algo: accmodel``: fit the acceptance model or the decision network (``objective``; minutes,
    so --resume simply refits), save it to RUN_DIR/accmodel, then the same final evaluation as the
    SB3 agents."""
    from specrl import accmodel
    from specrl.envs.config import policy_context
    from specrl.policies.base import ActionTable

    t0 = time.perf_counter()
    model, info = accmodel.train(env_cfg, accmodel.recipe_from(agent), seed, progress)
    train_s = time.perf_counter() - t0
    accmodel.save(model, run_dir / "accmodel", ActionTable(env_cfg.k_choices, env_cfg.w_choices), info)
    if tracker is not None:
        for h in info["history"]:
            tracker.log({f"accmodel/{k}": v for k, v in h.items() if k != "round"}, h["round"])
    samples = info["history"][-1]["samples"]  # env steps collected, over all envs and rounds
    summary: dict[str, Any] = {"run_dir": str(run_dir), "steps": samples, "steps_per_s": samples / max(train_s, 1e-9),
                               "train_seconds": train_s, "accmodel": info["history"]}
    pol = accmodel.policy_for(policy_context(env_cfg), model, info["objective"])
    return _validate_and_finish(run_dir, env_cfg, agent, pol, tracker, summary, final_eval,
                                f"accmodel ({info['objective']}, {train_s:.0f} s of training): ")


def _validate_and_finish(run_dir: Path, env_cfg: Any, agent: AgentConfig, pol: Any, tracker: Any,
                         summary: dict[str, Any], final_eval: bool, what: str) -> dict[str, Any]:
    """The tail the fitted (non-SB3) learners share: validation against ``goodput`` on the training
    prompts, the final held-out evaluation, the summary file."""
    val = quick_eval(env_cfg, agent, pol, ["goodput"], split="train", seed0=VALIDATION_SEED0)
    learned, good = val["overall"]["learned"], val["overall"]["goodput"]
    summary["validation"] = {"learned": learned, "goodput": good}
    print(f"{what}validation {learned:.2f} tokens/s vs goodput {good:.2f} ({learned / good:.3f}x)", flush=True)
    if final_eval:
        _final_eval(run_dir, env_cfg, agent, pol, tracker, summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    if tracker is not None:
        tracker.finish()
    return summary


def _train_rowmodel(env_cfg: Any, agent: AgentConfig, run_dir: Path, tracker: Any, final_eval: bool) -> dict[str, Any]:
    """``algo: rowmodel``: fit the per-request acceptance table on every position of the training
    prompts' traces (seconds; deterministic, so the seed changes nothing and --resume refits), save
    it to RUN_DIR/rowmodel, then the same validation and final evaluation as the other agents."""
    from specrl import rowmodel
    from specrl.envs.config import policy_context
    from specrl.envs.replay import load_replay_data
    from specrl.replay import action_table

    if env_cfg.backend != "replay":
        raise ConfigError(f"algo 'rowmodel' fits on replay traces, but the env's backend is {env_cfg.backend!r}. "
                          "Fix: --env envs/replay.yaml (or set backend: replay).")
    if env_cfg.drafter != "ngram":
        raise ConfigError(f"algo 'rowmodel' buckets rows by n-gram statistics, but the env's drafter is "
                          f"{env_cfg.drafter!r}. Fix: set drafter: ngram.")
    t0 = time.perf_counter()
    _, _, rows, tables = load_replay_data(env_cfg)  # the env's prompt split: its training prompts
    art = rowmodel.fit(tables, np.asarray(rows), action_table(env_cfg.k_choices, env_cfg.w_choices),
                       **{k: float(v) for k, v in agent.hyperparams.items()})
    rowmodel.save(art, run_dir / "rowmodel")
    train_s = time.perf_counter() - t0
    summary: dict[str, Any] = {"run_dir": str(run_dir), "steps": art["fit"]["rows"],
                               "steps_per_s": art["fit"]["rows"] / max(train_s, 1e-9), "train_seconds": train_s,
                               "rowmodel": art["fit"]}
    if tracker is not None:
        tracker.log({f"rowmodel/{k}": v for k, v in art["fit"].items()}, 0)
    pol = rowmodel.RowModelPolicy(policy_context(env_cfg), run_dir / "rowmodel")
    return _validate_and_finish(run_dir, env_cfg, agent, pol, tracker, summary, final_eval,
                                f"rowmodel: {art['fit']['rows']} trace rows, mean abs error {art['fit']['mae']:.3f} "
                                f"accepted tokens (constant {art['fit']['mae_constant']:.3f}); ")


def _final_eval(run_dir: Path, env_cfg: Any, agent: AgentConfig, pol: Any, tracker: Any, summary: dict[str, Any]) -> None:
    """Held-out evaluation of the run's policy beside every baseline and the oracles (table, plots);
    the per-request oracle where the verify is ragged (there per-request actions pay)."""
    from specrl.evaluate import markdown_table
    from specrl.policies import BASELINES

    refs = ["oracle", "oracle-rows"] if env_cfg.verify == "ragged" else ["oracle"]
    res = quick_eval(env_cfg, agent, pol, [*BASELINES, *refs], out=run_dir / "eval")
    summary["eval"] = {k: res[k] for k in ("overall", "by_load", "ci95", "accept_len", "plots", "table")}
    (run_dir / "eval" / "table.md").write_text(markdown_table(res["_agg"], res["_labels"], res["_names"]) + "\n")
    if tracker is not None:
        for p in res.get("plots", []):
            tracker.image(f"eval/{Path(p).stem}", Path(p))
        tracker.table("eval/overall", [[k, v] for k, v in res["overall"].items()], ["policy", "goodput"])


def keep_best(run_dir: Path, model: Any, agent: AgentConfig, callback: Any, summary: dict[str, Any]) -> Any:
    """Validate the final weights too, then make the best validated weights the run's policy
    (model.zip and obs_stats.json; the checkpoints keep the last weights for --resume)."""
    callback.init_callback(model)
    last = callback._evaluate()  # the final weights become a candidate (saved as best if they are)
    best = json.loads((run_dir / "best.json").read_text())
    summary["kept"] = {"step": best["step"], "validation_goodput": best["goodput"],
                       "last_validation_goodput": last["goodput"]}
    if best["step"] == last["step"]:
        return model
    shutil.copy(run_dir / "best_model.zip", run_dir / "model.zip")
    shutil.copy(run_dir / "best_obs_stats.json", run_dir / "obs_stats.json")
    return load_model(run_dir, agent)


def warm_start(model: Any, vec: Any, env_cfg: Any, agent: AgentConfig, seed: int, progress: bool) -> dict[str, Any]:
    """Behaviour-clone ``agent.pretrain`` into ``model`` (see ``specrl.pretrain``); returns what it measured."""
    from specrl import pretrain

    t0 = time.perf_counter()
    if progress:
        print(f"pretrain: cloning {agent.pretrain!r} from {agent.pretrain_steps} replay steps ...", flush=True)
    demos = pretrain.collect(env_cfg, agent.pretrain, agent.n_envs, agent.pretrain_steps, seed + 10_000)
    if agent.defer == agent.pretrain:  # the clone of the deferred-to rule is "always defer"
        from specrl.defer import defer_labels

        demos.actions = defer_labels(demos.actions, len(env_cfg.k_choices))
    if agent.normalize_obs:  # the clone and the RL phase see the same normalisation
        set_obs_stats(vec, {"mean": demos.obs.mean(axis=0), "var": demos.obs.var(axis=0), "count": len(demos.obs)})
    x = _normalizer(vec).normalize_obs(demos.obs)
    losses = pretrain.clone(model, x, demos.actions, agent.pretrain_epochs, seed=seed,
                            smoothing=agent.pretrain_smoothing)
    out = {"rule": agent.pretrain, "demo_steps": int(len(demos.obs)), "demo_goodput": demos.goodput,
           "loss_first": losses[0], "loss_last": losses[-1], "agreement": pretrain.agreement(model, x, demos.actions, len(env_cfg.k_choices) if agent.defer else None),
           "seconds": time.perf_counter() - t0}
    for key in ("loss_last", "agreement", "demo_goodput"):
        model.logger.record(f"pretrain/{key}", out[key])
    model.logger.dump(0)
    if progress:
        print(f"pretrain: agreement with {agent.pretrain!r} {out['agreement']:.1%}, loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f}, {out['seconds']:.0f} s", flush=True)
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", default="envs/replay.yaml", help="env preset (YAML, replay backend)")
    p.add_argument("--agent", default="agents/ppo.yaml", help="agent preset (YAML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an env key (workload.rate=2) or an agent key (agent.total_timesteps=1e5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--track", action="store_true", help="log to wandb (offline unless you are logged in)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--no-eval", action="store_true", help="skip the final evaluation against the baselines")


def run(args: argparse.Namespace) -> int:
    summary = train(args.env, args.agent, args.set, args.seed, args.track,
                    Path(args.run_dir) if args.run_dir else None, Path(args.resume) if args.resume else None,
                    final_eval=not args.no_eval)
    print(f"run: {summary['run_dir']} ({summary['steps']} steps, {summary['steps_per_s']:.0f} steps/s)")
    if "eval" in summary:
        ov = summary["eval"]["overall"]
        print("overall goodput (geometric mean over loads): " + ", ".join(f"{k} {v:.1f}" for k, v in ov.items()))
        print(f"table: {summary['eval']['table']}\nplots: {', '.join(summary['eval']['plots'])}")
    return 0
