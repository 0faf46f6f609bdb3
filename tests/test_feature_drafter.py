"""The feature drafter: the engine hands it the right target features, and decoding stays lossless.

Losslessness alone cannot catch a wrong feature (verification rejects bad drafts silently), so
the first test compares every feature the drafter holds with the target's own last hidden state
at the position before each row's root, over padded and packed verify passes, requests joining
and leaving, one-token prompts and EOS.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine_exact import fuzz_run, reference_greedy
from test_sampling_engine import chi2_p, exact_joint, sample_pairs
from tiny import tiny_pair

from specrl.drafters.feature import FeatureDrafter
from specrl.drafttrain.data import Sequence_
from specrl.drafttrain.feature import (
    FeatureHead,
    HeadConfig,
    load_head,
    save_head,
    target_features,
    train_head,
)
from specrl.engine import Action, SpecEngine
from specrl.errors import ConfigError, ModelLoadError
from specrl.sampling import SamplingParams
from specrl.tree import tree_shape

V = 16


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=V, noise=0.05, dtype=torch.float32)


def greedy_sequences(target, n: int, seed: int) -> list[Sequence_]:
    """The target's own greedy continuations of random prompts, labelled as `specrl draft data` does."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, V, size=int(rng.integers(2, 8))).tolist()
        gen = reference_greedy(target, prompt, 24)
        toks = torch.tensor(prompt + gen)
        with torch.no_grad():
            logits = target(toks[None]).logits[0, len(prompt) - 1 : -1]  # (G, V): label m predicts gen[m]
        top = logits.topk(4)
        out.append(Sequence_(toks, len(prompt), top.indices, top.values, f"c{i % 2}", "train-greedy"))
    return out


@pytest.fixture(scope="module")
def head(pair):
    """An mlp head distilled for a few seconds on the tiny target (so drafts do get accepted)."""
    train, held = greedy_sequences(pair.target, 40, 0), greedy_sequences(pair.target, 8, 1)
    ftrain, fheld = target_features(pair.target, train, 64, progress=False), target_features(pair.target, held, 64, progress=False)
    cfg = HeadConfig(epochs=30, lr=3e-3, batch_tokens=512, max_len=64, eval_every=1000)
    res = train_head(pair.target, train, ftrain, held, fheld, torch.arange(V), cfg, progress=False, log=lambda m: None)
    assert res["final"]["alpha"] > res["curve"][0]["alpha"]
    return res["head"]


class Recording(FeatureDrafter):
    """Remembers (sequence, feature) of every row at every draft round."""

    def __init__(self, head):
        super().__init__(head)
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def propose(self, seqs, shape, present, params, generator):
        self.seen += [(s.tolist(), self.f[b].clone()) for b, s in enumerate(seqs)]
        return super().propose(seqs, shape, present, params, generator)


