"""Alignment: the one module that owns row layout and KV moves (``attention`` turns it into masks and position ids).

Every sequence lives in a *slot* of a preallocated buffer. Its committed tokens are
left-padded: slot ``s`` holds ``pad[s]`` pad columns, then its content, and its padded
length (the column after its last committed token) is ``end[s]``. The ``SlotTable`` below
holds these per-slot integers (with the draft's reach and the live set) and the tensors they
lay out; everything else derives from them:

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

from dataclasses import dataclass
from typing import Callable

import torch

from ..models.attention import Packing
from ..policy.grouping import is_run

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
    on the cache object only: no statistic reports it (the engine
    moves every group into one slot range first, and ``StepStats.kv_gathered`` counts that move).

    Memory follows the rows there are: the buffers hold ``rows`` of the ``n_slots``
    addressable slots (slots ``0..rows-1``; rows are placed in the lowest free slots; at most
    twice the rows placed) and ``capacity`` columns, both grown on demand (``grow``: by the
    table ahead of a need that is known, by ``update`` when a forward runs past the end;
    before the first forward it only sets the size the buffers are allocated at). A growth
    allocates first, then copies the live slots' columns only (``keep``: the table's live set;
    ``None``: every row).
    """

    growth = 0.5  # a growth adds at least this fraction of the capacity (geometric: bounded total copying)

    def __init__(self, n_slots: int, capacity: int, rows: int | None = None,
                 keep: Callable[[], list[int]] | None = None):
        self.n_slots = n_slots
        self.rows = n_slots if rows is None else rows  # slots the buffers hold (a prefix of the slots)
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.keep = keep  # the slots whose entries a growth keeps (the table's live set; None: every row)
        self.rows_index: Selection = slice(0, 0)
        self.length = 0
        self.gathered = 0  # KV entries (token x layer) copied by group reads since reset
        self.packing: Packing | None = None  # a packed forward's pieces (bind_packed), instead of a group
        self.copied_rows = 0  # slot rows copied by growths (per layer and tensor counted once)

    # -- the interface the model's attention layers call ------------------------------
    def bind(self, rows_index: Selection, length: int) -> None:
        self.rows_index, self.length = rows_index, length

    def bind_packed(self, packing: Packing | None) -> None:
        """The next forward is packed (``attention.packed_forward``): its new entries are the pieces' columns one
        after another, in one sequence; ``None`` ends it."""
        self.packing, self.length = packing, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: [group, kv_heads, n_new, head_dim]
        n_new = key_states.shape[2]
        if layer_idx == len(self.keys):
            self._allocate(key_states, value_states)
        if self.packing is not None:
            return self._update_packed(key_states, value_states, layer_idx)
        stop = self.length + n_new
        if stop > self.capacity:
            self.grow(stop)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows_index, :, self.length : stop] = key_states
        values[self.rows_index, :, self.length : stop] = value_states
        if isinstance(self.rows_index, slice):
            return keys[self.rows_index, :, :stop], values[self.rows_index, :, :stop]
        out = keys[self.rows_index, :, :stop], values[self.rows_index, :, :stop]
        self.gathered += key_states.shape[0] * stop
        return out

    def _update_packed(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """Write each piece's entries ([1, kv_heads, n_new, head_dim], the pieces one after another) into its slot's
        columns; return the keys and values ``Packing`` says: the new ones, or each piece's from its first column."""
        pieces = self.packing.pieces
        self.grow(max(p.end for p in pieces), max(p.slot for p in pieces) + 1)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        offset = 0
        for p in pieces:
            n = p.end - p.start
            keys[p.slot, :, p.start : p.end] = key_states[0, :, offset : offset + n]
            values[p.slot, :, p.start : p.end] = value_states[0, :, offset : offset + n]
            offset += n
        if self.packing.whole:
            return key_states, value_states
        return (torch.cat([keys[p.slot, :, p.first : p.end] for p in pieces], 1)[None],
                torch.cat([values[p.slot, :, p.first : p.end] for p in pieces], 1)[None])

    # -- what masking utilities may ask of a cache --------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(key length, first key column) of a forward of ``query_length`` tokens: every column up to its end."""
        return self.length + query_length, 0

    # -- buffer management ------------------------------------------------------------
    def allocate_like(self, other: "SlotCache") -> None:
        """Allocate every layer's buffers (none allocated yet) shaped like ``other``'s, before any forward."""
        for keys, values in zip(other.keys, other.values):
            self._allocate(keys, values)

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
        if self.keys and rows > self.rows:  # slots too grow geometrically: each bucket's rows cost no copy of all
            rows = min(self.n_slots, max(rows, 2 * self.rows))
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
        keep = list(range(self.rows)) if self.keep is None else [s for s in self.keep() if s < self.rows]
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
    """The committed token ids of every slot, left-padded; pads and ends are the ``SlotTable``'s host values."""

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


class SlotTable:
    """Every slot's geometry, and the tensors laid out by it: the one home of each row's pad, end, draft end and
    liveness (in the manner of mlx-lm's ``BatchKVCache``: ``left_padding``, ``offset``, ``filter``, ``extend``).

    The table holds the committed tokens (``layout``), the target's and the draft's ``SlotCache``
    and, per slot, on the host: ``end`` (the column after the last committed token), ``pad``
    (left padding) and ``draft_end`` (the draft cache covers ``[0, draft_end)``), plus ``live``,
    the sorted slots that hold a row. Its verbs keep tensors and geometry together:

    - ``place``: rows start in free slots, left-padded to one end (``extend``);
    - ``commit``: a row's end advances past the tokens a round committed;
    - ``move``: rows change slot and/or end (assembly, realignment), tokens and KV with them;
    - ``pads``: a group's pads on the device, from which ``attention`` derives masks and position ids;
    - ``free``: a slot leaves the live set (``filter``); ``reserve``: room for rows about to come.

    A cache growth keeps the live slots only: the caches ask the table (``SlotCache(keep=...)``).
    """

    def __init__(self, n_slots: int, device: torch.device, with_draft: bool, capacity: int = 64):
        self.n_slots, self.device = n_slots, device
        self.layout = Layout.empty(n_slots, capacity, device)
        self.target = SlotCache(n_slots, capacity, rows=0, keep=self._live)
        self.draft = SlotCache(n_slots, capacity, rows=0, keep=self._live) if with_draft else None
        self.end = [0] * n_slots  # [slots] padded length: the column after the last committed token
        self.pad = [0] * n_slots  # [slots] left padding
        self.draft_end = [0] * n_slots  # [slots] the draft cache covers columns [0, draft_end)
        self.live: list[int] = []  # sorted slots that hold a row (the one live set; rebound, never mutated)

    def _live(self) -> list[int]:
        return self.live

    # ------------------------------------------------------------------ reading
    def is_live(self, slot: int) -> bool:
        return slot in self.live

    def free_slots(self) -> list[int]:
        live = set(self.live)
        return [s for s in range(self.n_slots) if s not in live]

    def content(self, slot: int) -> int:
        return self.end[slot] - self.pad[slot]

    def pads(self, slots: list[int]) -> torch.Tensor:
        """[G] left padding of the group's rows, on the device (``attention`` makes the masks and positions)."""
        return device_tensor([self.pad[s] for s in slots], self.device)

    def draft_reach(self, slots: list[int]) -> int:
        """The draft cache covers columns [0, reach) of every row of the group."""
        return min(self.draft_end[s] for s in slots)

    def caches(self, slots: list[int]) -> list[tuple[SlotCache, list[int]]]:
        """(cache, per-row lag) of both models for ``slots``: the target lags one column, the draft more."""
        caches = [(self.target, [1] * len(slots))]
        if self.draft is not None:
            caches.append((self.draft, [self.end[s] - self.draft_end[s] for s in slots]))
        return caches

    # ------------------------------------------------------------------ changing
    def place(self, slots: list[int], prompts: list[list[int]], end: int, pad_id: int) -> None:
        """Start rows in free slots, left-padded to the common padded length ``end`` (the draft covers nothing)."""
        self.layout.place(device_tensor(slots, self.device), prompts, end, pad_id)
        for s, ids in zip(slots, prompts):
            self.end[s], self.pad[s] = end, end - len(ids)
            self.draft_end[s] = self.pad[s]
        self.live = sorted(self.live + slots)

    def commit(self, slot: int, emitted: int, draft_refed: bool) -> None:
        """A round's geometry for one row: it gained ``emitted`` tokens (before any stop-string cut: the
        layout's tokens run to its new end)."""
        self.end[slot] += emitted
        if draft_refed:
            self.draft_end[slot] = self.end[slot] - 2  # the draft is re-fed the last two committed tokens

    def draft_prefilled(self, slots: list[int], end: int) -> None:
        """The draft cache of rows placed at ``end`` was filled up to ``end - 2``."""
        for s in slots:
            self.draft_end[s] = end - 2

    def share_prompt(self, pairs: list[tuple[int, int]], prompt_len: list[int], draft: bool = False) -> int:
        """Give rows just placed the prompt KV of a live row with the same prompt (``--n`` samples of one input
        row) instead of a prefill: ``pairs`` (source slot, destination slot), ``prompt_len`` each pair's prompt
        tokens; the target's cache, or the draft's (``draft``). A prompt's KV does not depend on the slot's
        padding (positions count from the row's first real token), so the source's columns ``[pad, pad + n)``
        go to the destination's ``[pad, pad + n)``, one gather and one scatter per layer: the target's first
        ``prompt - 1`` tokens (what a prefill writes), the draft's as far as the source's draft cache covers
        them, at most ``prompt - 2`` (the destination's draft end follows). Returns the KV entries (token x
        layer) copied."""
        cache = self.draft if draft else self.target
        if not pairs or cache is None:
            return 0
        device = self.layout.tokens.device
        src, dst = [s for s, _ in pairs], [d for _, d in pairs]
        if draft:
            lengths = [max(0, min(n - 2, self.draft_end[s] - self.pad[s])) for s, n in zip(src, prompt_len)]
            for d, n in zip(dst, lengths):
                self.draft_end[d] = self.pad[d] + n
        else:
            lengths = [max(0, n - 1) for n in prompt_len]
        total = sum(lengths)
        if cache.n_layers == 0 or total == 0:
            return 0
        lengths_t = device_tensor(lengths, device)
        row = torch.repeat_interleave(torch.arange(len(pairs), device=device), lengths_t, output_size=total)
        offset = torch.arange(total, device=device) - (torch.cumsum(lengths_t, 0) - lengths_t)[row]
        src_col = device_tensor([self.pad[s] for s in src], device)[row] + offset
        dst_col = device_tensor([self.pad[d] for d in dst], device)[row] + offset
        src_row, dst_row = device_tensor(src, device)[row], device_tensor(dst, device)[row]
        for buffers in (cache.keys, cache.values):
            for layer in buffers:
                _scatter(layer, (dst_row, dst_col), _gather(layer, (src_row, src_col)))
        return total * cache.n_layers

    def free(self, slot: int) -> None:
        self.live = [s for s in self.live if s != slot]

    def share_prefix(self, source: SlotCache, draft: bool, slots: list[int], lengths: list[int]) -> int:
        """Copy the first ``lengths[i]`` columns of ``source``'s one row (a shared prefix's KV, ``prefix``) into
        the target's (or the draft's) cache of slot ``slots[i]``, at that row's own content offset: columns
        ``[pad, pad + lengths[i])``. One gather and one scatter per layer. The draft's reach advances to the end of
        what it got. Returns the columns copied (summed over rows)::

            source (prefix alone):  a b c d e f
            slot, pad 2, length 4:  . . a b c d (its own suffix follows, prefilled from column 6 on)
        """
        cache = self.draft if draft else self.target
        pairs = [(s, n) for s, n in zip(slots, lengths) if n > 0]
        if not pairs or source.n_layers == 0:
            return 0
        device = self.layout.tokens.device
        rows, counts = [s for s, _ in pairs], [n for _, n in pairs]
        total = sum(counts)
        cache.grow(max(self.pad[s] + n for s, n in pairs), rows=max(rows) + 1)
        if cache.n_layers == 0:
            cache.allocate_like(source)
        counts_t = device_tensor(counts, device)
        row = torch.repeat_interleave(torch.arange(len(pairs), device=device), counts_t, output_size=total)
        src_col = torch.arange(total, device=device) - (torch.cumsum(counts_t, 0) - counts_t)[row]
        dst_col = device_tensor([self.pad[s] for s in rows], device)[row] + src_col
        dst_row, src_row = device_tensor(rows, device)[row], torch.zeros_like(row)
        for buffers, sources in ((cache.keys, source.keys), (cache.values, source.values)):
            for layer, prefix in zip(buffers, sources):
                layer[dst_row, :, dst_col] = prefix[src_row, :, src_col]  # [total, kv_heads, head_dim]
        if draft:
            for s, n in pairs:
                self.draft_end[s] = max(self.draft_end[s], self.pad[s] + n)
        return total

    def reserve(self, slots: list[int], columns: int, rows: int = 0) -> None:
        """Room for rows about to be placed in ``slots``, which can reach ``columns`` columns (and for ``rows`` slots
        in all, when more rows are known to come).

        The buffers must hold the slots (an out-of-memory error is raised, and nothing the
        table holds has changed, when they cannot); the columns are reserved when they fit,
        else left for the forward that needs them (it grows to exactly that).
        """
        rows = max(max(slots) + 1, rows)
        for cache in (self.target, self.draft):
            if cache is not None:
                try:
                    cache.grow(columns, rows)
                except torch.OutOfMemoryError:  # CacheFull included: the slots alone, then
                    cache.grow(cache.capacity, rows)
        self.layout.grow(columns)

    def move(self, moves: list[tuple[int, int, int]]) -> list[int]:
        """Move rows ``(source slot, destination slot, new padded length)``: tokens, KV and geometry as one unit.

        Sources may overlap destinations (e.g. a permutation: all reads happen before writes); a
        source slot no row moves into becomes free. Each row is shifted by ``new_end - end``:
        its pad and draft end shift with it. The tensors move first, all or nothing
        (``realign``); the geometry changes only once they have. Returns each row's KV entries
        (token x layer, both caches) actually copied.
        """
        if not moves:
            return []
        src, dst = [s for s, _, _ in moves], [d for _, d, _ in moves]
        copied = self.realign(src, dst, [e for _, _, e in moves])
        old = [(self.end[s], self.pad[s], self.draft_end[s]) for s in src]
        for (_, d, new_end), (end, pad, draft_end) in zip(moves, old):
            shift = new_end - end
            self.end[d], self.pad[d], self.draft_end[d] = new_end, pad + shift, draft_end + shift
        self.live = sorted(set(self.live).difference(src).union(dst))
        return copied

    def realign(self, src: list[int], dst: list[int], new_ends: list[int]) -> list[int]:
        """Copy rows' tokens and KV from slots ``src`` to slots ``dst`` so that row i ends at column
        ``new_ends[i]``; the geometry is not changed (``move`` does that).

        Each row is shifted by ``new_end - end``; the columns are worked out from the host's
        geometry (no device sync) and each layer copies the rows' cached content only (no pad
        columns, nothing past a row's end) out, then writes it to its place: on a CPU a block a row
        (memory copies: an indexed gather and scatter of the same entries took 2.5x as long, 113
        against 45 ms for 16 rows of 500 columns in 60 buffers), on an accelerator one indexed
        gather and scatter a buffer (a kernel launch a row would cost more). A cache with lag
        ``l`` covers columns [0, end - l) of that row.

        All or nothing: every buffer that grows and every gathered copy is allocated before the
        first write, so an out-of-memory error leaves layout and caches as they were.
        Returns each row's KV entries (token x layer, both caches) actually copied, counted from
        the lengths the index tensors were built from.
        """
        if not src:
            return []
        layout, device = self.layout, self.layout.tokens.device
        caches = self.caches(src)
        width = max(new_ends)
        shifts = [n - self.end[s] for n, s in zip(new_ends, src)]
        new_pads = [self.pad[s] + sh for s, sh in zip(src, shifts)]
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
            if device.type in BLOCK_COPIES:  # (slot, first column, end column) of each row's content, now and moved
                sources = [(s, p - sh, p - sh + n) for s, p, sh, n in zip(src, new_pads, shifts, lengths) if n]
                targets = [(d, p, p + n) for d, p, n in zip(dst, new_pads, lengths) if n]
            else:  # (rows, columns) of every entry: two kernels a buffer, however many rows
                lengths_t = device_tensor(lengths, device)
                row = torch.repeat_interleave(torch.arange(len(src), device=device), lengths_t, output_size=total)
                first = torch.cumsum(lengths_t, 0) - lengths_t
                dst_col = device_tensor(new_pads, device)[row] + torch.arange(total, device=device) - first[row]
                sources, targets = (src_t[row], dst_col - shift[row]), (dst_t[row], dst_col)
            gathered = [[_gather(layer, sources) for layer in buffers] for buffers in (cache.keys, cache.values)]
            moves.append((cache, targets, gathered, lengths))
        # 2. Write.
        layout.tokens[dst_t, :width] = tokens
        moved = [0] * len(src)
        for cache, targets, gathered, lengths in moves:
            for buffers, copies in zip((cache.keys, cache.values), gathered):
                for layer, copy in zip(buffers, copies):
                    _scatter(layer, targets, copy)
            moved = [m + n * cache.n_layers for m, n in zip(moved, lengths)]
        return moved


Where = list[tuple[int, int, int]] | tuple[torch.Tensor, torch.Tensor]  # spans (slot, first, end) or (rows, cols)
BLOCK_COPIES = {"cpu"}  # the devices on which ``SlotTable.realign`` copies a row's columns as one block


def _gather(layer: torch.Tensor, where: Where) -> torch.Tensor:
    """A copy of one layer's entries (a seam for fault-injection tests): spans, each a row's columns as one block,
    ``[kv_heads, entries, head_dim]``; or (rows, columns) index tensors, ``[entries, kv_heads, head_dim]``."""
    if isinstance(where, list):
        return torch.cat([layer[slot, :, first:end] for slot, first, end in where], 1)
    return layer[where[0], :, where[1]]


def _scatter(layer: torch.Tensor, where: Where, copy: torch.Tensor) -> None:
    """Write ``_gather``'s copy of entries to the places ``where`` names, in its order."""
    if isinstance(where, tuple):
        layer[where[0], :, where[1]] = copy
        return
    offset = 0
    for slot, first, end in where:
        layer[slot, :, first:end] = copy[:, offset : offset + end - first]
        offset += end - first
