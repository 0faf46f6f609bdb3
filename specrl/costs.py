"""A profiled cost model of one engine step on the current hardware.

Step time = prefill (requests joining) + draft round + target verify pass + fixed overhead.
Every term is measured (``profile_costs``, CLI ``specrl profile``) on a grid and interpolated:
multilinear in (log2 batch, log2 tokens per row, context length), clamped to the grid. The
grid shows the core trade-off: extra tokens are cheap at batch 1 and close to linear at large
batch, so long trees pay at low load and k = 0 wins at high load. The grid is not forced to be
monotone: on CPUs the matmul kernels make 2 tokens per row slower than 5 at batch 1, and
policies should see that.

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
# What the engine's measured costs depend on besides the kernels: bump it when a change to the
# engine makes cached profiles stale (2: prefill stopped computing logits over the prompt).
ENGINE_COSTS = 2
MAX_LEVELS = 16  # tree depths the step-time functions take (levels arrays are (N, MAX_LEVELS))
DENSE_BATCH = 64  # cost lookups are precomputed for every integer batch size up to this
DENSE_TOKENS = 65  # ... and every integer tokens-per-row up to this (1 + 64 tree nodes)


def _axis_weights(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo index, hi index, weight of hi) for linear interpolation along a sorted axis, clamped."""
    x = np.clip(x, grid[0], grid[-1])
    hi = np.clip(np.searchsorted(grid, x, side="right"), 1, len(grid) - 1) if len(grid) > 1 else np.zeros_like(x, int)
    lo = np.maximum(hi - 1, 0)
    span = grid[hi] - grid[lo]
    w = np.where(span > 0, (x - grid[lo]) / np.where(span > 0, span, 1.0), 0.0)
    return lo, hi, w


