"""A native vectorised replay env: N episodes of ``specrl/SpecReplay-v0`` in one numpy step.

Same observations, actions, rewards and info keys as the scalar envs (the features come from
the same ``specrl.features`` batch functions, step times from the same ``CostModel`` batch
function, arrivals from the same ``Workload``); a test checks that it reproduces N scalar replay
envs step for step. It is a Stable-Baselines3 ``VecEnv`` (auto-reset, ``terminal_observation``
and ``TimeLimit.truncated`` in the infos), so ``PPO("MlpPolicy", SpecReplayVecEnv(cfg, 64))``
trains at tens of thousands of steps per second on a CPU.

Request state lives in (N, S) slot arrays (S = max_batch_size); only events (requests finishing
or joining, episodes ending) touch Python per item.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.utils import seeding
from stable_baselines3.common.vec_env.base_vec_env import VecEnv

from specrl.costs import MAX_LEVELS
from specrl.envs.config import EnvConfig, load_cost_model, load_env_config
from specrl.envs.replay import load_replay_data
from specrl.errors import ConfigError
from specrl.features import (
    INDEX,
    NUM_FEATURES,
    FeatureTracker,
    arrival_ema,
    initial_features,
    update_draft_batch,
    update_load_batch,
    update_step_batch,
)
from specrl.replay import action_table, popcount64
from specrl.rows import RowView, trace_copy_runs
from specrl.serving import SLO_GRACE_TOKENS
from specrl.workload import Workload

EMA = FeatureTracker().ema  # the scalar envs' feature EMA weight
_STREAM = 64  # closed-loop replacement arrivals drawn ahead per episode (extended on demand)


class SpecReplayVecEnv(VecEnv):
    """N replay episodes stepped together (see module docstring)."""

    render_mode = None  # no rendering (SB3 asks for the attribute)

    def __init__(self, config: str | dict | EnvConfig | None, num_envs: int, **overrides: Any) -> None:
        cfg = load_env_config(config, **overrides)
        if num_envs < 1:
            raise ConfigError(f"num_envs={num_envs} is invalid. Allowed: >= 1.")
        self.cfg = cfg
        obs_space = spaces.Box(0.0, 1e6, shape=(NUM_FEATURES,), dtype=np.float32)
        act_space = spaces.MultiDiscrete([len(cfg.k_choices), len(cfg.w_choices)])
        super().__init__(num_envs, obs_space, act_space)
        _, self.pool, rows, self.tables = load_replay_data(cfg)
        self.pool_rows = np.asarray(rows)
        self.cost = load_cost_model(cfg)
        self.actions_kw = np.asarray(action_table(cfg.k_choices, cfg.w_choices))  # (A, 2)
        tb = self.tables
        a_count = len(self.actions_kw)
        # bitmask of the nodes at each depth of every action's tree: levels = popcount(union & mask)
        self.depth_masks = np.zeros((a_count, MAX_LEVELS), np.uint64)
        for a in range(a_count):
            for j, d in enumerate(tb.bit_depth[a]):
                if d > 0:
                    self.depth_masks[a, d - 1] |= np.uint64(1) << np.uint64(j)
        # per trace row: tokens predicted in a row by the 1-token lookup before it (0 without chains)
        run = trace_copy_runs(tb)
        self.copy_run = np.zeros(len(tb.accept), np.int64) if run is None else run  # (R,)
        self.workloads = [Workload(cfg.workload, self.pool) for _ in range(num_envs)]
        self.rngs = [seeding.np_random(None)[0] for _ in range(num_envs)]
        self._pending_seeds: list[int | None] = [None] * num_envs
        self._levels: list[dict | None] = [None] * num_envs
        n, s = num_envs, cfg.workload.max_batch_size
        self.S = s
        self.t = np.zeros(n)
        self.active = np.zeros((n, s), bool)
        self.new = np.zeros((n, s), bool)
        self.trow = np.zeros((n, s), np.int64)
        self.pos = np.zeros((n, s), np.int64)
        self.limit = np.zeros((n, s), np.int64)
        self.maxnew = np.zeros((n, s), np.int64)  # the request's max_new_tokens (observable, unlike limit)
        self.plen = np.zeros((n, s), np.int64)
        self.arrival = np.zeros((n, s))
        self.first = np.full((n, s), np.nan)
        self.ntok = np.zeros((n, s), np.int64)
        self.violated = np.zeros((n, s), bool)
        self.categories = sorted(set(self.pool.categories))
        cat_of = {c: j for j, c in enumerate(self.categories)}
        self.pool_cat = np.array([cat_of[c] for c in self.pool.categories])
        self.cat = np.zeros((n, s), np.int64)
        self.cat_acc = np.zeros((n, len(self.categories)))  # accepted draft tokens per category
        self.cat_steps = np.zeros((n, len(self.categories)))  # row-steps per category
        self.obs = initial_features(n)
        self.rate = np.zeros(n)
        self.prev = np.full((n, 2), -1)
        self.closed = cfg.workload.arrival == "closed"
        self.sched_t: list[np.ndarray] = [np.zeros(0)] * n
        self.sched_p: list[np.ndarray] = [np.zeros(0, np.int64)] * n
        self.sched_m: list[np.ndarray] = [np.zeros(0, np.int64)] * n
        self.arrived = np.zeros(n, np.int64)
        self.admitted = np.zeros(n, np.int64)
        self.rid = np.full((n, s), -1, np.int64)  # per slot: request serial, never reused within an env
        self.serial = np.zeros(n, np.int64)
        self.tokens_total = np.zeros(n, np.int64)
        self.finished_stats: list[list[tuple[float, float, float, bool]]] = [[] for _ in range(n)]
        self._actions: np.ndarray | None = None
        self._row_actions: np.ndarray | None = None  # (N, S) per-request actions of the next step

    # ----- SB3 VecEnv plumbing ---------------------------------------------------------------
    def seed(self, seed: int | None = None) -> list[int | None]:
        """Seeds for the next reset: env i gets ``seed + i`` (like SB3's DummyVecEnv)."""
        self._pending_seeds = [None if seed is None else seed + i for i in range(self.num_envs)]
        return list(self._pending_seeds)

    def seed_each(self, seeds: list[int]) -> None:
        """Seeds for the next reset, one per env (same seed = same arrivals and prompts)."""
        if len(seeds) != self.num_envs:
            raise ConfigError(f"seed_each got {len(seeds)} seeds for {self.num_envs} envs.")
        self._pending_seeds = [int(x) for x in seeds]

    def set_levels(self, levels: list[dict | None]) -> None:
        """Pin the load level of env i's next episodes (like ``reset(options={"level": ...})``)."""
        self._levels = list(levels)

    def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
        return [getattr(self, attr_name) for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
        setattr(self, attr_name, value)

    def env_method(self, method_name: str, *args: Any, indices: Any = None, **kwargs: Any) -> list[Any]:
        return [getattr(self, method_name)(*args, **kwargs) for _ in self._get_indices(indices)]

    def env_is_wrapped(self, wrapper_class: Any, indices: Any = None) -> list[bool]:
        return [False for _ in self._get_indices(indices)]

    def close(self) -> None:
        pass

    def get_images(self) -> list[Any]:
        return []

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = np.asarray(actions).reshape(self.num_envs, 2)
        self._row_actions = None

    def step_rows(self, row_actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        """One step with per-request actions: ``row_actions`` (N, S) indices into ``actions_kw``,
        one per slot (free slots are ignored). Returns what ``step`` returns. The observation's
        previous-action fields (and ``since_draft``) follow the deepest row's action, so acceptance
        keeps being tracked while some rows draft; the info's k, w report the most common one."""
        row_actions = np.asarray(row_actions, np.int64)
        if row_actions.shape != self.active.shape:
            raise ConfigError(f"row_actions has shape {row_actions.shape}; expected (num_envs, max_batch_size) = "
                              f"{self.active.shape}. Fix: one action index per slot (vec.active marks the rows).")
        if row_actions.min() < 0 or row_actions.max() >= len(self.actions_kw):
            raise ConfigError(f"row_actions must index the {len(self.actions_kw)} actions of actions_kw; got "
                              f"{row_actions.min()}..{row_actions.max()}.")
        n_w = len(self.cfg.w_choices)
        nominal = np.zeros(self.num_envs, np.int64)
        for i in range(self.num_envs):
            used = row_actions[i][self.active[i]]
            if used.size:
                nominal[i] = np.bincount(used, minlength=len(self.actions_kw)).argmax()
        self.step_async(np.stack([nominal // n_w, nominal % n_w], 1))
        self._row_actions = row_actions
        return self.step_wait()

    # ----- episodes ------------------------------------------------------------------------------
    def _reset_env(self, i: int) -> None:
        seed = self._pending_seeds[i]
        if seed is not None:
            self.rngs[i], _ = seeding.np_random(seed)
            self._pending_seeds[i] = None
        episode_seed = int(self.rngs[i].integers(0, 2**31 - 1))
        wl = self.workloads[i]
        first = wl.reset(episode_seed, self.cfg.horizon_s, self._levels[i])
        if self.closed:
            rest = wl.closed_stream(_STREAM)
            times = np.concatenate([np.zeros(len(first)), np.full(len(rest), np.inf)])
        else:
            rest = wl.schedule()
            times = np.array([a.t for a in first] + [a.t for a in rest], float)
        allv = first + rest
        self.sched_t[i] = times
        self.sched_p[i] = np.array([a.prompt for a in allv], np.int64)
        self.sched_m[i] = np.array([a.max_new_tokens for a in allv], np.int64)
        self.arrived[i], self.admitted[i] = len(first), 0
        self.t[i] = 0.0
        self.active[i] = self.new[i] = False
        self.obs[i] = initial_features(1)[0]
        self.rate[i] = 0.0
        self.prev[i] = -1
        self.tokens_total[i] = 0
        self.cat_acc[i] = self.cat_steps[i] = 0.0
        self.finished_stats[i] = []
        self._idle_jump(np.array([i]), ignore_horizon=True)
        self._admit(np.array([i]))
        self._load_features(np.array([i]))

    def reset(self) -> np.ndarray:
        for i in range(self.num_envs):
            self._reset_env(i)
        return self.obs.copy()

    def _next_arrival(self, idx: np.ndarray) -> np.ndarray:
        """(len(idx),) time of each env's next not-yet-arrived request (inf if none)."""
        out = np.full(len(idx), np.inf)
        for j, i in enumerate(idx):
            a = self.arrived[i]
            if a < len(self.sched_t[i]):
                out[j] = self.sched_t[i][a]
        return out

    def _idle_jump(self, idx: np.ndarray, ignore_horizon: bool = False) -> None:
        """Envs with nothing running or waiting jump to their next arrival (as ServingLoop)."""
        if self.closed:
            return
        for i in idx:
            if self.active[i].any() or self.admitted[i] < self.arrived[i]:
                continue
            a = self.arrived[i]
            if a >= len(self.sched_t[i]) or (self.sched_t[i][a] > self.cfg.horizon_s and not ignore_horizon):
                continue
            nxt = self.sched_t[i][a]
            idle = max(0.0, nxt - self.t[i])
            self.t[i] = nxt
            new_arrived = int(np.searchsorted(self.sched_t[i], nxt, side="right"))
            count = new_arrived - a
            self.arrived[i] = new_arrived
            self.rate[i] = arrival_ema(self.rate[i : i + 1], np.array([count], float), np.array([max(idle, 1e-6)]),
                                       EMA)[0]
            self.obs[i, INDEX["arrival_rate"]] = self.rate[i]

    def _admit(self, idx: np.ndarray) -> None:
        tb = self.tables
        free_count = (~self.active[idx]).sum(1)
        queued = self.arrived[idx] - self.admitted[idx]
        for i, nf, nq in zip(idx[(free_count > 0) & (queued > 0)], free_count[(free_count > 0) & (queued > 0)],
                             queued[(free_count > 0) & (queued > 0)]):
            free = np.flatnonzero(~self.active[i])
            n = min(int(nf), int(nq))
            for slot in free[:n]:
                q = self.admitted[i]
                prompt = self.sched_p[i][q]
                tr = self.pool_rows[prompt]
                self.trow[i, slot] = tr
                self.cat[i, slot] = self.pool_cat[prompt]
                self.pos[i, slot] = 0
                self.limit[i, slot] = min(int(tb.cont_len[tr]), int(self.sched_m[i][q]))
                self.maxnew[i, slot] = int(self.sched_m[i][q])
                self.plen[i, slot] = tb.prompt_len[tr]
                self.arrival[i, slot] = self.sched_t[i][q]
                self.first[i, slot] = np.nan
                self.ntok[i, slot] = 0
                self.violated[i, slot] = False
                self.active[i, slot] = self.new[i, slot] = True
                self.admitted[i] = q + 1
                self.rid[i, slot] = self.serial[i]
                self.serial[i] += 1

    def _load_features(self, idx: np.ndarray) -> None:
        """Load features and, for the n-gram drafter, the current contexts' match statistics."""
        act = self.active[idx]
        ctx = np.where(act, self.plen[idx] + self.pos[idx], 0).astype(np.float64)
        n = act.sum(1)
        sub = self.obs[idx]
        update_load_batch(sub, n, self.arrived[idx] - self.admitted[idx],
                          np.where(n > 0, ctx.sum(1) / np.maximum(n, 1), 0.0), ctx.max(1))
        if self.cfg.drafter == "ngram":
            rows = self.tables.offsets[self.trow[idx]] + self.pos[idx]
            update_draft_batch(sub, act, self.tables.stats[np.where(act, rows, 0)])
        self.obs[idx] = sub

    def _outcome(self, a_idx: np.ndarray, prefill: bool = True, row_actions: np.ndarray | None = None,
                 ) -> dict[str, np.ndarray]:
        """What one step with action indices ``a_idx`` (N,) does, without changing state.
        ``prefill=False``: ``dt`` leaves out the newcomers' prefill (the same for every action).
        ``row_actions`` (N, S): one action index per slot instead (per-request actions).

        Verify cost: ``verify: ragged`` charges each row its own tree (1 + the nodes it proposed;
        1 when its n-gram lookup found nothing) at the batch's mean tokens per row (the engine's
        packed pass); ``padded`` charges every row the union tree of the batch."""
        cfg, tb = self.cfg, self.tables
        valid = self.active.copy()  # (N, S)
        a_row = np.broadcast_to(a_idx[:, None], valid.shape) if row_actions is None else row_actions  # (N, S)
        drafted = ((valid & (self.actions_kw[a_row, 0] > 0)).any(1) if row_actions is not None
                   else self.actions_kw[a_idx, 0] > 0)
        rows = self._trace_rows(valid)  # (N, S)
        flat = rows * len(self.actions_kw) + a_row  # (N, S) index into the flattened (R, A) tables
        acc = np.where(valid, tb.accept_flat.take(flat), 0)
        masks = np.where(valid, tb.mask_flat.take(flat), np.uint64(0))
        batch = valid.sum(1)
        if row_actions is None:
            union = np.bitwise_or.reduce(masks, axis=1)  # (N,) node bits of the action's tree
            tree_tokens = 1 + popcount64(union)
            levels = popcount64(union[:, None] & self.depth_masks[a_idx])  # (N, MAX_LEVELS)
        else:  # rows' trees differ: the union of each action's rows (exact within an action), and
            # across actions the largest level (their trees share the rank paths of the smaller one)
            levels = np.zeros((self.num_envs, MAX_LEVELS), np.int64)
            for a in np.unique(a_row[valid]):
                union_a = np.bitwise_or.reduce(np.where(valid & (a_row == a), masks, np.uint64(0)), axis=1)  # (N,)
                levels = np.maximum(levels, popcount64(union_a[:, None] & self.depth_masks[a]))
            tree_tokens = 1 + levels.sum(1)
        if cfg.verify == "ragged":
            row_tokens = np.where(valid, 1 + popcount64(masks), 0)  # (N, S)
            verify_tokens = np.maximum(row_tokens.sum(1) / np.maximum(batch, 1), 1.0)  # mean per row
        else:
            verify_tokens = tree_tokens
        committed = np.where(valid, np.minimum(acc + 1, self.limit - self.pos), 0)
        ctx = np.where(valid, self.plen + self.pos, 0).astype(np.float64)
        ctx_mean = ctx.sum(1) / np.maximum(batch, 1)
        newv = self.new & valid if prefill else np.zeros_like(valid)
        dt = self.cost.step_time_batch(cfg.drafter, drafted, batch, verify_tokens, levels, ctx_mean, newv.sum(1),
                                       np.where(newv, self.plen, 0).max(1))
        return {"valid": valid, "rows": rows, "flat": flat, "acc": np.minimum(acc, committed),
                "committed": committed, "tree_tokens": tree_tokens, "verify_tokens": verify_tokens,
                "batch": batch, "dt": dt, "ctx_mean": ctx_mean}

    def _trace_rows(self, valid: np.ndarray) -> np.ndarray:
        """(N, S) replay-table row of every slot's current position (0 in free slots)."""
        return np.where(valid, self.tables.offsets[self.trow] + self.pos, 0)

    def row_view(self) -> RowView:
        """What a per-request policy may observe of every running row now (``specrl.rows``)."""
        tb, valid = self.tables, self.active.copy()
        rows = self._trace_rows(valid)  # (N, S)
        return RowView(
            valid=valid,
            match_len=np.where(valid, np.nan_to_num(tb.match_len[rows]), 0.0),
            num_matches=np.where(valid, np.nan_to_num(tb.num_matches[rows]), 0.0),
            copy_run=np.where(valid, self.copy_run[rows], 0),
            tokens_left=np.where(valid, self.maxnew - self.pos, 0),
            context=np.where(valid, self.plen + self.pos, 0),
            row_tokens=np.where(valid[..., None], 1 + popcount64(tb.mask[rows]), 1),
            rid=np.where(valid, self.rid, -1),
        )

    def row_outcomes(self) -> np.ndarray:
        """(N, S, A) tokens each row would commit under each action (clairvoyant: replay only)."""
        tb, valid = self.tables, self.active
        rows = self._trace_rows(valid)
        left = (self.limit - self.pos)[..., None]
        return np.where(valid[..., None], np.minimum(tb.accept[rows].astype(np.float64) + 1.0, left), 0.0)

    def action_outcomes(self, prefill: bool = True) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
        """(actions, tokens (N, A), seconds (N, A)): what every action would do now (for the oracle).

        ``prefill=False`` leaves the newcomers' prefill out of the seconds: it is paid whatever
        the action, so it is not part of the choice (see ``specrl.policies.oracle``)."""
        acts = [tuple(map(int, kw)) for kw in self.actions_kw]
        uniq = sorted(set(acts))
        tokens = np.zeros((self.num_envs, len(uniq)))
        secs = np.zeros((self.num_envs, len(uniq)))
        for j, kw in enumerate(uniq):
            a = acts.index(kw)
            out = self._outcome(np.full(self.num_envs, a), prefill)
            tokens[:, j] = out["committed"].sum(1)
            secs[:, j] = out["dt"]
        return uniq, tokens, secs

    # ----- one vector step -------------------------------------------------------------------------
    def step_wait(self):  # noqa: C901 - one pass over the whole batch of envs, kept in one place
        cfg, tb, wl_cfg = self.cfg, self.tables, self.cfg.workload
        acts = self._actions
        a_idx = acts[:, 0] * len(cfg.w_choices) + acts[:, 1]  # (N,)
        k = self.actions_kw[a_idx, 0]
        w = self.actions_kw[a_idx, 1]
        row_actions, self._row_actions = self._row_actions, None
        out = self._outcome(a_idx, row_actions=row_actions)
        k_feat = k  # previous-action features: per-request steps report the deepest row's action
        w_feat = w
        if row_actions is not None:
            deepest = np.argmax(np.where(self.active, self.actions_kw[row_actions, 0], -1), axis=1)  # (N,)
            a_deep = row_actions[np.arange(self.num_envs), deepest]
            k_feat, w_feat = self.actions_kw[a_deep, 0], self.actions_kw[a_deep, 1]
        valid, rows, acc, committed = out["valid"], out["rows"], out["acc"], out["committed"]
        tree_tokens, batch, dt = out["tree_tokens"], out["batch"], out["dt"]
        dep = np.where(valid, tb.depth_flat.take(out["flat"]), 0)
        stats = tb.stats[rows]  # (N, S, 4)
        if cfg.drafter != "ngram":
            row_k = k[:, None] if row_actions is None else self.actions_kw[row_actions, 0]  # (N, S) or (N, 1)
            stats = np.where((row_k == 0)[..., None], np.nan, stats)
        in_system = batch + (self.arrived - self.admitted)
        self.t = self.t + dt
        t = self.t
        tokens = committed.sum(1)
        # SLO accounting, in the order ServingLoop applies it
        first_now = valid & np.isnan(self.first) & (committed > 0)
        self.first = np.where(first_now, t[:, None], self.first)
        ttft_bad = first_now & ((t[:, None] - self.arrival) > wl_cfg.slo_ttft_s) & ~self.violated
        self.violated |= ttft_bad
        self.ntok += committed
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot_now = (t[:, None] - self.first) / (self.ntok - 1)
        tpot_bad = valid & ~self.violated & (self.ntok > SLO_GRACE_TOKENS) & (tpot_now > wl_cfg.slo_tpot_s)
        self.violated |= tpot_bad
        new_viol = ttft_bad.sum(1) + tpot_bad.sum(1)
        slo_tokens = np.where(valid & ~self.violated, committed, 0).sum(1)
        self.pos = self.pos + committed
        self.tokens_total += tokens
        env_i, slot_i = np.nonzero(valid)
        np.add.at(self.cat_acc, (env_i, self.cat[env_i, slot_i]), acc[env_i, slot_i])
        np.add.at(self.cat_steps, (env_i, self.cat[env_i, slot_i]), 1.0)
        fin = valid & (self.pos >= self.limit)
        n_fin = fin.sum(1)
        for i, s in zip(*np.nonzero(fin)):
            tpot = (t[i] - self.first[i, s]) / (self.ntok[i, s] - 1) if self.ntok[i, s] >= 2 else np.nan
            self.finished_stats[i].append((t[i] - self.arrival[i, s], self.first[i, s] - self.arrival[i, s], tpot,
                                           bool(self.violated[i, s])))
        self.active &= ~fin
        self.new[:] = False
        # arrivals during the step
        system_time = in_system * dt
        if self.closed:
            for i in np.flatnonzero(n_fin):
                a = self.arrived[i]
                need = a + n_fin[i]
                if need > len(self.sched_t[i]):
                    self._extend_stream(i)
                self.sched_t[i][a:need] = t[i]
                self.arrived[i] = need
            count = n_fin
        else:
            count = np.zeros(self.num_envs, np.int64)
            for i in range(self.num_envs):
                st = self.sched_t[i]
                a = self.arrived[i]
                b = int(np.searchsorted(st, t[i], side="right"))
                if b > a:
                    count[i] = b - a
                    system_time[i] += float(np.sum(t[i] - st[a:b]))
                    self.arrived[i] = b
        self.rate = arrival_ema(self.rate, count.astype(float), np.maximum(dt, 1e-6), EMA)
        self.obs[:, INDEX["arrival_rate"]] = self.rate
        update_step_batch(self.obs, valid, acc, dep, k_feat, w_feat, stats, EMA)
        all_idx = np.arange(self.num_envs)
        self._idle_jump(all_idx)
        self._admit(all_idx)
        self._load_features(all_idx)
        # rewards
        if cfg.reward == "throughput":
            rew = tokens.astype(np.float64) - self._time_penalty(batch, out["ctx_mean"]) * dt
            if cfg.reward_per_row:
                rew = rew / np.maximum(batch, 1)
        elif cfg.reward == "latency":
            rew = -system_time
        else:
            rew = slo_tokens - cfg.slo_penalty * new_viol
        kw_now = np.stack([k, w], 1)
        if cfg.switch_cost:
            changed = (self.prev[:, 0] >= 0) & (kw_now != self.prev).any(1)
            rew = rew - cfg.switch_cost * changed
        self.prev = kw_now
        rew = (rew * cfg.reward_scale).astype(np.float32)
        # episode ends
        empty = ~self.active.any(1) & (self.arrived <= self.admitted)
        nxt = np.full(self.num_envs, np.inf)
        if empty.any():
            nxt[empty] = self._next_arrival(np.flatnonzero(empty))
        exhausted = empty & np.isinf(nxt) & (not self.closed)
        done = (self.t >= cfg.horizon_s) | exhausted | (empty & (nxt > cfg.horizon_s))
        obs = self.obs.copy()
        infos: list[dict[str, Any]] = []
        acc_mean = acc.sum(1) / np.maximum(batch, 1)
        queue = self.arrived - self.admitted
        cols = zip(tokens.tolist(), dt.tolist(), self.t.tolist(), k.tolist(), w.tolist(), batch.tolist(),
                   queue.tolist(), acc_mean.tolist(), tree_tokens.tolist(), n_fin.tolist(), count.tolist(),
                   out["verify_tokens"].tolist())
        for i, (tk, d, tt, kk, ww, bb, qq, am, tr, nf, cn, vt) in enumerate(cols):
            info = {"tokens": tk, "dt": d, "time": tt, "k": kk, "w": ww, "batch_size": bb, "queue_len": qq,
                    "accept_len_mean": am, "tree_tokens": tr, "verify_tokens_per_row": vt, "finished": nf,
                    "arrivals": cn, "level": self.workloads[i].level}
            if done[i]:
                info["episode_summary"] = self._summary(i)
                info["terminal_observation"] = obs[i].copy()
                info["TimeLimit.truncated"] = bool(not exhausted[i])
                self._reset_env(i)
                obs[i] = self.obs[i]
            infos.append(info)
        return obs, rew, done, infos

    def _time_penalty(self, batch: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """(N,) rho of the throughput reward (see EnvConfig.time_penalty)."""
        tp = self.cfg.time_penalty
        if tp == "none":
            return np.zeros(self.num_envs)
        if tp != "ar":
            return np.full(self.num_envs, float(tp))
        zero = np.zeros(self.num_envs)
        ar = self.cost.step_time_batch(self.cfg.drafter, zero.astype(bool), batch, np.ones(self.num_envs),
                                       np.zeros((self.num_envs, MAX_LEVELS)), ctx, zero, zero)
        return batch / ar

    def _extend_stream(self, i: int) -> None:
        more = self.workloads[i].closed_stream(_STREAM)
        self.sched_t[i] = np.concatenate([self.sched_t[i], np.full(len(more), np.inf)])
        self.sched_p[i] = np.concatenate([self.sched_p[i], [a.prompt for a in more]]).astype(np.int64)
        self.sched_m[i] = np.concatenate([self.sched_m[i], [a.max_new_tokens for a in more]]).astype(np.int64)

    def _summary(self, i: int) -> dict[str, float]:
        """The same keys as ``ServingLoop.summary``."""
        fs = self.finished_stats[i]
        lat = [f[0] for f in fs]
        ttft = [f[1] for f in fs] + [self.first[i, s] - self.arrival[i, s] for s in np.flatnonzero(self.active[i])
                                     if not np.isnan(self.first[i, s])]
        tpot = [f[2] for f in fs if not np.isnan(f[2])]

        def pct(xs: list[float], q: float) -> float:
            return float(np.percentile(xs, q)) if xs else float("nan")

        return {
            "time_s": float(self.t[i]), "tokens": float(self.tokens_total[i]),
            "goodput": float(self.tokens_total[i] / self.t[i]) if self.t[i] > 0 else 0.0,
            "finished": float(len(fs)), "latency_p50": pct(lat, 50), "latency_p99": pct(lat, 99),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "slo_attainment": (sum(not f[3] for f in fs) / len(fs)) if fs else float("nan"),
            "accept_len": float(self.cat_acc[i].sum() / max(1.0, self.cat_steps[i].sum())),
            "accept_by_category": {c: float(self.cat_acc[i, j] / self.cat_steps[i, j])
                                   for j, c in enumerate(self.categories) if self.cat_steps[i, j] > 0},
        }
