"""specrl: reinforcement learning for speculative-decoding policies.

Importing specrl is cheap: no torch, transformers or gymnasium. The Gymnasium env ids
(``specrl/SpecDecode-v0``, ``specrl/SpecReplay-v0``) are registered as soon as gymnasium is
imported, before or after specrl, through a one-shot import hook, so that ``import
specrl.runtime`` in a serving process never pulls gymnasium in.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"


def _register() -> None:
    from specrl.envs.registration import register_envs

    register_envs()


class _RegisterWhenGymnasiumLoads(importlib.abc.MetaPathFinder):
    """Runs ``_register`` right after the first ``import gymnasium`` completes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "gymnasium":
            return None
        sys.meta_path.remove(self)  # one shot; also prevents recursion below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


if "gymnasium" in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterWhenGymnasiumLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenGymnasiumLoads())


def make_env(config: Any = None, **overrides: Any) -> Any:
    """Build the env a preset describes: ``specrl.make_env("envs/closed-loop.yaml", horizon_s=10)``.

    ``config`` is a YAML path, a mapping or an ``EnvConfig``; ``backend`` picks the env id.
    Returns ``gym.make(...)`` (with Gymnasium's standard wrappers).
    """
    import gymnasium as gym

    from specrl.envs.config import load_env_config

    pair = overrides.pop("pair", None)
    cfg = load_env_config(config, **overrides)
    env_id = "specrl/SpecDecode-v0" if cfg.backend == "live" else "specrl/SpecReplay-v0"
    kwargs: dict[str, Any] = {"config": cfg}
    if pair is not None:
        kwargs["pair"] = pair
    return gym.make(env_id, max_episode_steps=cfg.max_episode_steps, **kwargs)
