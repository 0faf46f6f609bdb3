"""An exported controller as a specrl policy (``controller:DIR`` in the policy registry)."""

from __future__ import annotations

from typing import Any

import numpy as np

from specrl.policies.base import BasePolicy, PolicyContext
from specrl.runtime.controller import Controller


class ControllerPolicy(BasePolicy):
    def __init__(self, ctx: PolicyContext, path: str) -> None:
        from specrl.replay import action_table

        super().__init__(ctx)
        self.path = path
        self.controller = Controller.load(path)
        self.name = f"controller:{path}"
        # per-request artifacts plan N envs at once in replay: one controller per env, as a runtime
        # runs one per engine (their rules may follow requests from step to step)
        self._per_env: list[Controller] = [self.controller]
        # (k, w) -> the env's action index (what decide_rows returns)
        self._index = {kw: a for a, kw in enumerate(action_table(ctx.k_choices, ctx.w_choices))}

    def reset(self) -> None:
        for c in self._per_env:
            c.reset()

    @property
    def per_row(self) -> bool:
        """A per-request artifact: the replay harness then calls ``decide_rows``."""
        return self.controller.per_row

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        return self.controller.decide(features)

    def decide_rows(self, features: np.ndarray, view: Any) -> np.ndarray:
        """(N, S) action indices (the env's order) from the controller's (k, w) per running row:
        what the replay harness asks of per-request policies, through the exported artifact."""
        from specrl.rows import RowView

        table = self._index
        out = np.full(view.valid.shape, table[(0, 1)], np.int64)
        while len(self._per_env) < view.valid.shape[0]:
            self._per_env.append(Controller.load(self.path))
        for i in range(view.valid.shape[0]):
            slots = np.flatnonzero(view.valid[i])
            one = RowView(*(getattr(view, f)[i : i + 1, slots] for f in view.__dataclass_fields__))
            for s, (k, w) in zip(slots, self._per_env[i].decide_rows(np.asarray(features)[i], one)):
                out[i, s] = table[(k, 1 if k == 0 else w)]
        return out

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        self.controller.observe(features, info)
