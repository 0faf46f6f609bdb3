"""Few-row CPU linears (specrl/kernels.py) against ``F.linear``, with weights streaming from memory.

A real decode forward touches every weight once (SmolLM2-135M: 540 MB in float32), so the
weights never sit in cache; a benchmark of one hot matrix hides what matters. This one multiplies
the activations by 90 distinct layer-sized matrices (SmolLM2's MLP shapes, 319 MB) and by the
output head, per activation row count M, and prints milliseconds and the ratio linear / skinny
(> 1: the skinny path, with its row padding and row-major layout, is faster). Final line: JSON.

``--forward``: whole forwards of the embedded default target instead (the profiler's grid: batch
x new tokens over 300 cached tokens), ``F.linear`` and the skinny path alternating pass by pass.

``--layout``: also the skinny product fed *column-major* activations (what the transposed view
``(W @ x.T).T`` returns, if the next layer took it as it is), against the row-major ones
``SkinnyLinear`` keeps. ``--dtype bfloat16``: bfloat16 weights and activations, where
``SkinnyLinear`` keeps ``F.linear``; the skinny formula is timed directly to show why.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _common import final_line, machine, table
from torch import nn

from specrl.kernels import MAX_ROWS, PAD_TO, SkinnyLinear


def best_ms(fn, reps: int, inner: int) -> float:
    fn()
    fn()  # warm-up: the first pass allocates and picks kernels
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best * 1e3


def skinny(weight: torch.Tensor) -> SkinnyLinear:
    lin = SkinnyLinear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight.data = weight
    return lin


def skinny_formula(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``SkinnyLinear``'s product without its dtype guard or its row-major copy of the input."""
    rows = x.shape[0]
    pad = PAD_TO[rows] - rows if rows <= MAX_ROWS else 0
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return (weight @ x.T).T[:rows].contiguous()


def column_major(x: torch.Tensor) -> torch.Tensor:
    """The same (M, in) values, stored column by column (a transposed view of a contiguous copy)."""
    return x.T.contiguous().T


def set_linear_class(model: nn.Module, cls: type[nn.Linear]) -> None:
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            mod.__class__ = cls


def forwards(reps: int) -> None:
    """Whole target forwards, plain ``nn.Linear`` vs ``SkinnyLinear``, alternating pass by pass."""
    import numpy as np

    from specrl.models import ModelPair
    from specrl.profiling import forward_grid

    pair = ModelPair.load("default")
    batch, tokens, context = (1, 2, 4, 8, 16), (1, 2, 3, 5, 9), (300,)
    grids: dict[str, list[np.ndarray]] = {"linear": [], "skinny": []}
    for _ in range(reps):
        for name, cls in (("linear", nn.Linear), ("skinny", SkinnyLinear)):
            set_linear_class(pair.target, cls)
            grids[name].append(forward_grid(pair.target, pair.device, batch, tokens, context, 2, pair.vocab_size))
    set_linear_class(pair.target, SkinnyLinear)
    lin, sk = (np.min(grids[k], axis=0)[:, :, 0] * 1e3 for k in ("linear", "skinny"))  # (B, T) ms
    print(f"# whole forwards of {pair.target_name}, {machine()}, 300 cached tokens, ms (linear -> skinny)")
    rows = [[b, *(f"{lin[i, j]:.1f} -> {sk[i, j]:.1f}" for j in range(len(tokens)))] for i, b in enumerate(batch)]
    print(table(["batch", *(f"{t} tokens" for t in tokens)], rows))
    final_line({"linear_over_skinny": {f"b{b}t{t}": round(float(lin[i, j] / sk[i, j]), 3)
                                       for i, b in enumerate(batch) for j, t in enumerate(tokens)}})


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default=",".join(str(m) for m in (*range(1, MAX_ROWS + 1), 17, 24, 32)))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--forward", action="store_true", help="whole forwards of the default target")
    ap.add_argument("--layout", action="store_true", help="also the skinny product on column-major activations")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    if args.forward:
        forwards(args.reps)
        return
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layers = [skinny(torch.randn(1536, 576, dtype=dtype)) for _ in range(60)] + [
        skinny(torch.randn(576, 1536, dtype=dtype)) for _ in range(30)]
    head = skinny(torch.randn(49152, 576, dtype=dtype))
    mb = sum(w.weight.numel() for w in layers) * layers[0].weight.element_size() / 1e6
    print(f"# few-row linears, {machine()}, {torch.get_num_threads()} threads, {args.dtype}; "
          f"90 MLP-sized weights ({mb:.0f} MB) + the 49152 x 576 head")

    def product(w: SkinnyLinear, x: torch.Tensor) -> torch.Tensor:  # what the skinny path computes
        return w(x) if dtype == torch.float32 else skinny_formula(w.weight, x)

    rows, ratios, layout = [], {}, {}
    for m in (int(x) for x in args.rows.split(",")):
        xs = {576: torch.randn(m, 576, dtype=dtype), 1536: torch.randn(m, 1536, dtype=dtype)}
        lin = best_ms(lambda: [F.linear(xs[w.in_features], w.weight) for w in layers], args.reps, 3)
        sk = best_ms(lambda: [product(w, xs[w.in_features]) for w in layers], args.reps, 3)
        hl = best_ms(lambda: F.linear(xs[576], head.weight), args.reps, 3)
        hs = best_ms(lambda: product(head, xs[576]), args.reps, 3)
        pad = PAD_TO[m] if m <= MAX_ROWS else "-"
        row = [m, pad, lin, sk, lin / sk, hl, hs, hl / hs]
        if args.layout:
            cm = {k: column_major(v) for k, v in xs.items()}
            skc = best_ms(lambda: [skinny_formula(w.weight, cm[w.in_features]) for w in layers], args.reps, 3)
            row += [skc, skc / sk]
            layout[m] = round(skc / sk, 3)
        rows.append(row)
        ratios[m] = round((lin + hl) / (sk + hs), 3)
    headers = ["M", "padded to", "layers linear ms", "skinny ms", "ratio", "head linear ms", "skinny ms", "ratio"]
    if args.layout:
        headers += ["layers skinny, column-major input ms", "/ row-major"]
    print(table(headers, rows))
    out = {"dtype": args.dtype, "linear_over_skinny_by_rows": ratios}
    if args.layout:
        out["column_major_over_row_major_by_rows"] = layout
    final_line(out)


if __name__ == "__main__":
    main()
