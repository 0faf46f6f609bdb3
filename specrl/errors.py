"""The small error hierarchy of specrl.

Every error names the offending value, what is allowed and how to fix it, so that a
researcher reading a traceback at 2 a.m. knows what to change without opening the code.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class SpecRLError(Exception):
    """Base class of every error raised on purpose by specrl."""


class ConfigError(SpecRLError, ValueError):
    """A configuration value (preset key, option, action table, ...) is invalid."""


class ModelLoadError(SpecRLError):
    """A model or tokenizer could not be found or loaded."""


class TokenizerMismatchError(SpecRLError):
    """Target and draft use different tokenizers, so draft tokens mean nothing to the target."""


class RequestError(SpecRLError, ValueError):
    """A generation request is invalid (empty prompt, too long, bad max_new_tokens, ...)."""


class TraceError(SpecRLError):
    """A trace or cost-model file is corrupt, truncated or recorded for other models."""


class ArtifactError(SpecRLError):
    """A controller artifact is malformed, unsafe or made for another feature schema."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ' Did you mean X?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def unknown_name(kind: str, name: str, choices: Iterable[str], fix: str = "") -> ConfigError:
    """Build the error for an unknown registry name or config key, with a suggestion."""
    choices = sorted(str(c) for c in choices)
    msg = f"Unknown {kind} {name!r}.{did_you_mean(name, choices)} Allowed: {', '.join(choices)}."
    if fix:
        msg += f" {fix}"
    return ConfigError(msg)
