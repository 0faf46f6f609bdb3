"""Verifier unit tests on synthetic distributions (no models): exactness of both methods."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specrl.sampling import SamplingParams, gumbel_topk, probs_from_logits
from specrl.tree import tree_shape
from specrl.verify import TreeTensors, verify_greedy, verify_sampling


def test_greedy_accepts_matching_path_and_returns_bonus():
    shape = tree_shape(2, 2)  # (), (0,), (1,), (0,0)
    tree = TreeTensors.of(shape, torch.device("cpu"))
    idx = shape.index()
    n, v = len(shape.paths), 10
    tokens = torch.zeros(2, n, dtype=torch.long)
    tokens[:, idx[(0,)]] = torch.tensor([3, 4])
    tokens[:, idx[(1,)]] = torch.tensor([4, 3])
    tokens[:, idx[(0, 0)]] = torch.tensor([5, 6])
    logits = torch.zeros(2, n, v)
    logits[:, idx[()], 4] = 1.0  # target wants 4 after the root
    logits[:, idx[(0,)], 6] = 1.0  # after node (0,): 6
    logits[:, idx[(1,)], 7] = 1.0  # after node (1,): 7
    logits[:, idx[(0, 0)], 8] = 1.0
    out = verify_greedy(tree, tokens, torch.ones(2, n, dtype=torch.bool), logits)
    # row 0: root->4 is node (1,) (token 4); then target wants 7, no child: accept 1, bonus 7
    # row 1: root->4 is node (0,); then 6 == node (0,0): accept 2, bonus 8
    assert out.accept_len.tolist() == [1, 2]
    assert out.bonus.tolist() == [7, 8]
    assert out.last_node.tolist() == [idx[(1,)], idx[(0, 0)]]
    assert out.path[1].tolist() == [0, idx[(0,)], idx[(0, 0)]]
    assert out.path[0].tolist() == [0, idx[(1,)], -1]


def test_greedy_ignores_absent_nodes():
    shape = tree_shape(1, 1)
    tree = TreeTensors.of(shape, torch.device("cpu"))
    tokens = torch.tensor([[0, 2]])
    logits = torch.zeros(1, 2, 4)
    logits[0, 0, 2] = 1
    present = torch.tensor([[True, False]])
    out = verify_greedy(tree, tokens, present, logits)
    assert out.accept_len.tolist() == [0] and out.bonus.tolist() == [2]


def _markov_case(v: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(torch.randn(v, generator=g) * 1.5, -1)
    p1 = torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)  # p1[x] = p(next | x)
    # a draft that is close to the target but not equal, so both acceptance and rejection happen
    q0 = 0.5 * p0 + 0.5 * torch.softmax(torch.randn(v, generator=g) * 1.5, -1)
    q1 = 0.5 * p1 + 0.5 * torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)
    return p0, p1, q0, q1


def _run_two_level(k: int, w: int, rows: int, deterministic: bool, seed: int, v: int = 5):
    """Draft a (k<=2, w) tree from a synthetic Markov draft q, verify against Markov target p.

    Returns the committed first two tokens per row (-1 where only one was committed).
    """
    shape = tree_shape(k, w)
    tree = TreeTensors.of(shape, torch.device("cpu"))
    n = len(shape.paths)
    p0, p1, q0, q1 = _markov_case(v, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    tokens = torch.zeros(rows, n, dtype=torch.long)
    qnode = torch.zeros(rows, n, v)  # q at each node (from which its children are drawn)
    pnode = torch.zeros(rows, n, v)  # target p at each node
    qnode[:, 0], pnode[:, 0] = q0, p0
    for d in range(1, k + 1):
        for parent in sorted({int(shape.parent[c]) for c in shape.level(d)}):
            kids = shape.children[parent]
            if deterministic:  # a fixed, distinct proposal per rank (like the n-gram drafter)
                picks = torch.argsort(qnode[:, parent], dim=-1, descending=True)[:, : len(kids)]
            else:
                picks = gumbel_topk(qnode[:, parent], len(kids), gen)
            for r, c in enumerate(kids):
                tokens[:, c] = picks[:, r]
                qnode[:, c] = q1[picks[:, r]]
                pnode[:, c] = p1[picks[:, r]]
    logits = torch.log(pnode)
    present = torch.ones(rows, n, dtype=torch.bool)
    params = SamplingParams(temperature=1.0)
    out = verify_sampling(tree, tokens, present, logits, None if deterministic else qnode, params, gen)
    first = torch.where(out.accept_len >= 1, tokens.gather(1, out.path[:, 1:2].clamp_min(0))[:, 0], out.bonus)
    second = torch.where(
        out.accept_len >= 2,
        tokens.gather(1, out.path[:, 2:3].clamp_min(0))[:, 0] if k >= 2 else out.bonus,
        torch.where(out.accept_len == 1, out.bonus, torch.full_like(out.bonus, -1)),
    )
    return first.numpy(), second.numpy(), p0.numpy(), p1.numpy(), out.accept_len.numpy()


def _chi2_p(observed_counts: np.ndarray, expected_probs: np.ndarray) -> float:
    probs = np.asarray(expected_probs, dtype=np.float64)
    exp = probs / probs.sum() * observed_counts.sum()
    keep = exp >= 5
    obs = np.append(observed_counts[keep], observed_counts[~keep].sum())
    exp = np.append(exp[keep], exp[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("k,w,deterministic", [(1, 1, False), (2, 1, False), (1, 4, False), (2, 3, False),
                                               (2, 2, True), (1, 3, True)])
def test_sampling_first_token_is_target_distributed(k, w, deterministic):
    rows = 40000
    first, _, p0, _, acc = _run_two_level(k, w, rows, deterministic, seed=k * 10 + w)
    counts = np.bincount(first, minlength=len(p0))
    assert _chi2_p(counts, p0) > 1e-3
    assert acc.mean() > 0.2  # the test exercises acceptance, not only bonus draws


@pytest.mark.parametrize("w,deterministic", [(1, False), (3, False), (2, True)])
def test_sampling_second_token_given_first_is_target_distributed(w, deterministic):
    """Rows that accepted a first draft token x commit a second token distributed as p(. | x)."""
    rows = 60000
    first, second, p0, p1, _ = _run_two_level(2, w, rows, deterministic, seed=7 + w)
    v = len(p0)
    two = second >= 0
    assert two.mean() > 0.3
    counts = np.bincount(first[two] * v + second[two], minlength=v * v).reshape(v, v)
    expected = counts.sum(1, keepdims=True) * p1  # n_x * p(y | x)
    assert _chi2_p(counts.reshape(-1), expected.reshape(-1)) > 1e-3


def test_chi2_detects_a_wrong_distribution():
    """Power check: the same test rejects the draft's own distribution."""
    rows = 40000
    _, _, p0, _, _ = _run_two_level(1, 1, 10, False, seed=11)
    _, _, q0, _ = _markov_case(len(p0), 11)
    draws = np.random.default_rng(0).choice(len(q0), size=rows, p=q0.numpy() / q0.numpy().sum())
    assert _chi2_p(np.bincount(draws, minlength=len(p0)), p0) < 1e-6


