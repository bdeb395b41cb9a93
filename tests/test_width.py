"""--batch-size auto: the width is chosen from measured plain-step rates (a pure choice, tested on invented rates),
and a run at the width it chose gives every row its per-prompt decoding."""

from __future__ import annotations

import random

import pytest
import torch

from batchspec_cli.engine.core import AUTO_WIDTHS, Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult, StepStats, WidthChosen
from batchspec_cli.models.attention import kv_column_bytes
from batchspec_cli.policy.control import choose_width, wider_pays
from conftest import TINY_VOCAB_SIZE, greedy_reference, make_tiny_llama

torch.set_num_threads(1)


def test_a_wider_batch_is_measured_only_while_the_last_one_paid():
    assert wider_pays({8: 100.0})
    assert wider_pays({8: 100.0, 16: 180.0})
    assert not wider_pays({8: 100.0, 16: 104.0})  # under 5 % more: stop
    assert not wider_pays({8: 100.0, 16: 180.0, 32: 150.0})


def test_the_narrowest_width_within_five_percent_of_the_best_is_kept():
    assert choose_width({8: 100.0, 16: 180.0, 32: 260.0, 64: 270.0}) == 32  # 64 is not 5 % better than 32
    assert choose_width({8: 100.0, 16: 90.0}) == 8
    assert choose_width({8: 100.0, 16: 180.0, 32: 400.0, 64: 300.0}) == 32
    with pytest.raises(ValueError):
        choose_width({})


class Timed(Engine):
    """An engine whose bare steps take invented times: a step costs 1 + width / 32 time units."""

    def _bare_step(self, width: int, context: int):
        return 1.0 + width / 32


def requests(n: int, max_new: int = 9) -> list[Request]:
    rng = random.Random(5)
    return [Request(row=i, id=f"r{i}", prompt_ids=[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(rng.randint(1, 12))],
                    max_new_tokens=max_new) for i in range(n)]


def run(engine: Engine, reqs: list[Request]):
    events = list(engine.run(reqs))
    chosen = [e for e in events if isinstance(e, WidthChosen)]
    rows = {e.row: e for e in events if isinstance(e, RowResult)}
    steps = [e for e in events if isinstance(e, StepStats) and e.group_kind != "prefill"]
    return chosen, rows, steps


@pytest.mark.parametrize("mode", ["ar", "auto"])
def test_auto_width_runs_at_the_measured_width_and_every_row_equals_greedy(mode):
    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    reqs = requests(40)
    cfg = EngineConfig(mode=mode, batch_size=AUTO_WIDTHS[-1], auto_width=True)
    engine = Timed(ModelHandle(target, "cache"), None, [1], cfg)
    chosen, rows, steps = run(engine, reqs)
    # rates w / (1 + w/32): 8: 6.4, 16: 10.7, 32: 16, 64: 21.3 (the job's 40 rows: no wider); all pay 5 %
    assert len(chosen) == 1 and sorted(chosen[0].rates) == [8, 16, 32, 64] and chosen[0].width == 64
    assert engine.batch_size == 64 and max(s.batch_size for s in steps) == 40  # every row in one batch
    for req in reqs:
        assert rows[req.row].token_ids == greedy_reference(target, req.prompt_ids, req.max_new_tokens, [1])
    again, _, _ = run(engine, reqs)  # a later run (a Ray worker's next block) keeps the width it measured
    assert again == []


def test_the_kv_memory_budget_bounds_the_width():
    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    reqs = requests(200)
    longest = max(len(r.prompt_ids) for r in reqs[:1]) + 9 + 1  # the first row, at its full length
    cfg = EngineConfig(mode="ar", batch_size=AUTO_WIDTHS[-1], auto_width=True,
                       kv_memory=16 * longest * kv_column_bytes(target))
    chosen, rows, steps = run(Timed(ModelHandle(target, "cache"), None, [1], cfg), reqs)
    assert sorted(chosen[0].rates) == [8, 16] and chosen[0].width == 16 and "memory" in chosen[0].stopped
    assert max(s.batch_size for s in steps) <= 16 and len(rows) == 200


def test_a_real_measurement_picks_a_measured_width():
    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    cfg = EngineConfig(mode="ar", batch_size=AUTO_WIDTHS[-1], auto_width=True)
    chosen, rows, _ = run(Engine(ModelHandle(target, "cache"), None, [1], cfg), requests(20))
    assert chosen[0].width in chosen[0].rates and all(rate > 0 for rate in chosen[0].rates.values())
    assert len(rows) == 20


