"""Grouping on invented slot states: which rows run together, and which rows move where (no model, no tensor)."""

from __future__ import annotations

from batchspec_cli.policy.grouping import MovePlan, Pool, Slots, StaticBatch, assemble, cheapest_window, select_group
from batchspec_cli.policy.grouping import target_end


def slots(*rows, n: int | None = None, last_run=None) -> Slots:
    """Slots from (end, pad) pairs, None for a free slot."""
    n = n or len(rows)
    rows = list(rows) + [None] * (n - len(rows))
    end = [r[0] if r else 0 for r in rows]
    pad = [r[1] if r else 0 for r in rows]
    live = [s for s, r in enumerate(rows) if r]
    return Slots(end, pad, live, list(last_run) if last_run else [0] * n)


def test_the_docstring_example():
    view = slots((20, 10), (12, 7), None, (20, 2), None, (12, 0))
    assert cheapest_window(view, [0, 3], 6) == (2, 10) and cheapest_window(view, [1, 5], 6) == (4, 5)
    assert select_group(view, 2, 1.0, step=0, starve_after=8) == [1, 5]
    assert target_end(view, [1, 5]) is None
    assert Pool(6, 2, 1.0, True).plan(view, [1, 5]) == MovePlan([4, 5], [(1, 4, 12)], False)


def test_the_cheapest_window_moves_the_fewest_kv_entries_not_the_fewest_rows():
    # slot 0: member, 100 tokens; slot 1: another row, 5 tokens; slot 4: member, 5 tokens; the rest free.
    view = slots((100, 0), (100, 95), None, None, (100, 95), None)
    assert cheapest_window(view, [0, 4], 6) == (0, 10)  # [0, 2) moves two short rows; [3, 5) the long one (100)
    plan = assemble(view, [0, 4], None, 6)
    assert plan.slots == [0, 1] and sorted(plan.moves) == [(1, 4, 100), (4, 1, 100)]  # a trade of places
    assert not plan.realigns


def test_target_end_keeps_a_shared_length_and_brings_a_mixed_group_to_the_most_common_reachable_end():
    assert target_end(slots((30, 10), (30, 4)), [0, 1]) is None
    # ends 30, 30, 28: 30 is reachable by every row (longest content 26) and most rows have it
    assert target_end(slots((30, 10), (30, 4), (28, 2)), [0, 1, 2]) == 30
    # a row whose content (35) is past every other end forces the longest content
    assert target_end(slots((30, 10), (40, 5)), [0, 1]) == 40
    # every row keeps >= 16 pad columns: trimmed to the longest content, unless trimming is off
    view = slots((60, 50), (60, 40))
    assert target_end(view, [0, 1]) == 20 and target_end(view, [0, 1], trim=False) is None


def test_select_group_takes_the_largest_same_length_core_and_tops_it_up_with_the_nearest_lengths():
    view = slots((30, 10), (30, 5), (32, 3), (50, 2), (29, 0), n=6)
    assert select_group(view, 2, 1.0, step=0, starve_after=8) == [0, 1]  # a full same-length group
    # three rows wanted, two share 30: the third is the nearest length whose content fits (29, content 29)
    assert select_group(view, 3, 1.0, step=0, starve_after=8) == [0, 1, 4]
    # min_group 0.5: a core of 2 out of 3 runs alone
    assert select_group(view, 3, 0.5, step=0, starve_after=8) == [0, 1]


def test_a_starving_row_runs_next():
    view = slots((30, 10), (30, 5), (44, 3), last_run=[9, 9, 0])
    assert select_group(view, 2, 1.0, step=9, starve_after=8) == [0, 2]  # slot 2 waited 9 steps
    assert select_group(view, 2, 1.0, step=8, starve_after=8) == [0, 1]


def test_the_pool_moves_nothing_for_a_same_length_group_in_one_slot_range():
    pool = Pool(window=8, batch_size=2, min_group=1.0, trim=True)
    view = slots((30, 10), (30, 5), (31, 3), n=8)
    assert pool.plan(view, [0, 1]) == MovePlan([0, 1])
    plan = pool.plan(view, [1, 2])  # mixed: realigned to 30 (the end most rows have, reachable by both)
    assert plan.realigns and plan.slots == [1, 2] and plan.moves == [(2, 2, 30)]


def test_a_static_batch_realigns_to_the_end_most_rows_have_and_compacts_into_the_first_slots():
    batch = StaticBatch(4)
    assert batch.plan(slots((12, 2), (12, 0), n=4), [0, 1]) == MovePlan([0, 1])
    plan = batch.plan(slots((13, 2), (12, 0), n=4), [0, 1])  # contents 11 and 12: both to end 12
    assert plan == MovePlan([0, 1], [(0, 0, 12)], True)
    joined = batch.plan(slots((40, 4), (40, 9), (20, 0), n=4), [0, 1, 2])  # a row admitted at 20 joins the two at 40
    assert joined == MovePlan([0, 1, 2], [(2, 2, 40)], True)  # only it moves: the others keep their place
    trimmed = batch.plan(slots((60, 20), (60, 25), n=4), [0, 1])  # 20 columns of padding in every row: trimmed
    assert trimmed == MovePlan([0, 1], [(0, 0, 40), (1, 1, 40)], True)
    hole = batch.plan(slots(None, (12, 0), (12, 3), n=4), [1, 2])  # a finished row left slot 0 empty
    assert hole == MovePlan([0, 1], [(1, 0, 12), (2, 1, 12)], False)
