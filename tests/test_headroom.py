"""The headroom benchmark's per-row acceptance predictor (benchmarks/headroom.py)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import headroom  # noqa: E402


def _tables(accept_11, extra=None):
    """Two prompts of 4 and 3 positions; action 0 = (1, 1), action 1 = a second action."""
    acc = np.zeros((7, 2), np.uint8)
    acc[:, 0] = accept_11
    if extra is not None:
        acc[:, 1] = extra
    return SimpleNamespace(accept=acc, offsets=np.array([0, 4, 7]), prompt_len=np.array([5, 5]),
                           match_len=np.zeros(7, np.float32), num_matches=np.zeros(7, np.float32))


def test_copy_run_counts_consecutive_hits_and_restarts_per_prompt():
    tb = _tables([1, 1, 0, 1, 1, 1, 1])
    # prompt 0: hits at 0, 1, miss at 2, hit at 3; prompt 1 starts from 0 again
    assert headroom.copy_run(tb, 0).tolist() == [0, 1, 2, 0, 0, 1, 2]


def test_fit_predicts_bucket_means_shrunk_to_the_global_mean():
    tb = _tables([0, 0, 0, 0, 0, 0, 0], extra=[4, 4, 0, 0, 2, 2, 2])
    ids = np.array([0, 0, 1, 1, 2, 2, 2])
    train = np.arange(4)  # only the first prompt's rows train the predictor
    pred = headroom.fit(tb, train, ids, 3, prior=1e-9)
    assert np.allclose(pred[:4, 1], [4.0, 4.0, 0.0, 0.0])
    shrunk = headroom.fit(tb, train, ids, 3, prior=2.0)
    assert shrunk[0, 1] == (8 + 2 * 2.0) / (2 + 2)  # two 4s plus two pseudo-counts at the mean 2
    assert shrunk[4, 1] == 2.0  # unseen bucket: the global training mean


def test_buckets_separate_run_lengths():
    tb = _tables([1] * 7)
    run = headroom.copy_run(tb, 0)
    ids, n = headroom.bucket_ids(tb, run)
    ids0, n0 = headroom.bucket_ids(tb, None)
    assert n == n0 * (len(headroom.RUN_EDGES) + 1)
    assert len(set(ids.tolist())) > len(set(ids0.tolist())) == 1
