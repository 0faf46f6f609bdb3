"""Plug a controller into inference runtimes.

1. The specrl engine: ``EngineController`` is the ``action`` callable of ``SpecEngine.generate``
   (CLI: ``specrl generate --policy controller:DIR``): it feeds a FeatureTracker from every
   StepResult and the engine's load, and asks the controller for the next (k, w).
2. transformers assisted generation: ``controlled_generate(model, input_ids, assistant_model=...,
   controller=...)`` runs ``model.generate`` with a draft model while the controller sets the
   number of draft tokens before every round (0 = plain decoding), in place of transformers'
   own heuristics. Output is unchanged: greedy stays identical to ``generate`` alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specrl.features import FeatureTracker


class EngineController:
    """Drives a SpecEngine: ``engine.generate(prompts, n, action=EngineController(engine, policy))``."""

    def __init__(self, engine: Any, policy: Any) -> None:
        self.engine = engine
        self.policy = policy
        self.tracker = FeatureTracker()
        self.decisions: list[tuple[int, int]] = []

    def __call__(self, last: Any) -> Any:
        from specrl.step import Action

        if last is not None:
            self.tracker.observe(last)
            k = max((a.k for a in last.actions), default=0)
            info = {"k": k, "accept_len_mean": float(np.mean(last.accept_len)) if len(last.rids) else 0.0,
                    "tokens": int(np.sum(last.num_committed)), "dt": last.step_time}
            self.policy.observe(self.tracker.vector(), info)
        self.engine.admit()  # decide for the batch that will actually run
        rows = self.engine.rows
        self.tracker.update_load(len(rows), len(self.engine.waiting), [r.length for r in rows])
        self.tracker.update_probe(self.engine.probe())
        k, w = self.policy.decide(self.tracker.vector())
        self.decisions.append((k, w))
        return Action(int(k), int(w))


def controlled_generate(model: Any, input_ids: Any, assistant_model: Any, controller: Any, **kwargs: Any) -> Any:
    """``model.generate(input_ids, assistant_model=..., **kwargs)`` with ``controller`` (anything with
    ``decide(features) -> (k, w)``; w is ignored: transformers drafts chains) choosing the number of
    draft tokens before every round. Batch size 1, as transformers' assisted generation."""
    tracker = FeatureTracker()
    decisions: list[int] = []
    original = model._get_candidate_generator

    def patched(*args: Any, **kw: Any) -> Any:
        gen = original(*args, **kw)
        update = gen.update_candidate_strategy

        def decide(context_len: int) -> None:
            tracker.update_load(1, 0, [context_len])
            k, _ = controller.decide(tracker.vector())
            gen.num_assistant_tokens = int(k)
            decisions.append(int(k))

        def update_strategy(ids: Any, scores: Any, num_matches: int) -> None:
            update(ids, scores, num_matches)  # keeps transformers' own bookkeeping consistent
            k = decisions[-1]
            tracker.update_step(np.array([num_matches]), np.array([k]), k, 1)
            decide(int(ids.shape[1]))

        gen.update_candidate_strategy = update_strategy
        ids = kw.get("input_ids", args[1] if len(args) > 1 else None)
        decide(int(ids.shape[1]) if ids is not None else 1)
        return gen

    model._get_candidate_generator = patched
    try:
        gc_kw = dict(num_assistant_tokens_schedule="constant", assistant_confidence_threshold=None)
        out = model.generate(input_ids, assistant_model=assistant_model, **{**gc_kw, **kwargs})
    finally:
        del model._get_candidate_generator  # restore the class method
    controlled_generate.last_decisions = decisions  # type: ignore[attr-defined]
    return out
