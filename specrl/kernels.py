"""CPU linear layers for the few-row products that speculative decoding is made of.

Why: a decode step multiplies every weight matrix by M = batch x tokens-per-row activation rows,
and speculation lives at small M (batch 1, verify k + 1 = 2-9 tokens). PyTorch's CPU ``F.linear``
computes ``x @ W.T`` through BLAS GEMM with the activations as the row operand; on the 2-core AMD
EPYC machines here (MKL, AVX2) that path costs 2-3x a single-row product already at M = 4 (the
49,152 x 576 output head: 36 ms at M = 4 vs 13 ms at M = 1), while the same product written as
``(W @ x.T).T`` - the weights as the row operand, a tall-skinny GEMM - stays near the memory-bound
single-row cost. Whole SmolLM2-135M forwards at batch 1 (2 threads, 256 cached tokens): verify of
4 tokens 127 -> 92 ms (1.58x -> 1.15x of a 1-token step); batch 4, 1 token: 131 -> 104 ms. Above
~16 rows the two paths trade places from shape to shape, so larger products keep ``F.linear``.

Row padding and layout: measured with weights streaming from memory, as in a real forward (90
layer-sized weights, 319 MB, per pass; ``benchmarks/few_row_linears.py``), the skinny path's cost
is not monotone in M. One row is the worst case: both paths end in MKL's matrix-vector product
(~11 GB/s), while two rows stream at ~30 GB/s (layers 26 -> 13 ms, output head 9.9 -> 2.9 ms),
and 9-15 rows cost more than 16. So a product is padded with zero rows up to the next size in
``PAD_TO`` and the extra rows are dropped: every plain decode step (k = 0) at batch 1 and every
verify of 9-16 tokens gets cheaper. Column-major activations (the transposed view ``(W @ x.T).T``
returns, fed to the next layer) make M = 2-8 1.8-4.1x slower (``few_row_linears.py --layout``), so
inputs and outputs are kept row-major.

float32 only: with bfloat16 weights MKL's ``F.linear`` is the faster path at 1-8 rows (2 rows:
13.5 vs 16.7 ms over 159 MB of bfloat16 layer weights; the skinny formula wins only at 16 rows,
1.09x; ``few_row_linears.py --dtype bfloat16``), so other dtypes keep it. Padding 3-8 rows
differently or other operand layouts (``x @ W.T`` on a pre-transposed weight) did not help: MKL
runs these products at 30-45 GFLOP/s, and each row past two adds ~5 ms per 319 MB of weights.

Which path wins depends on the CPU and its BLAS, so it is measured, not assumed. On an Intel
Sapphire Rapids machine (AVX-512, AMX; 2026-12-07) the picture above inverts: ``F.linear`` is
~3x faster at M = 1-6 over the streamed layer weights (13.5 vs 39 ms at M = 1) and a whole
batch-1 forward takes 42.8 ms with it against 87.3 ms skinny (``few_row_linears.py --forward``).
So ``SPECRL_SKINNY_LINEAR=auto`` (the default) times both paths over the first large model's own
weights (streamed, as in a forward; ~2 s, once per CPU / thread count / torch version, remembered
in ``<cache>/kernels.json``) and sends to the skinny path only the row counts where it is
clearly faster. ``1`` forces the skinny path for every few-row product, ``0`` never switches.
Small models (tests) skip the measurement and keep every row count on the skinny path until a
large model has been measured: their weights sit in cache, where timing says nothing.

Exactness: both paths compute the same sums in a different order, like the different BLAS kernels
PyTorch already picks for different M; greedy decoding stays identical to the target alone (the
engine's exactness tests run with these layers, since every CPU ``ModelPair`` uses them).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16  # products with at most this many activation rows may take the skinny path
# rows -> rows actually multiplied (zero-padded): 1 -> 2 and 9..15 -> 16; 2..8 and 16 as they are
PAD_TO = (0, 2, 2, 3, 4, 5, 6, 7, 8, 16, 16, 16, 16, 16, 16, 16, 16)
ALL_ROWS = frozenset(range(1, MAX_ROWS + 1))
MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # 9..15 are padded to 16 and follow its verdict
CALIBRATE_MIN_BYTES = 64 << 20  # smaller weights sit in cache: timing them says nothing
MARGIN = 0.97  # the skinny path must be at least 3% faster to be chosen (noise on these machines)
MODES = ("auto", "1", "0")

_rows: frozenset[int] | None = None  # auto mode: the measured choice of this process (None: not yet)
_looked_up = False  # whether ``<cache>/kernels.json`` was read: once per process, never per product


def mode() -> str:
    """``SPECRL_SKINNY_LINEAR``: ``auto`` (default: measured), ``1`` (always) or ``0`` (never)."""
    m = os.environ.get("SPECRL_SKINNY_LINEAR", "auto").strip().lower()
    if m not in MODES:
        raise ValueError(f"SPECRL_SKINNY_LINEAR={m!r} is invalid. Allowed: {', '.join(MODES)}. Fix: unset it "
                         "(auto: measured per CPU), or 1 / 0 to force the few-row path on / off.")
    return m


def enabled() -> bool:
    """Whether linears are switched at all (not with ``SPECRL_SKINNY_LINEAR=0``)."""
    return mode() != "0"


def machine_key() -> str:
    """What the measured choice depends on: the CPU, the thread count and torch (its BLAS).

    The CPU is its model name plus a hash of its feature flags: virtual machines often report a
    generic name ("Intel(R) Xeon(R) Processor") for generations whose BLAS paths differ (AVX2 vs
    AVX-512 / AMX)."""
    import hashlib

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), cpu)
        flags = next((ln.split(":", 1)[1] for ln in info if ln.startswith("flags")), "")
        cpu += f" [{hashlib.sha256(' '.join(sorted(flags.split())).encode()).hexdigest()[:8]}]"
    except OSError:
        pass
    return f"{cpu}|{torch.get_num_threads()} threads|torch {torch.__version__}"


def _store() -> os.PathLike:
    from specrl.models import cache_root

    return cache_root() / "kernels.json"


def _remembered() -> frozenset[int] | None:
    """The choice measured earlier on this machine (``<cache>/kernels.json``), if any."""
    try:
        data = json.loads(open(_store()).read())
        rows = data[machine_key()]["skinny_rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return frozenset(int(r) for r in rows) & ALL_ROWS


def _choice() -> frozenset[int] | None:
    """The auto-mode choice: measured in this process, or read from disk the first time asked.

    Why read only once: ``SkinnyLinear.forward`` asks on every product, and reading
    ``/proc/cpuinfo`` and the JSON file there cost ~30 us a call while nothing was measured.
    """
    global _rows, _looked_up
    if _rows is None and not _looked_up:
        _rows, _looked_up = _remembered(), True
    return _rows


def active_rows() -> frozenset[int]:
    """Row counts that take the skinny path now."""
    m = mode()
    if m == "0":
        return frozenset()
    if m == "1":
        return ALL_ROWS
    rows = _choice()
    return ALL_ROWS if rows is None else rows


def time_paths(weights: Sequence[torch.Tensor], rows: int, reps: int = 3) -> tuple[float, float]:
    """(F.linear, skinny) best-of-``reps`` seconds for one pass of ``rows`` activation rows over
    every weight in turn: each weight streams from memory, as in a forward. Sides alternate."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def linear() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def skinny() -> None:
        for w in weights:
            skinny_product(w, xs[w.shape[1]])

    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for i in range(reps + 1):  # the first round warms up (allocations, kernel choice)
            for j, fn in enumerate((linear, skinny)):
                t0 = time.perf_counter()
                fn()
                if i:
                    best[j] = min(best[j], time.perf_counter() - t0)
    return best[0], best[1]


