"""``specrl profile``: measure the cost model (see specrl/costs.py) on this machine."""

from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specrl.costs import CostModel, cost_path, provenance
from specrl.device import Stopwatch
from specrl.kvcache import RaggedKVCache, prefill

DEFAULT_BATCH = (1, 2, 4, 8, 16)
DEFAULT_TOKENS = (1, 2, 3, 5, 9, 17, 33)
DEFAULT_CONTEXT = (128, 768)  # context matters little next to batch and tokens at these lengths


def _time(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        sw = Stopwatch(device)
        sw.start("x")
        fn()
        sw.stop("x")
        out.append(sw.seconds()["x"])
    return statistics.median(out)


def replicate_rows(row: RaggedKVCache, rows: int) -> RaggedKVCache:
    """A cache of ``rows`` copies of a one-row cache, laid out as ``rows`` separate prefills would be."""
    cache = RaggedKVCache(row.waste_limit, row.min_compact_len)
    for _ in range(rows):
        cache.merge(copy.deepcopy(row))  # merge adopts the first row's buffers: never share them
    return cache


@torch.inference_mode()
def forward_grid(model, device, batch, tokens, context, reps, vocab, bar=None) -> np.ndarray:
    """Median seconds of a forward with B rows of n new tokens over c cached ones, per grid point.

    Every point is timed once per pass, passes visit the points in a fresh random order, and the
    median over passes is kept: a noisy moment of a shared machine then spreads over all points
    instead of corrupting a few."""
    rng = np.random.default_rng(0)
    caches = {}
    for k, c in enumerate(context):
        # One prefilled row per context, merged b times: the same buffers and layout that b row-by-row
        # prefills build (prefill merges a one-row cache too), for one forward instead of sum(batch)
        # of them: on 2 CPU cores that was ~100 s of the profile, more than all its timed passes.
        # What the rows hold does not change a forward's cost.
        row = RaggedKVCache()
        prefill(model, row, [rng.integers(0, vocab, size=c + 1)], device)
        for i, b in enumerate(batch):
            caches[i, k] = replicate_rows(row, b)
    points = [(i, j, k) for i in range(len(batch)) for j in range(len(tokens)) for k in range(len(context))]
    samples: dict[tuple[int, int, int], list[float]] = {p: [] for p in points}

    def once(i: int, j: int, k: int) -> float:
        b, n, c = batch[i], tokens[j], context[k]
        cache = caches[i, k]
        ids = torch.as_tensor(rng.integers(0, vocab, size=(b, n)), device=device)
        pos = torch.full((b, n), c, device=device) + torch.arange(n, device=device)
        tail = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None].expand(b, n, n)
        sw = Stopwatch(device)
        base = cache.T
        sw.start("x")
        cache.forward(model, ids, pos, tail, base)
        sw.stop("x")
        cache.keep(base, torch.full((b, 1), base, device=device), torch.zeros(b, dtype=torch.long, device=device), 0)
        return sw.seconds()["x"]

    for p in points:  # warm-up pass (allocations, kernel selection)
        once(*p)
    for _ in range(reps):
        for idx in rng.permutation(len(points)):
            p = points[idx]
            samples[p].append(once(*p))
        if bar is not None:
            bar.update(1)
    grid = np.zeros((len(batch), len(tokens), len(context)))
    for (i, j, k), xs in samples.items():
        grid[i, j, k] = statistics.median(xs)
    return grid