class Recorded(Timed):
    """A Timed engine that keeps the contexts its bare steps were asked for."""

    contexts: list[int]

    def _bare_step(self, width: int, context: int):
        self.contexts.append(context)
        return super()._bare_step(width, context)


def test_widths_are_timed_at_the_median_rows_context_and_bounded_by_the_longest_row():
    from batchspec_cli.job.generation import Counted, median_padded

    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    reqs = requests(40)  # prompts of 1-12 tokens; the job says its median row is padded to 30, its longest to 200
    cfg = EngineConfig(mode="ar", batch_size=AUTO_WIDTHS[-1], auto_width=True,
                       kv_memory=16 * (200 + 9 + 1) * kv_column_bytes(target))
    engine = Recorded(ModelHandle(target, "cache"), None, [1], cfg)
    engine.contexts = []
    events = list(engine.run(Counted(reqs, len(reqs), longest=200, typical=30)))
    chosen = [e for e in events if isinstance(e, WidthChosen)]
    assert set(engine.contexts) == {30 + 9 // 2}  # not the first row's 1-12 tokens
    assert sorted(chosen[0].rates) == [8, 16] and "memory" in chosen[0].stopped  # 32 rows of 210 columns do not fit
    assert len([e for e in events if isinstance(e, RowResult)]) == 40

    class B:  # a manifest's bucket: its padded length and its rows
        def __init__(self, hi, rows):
            self.hi, self.rows = hi, rows

    assert median_padded([B(100, 1), B(10, 5), B(50, 3)]) == 10  # rows 1-5 of 9 are padded to 10
    assert median_padded([B(10, 2), B(50, 3), B(100, 4)]) == 50  # the 5th of 9 rows
    assert median_padded([]) is None


def test_a_width_measured_before_on_this_machine_is_run_again_and_a_new_shape_is_measured(tmp_path):
    from batchspec_cli.job.generation import Counted
    from batchspec_cli.models.widths import WidthMemory

    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    memory = WidthMemory(tmp_path / "cache" / "widths.json", {"machine": "this one"})

    def job(typical: int, kv_memory: int | None = None):
        cfg = EngineConfig(mode="ar", batch_size=AUTO_WIDTHS[-1], auto_width=True, width_memory=memory,
                           kv_memory=kv_memory)
        engine = Recorded(ModelHandle(target, "cache"), None, [1], cfg)
        engine.contexts = []
        reqs = requests(40)
        events = list(engine.run(Counted(reqs, len(reqs), longest=20, typical=typical)))
        rows = {e.row: e.token_ids for e in events if isinstance(e, RowResult)}
        return [e for e in events if isinstance(e, WidthChosen)][0], engine.contexts, rows

    first, timed, rows = job(typical=20)
    assert timed and not first.remembered and first.width == 64  # measured (Timed: every width pays)
    again, timed, rows_again = job(typical=20)
    assert timed == [] and again.remembered and again.width == 64 and again.rates == first.rates
    assert rows_again == rows
    other, timed, _ = job(typical=300)  # another context: another shape, measured
    assert timed and not other.remembered
    squeezed, timed, _ = job(typical=20, kv_memory=16 * (20 + 9 + 1) * kv_column_bytes(target))  # no longer fits
    assert timed and not squeezed.remembered and squeezed.width == 16


def test_the_width_memory_reads_nothing_through_a_symlink_and_survives_a_bad_file(tmp_path):
    from batchspec_cli.models.widths import WidthMemory

    elsewhere = tmp_path / "not_ours.json"
    elsewhere.write_text('{"x": 1}')
    link = tmp_path / "widths.json"
    link.symlink_to(elsewhere)
    memory = WidthMemory(link, {})
    memory.remember({"a": 1}, 8, {8: 1.0})
    assert memory.recall({"a": 1}) is None and elsewhere.read_text() == '{"x": 1}'  # neither read nor written
    path = tmp_path / "own" / "widths.json"
    path.parent.mkdir()
    path.write_text("not json")
    memory = WidthMemory(path, {"m": 1})
    assert memory.recall({"a": 1}) is None
    memory.remember({"a": 1}, 16, {8: 1.0, 16: 3.0})
    assert memory.recall({"a": 1}) == (16, {8: 1.0, 16: 3.0}) and memory.recall({"a": 2}) is None
    assert WidthMemory(path, {"m": 2}).recall({"a": 1}) is None  # another machine's facts
    assert [p.name for p in path.parent.iterdir()] == ["widths.json"]  # no temporary file left
