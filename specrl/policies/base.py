"""The policy interface shared by baselines, the oracle and exported controllers.

A policy maps the schema-v2 feature vector (``specrl.features``) to an action ``(k, w)``
once per step, before the draft round; stateful rules also ``observe`` what the step did.
Actions are snapped to the env's tables by ``ActionTable``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class Policy(Protocol):
    name: str

    def reset(self) -> None: ...

    def decide(self, features: np.ndarray) -> tuple[int, int]: ...

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None: ...


@dataclass
class PolicyContext:
    """What a policy may know besides the features: the action tables, the cost model, the drafter."""

    k_choices: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 6, 8])
    w_choices: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    cost_model: Any = None
    drafter: str = "ngram"
    verify: str = "ragged"  # how the env's verify pass charges trees (EnvConfig.verify)


@dataclass
class ActionTable:
    k_choices: list[int]
    w_choices: list[int]

    def index(self, k: int, w: int) -> tuple[int, int]:
        """(k, w) -> env action indices, snapping to the nearest allowed values."""
        ki = int(np.argmin([abs(k - c) for c in self.k_choices]))
        wi = int(np.argmin([abs(w - c) for c in self.w_choices]))
        return ki, wi

    def value(self, ki: int, wi: int) -> tuple[int, int]:
        k = self.k_choices[ki]
        return (k, 1 if k == 0 else self.w_choices[wi])

    def all(self) -> list[tuple[int, int]]:
        """Every distinct (k, w) of the table (k = 0 once)."""
        out = []
        for k in self.k_choices:
            for w in ([1] if k == 0 else self.w_choices):
                out.append((k, w))
        return out


class BasePolicy:
    """Stateless default methods."""

    name = "base"

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.table = ActionTable(ctx.k_choices, ctx.w_choices)

    def reset(self) -> None:
        pass

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        pass

    def snap(self, k: int, w: int) -> tuple[int, int]:
        return self.table.value(*self.table.index(k, w))
