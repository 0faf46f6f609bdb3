"""SpecEngine: continuous batching of speculative decoding over running requests.

One ``step(action)`` = (admit waiting requests) + one draft round + **one** target forward
that verifies every row's tree + commit. Rows commit different numbers of tokens; the ragged
KV caches of target and drafter keep exactly each row's accepted path. With k = 0 a step is
plain autoregressive decoding through the same code path.

Host/device traffic: the decode loop copies results to the host once per step (one packed
tensor); nothing in it calls ``.item()`` per token.

Invariant (tested): with temperature 0 the committed tokens equal the target's own greedy
decoding, for every action sequence, batch composition and drafter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from specrl.device import Stopwatch
from specrl.drafters import make_drafter
from specrl.drafters.base import Draft, Drafter
from specrl.errors import ConfigError, RequestError
from specrl.kvcache import RaggedKVCache, prefill
from specrl.models import ModelPair
from specrl.sampling import SamplingParams
from specrl.step import Action, StepResult
from specrl.tree import MAX_K, TreeShape, tree_shape
from specrl.verify import TreeTensors, verify

ActionLike = Action | tuple[int, int] | Sequence[Action]


@dataclass
class Request:
    """One generation request and its running state."""

    rid: int
    prompt: np.ndarray  # (P,) int64 prompt token ids
    max_new_tokens: int
    tokens: np.ndarray = field(repr=False)  # (capacity,) prompt + output buffer
    length: int = 0  # tokens used in ``tokens``
    finish_reason: str | None = None  # "eos" | "length" once finished
    steps: int = 0
    accepted: int = 0  # accepted draft tokens over all steps
    t_join: float = 0.0  # perf_counter when admitted (prefill start)
    t_first: float | None = None  # perf_counter when its first token was committed
    t_done: float | None = None

    @property
    def seq(self) -> np.ndarray:
        return self.tokens[: self.length]

    @property
    def output(self) -> np.ndarray:
        return self.tokens[len(self.prompt) : self.length]


@lru_cache(maxsize=512)
def _union_shape(actions: tuple[Action, ...]) -> tuple[TreeShape, np.ndarray]:
    """Union tree of the rows' (k, w) shapes and, per row, which union nodes it asked for."""
    # a batch holds few distinct actions: build each shape, the union and each mask once
    kinds = list(dict.fromkeys((a.k, a.w) for a in actions))
    shapes = [tree_shape(k, w) for k, w in kinds]
    union = shapes[0]
    for s in shapes[1:]:
        if s is not union:
            union = union.union(s)
    masks = np.stack([s.mask_in(union) for s in shapes])  # (distinct actions, n)
    pos = {kw: i for i, kw in enumerate(kinds)}
    row_kind = [pos[(a.k, a.w)] for a in actions]
    return union, masks[row_kind]  # (B, n)


