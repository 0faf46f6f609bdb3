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
        if x.device.type != "cpu" or rows > MAX_ROWS or rows == 0:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])  # (M, in)
        out = (self.weight @ flat.T).T  # (M, out), a transposed view
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
    return f"skinny{MAX_ROWS}" if device.type == "cpu" and enabled() else "linear"