def test_top_p_keeps_smallest_prefix():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.0, 0.0]]) / 0.8)


def test_gumbel_topk_draws_without_replacement():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0]]).expand(20000, 4)
    picks = gumbel_topk(probs, 3, torch.Generator().manual_seed(0))
    assert (picks[:, 0] != picks[:, 1]).all() and (picks[:, 1] != picks[:, 2]).all()
    first = np.bincount(picks[:, 0].numpy(), minlength=4) / 20000
    assert np.allclose(first, [0.7, 0.2, 0.1, 0.0], atol=0.015)
    # second draw given first = 0 is (0.2, 0.1) renormalised
    sel = picks[:, 0] == 0
    second = np.bincount(picks[sel, 1].numpy(), minlength=4) / int(sel.sum())
    assert np.allclose(second[1:3], [2 / 3, 1 / 3], atol=0.02)


def test_sampling_with_a_confident_draft_keeps_the_target_distribution():
    """After a draft with q(x) ~ 1 is rejected, the next sibling is tested against q renormalised
    over what is left (< 1e-9 of mass here); the raw tail accepted every sibling (p = 0)."""
    v = 5
    q = torch.tensor([1.0, 8e-11, 1e-11, 5e-12, 5e-12], dtype=torch.float64)
    q = q / q.sum()
    p = torch.tensor([0.5, 0.125, 0.125, 0.125, 0.125], dtype=torch.float64)
    tree = TreeTensors.of(tree_shape(1, 2), torch.device("cpu"))  # a root with two children
    b = 40_000
    g = torch.Generator().manual_seed(0)
    picks = gumbel_topk(q.expand(b, v), 2, g)  # the children, drawn without replacement from q
    tokens = torch.zeros(b, 3, dtype=torch.long)
    tokens[:, 1:] = picks
    present = torch.ones(b, 3, dtype=torch.bool)
    probs = torch.zeros(b, 3, v, dtype=torch.float64)
    probs[:, 0] = q
    logits = torch.log(p).expand(b, 3, v).clone()
    out = verify_sampling(tree, tokens, present, logits, probs, SamplingParams(1.0), g)
    first = torch.where(out.accept_len > 0, tokens.gather(1, out.last_node[:, None])[:, 0], out.bonus)
    counts = np.bincount(first.numpy(), minlength=v)
    assert chisquare(counts, p.numpy() * b).pvalue > 1e-3


@pytest.mark.slow
def test_gumbel_topk_draws_rare_tokens_of_a_large_vocabulary():
    """A 1% tail spread over 150k tokens: float32 Gumbel noise drew it 0.43% of the time."""
    v, tail = 150_000, 0.01
    q = torch.full((v,), tail / (v - 1))
    q[0] = 1 - tail
    g = torch.Generator().manual_seed(0)
    n = 6000
    hits = sum(int((gumbel_topk(q.expand(200, v), 1, g)[:, 0] != 0).sum()) for _ in range(n // 200))
    se = (tail * (1 - tail) / n) ** 0.5
    assert abs(hits / n - tail) < 4 * se  # 0.0100 +- 0.0051
