"""Decision latency of the runtime controller (numpy only): microseconds per ``decide``.

Exports a controller from a run directory (or uses an artifact directory) and times
``decide(features)`` on realistic feature vectors (from the training statistics), median over
many calls. Final stdout line: {"decide_us": x, ...}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from _common import final_line, machine

from specrl.features import NUM_FEATURES
from specrl.runtime import Controller, FeatureTracker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("artifact", help="controller directory (specrl export) or a run directory")
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    path = Path(args.artifact)
    if not (path / "controller.json").exists() and (path / "export" / "controller.json").exists():
        path = path / "export"
    ctl = Controller.load(path)
    rng = np.random.default_rng(0)
    norm = ctl.meta.get("normalization")
    mean = np.asarray(norm["mean"]) if norm else np.ones(NUM_FEATURES)
    std = np.sqrt(np.asarray(norm["var"])) if norm else np.ones(NUM_FEATURES)
    feats = np.abs(rng.normal(mean, std * 0.5, (1024, NUM_FEATURES))).astype(np.float32)
    for x in feats[:100]:
        ctl.decide(x)  # warm-up
    times = []
    for i in range(args.calls):
        x = feats[i % 1024]
        t0 = time.perf_counter_ns()
        ctl.decide(x)
        times.append(time.perf_counter_ns() - t0)
    tracker = FeatureTracker()
    t_track = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        tracker.update_load(8, 0, [300] * 8)
        tracker.update_step(np.array([2, 0, 1, 3, 0, 0, 4, 1]), np.array([4] * 8), 4, 1,
                            match_len=np.array([2.0] * 8), num_matches=np.array([1.0] * 8))
        tracker.vector()
        t_track.append(time.perf_counter_ns() - t0)
    decide_us = statistics.median(times) / 1000
    p99 = float(np.percentile(times, 99)) / 1000
    print(f"# controller {path} ({ctl.kind}, {len(getattr(ctl, 'layers', []))} hidden layers), {machine()}")
    print(f"decide: median {decide_us:.1f} us, p99 {p99:.1f} us, fallbacks {ctl.fallbacks}; "
          f"FeatureTracker update (batch 8): median {statistics.median(t_track) / 1000:.1f} us")
    final_line({"decide_us": decide_us, "decide_p99_us": p99,
                "tracker_update_us": statistics.median(t_track) / 1000, "kind": ctl.kind})


if __name__ == "__main__":
    main()
