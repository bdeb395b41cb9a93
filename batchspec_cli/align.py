"""Alignment: the one module that owns row layout and KV moves (``attention`` turns it into masks and position ids).

Every sequence lives in a *slot* of a preallocated buffer. Its committed tokens are
left-padded: slot ``s`` holds ``pad[s]`` pad columns, then its content, and its padded
length (the column after its last committed token) is ``end[s]``. Everything else
derives from these two per-slot integers:

- the attention mask of a key column ``c`` is ``c >= pad`` (never inferred from token ids; per layer type in
  ``attention``);
- the position id of column ``c`` is ``c - pad`` (= ``cumsum(mask) - 1``: no holes);
- the target cache covers columns ``[0, end - 1)`` (every committed token but the last),
  the draft cache ``[0, end - 2)`` (it is always re-fed the last two committed tokens).

A *group* is a set of slots with the same ``end``: they stack into one rectangle with
their own pads, so a forward needs no realignment. After a round, rows gain different
numbers of tokens and their ``end`` values drift apart. *Realignment* makes a set of
rows share one ``end`` again by shifting each row's tokens and KV by ``shift = new_end - end``
(unpad -> append -> repad of the paper, done as one gather per layer).

Worked example, three rows, ``T = end = 6`` before a round with k = 2::

    row 0: . . a b c d        pad 2, content 4, accepts 2 + 1 -> end 9, content 7
    row 1: e f g h i j        pad 0, content 6, accepts 0 + 1 -> end 7, content 7
    row 2: . . . k l m        pad 3, content 3, accepts 1 + 1 -> end 8, content 5

    after the round (no move yet; "x" = committed this round):
    row 0: . . a b c d x x x        end 9
    row 1: e f g h i j x            end 7
    row 2: . . . k l m x x          end 8

    EQSPEC realigns to new_end = max content = 7: shifts -2, 0, -1
    row 0: a b c d x x x            pad 0
    row 1: e f g h i j x            pad 0   (does not move)
    row 2: . . k l m x x            pad 2

Rejected drafts need no cropping: a row's ``end`` advances only past accepted tokens,
and the next round overwrites the stale columns after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .grouping import is_run

Selection = slice | torch.Tensor  # slots of a group: a contiguous range (views) or indices


class CacheFull(torch.OutOfMemoryError):
    """The pool's KV buffers cannot grow to a row's length, even exactly: that row cannot go on."""


def old_device_is_cuda(buffers: list[torch.Tensor]) -> bool:
    return bool(buffers) and buffers[0].device.type == "cuda"


def device_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 indices from host values, copied without a blocking sync on an accelerator."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def selection(slots: list[int], device: torch.device) -> Selection:
    """A slice when the slots are one ascending contiguous run (zero-copy views), else indices."""
    if is_run(slots):
        return slice(slots[0], slots[0] + len(slots))
    return device_tensor(slots, device)


class SlotCache:
    """KV cache with one row per slot: per layer ``[rows, kv_heads, capacity, head_dim]`` (values: their own width).

    ``bind(rows_index, length)`` chooses the group and the column where the next forward writes;
    ``update`` (called by the model's attention layers) writes the new entries there and
    returns the group's keys/values up to the end of the new entries. With a slice
    selection that is a view; with an index selection it is a gather, counted in ``gathered``
    and timed in ``gather_s`` on the cache object only: no statistic reports them (the engine
    moves every group into one slot range first, and ``StepStats.kv_gathered`` counts that move).

    Memory follows the rows there are: the buffers hold ``rows`` of the ``n_slots``
    addressable slots (slots ``0..rows-1``; rows are placed in the lowest free slots) and
    ``capacity`` columns, both grown on demand (``grow``: by the pool ahead of a need that is
    known, by ``update`` when a forward runs past the end; before the first forward it only
    sets the size the buffers are allocated at). A growth allocates first, then copies the
    ``live`` slots' columns only (``None``: every row).
    """

    growth = 0.5  # a growth adds at least this fraction of the capacity (geometric: bounded total copying)

    def __init__(self, n_slots: int, capacity: int, rows: int | None = None):
        self.n_slots = n_slots
        self.rows = n_slots if rows is None else rows  # slots the buffers hold (a prefix of the slots)
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.live: list[int] | None = None  # the slots whose entries a growth keeps (set by the pool)
        self.rows_index: Selection = slice(0, 0)
        self.length = 0
        self.gathered = 0  # KV entries (token x layer) copied by group reads since reset
        self.gather_s = 0.0
        self.copied_rows = 0  # slot rows copied by growths (per layer and tensor counted once)

    # -- the interface the model's attention layers call ------------------------------
    def bind(self, rows_index: Selection, length: int) -> None:
        self.rows_index, self.length = rows_index, length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: [group, kv_heads, n_new, head_dim]
        n_new = key_states.shape[2]
        if layer_idx == len(self.keys):
            self._allocate(key_states, value_states)
        stop = self.length + n_new
        if stop > self.capacity:
            self.grow(stop)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows_index, :, self.length : stop] = key_states
        values[self.rows_index, :, self.length : stop] = value_states
        if isinstance(self.rows_index, slice):
            return keys[self.rows_index, :, :stop], values[self.rows_index, :, :stop]
        started = time.perf_counter()
        out = keys[self.rows_index, :, :stop], values[self.rows_index, :, :stop]
        self.gather_s += time.perf_counter() - started
        self.gathered += key_states.shape[0] * stop
        return out

    # -- what masking utilities may ask of a cache --------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(key length, first key column) of a forward of ``query_length`` tokens: every column up to its end."""
        return self.length + query_length, 0

    # -- buffer management ------------------------------------------------------------
    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One layer's buffers, each shaped like its own tensor (keys and values may differ in width: MLA)."""
        for buffers, like in ((self.keys, keys), (self.values, values)):
            shape = (self.rows, like.shape[1], self.capacity, like.shape[3])
            buffers.append(torch.zeros(shape, dtype=like.dtype, device=like.device))

    def grow(self, needed: int, rows: int = 0) -> None:
        """Hold at least ``needed`` columns and ``rows`` slots, all layers or none.

        Columns grow geometrically (by ``growth``, rounded up to 64 columns) so that a job's growths cost a
        bounded multiple of its final size; when that does not fit, to exactly what is
        needed; when that does not fit either, ``CacheFull`` is raised with the cache
        unchanged (halving the group cannot help: the buffer is the pool's, not the group's).
        """
        rows = min(self.n_slots, max(rows, self.rows))
        if needed <= self.capacity and rows <= self.rows:
            return
        if not self.keys:
            self.rows, self.capacity = rows, max(needed, self.capacity)
            return
        step = int(self.capacity * self.growth)
        generous = -(-max(needed, self.capacity + step) // 64) * 64 if needed > self.capacity else 0
        exact = max(-(-needed // 8) * 8, self.capacity)
        for new_cap in dict.fromkeys(c for c in (generous, exact) if c):
            try:
                self._resize(rows, new_cap)
                return
            except torch.OutOfMemoryError:
                continue
        raise CacheFull(f"the KV cache of {rows} slots cannot grow to {needed} columns")

    def _resize(self, rows: int, capacity: int) -> None:
        """New buffers of ``rows`` x ``capacity`` holding the live slots' entries; all or nothing."""
        try:
            fresh = [[self._new_buffer(old, rows, capacity) for old in buffers] for buffers in (self.keys, self.values)]
        except torch.OutOfMemoryError:
            if old_device_is_cuda(self.keys):
                torch.cuda.empty_cache()
            raise
        keep = list(range(self.rows)) if self.live is None else [s for s in self.live if s < self.rows]
        if keep:  # nothing below allocates but this small index
            run = keep == list(range(keep[0], keep[0] + len(keep)))
            index = slice(keep[0], keep[0] + len(keep)) if run else device_tensor(keep, self.keys[0].device)
            for buffers, new in zip((self.keys, self.values), fresh):
                for i, old in enumerate(buffers):
                    new[i][index, :, : self.capacity] = old[index]
        for buffers, new in zip((self.keys, self.values), fresh):
            buffers[:] = new
        self.copied_rows += len(keep)
        self.rows, self.capacity = rows, capacity

    @staticmethod
    def _new_buffer(old: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
        return old.new_zeros(rows, old.shape[1], capacity, old.shape[3])

    @property
    def n_layers(self) -> int:
        return len(self.keys)


@dataclass
class Layout:
    """The committed token ids of every slot, left-padded; pads and ends are the pool's host values."""

    tokens: torch.Tensor  # [slots, capacity] committed token ids, left-padded

    @classmethod
    def empty(cls, n_slots: int, capacity: int, device: torch.device) -> "Layout":
        return cls(torch.zeros(n_slots, capacity, dtype=torch.long, device=device))

    def grow(self, needed: int) -> None:
        """Allocate first, then swap: an out-of-memory error leaves the layout as it was."""
        if needed > self.tokens.shape[1]:
            new = self.tokens.new_zeros(self.tokens.shape[0], max(needed, 2 * self.tokens.shape[1]))
            new[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = new

    def place(self, slots: torch.Tensor, prompts: list[list[int]], end: int, pad_id: int) -> None:
        """Write prompts into ``slots`` left-padded to the common padded length ``end``."""
        self.grow(end)
        rows = torch.full((len(prompts), end), pad_id, dtype=torch.long)
        for i, ids in enumerate(prompts):
            rows[i, end - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        self.tokens[slots, :end] = rows.to(self.tokens.device)


def realign(layout: Layout, caches: list[tuple[SlotCache, list[int]]], src: list[int], dst: list[int],
            ends: list[int], new_ends: list[int], pads: list[int]) -> int:
    """Move rows from slots ``src`` to slots ``dst`` so that row i ends at column ``new_ends[i]``.

    src, dst: slot indices (may overlap, e.g. a permutation: all reads happen before
    writes); ends, pads: each row's current padded length and padding (the host's
    mirrors: no device sync); caches: (cache, per-row lag) pairs, a cache with lag ``l``
    covering columns [0, end - l) of that row. Each row is shifted by ``new_end - end``;
    index tensors are built once and each layer moves with one gather and one scatter of
    the rows' cached content only (no pad columns, nothing past a row's end).

    All or nothing: every buffer that grows and every gathered copy is allocated before the
    first write, so an out-of-memory error leaves layout and caches as they were.
    Returns each row's KV entries (token x layer, both caches) actually copied, counted from
    the lengths the index tensors were built from.
    """
    if not src:
        return []
    device = layout.tokens.device
    width = max(new_ends)
    shifts = [n - e for n, e in zip(new_ends, ends)]
    new_pads = [p + s for p, s in zip(pads, shifts)]
    src_t, dst_t = device_tensor(src, device), device_tensor(dst, device)
    shift = device_tensor(shifts, device)  # [rows]
    # 1. Allocate: grown buffers, index tensors, gathered copies.
    layout.grow(width)
    for cache, lags in caches:
        cache.grow(width - min(lags), rows=max(dst) + 1)
    # Columns past a row's own new end carry nothing; clamping keeps their (ignored) reads in bounds.
    tok_cols = (torch.arange(width, device=device)[None, :] - shift[:, None]).clamp(0, layout.tokens.shape[1] - 1)
    tokens = layout.tokens[src_t[:, None], tok_cols]  # [rows, width]
    moves = []
    for cache, lags in caches:
        # Only each row's cached content moves: columns [new pad, new end - lag) of its new place.
        lengths = [max(0, n - p - lag) for n, p, lag in zip(new_ends, new_pads, lags)]
        total = sum(lengths)
        if cache.n_layers == 0 or total == 0:
            continue
        lengths_t = device_tensor(lengths, device)
        row = torch.repeat_interleave(torch.arange(len(src), device=device), lengths_t, output_size=total)
        first = torch.cumsum(lengths_t, 0) - lengths_t
        dst_col = device_tensor(new_pads, device)[row] + torch.arange(total, device=device) - first[row]
        src_col, src_row, dst_row = dst_col - shift[row], src_t[row], dst_t[row]
        gathered = [[_gather(layer, src_row, src_col) for layer in buffers] for buffers in (cache.keys, cache.values)]
        moves.append((cache, dst_row, dst_col, gathered, lengths))
    # 2. Write.
    layout.tokens[dst_t, :width] = tokens
    moved = [0] * len(src)
    for cache, dst_row, dst_col, gathered, lengths in moves:
        for buffers, copies in zip((cache.keys, cache.values), gathered):
            for layer, copy in zip(buffers, copies):
                layer[dst_row, :, dst_col] = copy
        moved = [m + n * cache.n_layers for m, n in zip(moved, lengths)]
    return moved


def _gather(layer: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[entries, kv_heads, head_dim] copies of one layer's entries (a seam for fault-injection tests)."""
    return layer[rows, :, cols]
