"""Feature heads (specrl.drafttrain.feature, benchmarks/draft_feature_heads.py): position bookkeeping and training.

Its alpha is only meaningful if column c of the head's output is compared with the target's
label for the right token; these tests check that with the target's *true* features standing in
for a perfect head (alpha must then be exactly 1), on sequences cropped and uncropped.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import draft_feature_heads as fh  # noqa: E402

from specrl.drafttrain import feature as ft  # noqa: E402
from specrl.drafttrain.data import Sequence_  # noqa: E402


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def _sequences(target, n=6, window=64):
    """Random prompts + tokens, labelled with the target's teacher-forced top-4 (as `specrl draft data`).

    The target sees the last ``window`` tokens only (what the probe's features see after a
    crop); labels at positions before the window are -1 and must never be scored."""
    g = torch.Generator().manual_seed(1)
    seqs = []
    for i in range(n):
        pl, gen = 3 + i, 5 + (i % 3)
        toks = torch.randint(0, 64, (pl + gen,), generator=g)
        start = max(0, len(toks) - window)
        with torch.no_grad():
            logits = target(toks[None, start:]).logits[0]  # (L - start, V)
        top_i = torch.full((gen, 4), -1, dtype=torch.long)
        top_v = torch.zeros(gen, 4)
        for m in range(gen):  # label m: the target's view at position pl + m - 1
            p = pl + m - 1 - start
            if p >= 0:
                top = logits[p].topk(4)
                top_i[m], top_v[m] = top.indices, top.values
        seqs.append(Sequence_(toks, pl, top_i, top_v, "cat" + str(i % 2), "train-greedy"))
    return seqs


@pytest.mark.parametrize("max_len", [64, 7])  # 7 crops every sequence's start
def test_true_features_score_alpha_one_at_the_label_columns(target, max_len):
    seqs = _sequences(target, window=max_len)
    feats = ft.target_features(target, seqs, max_len, progress=False)
    head = target.get_output_embeddings().weight  # (V, H)
    _, _, _, fout, mask = ft.collate(seqs, feats, list(range(len(seqs))), max_len)
    checked = 0
    for b, s in enumerate(seqs):
        col, ok = ft.label_columns(s, max_len)
        pred = (fout[b, col[ok]] @ head.T).argmax(-1)  # the true f at each column -> its argmax
        assert torch.equal(pred, s.top_i[ok, 0])
        # a label is scored iff the feature before its position is inside the window
        start = max(0, len(s.tokens) - max_len)
        assert torch.equal(ok, s.prompt_len + torch.arange(len(ok)) - 1 - start >= 1)
        checked += int(ok.sum())
        assert mask[b, col[ok]].all()  # every label column is a trained position
    assert checked > 0


def test_generated_only_mask_keeps_exactly_the_label_columns(target):
    seqs = _sequences(target)
    feats = ft.target_features(target, seqs, 64, progress=False)
    _, _, _, _, mask = ft.collate(seqs, feats, list(range(len(seqs))), 64, generated_only=True)
    for b, s in enumerate(seqs):
        col, ok = ft.label_columns(s, 64)
        want = torch.zeros_like(mask[b])
        want[col[ok]] = True
        assert torch.equal(mask[b], want)


def test_heads_train_their_own_weights_on_a_frozen_target(target):
    seqs = _sequences(target)
    feats = ft.target_features(target, seqs, 64, progress=False)
    ids = torch.arange(64)
    for kind in ft.HEADS:
        head = ft.FeatureHead(target, ids, kind)
        trainable = {n for n, p in head.named_parameters() if p.requires_grad}
        # the eagle layer is a copy of a frozen target layer: it must still train (a bug once)
        assert any(n.startswith("layer." if kind == "eagle" else "mlp.") for n in trainable)
        assert not any(n.startswith("embed") for n in trainable)
    cfg = ft.HeadConfig(kind="mlp", seed=0, lr=3e-3, max_len=64, batch_tokens=64, epochs=3.0, eval_every=5,
                        w_cls=0.1, positions="all")
    res = ft.train_head(target, seqs, feats, seqs, feats, ids, cfg, progress=False, log=lambda m: None)
    first, last = res["curve"][0], res["final"]
    assert 0.0 <= last["alpha"] <= 1.0 and last["tokens"] == sum(int(ft.label_columns(s, 64)[1].sum()) for s in seqs)
    assert last["trained_tokens"] > 0 and last["step"] == res["steps"]
    assert last["alpha"] >= first["alpha"]  # on its own training data, training must not lose agreement
    # the trained head's draft-step cost against a cached single-token target forward
    cost = fh.head_cost(res["head"], target, context=16, reps=3)
    assert cost["target_step_ms"] > 0 and cost["head_step_ms"] > 0
    assert cost["c"] == pytest.approx(cost["head_step_ms"] / cost["target_step_ms"])


def test_unrolled_loss_feeds_each_column_the_previous_columns_own_prediction(target):
    """Step 2 of the unroll must be the drafter's second chained token: column c reads the f-hat
    that step 1 predicted at column c-1 (checked against a per-column recomputation), and column
    0, which has no predicted input, must not enter step 2's loss."""
    seqs = _sequences(target)
    feats = ft.target_features(target, seqs, 64, progress=False)
    fin, tok, pos, fout, mask = ft.collate(seqs, feats, list(range(len(seqs))), 64)
    torch.manual_seed(0)
    head = ft.FeatureHead(target, torch.arange(64), "mlp")
    torch.nn.init.normal_(head.mlp[-1].weight, std=0.1)  # a head whose prediction differs from its input
    one = ft.HeadConfig(unroll=1, w_cls=0.1)
    step1 = head(fin, tok, pos)
    want1 = ft.head_loss(step1[mask], fout[mask], head, 0.1)
    assert torch.allclose(ft.unrolled_loss(head, fin, tok, pos, fout, mask, one), want1)
    # step 2 column by column: input = step 1's prediction one column to the left
    cols = [head(step1[:, c - 1 : c], tok[:, c : c + 1], pos[:, c : c + 1]) for c in range(1, fin.shape[1])]
    step2 = torch.cat([step1[:, :1], *cols], 1)  # column 0 is a placeholder, masked out below
    m2 = mask.clone()
    m2[:, 0] = False
    want2 = want1 + 0.25 * ft.head_loss(step2[m2], fout[m2], head, 0.1)
    two = ft.HeadConfig(unroll=2, unroll_weight=0.25, w_cls=0.1)
    assert torch.allclose(ft.unrolled_loss(head, fin, tok, pos, fout, mask, two), want2, atol=1e-6)
    assert not torch.allclose(want2, want1)
    # the chained term backpropagates through the fed-back feature into the first step's use of fc
    head.zero_grad()
    ft.unrolled_loss(head, fin, tok, pos, fout, mask, ft.HeadConfig(unroll=2, unroll_weight=1.0)).backward()
    g_two = head.fc.weight.grad.clone()
    head.zero_grad()
    ft.unrolled_loss(head, fin, tok, pos, fout, mask, one).backward()
    assert not torch.allclose(g_two, head.fc.weight.grad)


def test_chain_counts_pair_token_one_with_the_next_tokens_step_two():
    r1 = torch.tensor([True, False, True, True, False])
    r2 = torch.tensor([True, True, False, True, True])  # r2[0] belongs to no scored chain
    # chains starting at tokens 0, 2, 3 have token 1 right; their token 2 is r2[1], r2[3], r2[4]
    assert ft.chain_counts(r1, r2) == (3, 3)
    assert ft.chain_counts(r1, torch.tensor([True, False, True, False, False])) == (3, 0)
    assert ft.chain_counts(torch.tensor([True]), torch.tensor([True])) == (0, 0)  # one token: no chain of 2


def test_evaluate_reports_the_conditional_second_token_rate(target):
    seqs = _sequences(target)
    feats = ft.target_features(target, seqs, 64, progress=False)
    torch.manual_seed(0)
    head = ft.FeatureHead(target, torch.arange(64), "mlp")
    res = ft.evaluate(head, seqs, feats, 64)
    assert set(res) >= {"alpha", "alpha_step2", "alpha_step2_given1", "tokens", "per_category"}
    assert 0.0 <= res["alpha_step2_given1"] <= 1.0


@pytest.mark.parametrize("kw, match", [({"unroll": 0}, "unroll >= 1"), ({"unroll_weight": -1.0}, "unroll_weight >= 0"),
                                       ({"kind": "eagle", "unroll": 2}, "position-wise mlp head only")])
def test_bad_unroll_settings_are_refused_with_a_fix(kw, match):
    from specrl.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        ft.HeadConfig(**kw)


def test_unknown_head_is_refused_with_the_allowed_names(target):
    from specrl.errors import ConfigError

    with pytest.raises(ConfigError, match="eagle, mlp"):
        ft.FeatureHead(target, torch.arange(8), "medusa")


def test_cli_refuses_unknown_heads_and_missing_data_before_loading_a_model(tmp_path):
    from specrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--heads 'mlp,medusa' names unknown heads \['medusa'\]. Allowed: eagle, mlp"):
        fh.main(["--data-dir", str(tmp_path), "--heads", "mlp,medusa", "--model", "no-such-model"])
    with pytest.raises(ConfigError, match="lacks held-out or training shards. Fix: run `specrl draft data"):
        fh.main(["--data-dir", str(tmp_path), "--heads", "mlp", "--model", "no-such-model"])
