"""The one place that decides device, dtype and how time is measured.

On CUDA, wall-clock timers around asynchronous kernels measure the launch, not the work, so
timings use CUDA events and one synchronisation per measured interval; on CPU
``time.perf_counter`` is exact enough.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specrl.errors import ConfigError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """CUDA when available and not overridden, else CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={str(device)!r} was requested but CUDA is not available on this machine. "
            "Use device='cpu' or 'auto'."
        )
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Default: bfloat16 on CUDA, float32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        from specrl.errors import unknown_name

        raise unknown_name("dtype", dtype, _DTYPES)
    return _DTYPES[dtype]


@dataclass
class Stopwatch:
    """Accumulates named intervals; CUDA events on GPU, perf_counter on CPU.

    Usage: ``sw.start("draft"); ...; sw.stop("draft")``; ``sw.seconds()`` synchronises once
    and returns every interval in seconds.
    """

    device: torch.device
    _open: dict[str, object] = field(default_factory=dict)
    _spans: dict[str, list[tuple[object, object]]] = field(default_factory=dict)

    def _mark(self) -> object:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self, name: str) -> None:
        self._open[name] = self._mark()

    def stop(self, name: str) -> None:
        begin = self._open.pop(name)
        self._spans.setdefault(name, []).append((begin, self._mark()))

    def seconds(self) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {
                k: sum(b.elapsed_time(e) for b, e in v) / 1000.0  # type: ignore[attr-defined]
                for k, v in self._spans.items()
            }
        return {k: float(sum(e - b for b, e in v)) for k, v in self._spans.items()}  # type: ignore[operator]
