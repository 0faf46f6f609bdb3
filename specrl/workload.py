"""Serving workloads: prompt pools, arrival processes and the request lifecycle.

A ``Workload`` decides *what* arrives *when*, in simulated seconds, from a seeded RNG, so
that every policy can be compared on exactly the same arrivals and prompts. Arrival processes
(registry ``ARRIVALS``):

* ``closed``  fixed concurrency: ``concurrency`` requests at t = 0, and a new one the moment
  one finishes (a saturated server with C clients).
* ``poisson`` open loop at ``rate`` requests/s.
* ``bursty``  Markov-modulated Poisson: exponential ON / OFF periods with their own rates.
* ``phase``   a sequence of phases, each with a duration, a rate and a category mix (e.g. a
  summarisation burst followed by chat); the last phase repeats.
* ``trace``   timestamps from a file (one ``t[,category[,max_new_tokens]]`` per line, or jsonl
  with keys ``t``, ``category``, ``max_new_tokens``).

``concurrency`` and ``rate`` may be lists: one value is drawn per episode, so one policy is
trained and evaluated across load levels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrl.errors import ConfigError, unknown_name

ARRIVALS = ("closed", "poisson", "bursty", "phase", "trace")


@dataclass
class PhaseSpec:
    duration_s: float
    """How long the phase lasts (simulated seconds)."""
    rate: float
    """Arrivals per second during the phase."""
    categories: list[str] | None = None
    """Prompt categories drawn in this phase (None = all)."""


@dataclass
class WorkloadConfig:
    arrival: str = "closed"
    """Arrival process: closed | poisson | bursty | phase | trace."""
    concurrency: int | list[int] = 4
    """closed: running requests; a list draws one value per episode."""
    rate: float | list[float] = 2.0
    """poisson: arrivals per second; a list draws one value per episode."""
    burst_rate_on: float = 8.0
    """bursty: arrival rate while ON (requests/s)."""
    burst_rate_off: float = 0.5
    """bursty: arrival rate while OFF."""
    burst_mean_on_s: float = 5.0
    """bursty: mean ON period (exponential), seconds."""
    burst_mean_off_s: float = 10.0
    """bursty: mean OFF period, seconds."""
    phases: list[PhaseSpec] = field(default_factory=list)
    """phase: the phases in order (the last one repeats)."""
    trace_file: str | None = None
    """trace: file of arrival timestamps."""
    episode_categories: int | list[int] = 0
    """closed / poisson / bursty: each episode draws its prompts from this many of the pool's
    categories, chosen at random per episode (0 = all; a list draws the number per episode). For
    training: episodes whose acceptance differs make a policy read acceptance from the features
    instead of memorising the average category mix (README: generalisation). Every evaluation
    (``specrl.evaluate``) runs standard episodes, all categories in each."""
    max_batch_size: int = 16
    """At most this many requests decode together; the rest wait in a FIFO queue."""
    max_new_tokens: int | list[int] = 128
    """Output budget per request: an int, or [lo, hi] drawn uniformly per request (EOS may end it sooner)."""
    slo_ttft_s: float = 3.0
    """Service-level objective on time to first token, seconds."""
    slo_tpot_s: float = 0.3
    """Service-level objective on time per output token after the first, seconds."""

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise unknown_name("arrival process", self.arrival, ARRIVALS)
        if self.max_batch_size < 1:
            raise ConfigError(f"workload.max_batch_size={self.max_batch_size} is invalid. Allowed: >= 1.")
        for c in _as_list(self.concurrency):
            if int(c) < 1:
                raise ConfigError(f"workload.concurrency={c} is invalid. Allowed: >= 1 running requests.")
        for r in _as_list(self.rate):
            if not float(r) > 0:
                raise ConfigError(f"workload.rate={r} is invalid. Allowed: > 0 requests per second.")
        for name in ("burst_rate_on", "burst_mean_on_s", "burst_mean_off_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"workload.{name}={getattr(self, name)} is invalid. Allowed: > 0.")
        if self.burst_rate_off < 0:
            raise ConfigError(f"workload.burst_rate_off={self.burst_rate_off} is invalid. Allowed: >= 0.")
        for n in _as_list(self.episode_categories):
            if int(n) < 0:
                raise ConfigError(f"workload.episode_categories={n} is invalid. Allowed: 0 (all categories) or a "
                                  "number of categories >= 1 drawn per episode.")
        if any(_as_list(self.episode_categories)) and self.arrival in ("phase", "trace"):
            raise ConfigError(f"workload.episode_categories applies to closed, poisson and bursty arrivals; "
                              f"arrival={self.arrival!r} sets its categories itself. Fix: set episode_categories: 0.")
        if self.arrival == "phase":
            if not self.phases:
                raise ConfigError("workload.arrival='phase' needs workload.phases (a list of {duration_s, rate, categories}).")
            for i, ph in enumerate(self.phases):
                if not (ph.duration_s > 0 and ph.rate > 0):
                    raise ConfigError(f"workload.phases[{i}] needs duration_s > 0 and rate > 0, got {ph}.")
        if self.arrival == "trace":
            if not self.trace_file or not Path(self.trace_file).is_file():
                raise ConfigError(
                    f"workload.trace_file={self.trace_file!r} does not exist. Fix: point it at a file of "
                    "arrival timestamps (one per line, or jsonl with key 't')."
                )
        mnt = _as_list(self.max_new_tokens)
        if len(mnt) not in (1, 2) or min(int(x) for x in mnt) < 1:
            raise ConfigError(f"workload.max_new_tokens={self.max_new_tokens} is invalid. Allowed: an int >= 1 or [lo, hi].")
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0):
            raise ConfigError("workload.slo_ttft_s and slo_tpot_s must be > 0 seconds.")


def _as_list(x: object) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


@dataclass(frozen=True)
class Arrival:
    t: float  # arrival time, simulated seconds
    prompt: int  # index into the prompt pool
    max_new_tokens: int


@dataclass
class PromptPool:
    """Encoded prompts and their categories."""

    ids: list[np.ndarray]
    categories: list[str]

    def __post_init__(self) -> None:
        if not self.ids:
            raise ConfigError("The prompt pool is empty. Fix: choose prompts/categories that match at least one prompt.")
        self._by_cat: dict[str, np.ndarray] = {}
        for i, c in enumerate(self.categories):
            self._by_cat.setdefault(c, [])  # type: ignore[arg-type]
            self._by_cat[c].append(i)  # type: ignore[union-attr]
        self._by_cat = {c: np.asarray(v) for c, v in self._by_cat.items()}
        self._all = np.arange(len(self.ids))
        self.names = sorted(self._by_cat)  # the pool's categories

    def sample(self, rng: np.random.Generator, categories: list[str] | None = None) -> int:
        if not categories:
            return int(rng.choice(self._all))
        pools = [self._by_cat[c] for c in categories if c in self._by_cat]
        if not pools:
            raise unknown_name("prompt category", categories[0], self._by_cat)
        return int(rng.choice(np.concatenate(pools)))


def _read_trace(path: str) -> list[tuple[float, str | None, int | None]]:
    out = []
    for ln, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if line.startswith("{"):
                row = json.loads(line)
                out.append((float(row["t"]), row.get("category"), row.get("max_new_tokens")))
            else:
                parts = [p.strip() for p in line.split(",")]
                out.append((float(parts[0]), parts[1] or None if len(parts) > 1 else None,
                            int(parts[2]) if len(parts) > 2 and parts[2] else None))
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}:{ln}: cannot parse arrival {line!r} ({e}). Fix: 't[,category[,max_new_tokens]]'.") from e
    if not out:
        raise ConfigError(f"Trace file {path!r} holds no arrivals. Fix: one 't[,category[,max_new_tokens]]' per line.")
    return sorted(out, key=lambda x: x[0])


class Workload:
    """Seeded arrivals for one episode at a time (see module docstring)."""

    def __init__(self, cfg: WorkloadConfig, pool: PromptPool) -> None:
        self.cfg = cfg
        self.pool = pool
        self.rng = np.random.default_rng(0)
        self.level: dict[str, float | str] = {}
        self._pending: list[Arrival] = []
        self._cursor = 0
        self._trace = _read_trace(cfg.trace_file) if cfg.arrival == "trace" else None
        self.episode_categories: list[str] | None = None  # this episode's categories (None = all)

    def _max_new(self) -> int:
        m = _as_list(self.cfg.max_new_tokens)
        return int(m[0]) if len(m) == 1 else int(self.rng.integers(int(m[0]), int(m[1]) + 1))

    def _arrival(self, t: float, categories: list[str] | None = None, max_new: int | None = None) -> Arrival:
        return Arrival(t, self.pool.sample(self.rng, categories or self.episode_categories), max_new or self._max_new())

    def reset(self, seed: int | None, horizon_s: float, level: dict[str, float] | None = None) -> list[Arrival]:
        """Start an episode; returns the arrivals at t = 0. ``level`` pins concurrency / rate."""
        self.rng = np.random.default_rng(seed)
        cfg = self.cfg
        lvl = dict(level or {})
        self._pending, self._cursor = [], 0
        self.episode_categories = None
        if any(_as_list(cfg.episode_categories)):  # draws nothing from the RNG when off
            n = int(self.rng.choice(_as_list(cfg.episode_categories)))
            if 0 < n < len(self.pool.names):
                self.episode_categories = sorted(self.rng.choice(self.pool.names, n, replace=False).tolist())
        if cfg.arrival == "closed":
            c = int(lvl.get("concurrency", self.rng.choice(_as_list(cfg.concurrency))))
            self.level = {"arrival": "closed", "concurrency": c}
            return [self._arrival(0.0) for _ in range(c)]
        arrivals: list[Arrival] = []
        end = horizon_s * 1.05 + 1.0
        for _ in range(1000):  # an episode needs at least one request: extend a silent schedule
            arrivals = self._open_loop(lvl, end)
            if arrivals:
                break
            end *= 2.0
        first = [a for a in arrivals if a.t <= 0.0]
        self._pending = [a for a in arrivals if a.t > 0.0]
        return first

    def _open_loop(self, lvl: dict[str, float], end: float) -> list[Arrival]:
        """Arrivals in (0, end] for the open-loop processes (seeded by ``self.rng``)."""
        cfg = self.cfg
        t, arrivals = 0.0, []
        if cfg.arrival == "poisson":
            rate = float(lvl.get("rate", self.rng.choice(_as_list(cfg.rate))))
            self.level = {"arrival": "poisson", "rate": rate}
            while True:
                t += self.rng.exponential(1.0 / rate)
                if t > end:
                    break
                arrivals.append(self._arrival(t))
        elif cfg.arrival == "bursty":
            self.level = {"arrival": "bursty", "rate": cfg.burst_rate_on}
            on = bool(self.rng.random() < cfg.burst_mean_on_s / (cfg.burst_mean_on_s + cfg.burst_mean_off_s))
            while t < end:
                dur = self.rng.exponential(cfg.burst_mean_on_s if on else cfg.burst_mean_off_s)
                rate, stop = (cfg.burst_rate_on if on else cfg.burst_rate_off), min(t + dur, end)
                while rate > 0:
                    t_next = t + self.rng.exponential(1.0 / rate)
                    if t_next > stop:
                        break
                    t = t_next
                    arrivals.append(self._arrival(t))
                t, on = stop, not on
        elif cfg.arrival == "phase":
            self.level = {"arrival": "phase", "rate": cfg.phases[0].rate}
            i = 0
            while t < end:
                ph = cfg.phases[min(i, len(cfg.phases) - 1)]
                stop = t + ph.duration_s
                while True:
                    t_next = t + self.rng.exponential(1.0 / ph.rate)
                    if t_next > stop or t_next > end:
                        break
                    t = t_next
                    arrivals.append(self._arrival(t, ph.categories))
                t, i = stop, i + 1
        else:  # trace
            self.level = {"arrival": "trace", "rate": len(self._trace or []) / max(end, 1e-9)}
            arrivals = [self._arrival(tt, [c] if c else None, m) for tt, c, m in (self._trace or [])]
        return arrivals

    def arrivals_until(self, t: float) -> list[Arrival]:
        """Arrivals with time in (previous call, t]."""
        j = self._cursor
        while j < len(self._pending) and self._pending[j].t <= t:
            j += 1
        out, self._cursor = self._pending[self._cursor : j], j
        return out

    def next_arrival_time(self) -> float | None:
        return self._pending[self._cursor].t if self._cursor < len(self._pending) else None

    def schedule(self) -> list[Arrival]:
        """Open loop: every arrival after t = 0 of this episode, in order (for vectorised envs)."""
        return list(self._pending)

    def closed_stream(self, n: int) -> list[Arrival]:
        """Closed loop: the next ``n`` replacement arrivals, drawn exactly as ``on_finish`` would
        draw them one at a time (same RNG order), with t = 0 as a placeholder."""
        return [self._arrival(0.0) for _ in range(n)]

    def on_finish(self, t: float) -> list[Arrival]:
        """Closed loop: a finished request is replaced at once."""
        return [self._arrival(t)] if self.cfg.arrival == "closed" else []

    @property
    def is_closed(self) -> bool:
        return self.cfg.arrival == "closed"


@dataclass
class RequestRecord:
    """Lifecycle of one request in simulated time."""

    rid: int
    arrival: float
    prompt: int
    max_new_tokens: int
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0
    slo_violated: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finished is None or self.first_token is None or self.tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.tokens - 1)

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival
