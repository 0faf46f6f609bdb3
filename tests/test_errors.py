"""Bad input gets a clear error naming the value, what is allowed and the fix."""

from __future__ import annotations

import pytest
from tiny import save_tiny, tiny_pair

from specrl.engine import Action, SpecEngine
from specrl.errors import ConfigError, ModelLoadError, RequestError, TokenizerMismatchError
from specrl.models import ModelPair

WORDS = "the cat sat on a mat and dog ran far away".split()


def test_unknown_model_id_and_path():
    with pytest.raises(ModelLoadError, match="local cache"):
        ModelPair.load("no-such-org/no-such-model", device="cpu")
    with pytest.raises(ModelLoadError, match="not a directory"):
        ModelPair.load("./definitely/not/here", device="cpu")
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelPair.load("missing.gguf", device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelPair.load(str(tmp_path), device="cpu")


def test_tokenizer_mismatch(tmp_path):
    a = save_tiny(tmp_path / "a", WORDS)
    b = save_tiny(tmp_path / "b", list(reversed(WORDS)), seed=1)  # same size, other ids
    with pytest.raises(TokenizerMismatchError, match="different tokenizers.*Fix"):
        ModelPair.load(str(a), draft=str(b), device="cpu")
    pair = ModelPair.load(str(a), draft=str(a), device="cpu")  # same tokenizer: fine
    assert pair.draft is not None and pair.tokenizer is not None


def test_vocab_size_mismatch_from_models():
    t = tiny_pair(vocab=16).target
    d = tiny_pair(vocab=32).target
    with pytest.raises(TokenizerMismatchError, match="16-token vocabulary.*32"):
        ModelPair.from_models(t, d)


@pytest.mark.parametrize("k,w,match", [(17, 1, "k=17"), (-1, 1, "k=-1"), (2, 0, "w=0"), (2, 9, "w=9")])
def test_action_out_of_range(k, w, match):
    with pytest.raises(ConfigError, match=match):
        Action(k, w)


def test_request_errors():
    pair = tiny_pair(vocab=16, max_pos=64)
    eng = SpecEngine(pair)
    with pytest.raises(RequestError, match="Empty prompt"):
        eng.add_request([], 4)
    for bad in (0, -3):
        with pytest.raises(RequestError, match=f"max_new_tokens={bad}.*positive"):
            eng.add_request([1, 2], bad)
    with pytest.raises(RequestError, match="context window of 64.*Fix: shorten the prompt to at most"):
        eng.add_request(list(range(16)) * 4, 8)
    with pytest.raises(RequestError, match=r"\[0, 16\)"):
        eng.add_request([3, 99], 4)
    with pytest.raises(RequestError, match="no running or waiting"):
        eng.step(Action(1, 1))


def test_empty_text_prompt_and_unknown_drafter(tmp_path):
    pair = ModelPair.load(str(save_tiny(tmp_path / "m", WORDS)), device="cpu")
    with pytest.raises(RequestError, match="Empty prompt"):
        pair.encode_prompt("   ")
    with pytest.raises(ConfigError, match="Did you mean 'ngram'"):
        SpecEngine(pair, drafter="ngarm")
    with pytest.raises(ConfigError, match="needs a draft model"):
        SpecEngine(pair, drafter="model")


def test_per_request_action_count_mismatch():
    pair = tiny_pair(vocab=16)
    eng = SpecEngine(pair)
    eng.add_request([1, 2, 3], 4)
    eng.add_request([1, 2], 4)
    eng.admit()
    with pytest.raises(ConfigError, match="3 per-request actions for 2 running"):
        eng.step([Action(1, 1)] * 3)
