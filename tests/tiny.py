"""Tiny random Llama model pairs built locally (no hub access), shared by the tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specrl.models import ModelPair


def tiny_llama(vocab: int = 64, layers: int = 2, hidden: int = 32, seed: int = 0, init: float = 0.5,
               dtype: torch.dtype = torch.float64, max_pos: int = 512) -> LlamaForCausalLM:
    """A random Llama with peaky logits (large init) so that argmax ties never happen."""
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
        initializer_range=init, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


def perturbed_copy(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """A draft that agrees with ``model`` often but not always."""
    draft = LlamaForCausalLM(model.config).to(model.dtype).eval()
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise * p.std())
    return draft


def tiny_pair(vocab: int = 64, noise: float = 0.3, seed: int = 0, **kw) -> ModelPair:
    target = tiny_llama(vocab=vocab, seed=seed, **kw)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    return ModelPair.from_models(target, draft, target_name="tiny-target", draft_name="tiny-draft")


def tiny_tokenizer(words: list[str]):
    """A whitespace word-level tokenizer over ``words`` (plus [UNK] and </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")


def save_tiny(path, words: list[str], seed: int = 0, max_pos: int = 512):
    """Write a tiny model + tokenizer directory (what save_pretrained produces)."""
    tok = tiny_tokenizer(words)
    model = tiny_llama(vocab=len(tok), seed=seed, max_pos=max_pos, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_tiny_pair(root, words: list[str], noise: float = 0.05, seed: int = 0, max_pos: int = 4096):
    """Target and perturbed-copy draft directories sharing one tokenizer."""
    from pathlib import Path

    root = Path(root)
    tok = tiny_tokenizer(words)
    target = tiny_llama(vocab=len(tok), seed=seed, max_pos=max_pos, dtype=torch.float32)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")
