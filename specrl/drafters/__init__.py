"""Drafter registry: one name -> one class; ``make_drafter`` builds one for a model pair."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from specrl.errors import ConfigError, unknown_name

if TYPE_CHECKING:
    from specrl.drafters.base import Drafter
    from specrl.models import ModelPair


def _ngram(pair: ModelPair, **kw: Any) -> Drafter:
    from specrl.drafters.ngram import NGramDrafter

    return NGramDrafter(pair.device, **kw)


def _model(pair: ModelPair, **kw: Any) -> Drafter:
    from specrl.drafters.model import ModelDrafter

    if pair.draft is None:
        raise ConfigError(
            "drafter='model' needs a draft model, but the model pair has none. "
            "Fix: load the pair with a draft (ModelPair.load(target, draft=...), CLI --draft PATH), "
            "or use drafter='ngram'."
        )
    return ModelDrafter(pair.draft, **kw)


def _feature(pair: ModelPair, head: str | None = None) -> Drafter:
    from pathlib import Path

    from specrl.drafters.feature import FeatureDrafter
    from specrl.drafttrain.feature import load_head
    from specrl.drafttrain.shipped import shipped_head_dir

    return FeatureDrafter(load_head(Path(head) if head else shipped_head_dir(pair.target_name), pair.target))


DRAFTERS: dict[str, Callable[..., Drafter]] = {"ngram": _ngram, "model": _model, "feature": _feature}


def make_drafter(name: str, pair: ModelPair, **kwargs: Any) -> Drafter:
    """Build the drafter registered under ``name`` for ``pair``."""
    if name not in DRAFTERS:
        raise unknown_name("drafter", name, DRAFTERS)
    return DRAFTERS[name](pair, **kwargs)
