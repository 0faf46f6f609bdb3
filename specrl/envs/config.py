"""EnvConfig: everything that defines a specrl environment (presets in ``envs/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrl.config import apply_overrides, from_dict, load_yaml
from specrl.errors import ConfigError, TraceError, unknown_name
from specrl.tree import MAX_K, MAX_W
from specrl.workload import WorkloadConfig

REWARDS = ("throughput", "latency", "slo")
TIME_SOURCES = ("measured", "profiled")
BACKENDS = ("live", "replay")
SPLITS = ("train", "test", "all")
VERIFY = ("ragged", "padded")


@dataclass
class EnvConfig:
    backend: str = "live"
    """live (the real engine) or replay (recorded traces + cost model)."""
    model: str = "default"
    """Target model: 'default' (embedded SmolLM2-135M-Instruct), a directory, a .gguf or a local HF id."""
    draft: str | None = None
    """Draft model for drafter 'model' (e.g. 'default-draft')."""
    drafter: str = "ngram"
    """Drafter name (ngram | model)."""
    device: str = "auto"
    """cuda | cpu | auto."""
    dtype: str = "auto"
    """float32 | bfloat16 | float16 | auto (float32 on CPU)."""
    prompts: str = "builtin"
    """'builtin' or a prompt file (Spec-Bench jsonl or one prompt per line)."""
    categories: list[str] | None = None
    """Keep only these prompt categories (None = all)."""
    prompt_split: str = "train"
    """train | test | all: which side of the stratified split the env draws prompts from."""
    held_out: float = 0.25
    """Fraction of each category held out for evaluation (prompt_split='test')."""
    split_seed: int = 0
    """Seed of the train/test split."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """Arrival process, batch limit, output lengths, SLOs."""
    reward: str = "throughput"
    """throughput (tokens per step) | latency (-dt x requests in system) | slo (tokens within SLO - penalties)."""
    reward_scale: float = 1.0
    """Multiplies the reward (keep returns in a range the agent likes)."""
    time_penalty: str | float = "none"
    """throughput reward only: subtract rho x step seconds. 'ar' = rho is plain decoding's rate for
    the step's batch (cost model), so a step earns what it gains over not speculating; a number =
    fixed tokens/s; 'none'. Average-reward (SMDP) form: it charges a step for the time it takes
    even when the agent discounts future steps, and leaves the fixed-time return's optimum alone."""
    reward_per_row: bool = False
    """throughput reward only: divide each step's reward by its batch size (running requests).
    PPO's loss weighs a sample by its advantage, and a batch-16 step's advantage is ~16x a batch-1
    step's, so one policy trained across loads learns mostly from the high ones. Per row, every
    load weighs alike; in a closed loop the batch is ~the concurrency for the whole episode, so an
    episode's optimum does not move (open loop: steps at low batch weigh more)."""
    switch_cost: float = 0.0
    """Subtracted from the reward whenever the action differs from the previous one."""
    slo_penalty: float = 20.0
    """slo reward: penalty per request whose SLO breaks (in tokens)."""
    horizon_s: float = 30.0
    """Episode length in simulated seconds (the episode is truncated after it)."""
    k_choices: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 6, 8])
    """Speculation lengths the agent chooses from."""
    w_choices: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """Tree widths the agent chooses from."""
    time_source: str = "measured"
    """measured (wall clock; CUDA events on GPU) or profiled (cost model: deterministic rewards)."""
    cost_model: str | None = None
    """Cost-model JSON for time_source=profiled / replay; None = the cached profile; 'analytic' = synthetic."""
    traces: str | None = None
    """replay: trace file (None = the cached trace for model, drafter and prompts)."""
    temperature: float = 0.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    verify: str = "ragged"
    """ragged: each row's verify tokens are its own tree (rows asking for less, and n-gram rows
    whose lookup found nothing, cost less), one packed pass (the engine's default); padded: every
    row pays the union tree of the batch (``SpecEngine(ragged=False)``, the engine before 2026-12-07)."""
    max_episode_steps: int = 20000
    """Safety cap on steps per episode (the simulated-time horizon normally ends it first)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise unknown_name("backend", self.backend, BACKENDS)
        if self.reward not in REWARDS:
            raise unknown_name("reward", self.reward, REWARDS)
        if self.time_source not in TIME_SOURCES:
            raise unknown_name("time_source", self.time_source, TIME_SOURCES)
        if self.prompt_split not in SPLITS:
            raise unknown_name("prompt_split", self.prompt_split, SPLITS)
        if self.verify not in VERIFY:
            raise unknown_name("verify", self.verify, VERIFY)
        from specrl.drafters import DRAFTERS

        if self.drafter not in DRAFTERS:
            raise unknown_name("drafter", self.drafter, DRAFTERS)
        if self.drafter == "feature" and self.backend == "replay":
            raise ConfigError("drafter='feature' runs on the live backend only: replay tables need the draft's ranks "
                              "of every target token, which traces record for the 'model' drafter alone so far. "
                              "Fix: backend: live, or drafter: model / ngram for replay.")
        if not self.k_choices or len(set(self.k_choices)) != len(self.k_choices) or not all(
            0 <= k <= MAX_K for k in self.k_choices
        ):
            raise ConfigError(
                f"k_choices={self.k_choices} is invalid. Allowed: a non-empty list of distinct integers in 0..{MAX_K}."
            )
        if not self.w_choices or len(set(self.w_choices)) != len(self.w_choices) or not all(
            1 <= w <= MAX_W for w in self.w_choices
        ):
            raise ConfigError(
                f"w_choices={self.w_choices} is invalid. Allowed: a non-empty list of distinct integers in 1..{MAX_W}."
            )
        if not self.horizon_s > 0:
            raise ConfigError(f"horizon_s={self.horizon_s} is invalid. Allowed: > 0 simulated seconds.")
        if isinstance(self.time_penalty, str) and self.time_penalty not in ("none", "ar"):
            raise ConfigError(f"time_penalty={self.time_penalty!r} is invalid. Allowed: 'none', 'ar' or tokens/s >= 0.")
        if not isinstance(self.time_penalty, str) and self.time_penalty < 0:
            raise ConfigError(f"time_penalty={self.time_penalty} is invalid. Allowed: 'none', 'ar' or tokens/s >= 0.")
        if self.reward != "throughput" and self.time_penalty not in ("none", 0, 0.0):
            raise ConfigError(f"time_penalty={self.time_penalty!r} is charged by the throughput reward only, but reward="
                              f"{self.reward!r} (it would be silently ignored). Fix: set reward: throughput or "
                              "time_penalty: none.")
        if self.reward_per_row and self.reward != "throughput":
            raise ConfigError(f"reward_per_row=True only divides the throughput reward, but reward={self.reward!r}. "
                              "Fix: set reward: throughput or drop reward_per_row.")
        if not 0 < self.held_out < 1:
            raise ConfigError(f"held_out={self.held_out} is invalid. Allowed: 0 < held_out < 1.")


def load_env_config(source: str | Path | dict[str, Any] | EnvConfig | None = None, **overrides: Any) -> EnvConfig:
    """An EnvConfig from a preset path, a mapping or defaults, with ``key=value`` overrides
    (dotted keys reach into the workload, e.g. ``{"workload.rate": 4}``)."""
    if isinstance(source, EnvConfig) and not overrides:
        return source
    if isinstance(source, EnvConfig):
        from dataclasses import asdict

        data: dict[str, Any] = asdict(source)
    elif source is None:
        data = {}
    elif isinstance(source, dict):
        data = dict(source)
    else:
        data = load_yaml(source)
        _resolve_paths(data, Path(source).parent)
    # accept both {"workload": {...}} and flat dotted keys in overrides
    return from_dict(EnvConfig, apply_overrides(data, overrides))


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """File paths in a preset are relative to the preset's folder (when the file is there)."""
    wl = data.get("workload")
    for holder, key in ((data, "prompts"), (data, "traces"), (data, "cost_model"), (wl, "trace_file")):
        if not isinstance(holder, dict):
            continue
        value = holder.get(key)
        if isinstance(value, str) and value not in ("builtin", "analytic") and not Path(value).is_absolute():
            candidate = base / value
            if candidate.exists() and not Path(value).exists():
                holder[key] = str(candidate)


def policy_context(cfg: EnvConfig) -> Any:
    """What a policy acting in this env may know: its action tables, cost model and drafter."""
    from specrl.policies import PolicyContext

    return PolicyContext(cfg.k_choices, cfg.w_choices, load_cost_model(cfg), cfg.drafter, cfg.verify)


def load_cost_model(cfg: EnvConfig) -> Any:
    """The cost model a replay env (or a profiled live env) charges: without loading models."""
    from specrl.costs import CostModel, cost_path

    if cfg.cost_model == "analytic":
        return CostModel.analytic()
    path = Path(cfg.cost_model) if cfg.cost_model else cost_path(cfg.model, cfg.draft, cfg.drafter, cfg.dtype, cfg.device)
    try:
        return CostModel.load(path)
    except TraceError as e:
        reason = str(e).split(" Fix:")[0]
        raise ConfigError(
            f"{reason} The cost model charges time in the replay env, with time_source=profiled and for "
            "time_penalty=ar. Fix: run "
            f"`specrl profile --model {cfg.model} --drafter {cfg.drafter}"
            f"{' --draft ' + str(cfg.draft) if cfg.drafter == 'model' else ''} --dtype {cfg.dtype}`, "
            "or set cost_model: analytic for a synthetic one."
        ) from e
