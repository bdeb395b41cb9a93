"""Which rows run together, and which rows move where: pure functions of the slots' host state.

Nothing here touches a tensor. Every function reads a ``Slots`` view (each slot's padded
length ``end``, left padding ``pad``, whether a row lives there, the step it last ran) and
returns slots or a ``MovePlan``; ``pool.SlotPool.move`` carries a plan out. Two strategies
use them:

- ``StaticBatch`` (``ar``, ``eqspec``): the group is every live row, brought to one padded
  length (``target_end``) and compacted into slots ``0..n-1`` whenever lengths differ or
  finished rows left holes (unpad -> append -> repad).
- ``Pool`` (``exspec``, ``auto``): a window of slots; each step runs the largest group of
  rows with one padded length (``select_group``), topped up with the rows closest in length
  when it is smaller than ``min_group`` x the batch; the group is brought to one padded
  length (``target_end``) in the contiguous slot range that copies the least KV
  (``cheapest_window``).

Worked example (window 6, batch 2; ``end/pad`` per slot, ``-`` free)::

    slot:   0      1      2      3      4      5
          20/10  12/7   -      20/2   -      12/0

    select_group: ends 20 and 12 both have two rows, so the core is the pair cheaper to
    bring into one slot range (cheapest_window; a move costs the row's content):
      [0, 3] -> range [2, 4): slot 0 (content 10) moves into free slot 2, cost 10
      [1, 5] -> range [4, 6): slot 1 (content 5) moves into free slot 4, cost 5
    target_end of [1, 5] is None (both end at 12), so the plan only assembles:
    MovePlan(slots=[4, 5], moves=[(1, 4, 12)], realigns=False), a ``same_length`` step.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

TRIM_MIN, TRIM_FRACTION = 16, 8  # trim shared padding of at least max(16, end / 8) columns


@dataclass
class Slots:
    """The host state grouping decides from, one entry per slot."""

    end: list[int]  # [slots] padded length (column after the last committed token)
    pad: list[int]  # [slots] left padding
    live: list[int]  # sorted slots that hold a row
    last_run: list[int] = field(default_factory=list)  # [slots] step at which the row last ran

    def content(self, slot: int) -> int:
        return self.end[slot] - self.pad[slot]


@dataclass(frozen=True)
class MovePlan:
    """Moves that bring a group into one rectangle in one contiguous slot range.

    ``moves``: (source slot, destination slot, new padded length) of every row that changes
    slot or length (rows of the group and rows they trade places with); sources are read
    before anything is written. ``realigns``: the decision that the group's rows change
    padded length (a ``realigned`` step); otherwise the moves only assemble rows that
    already share one length (a ``same_length`` step).
    """

    slots: list[int]  # the group's slots once the moves are done
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    realigns: bool = False


def is_run(slots: list[int]) -> bool:
    """Whether the slots are one ascending contiguous run (the group reads views)."""
    return slots == list(range(slots[0], slots[0] + len(slots)))


def target_end(view: Slots, slots: list[int], trim: bool = True) -> int | None:
    """The padded length a pooled group runs at, or None to keep the one its rows share.

    Any end at or past the group's longest content is reachable (rows shift left into
    their padding or right). Of those, the end most rows already have (fewest moved),
    unless it leaves at least max(16, end / 8) pad columns in every row: then the
    longest content. A pad column costs every later round an attention read per row
    and layer (target and draft); a move copies a row's content once.
    """
    floor = max(2, max(view.content(s) for s in slots))  # the draft re-reads 2 columns
    ends = Counter(view.end[s] for s in slots if view.end[s] >= floor)
    end = max(ends.items(), key=lambda item: (item[1], -item[0]))[0] if ends else floor
    if trim and end - floor >= max(TRIM_MIN, end // TRIM_FRACTION):
        end = floor
    if len(ends) == 1 and ends[end] == len(slots):
        return None  # every row already ends there
    return end


def cheapest_window(view: Slots, slots: list[int], n_slots: int) -> tuple[int, int]:
    """(first slot, KV columns moved) of the contiguous range that takes ``slots`` most cheaply.

    Moving the group into [a, a+G) moves every member outside the range and every other
    live row inside it (it trades places with a member); each costs its content length
    (``realign`` copies content only), so a long row stays put when a short one can move.
    """
    size, members, live = len(slots), set(slots), set(view.live)
    content = [view.content(s) if s in live else 0 for s in range(n_slots)]
    # cost(a) = (members' content outside) + (other rows' content inside), from running sums over the slots
    weight = [-content[s] if s in members else content[s] for s in range(n_slots)]
    cost = sum(content[s] for s in slots) + sum(weight[:size])
    best = (0, cost)
    for a in range(1, n_slots - size + 1):
        cost += weight[a + size - 1] - weight[a - 1]
        if cost < best[1]:
            best = (a, cost)
    return best


def assembly_cost(view: Slots, slots: list[int], n_slots: int) -> int:
    return 0 if is_run(slots) else cheapest_window(view, slots, n_slots)[1]


def assemble(view: Slots, slots: list[int], new_end: int | None, n_slots: int) -> MovePlan:
    """The plan that makes ``slots`` one contiguous range, at padded length ``new_end`` (None: each keeps its own).

    A live row in a slot the group needs trades places with the member that comes in.
    """
    a, _ = cheapest_window(view, slots, n_slots)
    target = range(a, a + len(slots))
    incoming = [s for s in slots if s not in target]
    opening = [d for d in target if d not in slots]  # as many as incoming
    plan = [(s, s) for s in slots if s in target] + list(zip(incoming, opening))
    moves = [(s, d, view.end[s] if new_end is None else new_end) for s, d in plan]
    moves += [(d, s, view.end[d]) for s, d in zip(incoming, opening) if d in set(view.live)]
    return MovePlan(list(target), [m for m in moves if m[0] != m[1] or view.end[m[0]] != m[2]], new_end is not None)


def select_group(view: Slots, size: int, min_group: float, step: int, starve_after: int) -> list[int]:
    """The next pooled group (sorted slots) of at most ``size`` rows.

    The *core* is the largest group of rows with one padded length, or the longest-waiting
    row's group when a row has waited more than ``starve_after`` steps. Among the ways to
    take it (runs of ``size`` in slot order), the one cheapest to bring into one slot range
    wins, then the one that waited longest (rows admitted together stay together). A core
    of at least ``min_group`` x ``size`` runs alone; a smaller one is topped up with the
    rows closest to it in length (rows whose content fits the core's length first: only
    they move).
    """
    live = view.live
    size = min(size, len(live))
    oldest = min(live, key=lambda s: view.last_run[s])
    n_slots = len(view.end)

    def best_run(same: list[int], must: int | None = None) -> list[int]:
        starts = range(len(same) - size + 1) if must is None else \
            range(max(0, same.index(must) - size + 1), min(same.index(must), len(same) - size) + 1)
        runs = [same[j : j + size] for j in starts] or [same]
        return min(runs, key=lambda c: (assembly_cost(view, c, n_slots), sum(view.last_run[s] for s in c)))

    if step - view.last_run[oldest] > starve_after:
        core = best_run([s for s in live if view.end[s] == view.end[oldest]], oldest)
    else:
        by_end = Counter(view.end[s] for s in live)
        best_n = min(size, max(by_end.values()))
        candidates = [best_run([s for s in live if view.end[s] == e]) for e, n in sorted(by_end.items())
                      if min(n, size) == best_n]
        core = min(candidates, key=lambda c: assembly_cost(view, c, n_slots))
    if len(core) >= max(1, math.ceil(min_group * size)):
        return sorted(core)
    end, members = view.end[core[0]], set(core)
    rest = sorted((s for s in live if s not in members),
                  key=lambda s: (view.content(s) > end, abs(view.end[s] - end), s))
    return sorted(core + rest[: size - len(core)])


class StaticBatch:
    """``ar`` / ``eqspec``: a batch of ``batch_size`` slots that runs as one rectangle in slots 0..n-1."""

    def __init__(self, batch_size: int):
        self.n_slots = batch_size
        self.admit_at = max(1, batch_size // 4)  # refill once a quarter of the batch is free (continuous batching)

    def select(self, view: Slots, size: int, step: int) -> list[int]:
        return view.live[:size]

    def plan(self, view: Slots, slots: list[int]) -> MovePlan:
        """Every live row to one padded length (``target_end``: the one most rows have, unless they all carry enough
        padding to trim), compacted into slots 0..n-1, when lengths differ or holes exist."""
        live = view.live
        new_end = target_end(view, live)
        if new_end is None and is_run(live) and live[0] == 0:
            return MovePlan(slots)
        end = view.end[live[0]] if new_end is None else new_end
        moves = [(s, d, end) for d, s in enumerate(live) if s != d or view.end[s] != end]
        return MovePlan(list(range(len(slots))), moves, new_end is not None)


class Pool:
    """``exspec`` / ``auto``: a window of slots, same-length groups, the EQSPEC fallback for the rest."""

    def __init__(self, window: int, batch_size: int, min_group: float, trim: bool):
        self.n_slots, self.batch_size = window, batch_size
        # Admitted rows form one same-length group: a whole batch at a time when the window has room for more
        # than one; a window of one batch refills as soon as a quarter is free, as a static batch does.
        self.admit_at = batch_size if window >= 2 * batch_size else max(1, batch_size // 4)
        self.min_group, self.trim = min_group, trim

    def select(self, view: Slots, size: int, step: int) -> list[int]:
        starve_after = 2 * max(1, self.n_slots // self.batch_size)
        return select_group(view, size, self.min_group, step, starve_after)

    def plan(self, view: Slots, slots: list[int]) -> MovePlan:
        """A mixed group to one padded length (the fallback), a same-length one trimmed or gathered together."""
        new_end = target_end(view, slots, self.trim)
        if new_end is None and is_run(slots):
            return MovePlan(slots)
        return assemble(view, slots, new_end, self.n_slots)
