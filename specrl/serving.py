"""The serving loop in simulated time, shared by the live and the replay backends.

One ``step(action)``: the running batch decodes one engine step; the clock advances by the
step's time (measured, or from the cost model); requests that arrived meanwhile join the FIFO
queue; finished requests leave and free their slots, which waiting requests take before the
next decision. When nothing is running or waiting the clock jumps to the next arrival.

The loop only needs a ``DecodeBackend``: the live ``SpecEngine`` (``LiveBackend``) or the
trace-driven replay simulator, so workload, queueing, metrics and features are never forked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from specrl.features import FeatureTracker
from specrl.workload import Arrival, RequestRecord, Workload

SLO_GRACE_TOKENS = 8


class DecodeBackend(Protocol):
    """What the serving loop needs from a decoder."""

    def add(self, rid: int, prompt: int, max_new_tokens: int) -> None: ...

    def step(self, action: Any) -> Any: ...  # -> StepResult (specrl.engine) with .finished rids

    def reset(self) -> None: ...

    def context_lens(self) -> np.ndarray: ...

    def probe(self) -> np.ndarray | None: ...  # (B, 4) draft stats known before drafting, or None


class LiveBackend:
    """The real engine; prompts are indices into an encoded prompt pool."""

    def __init__(self, engine: Any, prompt_ids: list[np.ndarray]) -> None:
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.outputs: dict[int, np.ndarray] = {}  # rid -> generated tokens of finished requests

    def add(self, rid: int, prompt: int, max_new_tokens: int) -> None:
        self.engine.add_request(self.prompt_ids[prompt], max_new_tokens, rid=rid)

    def step(self, action: Any) -> Any:
        res = self.engine.step(action)
        for r in self.engine.pop_finished():
            self.outputs[r.rid] = r.output.copy()
        return res

    def reset(self) -> None:
        self.engine.reset()
        self.outputs = {}

    def context_lens(self) -> np.ndarray:
        e = self.engine
        return np.array([r.length for r in e.rows] + [r.length for r in e.waiting], dtype=np.float32)

    def probe(self) -> np.ndarray | None:
        return self.engine.probe()


@dataclass
class StepReport:
    """What one serving step did, in simulated time."""

    result: Any  # the backend's StepResult
    dt: float  # seconds the step took
    t_end: float  # clock after the step (before any idle jump)
    idle: float  # idle seconds skipped after the step (empty system)
    tokens: int  # tokens committed in the step
    in_system: int  # requests running or queued when the step started
    system_time: float  # request-seconds spent in the system during the step (Little's law)
    finished: list[RequestRecord]
    arrivals: int  # requests that arrived during the step
    slo_tokens: int  # tokens committed by requests still within their SLO
    new_violations: int  # requests whose SLO broke in this step


@dataclass
class ServingLoop:
    backend: DecodeBackend
    workload: Workload
    time_fn: Callable[[Any], float]  # StepResult -> seconds
    horizon_s: float
    tracker: FeatureTracker = field(default_factory=FeatureTracker)

    def __post_init__(self) -> None:
        self.records: dict[int, RequestRecord] = {}
        self.queue: deque[int] = deque()
        self.running: set[int] = set()
        self.t = 0.0
        self._next_rid = 0
        self.cat_acc: dict[str, float] = {}  # accepted draft tokens per prompt category
        self.cat_steps: dict[str, float] = {}  # row-steps per prompt category

    # ----- lifecycle ------------------------------------------------------------------------
    def reset(self, seed: int | None, level: dict[str, float] | None = None) -> None:
        self.backend.reset()
        self.tracker.reset()
        self.records, self.queue, self.running = {}, deque(), set()
        self.t, self._next_rid = 0.0, 0
        self.cat_acc, self.cat_steps = {}, {}
        self._enqueue(self.workload.reset(seed, self.horizon_s, level))
        # an episode starts at its first arrival, even one past the horizon (then it is one step long)
        self._idle_jump(ignore_horizon=True)
        self._admit()

    def _enqueue(self, arrivals: list[Arrival]) -> None:
        for a in arrivals:
            rid = self._next_rid
            self._next_rid += 1
            self.records[rid] = RequestRecord(rid, a.t, a.prompt, a.max_new_tokens)
            self.queue.append(rid)

    def _admit(self) -> None:
        cap = self.workload.cfg.max_batch_size
        while self.queue and len(self.running) < cap:
            rid = self.queue.popleft()
            rec = self.records[rid]
            rec.admitted = self.t
            self.backend.add(rid, rec.prompt, rec.max_new_tokens)
            self.running.add(rid)

    def _idle_jump(self, ignore_horizon: bool = False) -> float:
        """If nothing is running or waiting, move the clock to the next arrival."""
        if self.running or self.queue:
            return 0.0
        nxt = self.workload.next_arrival_time()
        if nxt is None or (nxt > self.horizon_s and not ignore_horizon):
            return 0.0
        idle = max(0.0, nxt - self.t)
        self.t = nxt
        arrived = self.workload.arrivals_until(self.t)
        self._enqueue(arrived)
        self.tracker.record_arrivals(len(arrived), self.t, max(idle, 1e-6))
        return idle

    @property
    def exhausted(self) -> bool:
        """Nothing runs, nothing waits and nothing will ever arrive (e.g. a finite trace)."""
        return not (self.running or self.queue) and self.workload.next_arrival_time() is None

    @property
    def done(self) -> bool:
        """The horizon has passed, or nothing runs or waits before it."""
        if self.t >= self.horizon_s or self.exhausted:
            return True
        nxt = self.workload.next_arrival_time()
        return not (self.running or self.queue) and (nxt is None or nxt > self.horizon_s)

    def observation(self) -> np.ndarray:
        self.tracker.update_load(len(self.running), len(self.queue), self.backend.context_lens())
        self.tracker.update_probe(self.backend.probe())
        return self.tracker.vector()

    # ----- one step ---------------------------------------------------------------------------
    def step(self, action: Any) -> StepReport:
        in_system = len(self.running) + len(self.queue)
        res = self.backend.step(action)
        dt = float(self.time_fn(res))
        self.t += dt
        cfg = self.workload.cfg
        tokens = slo_tokens = new_viol = 0
        cats = self.workload.pool.categories
        for rid, n, a in zip(res.rids, res.num_committed, res.accept_len):
            rec = self.records[rid]
            n = int(n)
            cat = cats[rec.prompt]
            self.cat_acc[cat] = self.cat_acc.get(cat, 0.0) + float(a)
            self.cat_steps[cat] = self.cat_steps.get(cat, 0.0) + 1.0
            tokens += n
            if rec.first_token is None and n > 0:
                rec.first_token = self.t
                if rec.ttft is not None and rec.ttft > cfg.slo_ttft_s and not rec.slo_violated:
                    rec.slo_violated, new_viol = True, new_viol + 1
            rec.tokens += n
            if (not rec.slo_violated and rec.first_token is not None and rec.tokens > SLO_GRACE_TOKENS
                    and (self.t - rec.first_token) / (rec.tokens - 1) > cfg.slo_tpot_s):
                # the TPOT so far breaks the SLO (judged after a few tokens, not on the first step)
                rec.slo_violated, new_viol = True, new_viol + 1
            if not rec.slo_violated:
                slo_tokens += n
        finished = []
        for rid in res.finished:
            rec = self.records[rid]
            rec.finished = self.t
            self.running.discard(rid)
            finished.append(rec)
            self._enqueue(self.workload.on_finish(self.t))
        arrived = self.workload.arrivals_until(self.t)
        self._enqueue(arrived)
        system_time = in_system * dt + sum(self.t - a.t for a in arrived)
        if not self.workload.is_closed:
            self.tracker.record_arrivals(len(arrived), self.t, max(dt, 1e-6))
        else:
            self.tracker.record_arrivals(len(finished), self.t, max(dt, 1e-6))
        self.tracker.observe(res)
        t_end = self.t
        idle = self._idle_jump()
        self._admit()
        return StepReport(res, dt, t_end, idle, tokens, in_system, system_time, finished, len(arrived), slo_tokens,
                          new_viol)

    # ----- metrics --------------------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        """Goodput, latency percentiles, TTFT / TPOT and SLO attainment of this episode."""
        recs = list(self.records.values())
        done = [r for r in recs if r.finished is not None]
        total_tokens = sum(r.tokens for r in recs)

        def pct(xs: list[float], q: float) -> float:
            return float(np.percentile(xs, q)) if xs else float("nan")

        lat = [r.latency for r in done if r.latency is not None]
        ttft = [r.ttft for r in recs if r.ttft is not None]
        tpot = [r.tpot for r in done if r.tpot is not None]
        return {
            "time_s": self.t,
            "tokens": float(total_tokens),
            "goodput": total_tokens / self.t if self.t > 0 else 0.0,
            "finished": float(len(done)),
            "latency_p50": pct(lat, 50), "latency_p99": pct(lat, 99),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "slo_attainment": (sum(not r.slo_violated for r in done) / len(done)) if done else float("nan"),
            "accept_len": sum(self.cat_acc.values()) / max(1.0, sum(self.cat_steps.values())),
            "accept_by_category": {c: self.cat_acc[c] / self.cat_steps[c] for c in sorted(self.cat_steps)},
        }
