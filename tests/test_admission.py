"""Admission (which requests enter the pool, and when they are read) and the round as a function of its group:
invented requests with known answers, and one engine round checked for what it changes (the run's state only)."""

from __future__ import annotations

import contextlib
import copy

import torch

from batchspec_cli.engine.admission import Admission
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle, RoundOutcome
from batchspec_cli.engine.events import Request, RowResult, StepStats
from conftest import TINY_VOCAB_SIZE, make_tiny_llama


def requests(buckets: list[int], limit: int = 10) -> list[Request]:
    return [Request(row=i, id=str(i), prompt_ids=[5] * (i + 1), max_new_tokens=limit, bucket=b)
            for i, b in enumerate(buckets)]


class Pulled(list):
    """Requests that record how many were read."""

    def __iter__(self):
        for req in super().__iter__():
            self.read = getattr(self, "read", 0) + 1
            yield req


def test_chunks_are_one_bucket_of_at_most_a_batch_read_lazily():
    reqs = Pulled(requests([0, 0, 0, 1, 1, 2]))
    admission = Admission(reqs, batch_size=2)
    taken: set[int] = set()
    chunks = admission.chunks(list(range(5)), lambda s: s not in taken, lambda r: "no" if r.row == 4 else None)
    got = []
    for item in chunks:
        if isinstance(item, RowResult):
            got.append(("error", item.row, item.error))
            continue
        chunk, free = item
        got.append(([r.row for r in chunk], list(free)))
        taken.update(free[: len(chunk)])
    # 5 free slots: [0, 1] (a batch), [2] (row 3 is of bucket 1: held back), [3] (row 4 refused, row 5 of bucket 2
    # held back), [5]; then the stream is read ahead and found ended
    assert got == [([0, 1], [0, 1, 2, 3, 4]), ([2], [2, 3, 4]), ("error", 4, "no"), ([3], [3, 4]), ([5], [4])]
    assert reqs.read == 6 and admission.held_back is None and admission.exhausted


def test_tokens_left_counts_rows_in_flight_and_rows_to_come_at_the_mean_limit():
    admission = Admission(requests([0] * 6), batch_size=4)
    assert admission.tokens_left(0) == 0  # nothing admitted yet: no mean limit (none known)
    (chunk, _), = list(admission.chunks([0, 1], lambda s: False, lambda r: None))
    admission.admitted([10, 30])
    # 2 admitted (mean limit 20), 1 read ahead and held back, 3 still in the stream
    assert admission.pulled == 3 and admission.tokens_left(7) == 7 + 4 * 20
    streamed = Admission(iter(requests([0] * 3)), batch_size=4)  # no length: unknown until the stream ends
    list(streamed.chunks([0, 1], lambda s: False, lambda r: None))
    assert streamed.tokens_left(5) is None
    list(streamed.chunks([2], lambda s: False, lambda r: None))
    assert streamed.exhausted and streamed.tokens_left(5) == 5


def test_a_round_changes_the_run_it_is_handed_and_nothing_on_the_engine():
    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(copy.deepcopy(target), "cache"), [1],
                    EngineConfig(mode="exspec", k=3, batch_size=2, window=4))
    with contextlib.ExitStack() as models:
        run = engine._start(Admission(requests([0, 0, 0, 0], limit=6), engine.batch_size), models)
        events = engine._decode(run)
        first = next(e for e in events if isinstance(e, StepStats) and e.group_kind != "prefill")
        assert run.step == first.step
        group = engine.strategy.select(run.pool.view(), run.max_group, run.step)
        before = {name: (value if isinstance(value, (int, float, str, type(None))) else id(value))
                  for name, value in vars(engine).items()}
        outcome = engine._round(run, engine._prepare(run, group))
        after = {name: (value if isinstance(value, (int, float, str, type(None))) else id(value))
                 for name, value in vars(engine).items()}
        assert isinstance(outcome, RoundOutcome) and after == before  # the run's state, not the engine's, changes
        assert outcome.stats.step == first.step + 1 == run.step and outcome.stats.k == 3
        assert outcome.stats.tokens_emitted == 2 * 4  # a draft equal to the target: k drafts and the bonus, two rows
        events.close()
