"""Per-request actions: what a policy sees of each running request, and the planner that turns
per-row value estimates into one (k, w) per row.

Why per row: a batch-level (k, w) makes every request draft alike, although acceptance differs
a lot between the requests of one batch (one is copying a passage the n-gram drafter has seen,
another writes new text). With the engine's ragged verify (``SpecEngine(ragged=True)``) a row
that drafts less also costs less, so rows can be given different trees: long ones where a draft
is likely accepted, none where it is not. The step still pays one pass for all rows, so the
choice is coupled: the planner maximises the step's goodput

    sum_b value_b(a_b) / step_seconds(a_1 .. a_B)

over per-row actions, where ``value_b(a)`` is row b's expected committed tokens under action a
(a predictor's estimate; the clairvoyant oracle uses the actual ones). Dinkelbach iterations
solve it: with lambda = goodput of the current choice and the cost model linearised around it
(seconds per extra verify token of one row), each row independently picks
argmax_a value_b(a) - lambda * seconds_per_token * tokens_b(a); the best exactly-timed candidate
wins, and every batch-level action is a candidate too, so the per-row plan never scores below
the best single action for the same values.

``RowView`` fields are observable before the step: n-gram match statistics (the drafter's
lookup), the copy run (history), tokens left under ``max_new_tokens``, context length, the
verify tokens each action's tree would hold for the row (the n-gram drafter knows what it would
propose; a draft model fills the whole tree), and the request's id, so that a policy can follow
a request from step to step (its context grows by the tokens each step committed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrl.costs import MAX_LEVELS
from specrl.errors import ConfigError
from specrl.policies.base import BasePolicy, PolicyContext
from specrl.replay import action_table


@dataclass
class RowView:
    """Per-slot observations of N envs x S slots (index ``[i]`` for one env's (S, ...) slice)."""

    valid: np.ndarray  # (N, S) bool: slot holds a running request
    match_len: np.ndarray  # (N, S) float: n-gram match length of the row's lookup (0 = none)
    num_matches: np.ndarray  # (N, S) float: earlier occurrences of that n-gram
    copy_run: np.ndarray  # (N, S) int: latest tokens in a row the 1-token lookup predicted
    tokens_left: np.ndarray  # (N, S) int: max_new_tokens - generated
    context: np.ndarray  # (N, S) int: sequence length
    row_tokens: np.ndarray  # (N, S, A) int: verify tokens of the row's tree under each action (root included)
    rid: np.ndarray  # (N, S) int: the request in the slot (unique within an env's run; -1 = free)

    def env(self, i: int) -> RowView:
        """Env i's slots as a one-env view (arrays keep a leading axis of 1)."""
        return RowView(*(getattr(self, f)[i : i + 1] for f in self.__dataclass_fields__))


def copy_runs(offsets: np.ndarray, hit: np.ndarray) -> np.ndarray:
    """(R,) per trace row: how many tokens right before it were predicted in a row (``hit``: the
    1-token lookup's first draft token was accepted at that row), counted within its prompt."""
    n = len(hit)
    idx = np.arange(n)
    lens = np.diff(offsets)
    start = np.repeat(offsets[:-1], lens)  # (R,) first row of the row's prompt
    last_miss = np.maximum.accumulate(np.where(hit, -1, idx))  # last miss at or before each row
    before = np.concatenate([[-1], last_miss[:-1]])  # ... strictly before
    return idx - 1 - np.maximum(before, start - 1)


def trace_copy_runs(tables: object) -> np.ndarray | None:
    """(R,) copy run of every trace row of ``tables`` (ReplayTables), or None without a chain
    action: a chain's first draft token is the 1-token lookup's own prediction, whatever k, so the
    shortest chain's accept > 0 says whether that token was predicted."""
    chains = [a for a, (k, w) in enumerate(tables.actions) if k > 0 and w == 1]
    if not chains:
        return None
    first = min(chains, key=lambda a: tables.actions[a][0])
    return copy_runs(tables.offsets, tables.accept[:, first] > 0)


def action_levels(actions_kw: np.ndarray) -> np.ndarray:
    """(A, MAX_LEVELS) nodes per depth of every action's full tree."""
    from specrl.tree import tree_shape

    out = np.zeros((len(actions_kw), MAX_LEVELS))
    for a, (k, w) in enumerate(actions_kw):
        sizes = tree_shape(int(k), int(w)).level_sizes if k > 0 else ()
        out[a, : len(sizes)] = sizes
    return out


def plan_rows(value: np.ndarray, view: RowView, cost: object, drafter: str, actions_kw: np.ndarray,
              verify: str = "ragged", iters: int = 4, levels_a: np.ndarray | None = None) -> np.ndarray:
    """(N, S) per-row action indices maximising sum(value) / step seconds (module docstring).

    ``value`` (N, S, A): expected committed tokens per row and action (0 in free slots).
    ``cost``: the CostModel that charges the step (decode work only: prefill is the same for
    every choice). ``verify``: ragged charges each row its own tree at the batch's mean tokens per
    row; padded the union (where per-row choices rarely pay). ``iters=-1``: batch-level only.
    ``levels_a``: ``action_levels(actions_kw)``, precomputed by callers that plan every step.
    ``iters``: per-row plans tried after the best batch-level action (each one exactly timed)."""
    valid = view.valid
    n_env, n_slot, n_act = value.shape
    batch = np.maximum(valid.sum(1), 1)  # (N,)
    ctx = np.where(valid, view.context, 0).sum(1) / batch  # (N,)
    row_tok = view.row_tokens.astype(np.float64)  # (N, S, A)
    levels_a = action_levels(actions_kw) if levels_a is None else levels_a  # (A, L)
    drafts = actions_kw[:, 0] > 0  # (A,)
    a0 = int(np.flatnonzero(actions_kw[:, 0] == 0)[0])
    any_row = valid.any(1)  # (N,)

    def seconds(choice: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(step seconds, mean verify tokens per row) of per-row choices (N, S)."""
        lv = np.where(valid[..., None], levels_a[choice], 0).max(1)  # (N, L) a draft model drafts the union
        tok = np.where(valid, np.take_along_axis(row_tok, choice[..., None], 2)[..., 0], 0.0)
        mean = tok.sum(1) / batch if verify == "ragged" else 1 + lv.sum(1)
        drafted = (valid & drafts[choice]).any(1)
        zeros = np.zeros(n_env)
        return cost.step_time_batch(drafter, drafted, batch, np.maximum(mean, 1.0), lv, ctx, zeros, zeros), mean

    # every batch-level action is a candidate, all timed in one call: (N, A)
    lv_b = np.where(any_row[:, None, None], levels_a[None], 0.0)  # (N, A, L)
    mean_b = (np.where(valid[..., None], row_tok, 0.0).sum(1) / batch[:, None] if verify == "ragged"
              else 1 + lv_b.sum(2))
    zeros = np.zeros(n_env * n_act)
    secs_b = cost.step_time_batch(drafter, (any_row[:, None] & drafts[None]).ravel(), np.repeat(batch, n_act),
                                  np.maximum(mean_b, 1.0).ravel(), lv_b.reshape(n_env * n_act, -1),
                                  np.repeat(ctx, n_act), zeros, zeros).reshape(n_env, n_act)
    g_b = np.where(valid[..., None], value, 0.0).sum(1) / np.maximum(secs_b, 1e-12)  # (N, A)
    best = np.repeat(g_b.argmax(1)[:, None], n_slot, axis=1)  # (N, S)
    best_g = g_b.max(1)
    choice, lam = best.copy(), best_g.copy()
    mean = np.take_along_axis(mean_b, choice[:, :1], 1)[:, 0]  # (N,) of the batch-level start
    vt = cost.verify_times(batch, ctx) if iters > 0 else None  # (N, 66) verify seconds per tokens per row
    env = np.arange(n_env)
    for _ in range(max(iters, 0)):  # each iteration plans per row and times that plan exactly
        lo = np.clip(np.floor(mean), 1, 64).astype(np.int64)
        per_tok = np.maximum(vt[env, lo + 1] - vt[env, lo], 0.0) / batch
        choice = np.argmax(value - (lam * per_tok)[:, None, None] * row_tok, axis=2)
        choice = np.where(valid, choice, a0)
        dt, mean = seconds(choice)
        tot = np.where(valid, np.take_along_axis(value, choice[..., None], 2)[..., 0], 0.0).sum(1)
        lam = tot / np.maximum(dt, 1e-12)
        better = lam > best_g
        best_g = np.where(better, lam, best_g)
        best[better] = choice[better]
    return np.where(valid, best, a0)


class PerRowPolicy(BasePolicy):
    """Base of the per-request policies: ``decide_rows(features (N, F), view) -> (N, S)`` action
    indices (into ``action_table(k_choices, w_choices)``, the env's order) for N envs at once.
    They keep no state between steps, so the harness plans every env's rows in one call."""

    per_row = True  # the evaluation harness calls decide_rows with the env's RowView

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.actions_kw = np.asarray(action_table(ctx.k_choices, ctx.w_choices))  # the env's action order
        self.levels_a = action_levels(self.actions_kw)  # (A, MAX_LEVELS)
        if ctx.cost_model is None:
            raise ConfigError(f"{self.name} plans with the cost model, but the policy context has none. "
                              "Fix: build it with specrl.envs.config.policy_context(env_cfg).")
        if 0 not in ctx.k_choices:
            raise ConfigError(f"{self.name} gives a row k = 0 when drafting does not pay, but k_choices="
                              f"{ctx.k_choices} has no 0. Fix: add 0 to k_choices.")

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        raise ConfigError(f"{self.name!r} chooses one (k, w) per request and needs each request's observations. "
                          "Fix: call decide_rows(features, view) with a RowView: the replay vector env's row_view() "
                          "or the live env's (env.unwrapped.row_view(), then step_rows); `specrl evaluate` does this.")

    def plan(self, value: np.ndarray, view: RowView) -> np.ndarray:
        return plan_rows(value, view, self.ctx.cost_model, self.ctx.drafter, self.actions_kw, self.ctx.verify,
                         levels_a=self.levels_a)


class RowOracle(PerRowPolicy):
    """Clairvoyant per-request plan (replay only): the same planner on the actual outcomes.

    The batch-level ``oracle`` is no upper bound for per-request policies; this is the reference
    they are measured against (myopic, like ``oracle``; its seconds leave the prefill out)."""

    name = "oracle-rows"
    clairvoyant = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._value: np.ndarray | None = None

    def set_row_outcomes(self, value: np.ndarray) -> None:
        """(N, S, A) tokens each row would commit under each action (the harness calls this)."""
        self._value = value

    def decide_rows(self, features: np.ndarray, view: RowView) -> np.ndarray:
        if self._value is None:
            raise ConfigError("oracle-rows needs the replay env's per-row outcomes at every step. Fix: evaluate it "
                              "with `specrl evaluate` on a replay env.")
        value, self._value = self._value, None
        return self.plan(value, view)