def calibrate(model: nn.Module, timer: Callable[[Sequence[torch.Tensor], int], tuple[float, float]] = time_paths
              ) -> frozenset[int] | None:
    """Measure which row counts the skinny path wins on this CPU, over ``model``'s own weights.

    Runs in auto mode only, once per machine key (remembered on disk), and only on a model with
    at least ``CALIBRATE_MIN_BYTES`` of float32 CPU linear weights. Returns the choice, or None
    when nothing was decided (small model, other mode).
    """
    global _rows
    if mode() != "auto":
        return None
    if _choice() is not None:
        return _rows
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if sum(w.numel() * 4 for w in {id(w): w for w in weights}.values()) < CALIBRATE_MIN_BYTES:
        return None
    times = {r: timer(weights, r) for r in MEASURED_ROWS}
    win = {r for r, (lin, sk) in times.items() if sk < MARGIN * lin}
    _rows = frozenset(r for r in ALL_ROWS if (r if r <= 8 else 16) in win)
    path = _store()
    try:
        data = json.loads(open(path).read())
    except (OSError, ValueError):
        data = {}
    data[machine_key()] = {"skinny_rows": sorted(_rows), "ms": {str(r): [round(1e3 * t, 2) for t in v]
                                                                for r, v in times.items()},
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: measure again next time
    return _rows


def _reset_for_tests() -> None:
    global _rows, _looked_up
    _rows, _looked_up = None, False


def skinny_product(weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """(M, in) activations, M <= ``MAX_ROWS`` -> (M, out) as ``(W @ x.T).T``: zero-padded to
    ``PAD_TO[M]`` rows, inputs and output row-major (see the module docstring for why)."""
    rows = flat.shape[0]
    pad = PAD_TO[rows] - rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])  # (M + pad, in), row-major
    else:
        flat = flat.contiguous()  # row-major: a column-major x runs the GEMM 4x slower (M = 2-8)
    return (weight @ flat.T).T[:rows].contiguous()  # (M, out), row-major for the next layer


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose few-row CPU products run as ``(W @ x.T).T``; same parameters and state dict.

    A class (not a patched ``forward``) so that ``copy.deepcopy`` - the draft trainer copies target
    layers - keeps the behaviour and no bound method points at the original module.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if x.device.type != "cpu" or x.dtype != torch.float32 or rows not in active_rows():
            return F.linear(x, self.weight, self.bias)
        out = skinny_product(self.weight, x.reshape(rows, x.shape[-1]))  # (M, out)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def use_skinny_linear(model: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` of a CPU ``model`` to :class:`SkinnyLinear` in place, and
    in auto mode measure (once per machine) which row counts should use it.

    Returns how many layers were switched (0 off CPU, when disabled, or when already switched).
    """
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or not enabled():
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = SkinnyLinear
            n += 1
    calibrate(model)
    return n


def kernel_tag(device: torch.device) -> str:
    """What a cost profile measured with: part of its cache key, so a kernel change re-profiles."""
    if device.type != "cpu" or not enabled():
        return "linear"
    rows = active_rows()
    if rows == ALL_ROWS:
        return f"skinny{MAX_ROWS}pad"
    return "linear" if not rows else "skinny" + "-".join(str(r) for r in sorted(rows))
