"""A ragged, rollback-friendly KV cache for batched speculative decoding.

Why not ``transformers.DynamicCache``: it concatenates on every forward (copying the whole
cache each step) and assumes every row of the batch has the same length. Speculative decoding
commits a different number of tokens per row each step and must drop rejected tree nodes.

Layout. Per layer, keys and values live in preallocated buffers of shape (B_cap, H, T_cap, D).
Columns ``[0, T)`` are in use; ``valid[b, t]`` says whether column t holds a committed token
of row b. Rows may have *holes* (invalid columns) anywhere: position ids are passed explicitly
and every forward gets an explicit 4-D boolean attention mask, so a column's index has no
meaning of its own. Operations:

* ``forward``: run the model on new tokens; their K/V are appended at ``[T, T + n)`` as
  *tentative* columns (not valid yet) and the caller supplies the mask among them.
* ``keep``: after verification, per row, move the chosen tentative columns to the front of the
  tentative region and mark them valid; the rest of the region is discarded.
* ``select_rows`` / ``merge``: requests leave (rows are dropped) and join (rows prefilled in
  another cache are appended; the shorter side gets trailing holes).
* ``compact``: when packing would free more than ``waste_limit`` of the columns (holes shared
  by every row's tail, e.g. rejected tree slots), every row's valid columns are packed to the
  left (one gather per layer, amortised over many steps).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` in 5.x; accept both."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class RaggedKVCache:
    """KV cache whose rows hold different numbers of tokens (see module docstring)."""

    def __init__(self, waste_limit: float = 0.3, min_compact_len: int = 64) -> None:
        self.keys: list[torch.Tensor] = []  # per layer (B_cap, H, T_cap, D)
        self.values: list[torch.Tensor] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # (B, T) committed columns
        self.T = 0  # columns in use
        self.B = 0  # rows in use
        self.waste_limit = waste_limit
        self.min_compact_len = min_compact_len
        self._pending = 0  # tokens being written by the current forward
        self._pack: tuple[torch.Tensor, torch.Tensor, int, int, list | None] | None = None  # packed forward in flight
        self._kwarg: str | None = None

    # ----- the duck-typed transformers Cache interface ------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by every attention layer: write (B, H, n, D) at [T, T+n), return [0, T+n).

        In a packed forward (``forward(pack=...)``) the states arrive as (1, H, N, D), one column
        per (row, node) pair, and are scattered to their rows' columns ``T + node``.
        """
        bsz, heads, n, dim = key_states.shape
        if self._pack is not None:
            rows, nodes, bsz, n, _ = self._pack
        if layer_idx >= len(self.keys):
            cap_t = max(64, 2 * (self.T + n))
            cap_b = max(bsz, self.B)
            self.keys.append(key_states.new_zeros(cap_b, heads, cap_t, dim))
            self.values.append(value_states.new_zeros(cap_b, heads, cap_t, dim))
        self._ensure(layer_idx, bsz, self.T + n)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self._pack is not None:
            # columns of nodes a row did not ask for keep stale values: the mask hides them
            k[rows, :, self.T + nodes] = key_states[0].transpose(0, 1)  # (N, H, D)
            v[rows, :, self.T + nodes] = value_states[0].transpose(0, 1)
        else:
            k[:bsz, :, self.T : self.T + n] = key_states
            v[:bsz, :, self.T : self.T + n] = value_states
        return k[:bsz, :, : self.T + n], v[:bsz, :, : self.T + n]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.T

    def __len__(self) -> int:
        return len(self.keys)

    # ----- buffers ---------------------------------------------------------------------------
    def _ensure(self, layer_idx: int, rows: int, cols: int) -> None:
        k = self.keys[layer_idx]
        cap_b, heads, cap_t, dim = k.shape
        if rows <= cap_b and cols <= cap_t:
            return
        nb, nt = max(rows, cap_b), max(cols, cap_t)
        if cols > cap_t:
            nt = max(cols, 2 * cap_t)
        if rows > cap_b:
            nb = max(rows, 2 * cap_b)
        for store in (self.keys, self.values):
            old = store[layer_idx]
            new = old.new_zeros(nb, heads, nt, dim)
            new[:cap_b, :, :cap_t] = old
            store[layer_idx] = new

    def _grow_valid(self, rows: int, cols: int) -> None:
        b, t = self.valid.shape
        if rows > b or cols > t:
            new = torch.zeros(max(rows, b), max(cols, t), dtype=torch.bool, device=self.valid.device)
            new[:b, :t] = self.valid
            self.valid = new

    # ----- model calls -------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,  # (B, n)
        position_ids: torch.Tensor,  # (B, n)
        tail_mask: torch.Tensor,  # (B, n, T + n - base) bool: visibility of columns >= base
        base: int,
        output_hidden: bool = False,
        logits_to_keep: int = 0,
        pack: tuple[torch.Tensor, torch.Tensor, list | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``model`` on new tokens; columns < base use ``valid``, columns >= base ``tail_mask``.

        Returns (logits (B, n, V), last hidden state (B, n, H) if asked). The new tokens become
        tentative columns [T, T + n) until ``keep`` commits some of them. ``logits_to_keep=m > 0``
        computes logits for the last m positions only (B, m, V): a prefill needs none, and the
        output head over every prompt token was ~20% of its compute.

        ``pack=(rows, nodes, runs)`` (rows, nodes: (N,) long, row-major) runs a *ragged* pass:
        ``input_ids`` and ``position_ids`` are (1, N), token i belongs to row ``rows[i]`` at tree slot
        ``nodes[i]`` of the (B, n) layout that ``tail_mask`` describes. The linear layers and the
        output head then see N token rows instead of B * n (the padding of rows that asked for
        smaller trees is never computed). Attention (``specrl.attention``) either unpacks the
        queries to the (B, n) layout for one call (``runs=None``) or, given ``runs`` of consecutive
        rows with the same nodes, attends run by run without padding. Returns (1, N, V) logits.
        Needs a model using ``specrl_sdpa`` attention.
        """
        if pack is not None:
            bsz, n = tail_mask.shape[0], tail_mask.shape[1]
            self._pack = (pack[0], pack[1], bsz, n, pack[2])
        else:
            bsz, n = input_ids.shape
        if self.valid.device != input_ids.device:
            self.valid = self.valid.to(input_ids.device)
        self._grow_valid(bsz, self.T + n)
        head = self.valid[:bsz, :base]  # (B, base)
        mask = torch.cat([head[:, None, :].expand(bsz, n, base), tail_mask], dim=-1)  # (B, n, T+n)
        # every query sees itself: a padding query with an empty row would produce NaNs (softmax
        # over nothing) that leak into later layers' K/V through 0 * NaN
        diag = torch.arange(n, device=mask.device)
        mask[:, diag, self.T + diag] = True
        if self._kwarg is None:
            self._kwarg = cache_kwarg(model)
        extra = {} if pack is None else {"specrl_pack": self._pack}
        try:
            out = model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask[:, None],  # (B, 1, n, T+n)
                use_cache=True,
                output_hidden_states=output_hidden,
                logits_to_keep=logits_to_keep,
                **{self._kwarg: self},
                **extra,
            )
        finally:
            self._pack = None
        self.T += n
        self.B = max(self.B, bsz)
        hidden = out.hidden_states[-1] if output_hidden else None
        return out.logits, hidden

    # ----- commit / rollback --------------------------------------------------------------------
    def keep(
        self, start: int, cols: torch.Tensor, counts: torch.Tensor, max_count: int, in_place: bool = False
    ) -> None:
        """Commit per row the tentative columns ``cols[b, :counts[b]]`` (absolute, >= start).

        They are moved to ``[start, start + counts[b])`` in order; every other column >= start is
        dropped. ``cols``: (B, m) long, entries beyond ``counts`` are ignored; ``max_count`` is
        ``counts.max()`` already known on the host (avoids a device sync). ``in_place=True``
        promises ``cols[b, j] == start + j`` (plain decoding, accepted chains), which skips the
        data movement.
        """
        bsz = cols.shape[0]
        if max_count > 0 and not in_place:
            src = cols[:, :max_count].clamp(min=start, max=self.T - 1)  # (B, m)
            for store in (self.keys, self.values):
                for buf in store:
                    h, d = buf.shape[1], buf.shape[3]
                    idx = src[:, None, :, None].expand(bsz, h, max_count, d)
                    moved = buf[:bsz].gather(2, idx)  # (B, H, m, D)
                    buf[:bsz, :, start : start + max_count] = moved
        self.valid[:bsz, start:] = False
        ar = torch.arange(max_count, device=cols.device)
        self.valid[:bsz, start : start + max_count] = ar[None, :] < counts[:, None]
        self.T = start + max_count
        self.maybe_compact()

    def select_rows(self, index: list[int]) -> None:
        """Keep rows ``index`` (in that order) and drop the others."""
        moves = [(new, old) for new, old in enumerate(index) if new != old]
        if moves:
            new_ids = torch.tensor([m[0] for m in moves], device=self.valid.device)
            old_ids = torch.tensor([m[1] for m in moves], device=self.valid.device)
            for store in (self.keys, self.values):
                for buf in store:
                    buf[new_ids, :, : self.T] = buf[old_ids, :, : self.T]
            self.valid[new_ids] = self.valid[old_ids]
        self.B = len(index)
        if self.valid.shape[0]:
            self.valid[self.B :] = False
        if self.B == 0:
            self.T = 0
        else:
            self._trim()
            self.maybe_compact()

    def merge(self, other: RaggedKVCache) -> None:
        """Append the rows of ``other`` (e.g. freshly prefilled requests) after ours."""
        if other.B == 0:
            return
        if self.B == 0:
            self.keys, self.values = other.keys, other.values
            self.valid, self.T, self.B = other.valid, other.T, other.B
            return
        rows, cols = self.B + other.B, max(self.T, other.T)
        if not self.keys and other.keys:  # our rows hold nothing yet: allocate like theirs
            for store, theirs in ((self.keys, other.keys), (self.values, other.values)):
                for buf in theirs:
                    store.append(buf.new_zeros(rows, buf.shape[1], max(64, cols), buf.shape[3]))
        for i in range(len(self.keys)):
            self._ensure(i, rows, cols)
            if other.keys and other.T:
                for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
                    mine[i][self.B : rows, :, : other.T] = theirs[i][: other.B, :, : other.T]
        self._grow_valid(rows, cols)
        self.valid[self.B : rows] = False
        if other.T:
            self.valid[self.B : rows, : other.T] = other.valid[: other.B, : other.T].to(self.valid.device)
        self.B, self.T = rows, cols

    def add_empty_rows(self, count: int) -> None:
        """Append ``count`` rows that hold no tokens yet."""
        self.B += count
        self._grow_valid(self.B, self.T)
        self.valid[self.B - count : self.B] = False

    def _trim(self) -> None:
        """Drop trailing columns that no row uses."""
        used = self.valid[: self.B, : self.T].any(dim=0).nonzero()
        self.T = int(used.max()) + 1 if used.numel() else 0

    def reclaimable(self) -> float:
        """Fraction of the ``T`` columns that ``compact`` would free: 1 - (longest row) / T.

        Not the share of holes: rows of different lengths (a short prompt beside a long one)
        leave holes that no packing removes, and compacting for them would copy the whole cache
        on every step while freeing nothing (what this once did: 29 ms of a 160 ms step at
        batch 4 on CPU)."""
        if self.B == 0 or self.T == 0:
            return 0.0
        return 1.0 - float(self.valid[: self.B, : self.T].sum(dim=1).max()) / self.T

    def maybe_compact(self) -> bool:
        if self.T < self.min_compact_len or self.reclaimable() <= self.waste_limit:
            return False
        self.compact()
        return True

    def compact(self) -> None:
        """Pack every row's valid columns to the left (order preserved)."""
        bsz, t = self.B, self.T
        v = self.valid[:bsz, :t]
        counts = v.sum(dim=1)  # (B,)
        new_t = int(counts.max())
        # stable sort puts valid columns first, in their original order
        order = torch.sort((~v).to(torch.int8), dim=1, stable=True).indices[:, :new_t]  # (B, new_t)
        for store in (self.keys, self.values):
            for buf in store:
                h, d = buf.shape[1], buf.shape[3]
                idx = order[:, None, :, None].expand(bsz, h, new_t, d).to(buf.device)
                buf[:bsz, :, :new_t] = buf[:bsz, :, :t].gather(2, idx)
        self.valid[:bsz] = False
        self.valid[:bsz, :new_t] = torch.arange(new_t, device=v.device)[None, :] < counts[:, None]
        self.T = new_t


@torch.no_grad()
def prefill(model: torch.nn.Module, cache: RaggedKVCache, seqs: list[np.ndarray], device: torch.device,
            output_hidden: bool = False) -> torch.Tensor | None:
    """Append rows for ``seqs`` to ``cache`` holding every token but the last.

    The last token is left out on purpose: it is the root of the row's first draft tree, so the
    first decode step handles it like any other step (and k = 0 is plain decoding).
    ``output_hidden``: return the last hidden state at each row's last prefilled token (b, H),
    zeros for a row with nothing to prefill (a 1-token prompt); else None.
    """
    lens = [len(s) - 1 for s in seqs]
    width = max(lens)
    hidden = None
    if output_hidden:
        ref = next(model.parameters())
        hidden = ref.new_zeros(len(seqs), model.config.hidden_size)  # (b, H)
    if width == 0:
        cache.add_empty_rows(len(seqs))
        return hidden
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    for b, s in enumerate(seqs):
        ids[b, : lens[b]] = s[:-1]
    n_tok = torch.tensor(lens, device=device)  # (b,)
    cols = torch.arange(width, device=device)
    ok = cols[None, :] < n_tok[:, None]  # (b, width) right padding is masked out
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    tmp = RaggedKVCache(cache.waste_limit, cache.min_compact_len)
    _, h = tmp.forward(model, torch.from_numpy(ids).to(device), cols[None, :].expand(len(seqs), width),
                       causal[None] & ok[:, None, :], base=0, output_hidden=output_hidden,
                       logits_to_keep=1)  # the logits are not used: skip the head over the prompt
    tmp.keep(0, cols[None, :].expand(len(seqs), width), n_tok, width)
    cache.merge(tmp)
    if hidden is not None and h is not None:
        rows = [b for b, n in enumerate(lens) if n > 0]
        last = torch.tensor([lens[b] - 1 for b in rows], device=h.device)
        hidden[rows] = h[torch.tensor(rows, device=h.device), last]  # (b', H) at each row's last prefilled token
    return hidden
