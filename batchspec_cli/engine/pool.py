"""The engine's slot pool: the slot table and the rows' state, moved as one unit.

A ``SlotPool`` holds the ``align.SlotTable`` (every slot's geometry, the committed tokens and
both models' KV caches, each fact in one home) and the per-slot ``SlotState`` (the request,
its limit, completion ids, counters and the round's ``[slots]`` tensors). Which rows move
where is decided in ``grouping`` (a ``MovePlan``); ``move`` carries a plan out through the
table (tokens, KV and geometry, all or nothing) and the row state, as one unit.

KV memory follows the rows (``reserve``): the caches' buffers hold only the slots rows
were placed in (slots are taken lowest first, so that is about the live rows, never the
window or the batch size when fewer rows exist), and their columns are reserved at
admission for what the admitted rows can reach (``end + max_new_tokens + k + 1``), so
decoding never stops to grow them. A growth (a later, longer bucket) allocates first and
copies the live slots only; the buffers are zeroed once when allocated.
"""

from __future__ import annotations

import torch

from ..policy.grouping import MovePlan, Slots
from .align import SlotTable, device_tensor
from .events import Request
from .slots import SlotState


class SlotPool:
    def __init__(self, n_slots: int, device: torch.device, with_draft: bool, capacity: int = 64):
        self.n_slots, self.device = n_slots, device
        self.table = SlotTable(n_slots, device, with_draft, capacity)
        self.state = SlotState.empty(n_slots, device)

    def view(self) -> Slots:
        """The host state ``grouping`` decides from (shared lists, not copies: read, don't write)."""
        table = self.table
        return Slots(table.end, table.pad, table.live, self.state.last_run)

    def place(self, slots: list[int], requests: list[Request], end: int, keys: list[int], limits: list[int],
              pad_id: int, step: int) -> None:
        """Start rows in free slots, left-padded to the common padded length ``end``."""
        self.table.place(slots, [r.prompt_ids for r in requests], end, pad_id)
        self.state.place(slots, requests, keys, limits, step, self.device)

    def commit(self, slot: int, emitted: int, draft_refed: bool, step: int) -> None:
        """A round's host side for one row: it gained ``emitted`` tokens at ``step``."""
        self.table.commit(slot, emitted, draft_refed)
        self.state.last_run[slot] = step

    def move(self, plan: MovePlan) -> tuple[int, int]:
        """Carry out a plan: tokens, KV and geometry first (all or nothing), then the row state.

        Returns the KV entries (token x layer) copied for rows whose padded length changed
        (realignment) and for rows that only changed slot (assembly), counted by the table
        from the index tensors it used.
        """
        if not plan.moves:
            return 0, 0
        src, dst = [s for s, _, _ in plan.moves], [d for _, d, _ in plan.moves]
        ends = [self.table.end[s] for s in src]
        per_row = self.table.move(plan.moves)
        self.state.move(plan.moves, device_tensor(src, self.device), device_tensor(dst, self.device))
        realigned = sum(n for n, old, (_, _, new) in zip(per_row, ends, plan.moves) if new != old)
        return realigned, sum(per_row) - realigned

    def free(self, slot: int) -> Request:
        """Empty a slot; returns the request that lived there."""
        req = self.state.rows[slot]
        self.state.clear(slot)
        self.table.free(slot)
        return req

    def reserve(self, slots: list[int], columns: int, rows: int = 0) -> None:
        """Room for rows about to be placed in ``slots`` (``SlotTable.reserve``)."""
        self.table.reserve(slots, columns, rows)
