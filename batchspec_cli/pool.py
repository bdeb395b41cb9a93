"""The engine's slot pool: one object owning every slot's tokens, KV caches and state.

A ``SlotPool`` holds the ``Layout`` (committed token ids), the target's and the draft's
``SlotCache``, the per-slot ``SlotState`` and the set of live slots. Each per-slot fact
has one home: a row's padded length ``end``, padding ``pad`` and draft reach ``draft_end`` are
host values in ``SlotState`` (the device gets a group's pads as a tensor when a forward
needs them); the live set is changed by ``place``, ``move`` and ``free`` only. Which rows
move where is decided in ``grouping`` (a ``MovePlan``); ``move`` carries a plan out with
``align.realign`` and the slot state as one unit, all or nothing.

KV memory follows the rows (``reserve``): the caches' buffers hold only the slots rows
were placed in (slots are taken lowest first, so that is about the live rows, never the
window or the batch size when fewer rows exist), and their columns are reserved at
admission for what the admitted rows can reach (``end + max_new_tokens + k + 1``), so
decoding never stops to grow them. A growth (a later, longer bucket) allocates first and
copies the live slots only; the buffers are zeroed once when allocated.
"""

from __future__ import annotations

import torch

from .align import Layout, SlotCache, device_tensor, realign
from .events import Request
from .grouping import MovePlan, Slots
from .slots import SlotState


class SlotPool:
    def __init__(self, n_slots: int, device: torch.device, with_draft: bool, capacity: int = 64):
        self.n_slots, self.device = n_slots, device
        self.layout = Layout.empty(n_slots, capacity, device)
        self.target = SlotCache(n_slots, capacity, rows=0)
        self.draft = SlotCache(n_slots, capacity, rows=0) if with_draft else None
        self.state = SlotState.empty(n_slots, device)
        self.live: list[int] = []  # sorted slots that hold a row
        self._set_live([])

    # ------------------------------------------------------------------ reading
    def view(self) -> Slots:
        """The host state ``grouping`` decides from (shared lists, not copies: read, don't write)."""
        state = self.state
        return Slots(state.end, state.pad, self.live, state.last_run)

    def free_slots(self) -> list[int]:
        return [s for s in range(self.n_slots) if self.state.rows[s] is None]

    def is_free(self, slot: int) -> bool:
        return self.state.rows[slot] is None

    def pads(self, slots: list[int]) -> torch.Tensor:
        """[G] left padding of the group's rows, on the device."""
        return device_tensor([self.state.pad[s] for s in slots], self.device)

    def caches(self, slots: list[int]) -> list[tuple[SlotCache, list[int]]]:
        """(cache, per-row lag) of both models for ``slots``: the target lags one column, the draft more."""
        state = self.state
        caches = [(self.target, [1] * len(slots))]
        if self.draft is not None:
            caches.append((self.draft, [state.end[s] - state.draft_end[s] for s in slots]))
        return caches

    # ------------------------------------------------------------------ changing
    def place(self, slots: list[int], requests: list[Request], end: int, keys: list[int], limits: list[int],
              pad_id: int, step: int) -> None:
        """Start rows in free slots, left-padded to the common padded length ``end``."""
        self.layout.place(device_tensor(slots, self.device), [r.prompt_ids for r in requests], end, pad_id)
        self.state.place(slots, requests, end, keys, limits, self.device)
        for slot in slots:
            self.state.last_run[slot] = step
        self._set_live(sorted(self.live + slots))

    def commit(self, slot: int, emitted: int, draft_refed: bool, step: int) -> None:
        """A round's host side for one row: it gained ``emitted`` tokens at ``step``."""
        state = self.state
        state.end[slot] += emitted  # before any stop-string cut: the layout's tokens run to here
        state.last_run[slot] = step
        if draft_refed:
            state.draft_end[slot] = state.end[slot] - 2  # the draft is re-fed the last two committed tokens

    def move(self, plan: MovePlan) -> tuple[int, int]:
        """Carry out a plan: KV and tokens first (all or nothing), then the slot state as a unit.

        Returns the KV entries (token x layer) copied for rows whose padded length changed
        (realignment) and for rows that only changed slot (assembly), counted by ``realign``
        from the index tensors it used.
        """
        if not plan.moves:
            return 0, 0
        state = self.state
        src, dst = [s for s, _, _ in plan.moves], [d for _, d, _ in plan.moves]
        ends = [state.end[s] for s in src]
        per_row = realign(self.layout, self.caches(src), src, dst, ends, [e for _, _, e in plan.moves],
                          [state.pad[s] for s in src])
        state.move(plan.moves, device_tensor(src, self.device), device_tensor(dst, self.device))
        self._set_live(state.live())
        realigned = sum(n for n, old, (_, _, new) in zip(per_row, ends, plan.moves) if new != old)
        return realigned, sum(per_row) - realigned

    def free(self, slot: int) -> Request:
        """Empty a slot; returns the request that lived there."""
        req = self.state.rows[slot]
        self.state.clear(slot)
        self._set_live([s for s in self.live if s != slot])
        return req

    def reserve(self, slots: list[int], columns: int) -> None:
        """Room for rows about to be placed in ``slots``, which can reach ``columns`` columns.

        The buffers must hold the slots (an out-of-memory error is raised, and nothing the
        pool holds has changed, when they cannot); the columns are reserved when they fit,
        else left for the forward that needs them (it grows to exactly that).
        """
        rows = max(slots) + 1
        for cache in (self.target, self.draft):
            if cache is not None:
                try:
                    cache.grow(columns, rows)
                except torch.OutOfMemoryError:  # CacheFull included: the slots alone, then
                    cache.grow(cache.capacity, rows)
        self.layout.grow(columns)

    def _set_live(self, live: list[int]) -> None:
        self.live = live
        for cache in (self.target, self.draft):
            if cache is not None:
                cache.live = live
