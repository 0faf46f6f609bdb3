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


class RowObserver:
    """The ``specrl.rows.RowView`` of a live engine's running requests: what a per-request policy
    (``rowmodel``) reads, computed as the replay tables compute it, so that a table fit on traces
    sees the same numbers live.

    Per request it keeps the copy run: for every context length L since its prompt, whether the
    1-token n-gram lookup on the first L tokens predicted token L (one lookup per committed token,
    done after the step that committed it). Per step and row: the lookup's match statistics, and
    for every action the verify tokens of the tree the n-gram drafter would propose
    (``tree_sizes``: one shared suffix scan per row)."""

    def __init__(self, engine: Any, actions_kw: np.ndarray) -> None:
        from specrl.drafters.ngram import MAX_NGRAM, MIN_NGRAM
        from specrl.tree import tree_shape

        self.engine = engine
        self.actions_kw = np.asarray(actions_kw)
        self.shapes = [tree_shape(int(k), int(w)) if k > 0 else None for k, w in self.actions_kw]
        self.max_ngram = getattr(engine.drafter, "max_ngram", MAX_NGRAM)
        self.min_ngram = getattr(engine.drafter, "min_ngram", MIN_NGRAM)
        self.ngram = getattr(engine.drafter, "name", "ngram") == "ngram"
        # rid -> (context lengths checked up to, copy run, the 1-token prediction at that length or -1)
        self._runs: dict[int, tuple[int, int, int]] = {}

    def view(self) -> Any:
        from specrl.drafters.ngram import lookup, tree_sizes
        from specrl.rows import RowView

        rows = self.engine.rows
        n, n_act = len(rows), len(self.shapes)
        row_tokens = np.ones((1, n, n_act), np.int64)
        match = np.zeros((1, n))
        count = np.zeros((1, n))
        run = np.zeros((1, n), np.int64)
        runs: dict[int, tuple[int, int, int]] = {}
        for b, r in enumerate(rows):
            seq = r.seq
            upto, c, pred = self._runs.get(r.rid, (len(r.prompt), 0, -2))
            for length in range(upto, r.length):  # token `length` is known now: was it predicted?
                if pred == -2 or length > upto:  # not known from the last step's scan: look it up
                    found = lookup(seq[:length], 1, self.max_ngram, self.min_ngram, max_continuations=1)
                    pred = int(found.continuations[0][0]) if found.continuations else -1
                c = c + 1 if pred == seq[length] else 0
            run[0, b] = c
            pred = -2
            if self.ngram:
                row_tokens[0, b], match[0, b], count[0, b], pred = tree_sizes(seq, self.shapes, self.max_ngram,
                                                                               self.min_ngram)
            else:  # a draft model fills the whole tree
                row_tokens[0, b] = [1 if s is None else s.num_nodes + 1 for s in self.shapes]
            runs[r.rid] = (r.length, c, pred)
        self._runs = runs  # finished requests drop out
        left = np.array([[r.max_new_tokens - (r.length - len(r.prompt)) for r in rows]], np.int64)
        ctx = np.array([[r.length for r in rows]], np.int64)
        rid = np.array([[r.rid for r in rows]], np.int64)
        return RowView(np.ones((1, n), bool), match, count, run, left, ctx, row_tokens, rid)


class EngineController:
    """Drives a SpecEngine: ``engine.generate(prompts, n, action=EngineController(engine, policy))``.

    A per-request controller (an exported ``rowmodel``) gets every running request's observations
    (``RowObserver``) and returns one action per request; the engine verifies them ragged."""

    def __init__(self, engine: Any, policy: Any) -> None:
        self.engine = engine
        self.policy = policy
        self.tracker = FeatureTracker()
        self.decisions: list[tuple[int, int]] = []
        ctl = getattr(policy, "controller", policy)  # a Controller, or a ControllerPolicy wrapping one
        self.rows_controller = ctl if getattr(ctl, "per_row", False) else None
        if self.rows_controller is not None and not hasattr(ctl, "rule"):
            from specrl.errors import ConfigError

            raise ConfigError(f"{type(policy).__name__} plans per request but is not an exported controller. Fix: "
                              "export it (`specrl export RUN_DIR` or --rule rowmodel:DIR -o DIR) and pass "
                              "specrl.runtime.Controller.load(DIR).")
        self.observer = None
        if self.rows_controller is not None:
            self.observer = RowObserver(engine, self.rows_controller.rule.actions_kw)

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
        if self.rows_controller is not None:
            per_row = self.rows_controller.decide_rows(self.tracker.vector(), self.observer.view())
            self.decisions.append(max(per_row, default=(0, 1)))  # the deepest row's action, as replay logs it
            return [Action(int(k), 1 if k == 0 else int(w)) for k, w in per_row]
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
