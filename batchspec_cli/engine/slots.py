"""Per-slot row state of the engine's pool, as one object that moves as a unit.

A *slot* holds one in-flight row. What the round's tensors need lives on the device as
``[slots]`` tensors (completion position, noise key, sampling settings); everything
the host decides with lives in host lists, updated at the round's one sync (the request, its
limit, when it last ran, its committed completion ids and counters). A slot's geometry
(padded length, padding, draft reach, whether a row lives there) is not here: it is
``align.SlotTable``'s alone. ``move`` carries every field from source to destination slots at
once, so a realignment or a group's assembly can never leave one field behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterable

import torch

from .events import Request

DEVICE_FIELDS = ("gen", "keys", "temperature", "top_k", "top_p")


@dataclass
class SlotState:
    # device, [slots]
    gen: torch.Tensor  # [slots] int64 completion tokens committed
    keys: torch.Tensor  # [slots] int64 row key of the Gumbel noise
    temperature: torch.Tensor  # [slots] float64 (0: greedy)
    top_k: torch.Tensor  # [slots] int64 (0: off)
    top_p: torch.Tensor  # [slots] float64 (1: off)
    # host, per slot
    rows: list = field(default_factory=list)  # Request (None once its slot is freed; liveness: SlotTable.live)
    limit: list = field(default_factory=list)  # the most completion tokens the row may have (worked out at admission)
    last_run: list = field(default_factory=list)  # step at which the row last ran
    ids: list = field(default_factory=list)  # committed completion ids (a list per live slot)
    drafted: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    rounds: list = field(default_factory=list)

    @classmethod
    def empty(cls, n: int, device: torch.device) -> "SlotState":
        zeros = torch.zeros(n, dtype=torch.long, device=device)
        host_lists = {f.name: [None if f.name in ("rows", "ids") else 0] * n for f in fields(cls)
                if f.name not in DEVICE_FIELDS}
        return cls(gen=zeros, keys=zeros.clone(),
                   temperature=torch.zeros(n, dtype=torch.float64, device=device), top_k=zeros.clone(),
                   top_p=torch.ones(n, dtype=torch.float64, device=device), **host_lists)

    def place(self, slots: list[int], requests: list[Request], keys: list[int], limits: list[int], step: int,
              device) -> None:
        """Start rows in free slots at ``step``."""
        idx = torch.tensor(slots, dtype=torch.long, device=device)
        self.gen[idx] = 0
        self.keys[idx] = torch.tensor(keys, device=device)
        self.temperature[idx] = torch.tensor([r.sampling.temperature for r in requests], dtype=torch.float64,
                                             device=device)
        self.top_k[idx] = torch.tensor([r.sampling.top_k for r in requests], device=device)
        self.top_p[idx] = torch.tensor([r.sampling.top_p for r in requests], dtype=torch.float64, device=device)
        for s, req, limit in zip(slots, requests, limits):
            self.rows[s], self.limit[s], self.last_run[s] = req, limit, step
            self.ids[s] = []
            self.drafted[s] = self.accepted[s] = self.rounds[s] = 0

    def tokens_left(self, slots: Iterable[int]) -> list[int]:
        """[len(slots)] completion tokens each row may still commit: its limit less what it has committed."""
        return [self.limit[s] - len(self.ids[s]) for s in slots]

    def clear(self, slot: int) -> None:
        self.rows[slot], self.ids[slot] = None, None

    def move(self, plan: list[tuple[int, int, int]], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Carry every field of rows ``(src slot, dst slot, new padded length)`` along; src/dst as device indices.

        Sources are read before anything is written (a permutation is fine); a source slot
        that no row moves into is cleared.
        """
        for name in DEVICE_FIELDS:
            tensor = getattr(self, name)
            tensor[dst] = tensor[src]
        snapshot = [{name: getattr(self, name)[s] for name in HOST_FIELDS} for s, _, _ in plan]
        destinations = {d for _, d, _ in plan}
        for s, _, _ in plan:
            if s not in destinations:
                self.clear(s)
        for (_, d, _), row in zip(plan, snapshot):
            for name, value in row.items():
                getattr(self, name)[d] = value


HOST_FIELDS = tuple(f.name for f in fields(SlotState) if f.name not in DEVICE_FIELDS)
