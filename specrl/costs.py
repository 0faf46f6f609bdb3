"""A profiled cost model of one engine step on the current hardware.

Step time = prefill (requests joining) + draft round + target verify pass + fixed overhead.
Every term is measured (``profile_costs``, CLI ``specrl profile``) on a grid and interpolated:
multilinear in (log2 batch, log2 tokens per row, context length), clamped to the grid. The
grid shows the core trade-off: the verify pass is almost free per extra token at batch 1 and
close to linear at large batch, so long trees pay at low load and k = 0 wins at high load.

The file is JSON with provenance (models, dtype, device, torch version, date) so a replay run
can refuse a profile made for other models.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specrl.errors import TraceError

COST_FORMAT = 1


def _interp_axis(grid: np.ndarray, x: float) -> tuple[int, int, float]:
    """Indices and weight for linear interpolation along one sorted axis (clamped)."""
    if x <= grid[0]:
        return 0, 0, 0.0
    if x >= grid[-1]:
        j = len(grid) - 1
        return j, j, 0.0
    j = int(np.searchsorted(grid, x, side="right"))
    lo, hi = grid[j - 1], grid[j]
    return j - 1, j, float((x - lo) / (hi - lo))


def interp3(values: np.ndarray, axes: tuple[np.ndarray, np.ndarray, np.ndarray], x: tuple[float, float, float]) -> float:
    """Trilinear interpolation of ``values`` (shape of the three axes) at point ``x``."""
    (a0, a1, wa), (b0, b1, wb), (c0, c1, wc) = (_interp_axis(g, v) for g, v in zip(axes, x))
    out = 0.0
    for ia, fa in ((a0, 1 - wa), (a1, wa)):
        for ib, fb in ((b0, 1 - wb), (b1, wb)):
            for ic, fc in ((c0, 1 - wc), (c1, wc)):
                f = fa * fb * fc
                if f:
                    out += f * values[ia, ib, ic]
    return float(out)


@dataclass
class CostModel:
    """Seconds per step component; grids indexed [batch, tokens per row, context]."""

    batch: list[int]
    tokens: list[int]
    context: list[int]
    verify: list  # (|batch|, |tokens|, |context|) seconds: target forward with B rows of n tokens
    draft: list | None = None  # same grid for a draft model forward (model drafter only)
    ngram_per_row: float = 0.0  # seconds per row of an n-gram lookup (host side)
    overhead: tuple[float, float] = (0.0, 0.0)  # a + b * batch: engine bookkeeping per step
    prefill: tuple[float, float, float] = (0.0, 0.0, 0.0)  # a + b * rows + c * padded tokens (rows x max len)
    provenance: dict[str, Any] = field(default_factory=dict)
    format: int = COST_FORMAT

    def __post_init__(self) -> None:
        self._axes = (np.log2(np.asarray(self.batch, float)), np.log2(np.asarray(self.tokens, float)),
                      np.asarray(self.context, float))
        self._verify = np.asarray(self.verify, float)
        self._draft = None if self.draft is None else np.asarray(self.draft, float)
        expect = (len(self.batch), len(self.tokens), len(self.context))
        for name, arr in (("verify", self._verify), ("draft", self._draft)):
            if arr is not None and arr.shape != expect:
                raise TraceError(
                    f"Cost model grid {name!r} has shape {arr.shape}, expected {expect} from its axes. "
                    "Fix: re-run `specrl profile`."
                )

    def verify_time(self, batch: int, tokens: int, context: float) -> float:
        return interp3(self._verify, self._axes, (np.log2(max(batch, 1)), np.log2(max(tokens, 1)), context))

    def draft_forward_time(self, batch: int, tokens: int, context: float) -> float:
        if self._draft is None:
            raise TraceError("This cost model has no draft-model grid. Fix: profile with a draft (`specrl profile --draft`).")
        return interp3(self._draft, self._axes, (np.log2(max(batch, 1)), np.log2(max(tokens, 1)), context))

    def draft_time(self, drafter: str, batch: int, level_sizes: list[int], context: float) -> float:
        """A draft round: n-gram lookups, or draft forwards: one feeding the pending tokens (~1-2
        per row, the root among them) and one per inner tree level (``level_sizes[d-1]`` = nodes
        at depth d; the deepest level is never fed)."""
        if not level_sizes:
            return 0.0
        if drafter == "ngram":
            return self.ngram_per_row * batch
        first = self.draft_forward_time(batch, 2, context)
        return first + sum(self.draft_forward_time(batch, m, context) for m in level_sizes[:-1])

    def overhead_time(self, batch: int) -> float:
        a, b = self.overhead
        return a + b * batch

    def prefill_time(self, rows: int, max_len: int) -> float:
        if rows == 0:
            return 0.0
        a, b, c = self.prefill
        return a + b * rows + c * rows * max_len

    def step_time(
        self, drafter: str, batch: int, tree_tokens: int, level_sizes: list[int], context: float,
        prefill_rows: int = 0, prefill_len: int = 0,
    ) -> float:
        return (self.prefill_time(prefill_rows, prefill_len) + self.draft_time(drafter, batch, level_sizes, context)
                + self.verify_time(batch, tree_tokens, context) + self.overhead_time(batch))

    # ----- persistence ---------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @staticmethod
    def load(path: str | Path) -> CostModel:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise TraceError(f"Cost model {str(path)!r} does not exist. Fix: run `specrl profile` first.") from e
        except json.JSONDecodeError as e:
            raise TraceError(f"Cost model {str(path)!r} is not valid JSON ({e.msg}). Fix: re-run `specrl profile`.") from e
        if d.get("format") != COST_FORMAT:
            raise TraceError(f"Cost model {str(path)!r} has format {d.get('format')!r}, expected {COST_FORMAT}. "
                             "Fix: re-run `specrl profile`.")
        try:
            d["overhead"] = tuple(d["overhead"])
            d["prefill"] = tuple(d["prefill"])
            return CostModel(**d)
        except (TypeError, KeyError) as e:
            raise TraceError(f"Cost model {str(path)!r} is missing fields ({e}). Fix: re-run `specrl profile`.") from e

    @staticmethod
    def analytic(provenance: dict[str, Any] | None = None) -> CostModel:
        """A synthetic CPU-like cost model (for tests and for envs before profiling):
        40 ms per single-token step at batch 1, memory-bound (flat) for few tokens, compute-bound
        (linear in batch x tokens) beyond ~32 tokens per step."""
        batch, tokens, context = [1, 2, 4, 8, 16], [1, 2, 3, 5, 9, 17, 33], [128, 1024, 4096]
        grid = np.zeros((5, 7, 3))
        for i, b in enumerate(batch):
            for j, n in enumerate(tokens):
                for k, c in enumerate(context):
                    work = b * n
                    grid[i, j, k] = 0.040 + 0.0009 * max(0, work - 2) + 2e-6 * b * n * c / 128
        return CostModel(batch, tokens, context, grid.tolist(), draft=(grid * 0.1).tolist(),
                         ngram_per_row=5e-5, overhead=(0.001, 0.0002), prefill=(0.01, 0.002, 0.00015),
                         provenance=provenance or {"kind": "analytic"})


def cost_path(model: str, draft: str | None, drafter: str, dtype: str = "auto", device: str = "auto") -> Path:
    """The cached profile for a model pair / drafter / requested dtype and device."""
    from specrl.models import cache_root, display_name

    d = Path(str(draft)).name if drafter == "model" and draft else "nodraft"
    return cache_root() / "costs" / f"{display_name(model)}-{d}-{drafter}-{dtype}-{device}.json"


def provenance(pair: Any, drafter: str) -> dict[str, Any]:
    import torch

    return {
        "target": pair.target_name,
        "draft": pair.draft_name,
        "drafter": drafter,
        "dtype": str(pair.dtype).replace("torch.", ""),
        "device": str(pair.device),
        "device_name": torch.cuda.get_device_name(0) if pair.device.type == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