@pytest.mark.parametrize("per_request", [False, True], ids=["padded", "packed"])
def test_drafter_holds_the_targets_feature_before_each_root(pair, head, per_request):
    rec: list[Recording] = []

    def make(p):
        rec.append(Recording(head))
        return rec[-1]

    for seed in range(3):
        fuzz_run(pair, make, 400 + seed, per_request=per_request, eos=(1,))
    # one- and two-token prompts beside a long one (the first has no feature before its root)
    eng = SpecEngine(pair, drafter=make(pair), ragged=per_request)
    eng.generate([[3], [4, 5], list(range(12))], 10, action=Action(2, 2))
    seen = [x for r in rec for x in r.seen]
    assert len(seen) > 50
    assert any(len(s) < 2 for s, _ in seen)
    with torch.no_grad():
        for seq, f in seen:
            if len(seq) < 2:  # a one-token prompt: no feature yet
                assert not f.any()
                continue
            want = pair.target.model(torch.tensor([seq[:-1]])).last_hidden_state[0, -1]
            torch.testing.assert_close(f, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_exact_with_the_feature_drafter(pair, head, seed):
    accepted = fuzz_run(pair, lambda p: FeatureDrafter(head), 500 + seed, per_request=bool(seed % 2), eos=(1, 5))
    accepted += fuzz_run(pair, lambda p: FeatureDrafter(head), 600 + seed, ragged=False)
    assert accepted > 5  # drafts are accepted, so the exactness check is not vacuous


@pytest.mark.parametrize("action", [Action(3, 1), Action(2, 2)], ids=str)
def test_sampling_with_the_feature_drafter_keeps_the_target_distribution(action):
    # vocabulary 8, spread-out distributions (as tests/test_sampling_engine.py); an untrained head,
    # with a shortlist that leaves token 7 out: q is zero there and the target must still emit it
    p8 = tiny_pair(vocab=8, noise=0.3, seed=4, init=0.15, dtype=torch.float32)
    params = SamplingParams(1.0)
    torch.manual_seed(0)
    drafter = FeatureDrafter(FeatureHead(p8.target, torch.arange(7), "mlp").eval())
    toks, accepted = sample_pairs(p8, drafter, action, params, 6000, seed=1)
    assert accepted > 6000 * 0.05
    counts = np.bincount(toks[:, 0] * 8 + toks[:, 1], minlength=64)
    assert counts[7::8].sum() > 0 and counts[56:].sum() > 0  # the token outside the shortlist is emitted
    assert chi2_p(counts, exact_joint(p8.target, params)) > 1e-3


def test_head_round_trips_through_safetensors(pair, head, tmp_path):
    save_head(head, tmp_path / "h", {"recipe": "test"})
    again = load_head(tmp_path / "h", pair.target)
    assert again.kind == "mlp" and torch.equal(again.ids, head.ids)
    f, tok = torch.randn(3, 5, pair.target.config.hidden_size), torch.randint(0, V, (3, 5))
    with torch.no_grad():  # stored in bfloat16: close, not equal
        torch.testing.assert_close(again(f, tok), head(f, tok), atol=0.05, rtol=0.05)
    eng = SpecEngine(pair, drafter=FeatureDrafter(again))
    out = eng.generate([[1, 2, 3]], 12, action=Action(2, 2))[0].output.tolist()
    assert out == reference_greedy(pair.target, [1, 2, 3], 12)


def test_refusals_name_the_fix(pair, head, tmp_path):
    with pytest.raises(ModelLoadError, match="No feature head at .* Fix: pass a directory written by `specrl draft head`"):
        load_head(tmp_path / "nothing", pair.target)
    save_head(head, tmp_path / "h", {})
    other = tiny_pair(vocab=32, dtype=torch.float32)
    with pytest.raises(ModelLoadError, match="trained for hidden size 32 / vocabulary 16, but the target has 32 / 32"):
        load_head(tmp_path / "h", other.target)
    with pytest.raises(ConfigError, match="position-wise heads only .* kind 'eagle'"):
        FeatureDrafter(FeatureHead(pair.target, torch.arange(V), "eagle"))
    with pytest.raises(ModelLoadError, match="No shipped feature head for target 'tiny-target'"):
        SpecEngine(pair, drafter="feature")
    with pytest.raises(ConfigError, match="Unknown head kind 'medusa'. Allowed: eagle, mlp"):
        HeadConfig(kind="medusa")


def test_draft_quality_scores_the_token_the_drafter_proposes(pair, head):
    """benchmarks/draft_quality.py's feature alpha must score, for every generated token, the token
    the engine's feature drafter proposes at k = 1 from that position (no off-by-one)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import draft_quality as dq

    prompt = [3, 1, 4, 1, 5]
    out = reference_greedy(pair.target, prompt, 20)
    hits, _, n = dq.feature_agreement(head, pair.target, prompt, out)
    want = 0
    shape = tree_shape(1, 1)
    for g in range(len(out)):  # the drafter's k = 1 proposal once prompt + out[:g] is committed
        d = FeatureDrafter(head)
        eng = SpecEngine(pair, drafter=d)
        eng.add_request(prompt + out[:g], 5)
        eng.admit()  # the prefill hands the drafter its feature
        seq = np.array(prompt + out[:g])
        draft = d.propose([seq], shape, np.ones((1, len(shape.paths)), bool), SamplingParams(), None)
        want += int(draft.tokens[0, 1]) == out[g]
    assert n == len(out) and hits == want and 0 < hits < n


def test_env_config_names_the_drafters_and_keeps_feature_on_the_live_backend():
    from specrl.envs.config import EnvConfig

    with pytest.raises(ConfigError, match="Unknown drafter 'medusa'. Allowed: feature, model, ngram"):
        EnvConfig(drafter="medusa")
    with pytest.raises(ConfigError, match="drafter='feature' runs on the live backend only.*Fix: backend: live"):
        EnvConfig(backend="replay", drafter="feature")
    assert EnvConfig(backend="live", drafter="feature").drafter == "feature"


def test_a_bfloat16_head_leaves_the_target_alone(pair, head, tmp_path):
    save_head(head, tmp_path / "h", {})
    h16 = load_head(tmp_path / "h", pair.target, torch.bfloat16)
    assert h16.fc.weight.dtype == torch.bfloat16 and h16.sub_w.dtype == torch.bfloat16
    assert pair.target.get_input_embeddings().weight.dtype == torch.float32  # shared, not converted
    out = SpecEngine(pair, drafter=FeatureDrafter(h16)).generate([[1, 2, 3]], 12, action=Action(2, 2))[0]
    assert out.output.tolist() == reference_greedy(pair.target, [1, 2, 3], 12)
