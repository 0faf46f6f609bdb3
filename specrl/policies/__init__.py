"""Policy registry: every baseline, the oracle and exported controllers by name.

Names (usable from the CLI): ``ar``, ``static:K[,W]``, ``hf-heuristic``, ``hf-constant``,
``hf-confidence``, ``goodput[:P | :B1=P1,B2=P2,...]`` (probe period, by batch size),
``sglang-ema``, ``ucb``, ``oracle``, ``controller:DIR``, ``accmodel:DIR`` (a learned acceptance
model, ``specrl.accmodel``). Per-request policies (one (k, w) per running request, replay only):
``goodput-rows`` (goodput's estimate per request), ``rowmodel:DIR`` (a learned per-request
acceptance table, ``specrl.rowmodel``) and ``oracle-rows`` (their clairvoyant reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specrl.errors import ConfigError, unknown_name
from specrl.policies.base import ActionTable, BasePolicy, Policy, PolicyContext

BASELINES = ("ar", "static:4,1", "hf-heuristic", "hf-constant", "hf-confidence", "goodput", "sglang-ema", "ucb",
             "goodput-rows")


def _static(ctx: PolicyContext, arg: str) -> Any:
    from specrl.policies.rules import Static
    from specrl.tree import parse_action

    return Static(ctx, *parse_action(arg, prefix="static:"))


def _lazy(module: str, cls: str, **kw: Any) -> Callable[[PolicyContext, str], Any]:
    def make(ctx: PolicyContext, arg: str) -> Any:
        import importlib

        return getattr(importlib.import_module(module), cls)(ctx, **kw)

    return make


def _goodput(ctx: PolicyContext, arg: str) -> Any:
    from specrl.policies.goodput import GoodputArgmax, parse_probe_spec

    if not arg:
        return GoodputArgmax(ctx)
    return GoodputArgmax(ctx, probe_by_batch=parse_probe_spec(arg))


def _accmodel(ctx: PolicyContext, arg: str) -> Any:
    from specrl.accmodel import make_policy as make_accmodel

    return make_accmodel(ctx, arg)


def _rowmodel(ctx: PolicyContext, arg: str) -> Any:
    from specrl.rowmodel import make_policy as make_rowmodel

    return make_rowmodel(ctx, arg)


def _controller(ctx: PolicyContext, arg: str) -> Any:
    from specrl.runtime.policy import ControllerPolicy

    if not arg:
        raise ConfigError("controller: needs a directory, e.g. controller:runs/ppo/export.")
    return ControllerPolicy(ctx, arg)


SPEC_FORMS = ("static:K,W", "goodput:P", "goodput:B=P,...", "controller:DIR", "accmodel:DIR", "rowmodel:DIR")
"""The argument-taking names, as error messages list them beside the registry's."""

REGISTRY: dict[str, Callable[[PolicyContext, str], Any]] = {
    "ar": lambda ctx, arg: _static(ctx, "0"),
    "static": _static,
    "hf-heuristic": _lazy("specrl.policies.rules", "HFHeuristic"),
    "hf-constant": lambda ctx, arg: _static(ctx, str(min(20, max(ctx.k_choices)))),
    "hf-confidence": _lazy("specrl.policies.rules", "HFConfidence"),
    "goodput": _goodput,
    "sglang-ema": _lazy("specrl.policies.rules", "SGLangEMA"),
    "ucb": _lazy("specrl.policies.rules", "UCB"),
    "oracle": _lazy("specrl.policies.oracle", "Oracle"),
    "controller": _controller,
    "accmodel": _accmodel,
    "rowmodel": _rowmodel,
    "oracle-rows": _lazy("specrl.rows", "RowOracle"),
    "goodput-rows": _lazy("specrl.policies.goodput", "GoodputRows"),
}


def make_policy(spec: str, ctx: PolicyContext | None = None) -> Any:
    """Build a policy from its name (``static:4,2``, ``goodput``, ``controller:DIR``, ...)."""
    ctx = ctx or PolicyContext()
    name, _, arg = spec.partition(":")
    if name not in REGISTRY:
        raise unknown_name("policy", spec, [*REGISTRY, *SPEC_FORMS])
    pol = REGISTRY[name](ctx, arg)
    if name == "hf-constant" or (name == "goodput" and arg):
        pol.name = spec  # tables tell variants apart
    return pol


__all__ = ["ActionTable", "BASELINES", "SPEC_FORMS", "BasePolicy", "Policy", "PolicyContext", "REGISTRY", "make_policy"]
