"""An exported controller as a specrl policy (``controller:DIR`` in the policy registry)."""

from __future__ import annotations

from typing import Any

import numpy as np

from specrl.policies.base import BasePolicy, PolicyContext
from specrl.runtime.controller import Controller


class ControllerPolicy(BasePolicy):
    def __init__(self, ctx: PolicyContext, path: str) -> None:
        super().__init__(ctx)
        self.controller = Controller.load(path)
        self.name = f"controller:{path}"

    def reset(self) -> None:
        self.controller.reset()

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        return self.controller.decide(features)

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        self.controller.observe(features, info)
