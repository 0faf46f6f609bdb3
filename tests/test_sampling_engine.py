"""Invariant 2: sampling through the engine preserves the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny import tiny_pair

from specrl.engine import Action, SpecEngine
from specrl.sampling import SamplingParams, probs_from_logits

V = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so the n-gram drafter proposes trees too


@pytest.fixture(scope="module")
def pair():
    # modest init: spread-out distributions, so many cells of the joint are populated
    return tiny_pair(vocab=V, noise=0.3, seed=4, init=0.15)


@torch.inference_mode()
def exact_joint(model, params):
    """p(t1, t2 | PROMPT) under the target with the same temperature / top-p."""
    ids = torch.tensor([PROMPT])
    p1 = probs_from_logits(model(ids).logits[0, -1], params).double()
    ext = torch.cat([ids.expand(V, -1), torch.arange(V)[:, None]], dim=1)
    p2 = probs_from_logits(model(ext).logits[:, -1], params).double()  # (V, V)
    return (p1[:, None] * p2).reshape(-1).numpy()


def sample_pairs(pair, drafter, action, params, rows, seed):
    eng = SpecEngine(pair, drafter=drafter, sampling=params, seed=seed)
    out = eng.generate([PROMPT] * rows, max_new_tokens=2, action=action)
    acc = sum(r.accepted for r in out)
    return np.array([r.output.tolist() for r in out]), acc


def chi2_p(counts, probs):
    exp = probs / probs.sum() * counts.sum()
    keep = exp >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(exp[keep], exp[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


CASES = [
    ("model", Action(3, 1), SamplingParams(1.0)),  # chain: standard speculative sampling
    ("model", Action(2, 3), SamplingParams(1.0)),  # tree: recursive rejection, without replacement
    ("model", Action(2, 2), SamplingParams(0.7, top_p=0.9)),
    ("ngram", Action(2, 2), SamplingParams(1.0)),  # deterministic drafts
]


@pytest.mark.parametrize("drafter,action,params", CASES, ids=lambda x: str(x))
def test_engine_samples_follow_target_distribution(pair, drafter, action, params):
    rows = 6000
    toks, accepted = sample_pairs(pair, drafter, action, params, rows, seed=1)
    assert accepted > rows * 0.05  # drafts do get accepted, so acceptance and rejection are both tested
    counts = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
    assert chi2_p(counts, exact_joint(pair.target, params)) > 1e-3


def test_power_the_draft_distribution_is_rejected(pair):
    """The same test tells the draft's own distribution apart from the target's."""
    params = SamplingParams(1.0)
    draft_only = SpecEngine(pair.__class__.from_models(pair.draft), drafter="ngram", sampling=params, seed=2)
    out = draft_only.generate([PROMPT] * 6000, max_new_tokens=2, action=Action(0, 1))
    toks = np.array([r.output.tolist() for r in out])
    counts = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
    assert chi2_p(counts, exact_joint(pair.target, params)) < 1e-6


@pytest.mark.parametrize("action", [Action(3, 1), Action(2, 2)], ids=str)
def test_confidence_threshold_keeps_the_target_distribution(pair, action):
    """min_confidence in sampling mode: whether a level is proposed must not depend on which token
    the draft sampled there, or the proposal is no longer q and rejection sampling skews."""
    from specrl.drafters.model import ModelDrafter

    params = SamplingParams(1.0)
    drafter = ModelDrafter(pair.draft, min_confidence=0.25)
    eng = SpecEngine(pair, drafter=drafter, sampling=params, seed=1)
    rows = 6000
    out = eng.generate([PROMPT] * rows, max_new_tokens=2, action=action)
    assert sum(r.accepted for r in out) > rows * 0.05
    toks = np.array([r.output.tolist() for r in out])
    counts = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
    assert chi2_p(counts, exact_joint(pair.target, params)) > 1e-3