def calibrate_on_engine(pair, drafter: str, cost: CostModel, reps: int,
                        rng: np.random.Generator) -> tuple[list[float], tuple[float, float]]:
    """(verify scale per batch size, per-step overhead (a, b): a + b * batch) from real engine steps.

    Forward timings taken in isolation miss what the engine pays around them: the first forward
    after a shape change runs slower than a run of identical ones (up to 25% at batch 1 on this
    CPU), the verify interval also holds acceptance and the step's one host copy, and the step
    has bookkeeping outside draft and verify. So at every profiled batch size the engine steps
    through a cycle of actions as an adaptive policy does (k = 0, 2, 4, 8 chains and a (4, 2)
    tree, on repetitive text so the n-gram drafter proposes real trees). Scale = measured /
    modelled verify time summed over those steps; the grid keeps the shape over tokens and
    context. Overhead = step - prefill - draft - verify, fitted linearly in the batch size."""
    from specrl.engine import Action, SpecEngine

    cycle = [Action(0, 1), Action(2, 1), Action(4, 1), Action(4, 2), Action(8, 1)]
    steps = max(2, reps) * len(cycle)
    scale, over_x, over_y = [], [], []
    for b in cost.batch:
        eng = SpecEngine(pair, drafter=drafter)
        for _ in range(b):  # room for every step to commit k + 1 = 9 tokens
            eng.add_request(np.tile(rng.integers(0, pair.vocab_size, size=32), cost.context[0] // 32 + 1),
                            max_new_tokens=9 * steps)
        eng.step(Action(0, 1))  # prefill
        measured = modelled = 0.0
        for step in range(steps):
            r = eng.step(cycle[step % len(cycle)])
            measured += r.verify_time
            modelled += cost.isolated_verify_time(b, r.verify_rows / b, float(np.mean(r.context_len)))
            over_x.append(b)
            over_y.append(r.step_time - r.prefill_time - r.draft_time - r.verify_time)
        scale.append(measured / modelled)
    slope, icpt = np.polyfit(np.asarray(over_x, float), np.asarray(over_y), 1)
    return scale, (float(max(icpt, 0.0)), float(max(slope, 0.0)))


def profile_costs(
    pair, drafter: str = "ngram", batch=DEFAULT_BATCH, tokens=DEFAULT_TOKENS, context=DEFAULT_CONTEXT,
    reps: int = 5, progress: bool = True,
) -> CostModel:
    """Measure every cost-model term for ``pair`` on its device."""
    from specrl.drafters.ngram import NGramDrafter
    from specrl.sampling import SamplingParams
    from specrl.tree import tree_shape

    dev, vocab = pair.device, pair.vocab_size
    with_draft = drafter == "model" and pair.draft is not None
    # progress in timed passes: one per repeat over each forward grid, then three calibrations
    total = reps * (2 if with_draft else 1) + 3
    with tqdm(total=total, desc="profiling", disable=not progress, unit="pass") as bar:
        verify = forward_grid(pair.target, dev, batch, tokens, context, reps, vocab, bar)
        draft = forward_grid(pair.draft, dev, batch, tokens, context, reps, vocab, bar) if with_draft else None
        rng = np.random.default_rng(1)

        # n-gram lookups: host time per row on mid-length sequences with repetitions
        seqs = [np.tile(rng.integers(0, vocab, size=64), 8) for _ in range(8)]
        ng = NGramDrafter(dev)
        shape = tree_shape(4, 2)
        present = np.ones((len(seqs), len(shape.paths)), bool)
        per_row = _time(lambda: ng.propose(seqs, shape, present, SamplingParams(), None), dev, reps) / len(seqs)
        bar.update(1)

        # in-situ calibration on real engine steps (see calibrate_on_engine)
        bare = CostModel(list(batch), list(tokens), list(context), verify.tolist())
        verify_scale, overhead = calibrate_on_engine(pair, drafter, bare, reps, rng)
        bar.update(1)

        # prefill: a + b * rows + c * rows * len
        xs, ys = [], []
        for rows, length in ((1, 64), (1, 256), (1, 512), (2, 64), (2, 256), (4, 64), (4, 128)):
            seq_batch = [rng.integers(0, vocab, size=length + 1) for _ in range(rows)]

            def once():
                prefill(pair.target, RaggedKVCache(), seq_batch, dev)
                if with_draft:
                    prefill(pair.draft, RaggedKVCache(), seq_batch, dev)

            with torch.inference_mode():
                ys.append(_time(once, dev, max(2, reps // 2)))
            xs.append((1.0, rows, rows * length))
        coef, *_ = np.linalg.lstsq(np.asarray(xs, float), np.asarray(ys), rcond=None)
        bar.update(1)
    return CostModel(
        list(batch), list(tokens), list(context), verify.tolist(),
        None if draft is None else draft.tolist(), float(per_row), overhead,
        tuple(float(max(c, 0.0)) for c in coef),  # type: ignore[arg-type]
        provenance(pair, drafter), verify_scale=verify_scale,
    )


def plot_costs(cm: CostModel, path: str | Path) -> Path:
    """Verify latency per token vs tokens per row, one line per batch size (mid context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ctx = cm.context[len(cm.context) // 2]
    for b in cm.batch:
        t = [cm.verify_time(b, n, ctx) for n in cm.tokens]
        axes[0].plot(cm.tokens, [1000 * x for x in t], marker="o", label=f"batch {b}")
        axes[1].plot(cm.tokens, [x / cm.verify_time(b, 1, ctx) for x in t], marker="o", label=f"batch {b}")
    axes[0].set(xscale="log", xlabel="tokens per row (1 + tree nodes)", ylabel="verify pass (ms)",
                title=f"Target verify latency, context {ctx}")
    axes[1].set(xscale="log", xlabel="tokens per row (1 + tree nodes)", ylabel="relative to 1 token",
                title="Cost of verifying a tree vs plain decoding")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{cm.provenance.get('target', '?')} on {cm.provenance.get('device_name', '?')} "
                 f"({cm.provenance.get('dtype', '?')})")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_args(p: argparse.ArgumentParser) -> None:
    from specrl.generate import add_model_args

    add_model_args(p)
    p.add_argument("-o", "--output", default=None, help="JSON path (default: the specrl cache)")
    p.add_argument("--reps", type=int, default=5, help="timed repeats per grid point (median)")
    p.add_argument("--quick", action="store_true", help="a coarse grid (for smoke tests)")
    p.add_argument("--plot", default=None, help="PNG path for the latency surfaces (default: beside the JSON)")


def run(args: argparse.Namespace) -> int:
    from specrl.models import ModelPair

    pair = ModelPair.load(args.model, args.draft if args.drafter == "model" else None, args.device, args.dtype)
    kw = {}
    if args.quick:
        kw = dict(batch=(1, 4), tokens=(1, 5), context=(64, 256))
    cm = profile_costs(pair, args.drafter, reps=args.reps, **kw)
    out = Path(args.output) if args.output else cost_path(args.model, args.draft, args.drafter, args.dtype, args.device)
    cm.save(out)
    png = plot_costs(cm, args.plot or out.with_suffix(".png"))
    b1 = cm.verify_time(1, 1, cm.context[0])
    print(f"cost model written to {out} (plot {png}); target step at batch 1: {1000 * b1:.1f} ms; "
          f"9 tokens {cm.verify_time(1, 9, cm.context[0]) / b1:.2f}x; batch 8: {cm.verify_time(8, 1, cm.context[0]) / b1:.2f}x")
    return 0
