"""The ragged KV caches stay consistent with a fresh prefill after long runs of rollbacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import tiny_pair

from specrl.engine import Action, SpecEngine
from specrl.kvcache import RaggedKVCache, prefill


@torch.inference_mode()
def probe(cache: RaggedKVCache, model, seqs, cached):
    """Logits for each row's last token computed through ``cache`` (which holds seq[:cached]),
    without committing anything."""
    bsz = len(seqs)
    pend = [s[c:] for s, c in zip(seqs, cached)]
    width = max(len(p) for p in pend)
    ids = torch.zeros(bsz, width, dtype=torch.long)
    for b, p in enumerate(pend):
        ids[b, : len(p)] = torch.as_tensor(p)
    n = torch.tensor([len(p) for p in pend])
    cols = torch.arange(width)
    ok = cols[None] < n[:, None]
    tail = torch.ones(width, width, dtype=torch.bool).tril()[None] & ok[:, None, :]
    pos = torch.tensor(cached)[:, None] + cols[None]
    base = cache.T
    logits, _ = cache.forward(model, ids, pos, tail, base)
    cache.keep(base, torch.full((bsz, 1), base), torch.zeros(bsz, dtype=torch.long), 0)
    return logits[torch.arange(bsz), n - 1]


@torch.inference_mode()
def fresh(model, seq):
    return model(torch.as_tensor(seq)[None]).logits[0, -1]


def test_caches_match_fresh_prefill_after_many_rollbacks():
    pair = tiny_pair(vocab=64, noise=0.05, seed=5)
    eng = SpecEngine(pair, drafter="model", max_batch_size=4)
    for c in (eng.cache, eng.drafter.cache):  # compact aggressively to exercise it
        c.min_compact_len, c.waste_limit = 8, 0.05
    rng = np.random.default_rng(0)
    for _i in range(6):
        eng.add_request(rng.integers(0, 64, size=int(rng.integers(2, 30))), max_new_tokens=int(rng.integers(60, 150)))
    checks = compactions = 0
    for step in range(400):
        if not eng.has_work():
            break
        before = eng.cache.T
        eng.step(Action(int(rng.integers(0, 9)), int(rng.integers(1, 5))))
        compactions += eng.cache.T < before
        if step % 7 == 0 and eng.rows:
            seqs = [r.seq for r in eng.rows]
            got_t = probe(eng.cache, pair.target, seqs, [len(s) - 1 for s in seqs])
            got_d = probe(eng.drafter.cache, pair.draft, seqs, eng.drafter.cached)
            for b, s in enumerate(seqs):
                torch.testing.assert_close(got_t[b], fresh(pair.target, s), rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(got_d[b], fresh(pair.draft, s), rtol=1e-9, atol=1e-9)
            checks += 1
    assert checks >= 10
    assert compactions > 0  # rows were compacted at least once during the run


@torch.inference_mode()
def test_merge_select_and_compact_preserve_rows():
    pair = tiny_pair(vocab=32, seed=2)
    model = pair.target
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 32, size=n) for n in (3, 9, 1, 6)]
    cache = RaggedKVCache()
    prefill(model, cache, seqs[:2], torch.device("cpu"))
    prefill(model, cache, seqs[2:], torch.device("cpu"))  # merged with a different length
    assert cache.B == 4
    ref = [fresh(model, s) for s in seqs]
    got = probe(cache, model, seqs, [len(s) - 1 for s in seqs])
    for b in range(4):
        torch.testing.assert_close(got[b], ref[b])
    cache.select_rows([3, 1])
    got = probe(cache, model, [seqs[3], seqs[1]], [5, 8])
    torch.testing.assert_close(got[0], ref[3])
    torch.testing.assert_close(got[1], ref[1])
    cache.compact()
    assert cache.T == 8  # packed: the longest row (8 tokens) sets the width
    got = probe(cache, model, [seqs[3], seqs[1]], [5, 8])
    torch.testing.assert_close(got[1], ref[1])


@torch.inference_mode()
def test_compaction_runs_only_when_it_frees_columns():
    """Rows of different lengths leave holes no packing removes: compacting for them would copy the
    whole cache every step for nothing. Holes in every row (dropped tree slots) are freed."""
    pair = tiny_pair(vocab=32, seed=3)
    rng = np.random.default_rng(2)
    cache = RaggedKVCache(waste_limit=0.3, min_compact_len=16)
    prefill(pair.target, cache, [rng.integers(0, 32, size=n) for n in (4, 90)], torch.device("cpu"))
    assert cache.T == 89 and cache.reclaimable() == 0.0
    assert not cache.maybe_compact()  # half the columns are holes, but the long row needs them all
    cache.valid[:, 10:60] = False  # a hole shared by both rows: packing frees 50 of 89 columns
    assert cache.reclaimable() == pytest.approx(50 / 89)
    assert cache.maybe_compact() and cache.T == 39