def interp3(values: np.ndarray, axes: tuple[np.ndarray, np.ndarray, np.ndarray], a: np.ndarray, b: np.ndarray,
            c: np.ndarray) -> np.ndarray:
    """Trilinear interpolation of ``values`` (|a| x |b| x |c| grid) at points (a, b, c), vectorised.

    Scalars and N-vectors go through the same arithmetic, so the scalar replay env and the
    vectorised one charge bit-identical times."""
    (a0, a1, wa), (b0, b1, wb), (c0, c1, wc) = (_axis_weights(g, np.asarray(v, float)) for g, v in zip(axes, (a, b, c)))
    out = np.zeros(np.broadcast(a0, b0, c0).shape)
    for ia, fa in ((a0, 1 - wa), (a1, wa)):
        for ib, fb in ((b0, 1 - wb), (b1, wb)):
            for ic, fc in ((c0, 1 - wc), (c1, wc)):
                out = out + fa * fb * fc * values[ia, ib, ic]
    return out


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
    # per batch size: engine verify time / isolated forward time (``calibrate_on_engine``); the
    # step functions charge verify * scale, ``isolated_verify_time`` the bare grid
    verify_scale: list[float] | None = None

    def __post_init__(self) -> None:
        self._axes = (np.log2(np.asarray(self.batch, float)), np.log2(np.asarray(self.tokens, float)),
                      np.asarray(self.context, float))
        self._raw_verify = np.asarray(self.verify, float)
        self._draft = None if self.draft is None else np.asarray(self.draft, float)
        expect = (len(self.batch), len(self.tokens), len(self.context))
        for name, arr in (("verify", self._raw_verify), ("draft", self._draft)):
            if arr is not None and arr.shape != expect:
                raise TraceError(
                    f"Cost model grid {name!r} has shape {arr.shape}, expected {expect} from its axes. "
                    "Fix: re-run `specrl profile`."
                )
        scale = np.ones(len(self.batch)) if self.verify_scale is None else np.asarray(self.verify_scale, float)
        if scale.shape != (len(self.batch),) or not np.all(scale > 0):
            raise TraceError(f"Cost model verify_scale {self.verify_scale!r} must hold one positive factor per "
                             f"batch size {self.batch}. Fix: re-run `specrl profile`.")
        self._verify = self._raw_verify * scale[:, None, None]  # what the engine pays
        # Batch sizes and token counts are integers: interpolate (log2 batch, log2 tokens) once per
        # integer pair, so a lookup is an index plus a linear step along the context axis.
        b = np.arange(DENSE_BATCH + 1, dtype=float)[:, None, None]
        n = np.arange(DENSE_TOKENS + 1, dtype=float)[None, :, None]
        c = self._axes[2][None, None, :]
        self._dense_verify = interp3(self._verify, self._axes, np.log2(np.maximum(b, 1)), np.log2(np.maximum(n, 1)), c)
        self._dense_draft = None if self._draft is None else interp3(
            self._draft, self._axes, np.log2(np.maximum(b, 1)), np.log2(np.maximum(n, 1)), c)

    @staticmethod
    def _lookup(dense: np.ndarray, axes: tuple, batch: Any, tokens: Any, context: Any) -> Any:
        bi = np.clip(np.rint(batch).astype(np.int64), 0, DENSE_BATCH)
        # tokens per row may be fractional: a ragged verify pass of N token rows over B rows is
        # charged as a padded pass at N / B tokens per row, linear between the integer points
        # (the linear layers cost by total rows; integer inputs give the grid value exactly)
        tok = np.clip(np.asarray(tokens, float), 0, DENSE_TOKENS)
        n0 = np.floor(tok).astype(np.int64)
        n1 = np.minimum(n0 + 1, DENSE_TOKENS)
        wn = tok - n0
        lo, hi, w = _axis_weights(axes[2], np.asarray(context, float))
        out = (dense[bi, n0, lo] * (1 - w) + dense[bi, n0, hi] * w) * (1 - wn)
        if np.any(wn > 0):
            out = out + (dense[bi, n1, lo] * (1 - w) + dense[bi, n1, hi] * w) * wn
        return float(out) if np.ndim(out) == 0 else out

    def verify_times(self, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        """(N, DENSE_TOKENS + 1) ``verify_time(batch[i], t, context[i])`` at every integer t, from
        one lookup (the same values bit for bit): for callers that ask many token counts per step."""
        bi = np.clip(np.rint(np.asarray(batch)).astype(np.int64), 0, DENSE_BATCH)[:, None]  # (N, 1)
        lo, hi, w = _axis_weights(self._axes[2], np.asarray(context, float))
        d, t = self._dense_verify, np.arange(DENSE_TOKENS + 1)[None, :]  # (1, T)
        return (d[bi, t, lo[:, None]] * (1 - w[:, None]) + d[bi, t, hi[:, None]] * w[:, None]) * 1.0

    def verify_time(self, batch: Any, tokens: Any, context: Any) -> Any:
        """Target forward with ``batch`` rows of ``tokens`` tokens at ``context``; scalars or arrays
        (batch <= 64 and tokens <= 65 are exact grid interpolations; larger values are clamped;
        fractional ``tokens`` = a ragged pass's mean tokens per row)."""
        return self._lookup(self._dense_verify, self._axes, batch, tokens, context)

    def isolated_verify_time(self, batch: float, tokens: float, context: float) -> float:
        """The profiled forward alone, before the engine calibration (what ``forward_grid`` measures)."""
        return float(interp3(self._raw_verify, self._axes, np.log2(batch), np.log2(tokens), context))

    def draft_forward_time(self, batch: Any, tokens: Any, context: Any) -> Any:
        if self._dense_draft is None:
            raise TraceError("This cost model has no draft-model grid. Fix: profile with a draft "
                             "(`specrl profile --drafter model --draft ...`).")
        return self._lookup(self._dense_draft, self._axes, batch, tokens, context)

    def step_time_batch(
        self, drafter: str, drafted: np.ndarray, batch: np.ndarray, tree_tokens: np.ndarray, levels: np.ndarray,
        context: np.ndarray, prefill_rows: np.ndarray, prefill_len: np.ndarray,
    ) -> np.ndarray:
        """(N,) step seconds. ``drafted``: (N,) bool, k > 0; ``levels``: (N, D) verify-tree nodes per
        depth 1..D (zeros beyond its depth).

        Step = prefill + draft round + verify + overhead. Draft round: n-gram lookups (per row, even
        when they find nothing), or one draft forward feeding the pending tokens (~2 per row) plus
        one per inner tree level (the deepest level is never fed to the draft)."""
        batch = np.asarray(batch, float)
        has_tree = np.asarray(tree_tokens) > 1
        if drafter == "ngram":
            draft = np.where(np.asarray(drafted, bool), self.ngram_per_row * batch, 0.0)
        else:
            levels = np.asarray(levels, float)
            depth = (levels > 0).sum(axis=1)  # (N,)
            draft = np.where(has_tree, self.draft_forward_time(batch, 2, context), 0.0)
            for d in range(levels.shape[1]):
                inner = has_tree & (d + 1 < depth)
                if inner.any():
                    draft = draft + np.where(inner, self.draft_forward_time(batch, np.maximum(levels[:, d], 1), context),
                                             0.0)
        a, b, c = self.prefill
        rows = np.asarray(prefill_rows, float)
        prefill = np.where(rows > 0, a + b * rows + c * rows * np.asarray(prefill_len, float), 0.0)
        over = self.overhead[0] + self.overhead[1] * batch
        return prefill + draft + self.verify_time(batch, tree_tokens, context) + over

    def step_time(
        self, drafter: str, k: int, batch: int, tree_tokens: float, level_sizes: list[int] | tuple[int, ...],
        context: float, prefill_rows: int = 0, prefill_len: int = 0,
    ) -> float:
        """One step (see ``step_time_batch``; this is its N = 1 case). ``tree_tokens``: verify tokens
        per row, fractional for a ragged pass (total token rows / batch)."""
        levels = np.zeros((1, MAX_LEVELS))
        levels[0, : len(level_sizes)] = level_sizes
        return float(self.step_time_batch(drafter, np.array([k > 0]), np.array([batch]), np.array([tree_tokens]),
                                          levels, np.array([context]), np.array([prefill_rows]),
                                          np.array([prefill_len]))[0])

    # ----- persistence ---------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

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
    import torch

    from specrl.kernels import kernel_tag
    from specrl.models import cache_root, display_name

    d = Path(str(draft)).name if drafter == "model" and draft else "nodraft"
    # a kernel change re-profiles instead of reusing stale costs; no CUDA check here: a replay-only
    # run may read a profile made on another machine
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device in (None, "auto") else str(device).split(":")[0]
    kern = kernel_tag(torch.device(dev))
    return cache_root() / "costs" / f"{display_name(model)}-{d}-{drafter}-{dtype}-{device}-{kern}-e{ENGINE_COSTS}.json"


def provenance(pair: Any, drafter: str) -> dict[str, Any]:
    import torch

    from specrl.kernels import kernel_tag

    return {
        "target": pair.target_name,
        "draft": pair.draft_name,
        "drafter": drafter,
        "dtype": str(pair.dtype).replace("torch.", ""),
        "device": str(pair.device),
        "device_name": torch.cuda.get_device_name(0) if pair.device.type == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "kernels": kernel_tag(pair.device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
