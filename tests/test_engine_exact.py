"""Invariant 1: greedy decoding through the engine equals the target alone, token for token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import tiny_pair

from specrl.engine import Action, SpecEngine


def reference_greedy(model, prompt, max_new_tokens, eos=()):
    """Target-alone greedy decoding (transformers generate, explicit attention mask)."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0, eos_token_id=None,
    )[0, len(prompt):].tolist()
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


PAIRS = {
    "v16": dict(vocab=16, noise=0.05),  # small vocabulary: loops, so the n-gram drafter hits often
    "v64": dict(vocab=64, noise=0.05, seed=3),
}


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request):
    return tiny_pair(**PAIRS[request.param])


def fuzz_run(pair, drafter, seed, per_request=False, eos=(), ragged=True, stats=None):
    rng = np.random.default_rng(seed)
    vocab = pair.vocab_size
    n_req = int(rng.integers(3, 7))
    prompts = [rng.integers(0, vocab, size=int(rng.integers(1, 20))).tolist() for _ in range(n_req)]
    max_new = [int(rng.integers(1, 40)) for _ in range(n_req)]
    max_batch = int(rng.integers(1, 5))
    eng = SpecEngine(pair, drafter=drafter if isinstance(drafter, str) else drafter(pair), max_batch_size=max_batch,
                     eos_token_ids=eos, ragged=ragged)
    packed_steps = 0
    todo = list(range(n_req))
    rid_of = {}
    outputs = {}
    accepted = 0
    while todo or eng.has_work():
        # requests join at random times, never more than the batch limit waiting
        while todo and eng.free_slots() > 0 and (rng.random() < 0.6 or not eng.has_work()):
            i = todo.pop(0)
            rid_of[eng.add_request(prompts[i], max_new[i])] = i
        if not eng.has_work():
            continue
        n_rows = len(eng.rows) + min(len(eng.waiting), eng.free_slots() + len(eng.waiting))
        if per_request:
            # the engine admits waiting requests first, so ask after admission
            eng.admit()
            acts = [Action(int(rng.integers(0, 9)), int(rng.integers(1, 5))) for _ in eng.rows]
            res = eng.step(acts)
        else:
            res = eng.step(Action(int(rng.integers(0, 9)), int(rng.integers(1, 5))))
        assert len(res.rids) >= 1 and n_rows >= 1
        accepted += int(res.accept_len.sum())
        packed_steps += res.verify_rows < res.batch_size * res.tree_tokens
        if not ragged:
            assert res.verify_rows == res.batch_size * res.tree_tokens
        for r in eng.pop_finished():
            outputs[rid_of[r.rid]] = r.output.tolist()
    for i in range(n_req):
        assert outputs[i] == reference_greedy(pair.target, prompts[i], max_new[i], eos), (
            f"request {i} differs (drafter={drafter}, seed={seed})"
        )
    if stats is not None:
        stats["packed_steps"] = stats.get("packed_steps", 0) + packed_steps
        stats["packed_runs"] = stats.get("packed_runs", 0) + eng.pass_counts["packed-runs"]
        stats["packed_one_call"] = stats.get("packed_one_call", 0) + eng.pass_counts["packed"]
    return accepted


@pytest.mark.parametrize("threshold", [0.3, 0.7])
def test_greedy_exact_with_confidence_threshold(pair, threshold):
    """A draft that stops where it is unsure (dynamic depth, verify cut to the proposed nodes)
    stays exact, still gets tokens accepted, and really proposes shorter trees."""
    from specrl.drafters.model import ModelDrafter

    depths = []

    def make(p):
        d = ModelDrafter(p.draft, min_confidence=threshold)
        real = d.propose

        def propose(seqs, shape, present, params, gen):
            out = real(seqs, shape, present, params, gen)
            depths.append((shape.max_depth, int((out.present.any(0).cpu().numpy() * shape.depth).max())))
            assert out.host_union is not None and out.host_union[0]
            return out

        d.propose = propose
        return d

    accepted = sum(fuzz_run(pair, make, 300 + seed) for seed in range(4))
    assert accepted > 0
    assert any(got < asked for asked, got in depths)  # the threshold cut some trees short
    with pytest.raises(Exception, match="min_confidence"):
        ModelDrafter(pair.draft, min_confidence=1.0)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("seed", range(6))
def test_greedy_exact_fuzzed_actions_and_batches(pair, drafter, seed):
    fuzz_run(pair, drafter, seed)


@pytest.mark.parametrize("ragged", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_greedy_exact_per_request_actions(pair, drafter, ragged):
    """Every row its own (k, w): verified in one packed pass (each row's own tree size) or padded
    to the union tree; both must equal the target alone."""
    stats = {}
    for seed in range(3):
        fuzz_run(pair, drafter, 100 + seed, per_request=True, ragged=ragged, stats=stats)
    if ragged:  # both attention layouts of a packed pass ran (one padded call; per-run calls)
        assert stats["packed_one_call"] > 0 and stats["packed_runs"] > 0, stats


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_greedy_exact_with_eos(pair, drafter):
    # frequent "EOS" tokens make requests leave mid-tree and at random steps
    for seed in range(3):
        fuzz_run(pair, drafter, 200 + seed, eos=(1, 5))


def test_fuzz_exercises_acceptance():
    """The fuzz would be vacuous if drafts were never accepted: check both drafters accept."""
    pair = tiny_pair(**PAIRS["v16"])
    assert fuzz_run(pair, "ngram", 0) > 5
    assert fuzz_run(pair, "model", 0) > 5


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_confidence_pruning_keeps_the_draft_cache_right(greedy):
    """With min_confidence the verify tree is renumbered; the drafter must commit its own node ids,
    or its KV cache holds wrong columns: every draft round's top-1 must match a fresh draft forward."""
    from specrl.drafters.model import ModelDrafter
    from specrl.sampling import SamplingParams

    vocab = 16
    pair = tiny_pair(vocab=vocab, noise=0.05)
    d = ModelDrafter(pair.draft, min_confidence=0.3)
    real, errs, pruned = d.propose, [], []

    def propose(seqs, shape, present, params, gen):
        out = real(seqs, shape, present, params, gen)
        with torch.no_grad():
            for b, s in enumerate(seqs):
                ref = torch.softmax(pair.draft(torch.tensor([s.tolist()])).logits[0, -1].double(), -1).max()
                errs.append(abs(float(out.top1[b]) - float(ref)))
        hu = out.host_union
        pruned.append(hu is not None and not (np.flatnonzero(hu) == np.arange(hu.sum())).all())
        return out

    d.propose = propose
    eng = SpecEngine(pair, drafter=d, sampling=SamplingParams(0.0 if greedy else 1.0), seed=0)
    rng = np.random.default_rng(0)
    eng.generate([rng.integers(0, vocab, size=8).tolist() for _ in range(4)], 40, action=Action(4, 3))
    assert sum(pruned) > 0  # pruning that renumbers the tree did happen
    assert max(errs) < 1e-6