class SpecEngine:
    """Batched speculative decoding over a ``ModelPair`` with any registered drafter."""

    def __init__(
        self,
        pair: ModelPair,
        drafter: Drafter | str = "ngram",
        sampling: SamplingParams | None = None,
        seed: int = 0,
        max_batch_size: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        ragged: bool = True,
    ) -> None:
        """``ragged``: when rows ask for different trees (per-request actions), verify them in one
        *packed* pass (each row's own tree size) instead of padding every row to the union tree.
        Same tokens either way (tested); off only for comparisons."""
        self.pair = pair
        self.device = pair.device
        self.drafter = make_drafter(drafter, pair) if isinstance(drafter, str) else drafter
        self.drafter_name = drafter if isinstance(drafter, str) else type(drafter).__name__
        # a feature drafter reads the target's last hidden state (prefill and every verify pass)
        self._features = bool(getattr(self.drafter, "uses_target_features", False))
        self.sampling = sampling or SamplingParams()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        if max_batch_size is not None and max_batch_size < 1:
            raise ConfigError(f"max_batch_size={max_batch_size} is invalid. Allowed: >= 1 (or None for no limit).")
        self.max_batch_size = max_batch_size
        from specrl.attention import NAME as _packable_attention

        # packing needs the attention function that unpacks queries to their rows
        self.ragged = ragged and getattr(pair.target.config, "_attn_implementation", None) == _packable_attention
        if ragged and not self.ragged:
            import warnings

            warnings.warn(f"The target's attention implementation is "
                          f"{getattr(pair.target.config, '_attn_implementation', None)!r}, not {_packable_attention!r}: "
                          "verify passes stay padded, while replay envs with verify: ragged charge packed ones. "
                          "Fix: load the model with attn_implementation='sdpa' (ModelPair switches it), or set "
                          "verify: padded.", stacklevel=2)
        self.eos = frozenset(pair.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.cache = RaggedKVCache()
        self.rows: list[Request] = []  # running requests, row order = cache row order
        self.waiting: list[Request] = []  # admitted at the start of the next step
        self._finished: list[Request] = []
        self._joined: list[Request] = []  # admitted since the last step: that step pays their prefill
        self._prefill_watches: list[Stopwatch] = []
        self._next_rid = 0
        self._tree_cache: dict[tuple, tuple[TreeShape, TreeTensors]] = {}
        # verify passes by kind: "padded", "packed" (one attention call), "packed-runs" (per-run attention)
        self.pass_counts: dict[str, int] = {"padded": 0, "packed": 0, "packed-runs": 0}

    # ----- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int, rid: int | None = None) -> int:
        """Queue a request; it joins the batch at the start of the next step. Returns its id."""
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise RequestError("Empty prompt (0 tokens). Fix: pass at least one token id.")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
            raise RequestError(
                f"max_new_tokens={max_new_tokens!r} is invalid. Allowed: a positive integer. Fix: e.g. 128."
            )
        vocab = self.pair.vocab_size
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise RequestError(f"Prompt token ids must lie in [0, {vocab}); got min {prompt.min()}, max {prompt.max()}.")
        limit = self.pair.max_context
        need = prompt.size + int(max_new_tokens) + MAX_K
        if need > limit:
            raise RequestError(
                f"Prompt of {prompt.size} tokens + max_new_tokens={max_new_tokens} (+{MAX_K} draft slots) exceeds "
                f"the context window of {limit} tokens of {self.pair.target_name!r}. "
                f"Fix: shorten the prompt to at most {max(0, limit - int(max_new_tokens) - MAX_K)} tokens "
                "or lower max_new_tokens."
            )
        if rid is None:
            rid = self._next_rid
        self._next_rid = max(self._next_rid, rid) + 1
        buf = np.zeros(prompt.size + int(max_new_tokens) + MAX_K + 1, dtype=np.int64)
        buf[: prompt.size] = prompt
        self.waiting.append(Request(rid, prompt, int(max_new_tokens), buf, prompt.size))
        return rid

    @property
    def num_running(self) -> int:
        return len(self.rows)

    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    def free_slots(self) -> int:
        if self.max_batch_size is None:
            return 1 << 30
        return self.max_batch_size - len(self.rows) - len(self.waiting)

    @torch.inference_mode()
    def admit(self) -> None:
        """Prefill waiting requests (up to the batch limit) so they run in the next step.

        ``step`` calls this itself; call it earlier to learn the rows (``rids``) before
        choosing per-request actions.
        """
        room = len(self.waiting) if self.max_batch_size is None else self.max_batch_size - len(self.rows)
        joining, self.waiting = self.waiting[:room], self.waiting[room:]
        if not joining:
            return
        now = time.perf_counter()
        for r in joining:
            r.t_join = now
        seqs = [r.seq for r in joining]
        sw = Stopwatch(self.device)
        sw.start("prefill")
        hidden = prefill(self.pair.target, self.cache, seqs, self.device, output_hidden=self._features)
        self.drafter.join(seqs)
        if hidden is not None:
            self.drafter.observe_features(hidden, len(self.rows))  # type: ignore[attr-defined]
        sw.stop("prefill")
        self.rows.extend(joining)
        # charged to the next step (its StepResult's prefill fields and step_time), whether that
        # step admitted them itself or a caller did earlier to choose per-request actions
        self._joined.extend(joining)
        self._prefill_watches.append(sw)

    # ----- one step ----------------------------------------------------------------------------
    def _actions(self, action: ActionLike) -> tuple[Action, ...]:
        if isinstance(action, Action):
            return (action,) * len(self.rows)
        if isinstance(action, tuple) and len(action) == 2 and all(isinstance(x, (int, np.integer)) for x in action):
            return (Action(int(action[0]), int(action[1])),) * len(self.rows)
        acts = tuple(a if isinstance(a, Action) else Action(*a) for a in action)  # type: ignore[misc]
        if len(acts) != len(self.rows):
            raise ConfigError(
                f"Got {len(acts)} per-request actions for {len(self.rows)} running requests. "
                "Fix: pass one Action for the batch or exactly one per running request (engine.rids order)."
            )
        return acts

    @property
    def rids(self) -> list[int]:
        return [r.rid for r in self.rows]

    def _tree_tensors(self, shape: TreeShape, keep: np.ndarray | None) -> tuple[TreeShape, TreeTensors]:
        """The (possibly pruned) verify tree and its device tensors, cached by rank paths."""
        paths = shape.paths if keep is None else tuple(p for p, k in zip(shape.paths, keep) if k)
        hit = self._tree_cache.get(paths)
        if hit is None:
            sub = shape if keep is None or len(paths) == len(shape.paths) else TreeShape.from_paths(paths)
            if len(self._tree_cache) > 1024:
                self._tree_cache.clear()
            hit = self._tree_cache[paths] = (sub, TreeTensors.of(sub, self.device))
        return hit

    def _attention_runs(self, wanted: np.ndarray) -> list | None:
        """Runs of consecutive rows asking for the same nodes, for a packed pass's attention, or
        None (one padded call) when padding the queries to the union tree wastes little: every
        extra call costs ~20 us per layer, a padded query row a pass over its row's context."""
        bsz, n = wanted.shape
        count = wanted.sum(axis=1)  # (B,)
        if self.device.type != "cpu" or bsz * n <= 2 * int(count.sum()):
            # (CUDA: masked GQA attention per run would take the slow math kernel; unmeasured there)
            return None
        runs, off, b0 = [], 0, 0
        for b in range(1, bsz + 1):
            if b == bsz or not np.array_equal(wanted[b], wanted[b0]):
                ids = torch.from_numpy(np.flatnonzero(wanted[b0])).to(self.device)
                runs.append((b0, b, off, int(count[b0]), ids))
                off += (b - b0) * int(count[b0])
                b0 = b
        return runs

    @torch.inference_mode()
    def step(self, action: ActionLike = Action(0, 1)) -> StepResult:
        """Admit waiting requests, draft with ``action``, verify in one target pass, commit."""
        sw = Stopwatch(self.device)
        early = len(self._prefill_watches)  # admissions before this step (outside its stopwatch)
        sw.start("step")
        self.admit()
        joined, watches = self._joined, self._prefill_watches
        self._joined, self._prefill_watches = [], []
        if not self.rows:
            raise RequestError("step() called with no running or waiting requests. Fix: add_request() first.")
        actions = self._actions(action)
        shape, asked = _union_shape(actions)
        seqs = [r.seq for r in self.rows]
        bsz, dev = len(self.rows), self.device
        context = np.array([r.length for r in self.rows])

        sw.start("draft")
        proposed = shape.num_nodes > 0
        if proposed:
            draft = self.drafter.propose(seqs, shape, asked, self.sampling, self.generator)
            # drop tree slots that no row filled (an n-gram drafter often finds nothing): they
            # would cost verify compute for nothing. Only when the drafter knows it on the host:
            # asking the device would cost a synchronisation per step.
            keep = draft.host_union
            kept = np.flatnonzero(keep) if keep is not None and not keep.all() else None  # verify id -> drafted id
            if kept is not None:
                idx = torch.from_numpy(kept).to(dev)
                draft = Draft(
                    draft.tokens[:, idx], draft.present[:, idx],
                    None if draft.probs is None else draft.probs[:, idx],  # sampled drafts keep their q
                    draft.top1, draft.entropy, draft.match_len, draft.num_matches,
                    host_present=None if draft.host_present is None else draft.host_present[:, kept],
                )
            vshape, tree = self._tree_tensors(shape, keep)
        else:
            roots = torch.tensor([int(s[-1]) for s in seqs], device=dev)[:, None]
            # no draft round: report what a cheap probe can tell (n-gram matches), NaN otherwise
            probe = getattr(self.drafter, "probe", None)
            stats = probe(seqs) if probe is not None else torch.full((bsz, 4), float("nan"), device=dev)
            draft = Draft(roots, torch.ones_like(roots, dtype=torch.bool), None, *stats.unbind(1))
            vshape, tree = self._tree_tensors(shape, None)
        sw.stop("draft")

        sw.start("verify")
        n = len(vshape.paths)
        base = self.cache.T
        pos = torch.from_numpy(context - 1).to(dev)[:, None] + tree.depth[None, :]  # (B, n)
        tail = tree.ancestors[None].expand(bsz, n, n)  # tree attention among the new tokens
        wanted = None
        if proposed and self.ragged:
            # (B, n) host: the nodes each row really proposed when the drafter knows them (n-gram:
            # a row whose lookup found nothing verifies its root only), else the nodes it asked for
            wanted = draft.host_present if draft.host_present is not None else (
                asked if kept is None else asked[:, kept])
            if wanted.all():
                wanted = None  # every row asked for the whole union: nothing to pack away
        choice = None
        slot = None  # (B, n) packed index of each computed node, for the feature drafter
        if wanted is None:
            logits, hidden = self.cache.forward(self.pair.target, draft.tokens, pos, tail, base,
                                                output_hidden=self._features)  # (B, n, V), (B, n, H) | None
            verify_tokens = bsz * n
            self.pass_counts["padded"] += 1
        else:
            rows_h, nodes_h = np.nonzero(wanted)  # (N,) each, row-major
            rows_t, nodes_t = torch.from_numpy(rows_h).to(dev), torch.from_numpy(nodes_h).to(dev)
            runs = self._attention_runs(wanted)
            self.pass_counts["packed" if runs is None else "packed-runs"] += 1
            packed_logits, hidden = self.cache.forward(
                self.pair.target, draft.tokens[rows_t, nodes_t][None], pos[rows_t, nodes_t][None], tail, base,
                pack=(rows_t, nodes_t, runs), output_hidden=self._features,
            )  # (1, N, V), (1, N, H) | None
            if hidden is not None:
                slot = torch.zeros(bsz, n, dtype=torch.long, device=dev)
                slot[rows_t, nodes_t] = torch.arange(rows_t.numel(), device=dev)
            if self.sampling.greedy:  # greedy reads the argmax only: no (B, n, V) buffer
                logits = None
                choice = torch.zeros(bsz, n, dtype=torch.long, device=dev)  # (B, n)
                choice[rows_t, nodes_t] = packed_logits[0].argmax(dim=-1)
            else:
                logits = packed_logits.new_zeros(bsz, n, packed_logits.shape[-1])  # (B, n, V)
                logits[rows_t, nodes_t] = packed_logits[0]
            # a node a row did not ask for was never computed: it must not count as proposed
            draft = Draft(draft.tokens, draft.present & torch.from_numpy(wanted).to(dev), draft.probs,
                          draft.top1, draft.entropy, draft.match_len, draft.num_matches)
            verify_tokens = int(rows_h.size)
        out = verify(tree, draft.tokens, draft.present, logits, draft.probs, self.sampling, self.generator, choice)
        if hidden is not None:
            # the target's feature at each row's last accepted node: the position before the new root (the bonus)
            ar = torch.arange(bsz, device=dev)
            last = out.last_node  # (B,) verify node ids
            feats = hidden[ar, last] if slot is None else hidden[0, slot[ar, last]]  # (B, H)
            self.drafter.observe_features(feats, 0)  # type: ignore[attr-defined]
        node_tokens = draft.tokens.gather(1, out.path.clamp_min(0))  # (B, D+1), [:, 0] = root
        depth_drafted = torch.where(draft.present, tree.depth[None, :], 0).max(dim=1).values  # (B,)
        packed = torch.cat(
            [
                out.accept_len[:, None].double(),
                out.path.double(),
                out.bonus[:, None].double(),
                node_tokens.double(),
                depth_drafted[:, None].double(),
                torch.stack([draft.top1, draft.entropy, draft.match_len, draft.num_matches], 1).double(),
            ],
            dim=1,
        ).cpu().numpy()  # the one host copy of the step
        sw.stop("verify")

        d1 = tree.max_depth + 1
        accept_len = packed[:, 0].astype(np.int64)
        path = packed[:, 1 : 1 + d1].astype(np.int64)
        bonus = packed[:, 1 + d1].astype(np.int64)
        tok_on_path = packed[:, 2 + d1 : 2 + 2 * d1].astype(np.int64)
        depth_drafted_h = packed[:, 2 + 2 * d1].astype(np.int64)
        conf = packed[:, 3 + 2 * d1 :].astype(np.float32)

        # the target cache keeps the root and the accepted nodes of each row
        max_keep = int(accept_len.max()) + 1
        cols = base + out.path[:, :max_keep].clamp_min(0)
        # accepted chains are already in place (node j at column base + j): no data movement
        in_place = bool(((path[:, :max_keep] == np.arange(max_keep)) | (path[:, :max_keep] < 0)).all())
        self.cache.keep(base, cols, out.accept_len + 1, max_keep, in_place=in_place)
        if proposed:
            # the drafter numbers nodes in the unpruned shape it drafted
            dpath = path if kept is None else np.where(path >= 0, kept[np.clip(path, 0, None)], -1)
            self.drafter.commit(dpath, accept_len)

        now = time.perf_counter()
        committed, finished, keep_rows = [], [], []
        for b, r in enumerate(self.rows):
            new = np.append(tok_on_path[b, 1 : accept_len[b] + 1], bonus[b])
            room = r.max_new_tokens - (r.length - len(r.prompt))
            new = new[:room]
            if self.eos:
                hit = np.flatnonzero(np.isin(new, list(self.eos)))
                if hit.size:
                    new = new[: hit[0] + 1]
                    r.finish_reason = "eos"
            r.tokens[r.length : r.length + new.size] = new
            r.length += new.size
            r.steps += 1
            # drafts accepted past EOS / the length limit are not committed: do not count them
            accept_len[b] = min(accept_len[b], new.size)
            r.accepted += int(accept_len[b])
            if r.t_first is None:
                r.t_first = now
            if r.finish_reason is None and r.length - len(r.prompt) >= r.max_new_tokens:
                r.finish_reason = "length"
            committed.append(new)
            if r.finish_reason is not None:
                r.t_done = now
                finished.append(r)
            else:
                keep_rows.append(b)
        rids = [r.rid for r in self.rows]
        if finished:
            self.cache.select_rows(keep_rows)
            self.drafter.select_rows(keep_rows)
            self.rows = [self.rows[b] for b in keep_rows]
            self._finished.extend(finished)
        sw.stop("step")
        t = sw.seconds()
        pre = [w.seconds()["prefill"] for w in watches]  # this step's admissions and earlier ones
        return StepResult(
            rids=rids,
            actions=list(actions),
            committed=committed,
            num_committed=np.array([c.size for c in committed]),
            accept_len=accept_len,
            draft_depth=depth_drafted_h,
            draft_top1=conf[:, 0],
            draft_entropy=conf[:, 1],
            match_len=conf[:, 2],
            num_matches=conf[:, 3],
            context_len=context,
            tree_tokens=n,
            verify_tokens=verify_tokens,
            level_sizes=vshape.level_sizes,
            prefill_rows=len(joined),
            prefill_len=max((len(r.prompt) for r in joined), default=0),
            finished=[r.rid for r in finished],
            prefill_time=sum(pre),
            draft_time=t.get("draft", 0.0),
            verify_time=t.get("verify", 0.0),
            step_time=t["step"] + sum(pre[:early]),
        )

    def probe(self) -> np.ndarray | None:
        """(B, 4) [top1, entropy, match_len, num_matches] of running + waiting requests that the
        drafter can tell without drafting (n-gram lookups), or None (model drafters)."""
        fn = getattr(self.drafter, "probe", None)
        seqs = [r.seq for r in self.rows + self.waiting]
        if fn is None or not seqs:
            return None
        return fn(seqs).cpu().numpy()

    @torch.inference_mode()
    def reset(self) -> None:
        """Drop every running and waiting request (the drafter's state too)."""
        self.cache.select_rows([])
        self.drafter.select_rows([])
        self.rows, self.waiting, self._finished = [], [], []
        self._joined, self._prefill_watches = [], []

    def pop_finished(self) -> list[Request]:
        """Requests finished since the last call."""
        done, self._finished = self._finished, []
        return done

    # ----- convenience ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        action: ActionLike | Callable[[StepResult | None], ActionLike] = Action(0, 1),
        batch_size: int | None = None,
        on_step: Callable[[StepResult], None] | None = None,
    ) -> list[Request]:
        """Decode ``prompts`` with continuous batching (at most ``batch_size`` running).

        ``action`` is a fixed action or a callable mapping the previous StepResult to the next
        action (a policy). Returns the finished requests in prompt order.
        """
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} is invalid. Allowed: >= 1.")
        todo = list(enumerate(prompts))
        done: dict[int, Request] = {}
        rid_to_idx: dict[int, int] = {}
        last: StepResult | None = None
        while todo or self.has_work():
            while todo and (batch_size is None or len(self.rows) + len(self.waiting) < batch_size):
                i, p = todo.pop(0)
                rid_to_idx[self.add_request(p, max_new_tokens)] = i
            act = action(last) if callable(action) else action
            last = self.step(act)
            if on_step is not None:
                on_step(last)
            for r in self.pop_finished():
                if r.rid in rid_to_idx:
                    done[rid_to_idx[r.rid]] = r
        return [done[i] for i in range(len(prompts))]
