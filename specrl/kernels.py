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

Exactness: both paths compute the same sums in a different order, like the different BLAS kernels
PyTorch already picks for different M; greedy decoding stays identical to the target alone (the
engine's exactness tests run with these layers, since every CPU ``ModelPair`` uses them).
Disable with ``SPECRL_SKINNY_LINEAR=0``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16  # products with at most this many activation rows take the skinny path
# rows -> rows actually multiplied (zero-padded): 1 -> 2 and 9..15 -> 16; 2..8 and 16 as they are
PAD_TO = (0, 2, 2, 3, 4, 5, 6, 7, 8, 16, 16, 16, 16, 16, 16, 16, 16)


def enabled() -> bool:
    """On unless ``SPECRL_SKINNY_LINEAR=0`` (for comparisons, or a CPU whose BLAS does better)."""
    return os.environ.get("SPECRL_SKINNY_LINEAR", "1") != "0"


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose few-row CPU products run as ``(W @ x.T).T``; same parameters and state dict.

    A class (not a patched ``forward``) so that ``copy.deepcopy`` - the draft trainer copies target
    layers - keeps the behaviour and no bound method points at the original module.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if x.device.type != "cpu" or x.dtype != torch.float32 or rows > MAX_ROWS or rows == 0:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])  # (M, in)
        pad = PAD_TO[rows] - rows
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])  # (M + pad, in), row-major
        else:
            flat = flat.contiguous()  # row-major: a column-major x runs the GEMM 4x slower (M = 2-8)
        out = (self.weight @ flat.T).T[:rows].contiguous()  # (M, out), row-major for the next layer
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def use_skinny_linear(model: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` of a CPU ``model`` to :class:`SkinnyLinear` in place.

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
    return n


def kernel_tag(device: torch.device) -> str:
    """What a cost profile measured with: part of its cache key, so a kernel change re-profiles."""
    return f"skinny{MAX_ROWS}pad" if device.type == "cpu" and enabled() else "linear"
