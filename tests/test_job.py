"""done.py: StepNumbering (the steps of several engine runs as one sequence: resume, Ray blocks) and
what opening a job undoes when it is refused."""

from __future__ import annotations

import pytest
import torch

from batchspec_cli.config import GenerateConfig, UsageError
from batchspec_cli.engine.events import StepStats
from batchspec_cli.job.done import StepNumbering
from batchspec_cli.job.generation import Generation, work_dir_for
from batchspec_cli.store.checkpoint import WorkDir
from conftest import make_step


def steps(*numbers: int) -> list[StepStats]:
    return [make_step(step=n, group_kind="ar", accepted=[0], tokens_emitted=1, verify_ms=1.0, total_ms=1.0)
            for n in numbers]


def test_a_resumed_run_continues_after_the_saved_steps():
    numbering = StepNumbering(last=7)  # the interrupted run saved steps 1..7
    assert [numbering(s).step for s in steps(1, 2, 3)] == [8, 9, 10]


def test_runs_follow_each_other_in_arrival_order():
    numbering = StepNumbering()
    first = [numbering(s).step for s in steps(1, 2, 3)]
    numbering.next_run()
    second = [numbering(s).step for s in steps(1, 2)]
    numbering.next_run()
    third = [numbering(s).step for s in steps(1)]
    assert first + second + third == [1, 2, 3, 4, 5, 6]


def test_the_engine_event_is_not_changed():
    event = steps(2)[0]
    assert StepNumbering(last=5)(event).step == 7 and event.step == 2


def test_a_job_refused_for_a_held_lock_leaves_the_thread_count_as_it_was(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    inp.write_text('{"prompt": "hello"}\n')
    holder = WorkDir(work_dir_for(out))
    holder.lock()  # this process holds the output: another run of it is refused
    before = torch.get_num_threads()
    try:
        with pytest.raises(UsageError, match="being written by another batchspec run"):
            Generation.open(GenerateConfig(input=inp, output=out, threads=before + 1))
        assert torch.get_num_threads() == before
    finally:
        holder.unlock()
        torch.set_num_threads(before)


def test_the_job_numbers_the_steps_of_every_engine_run_and_of_a_resumed_one_as_one_sequence(tmp_path, tiny_model_dir):
    """The one place steps are numbered: an executor whose engine runs (each opened by a ``RunsOn``, as a Ray block's
    are) number their steps from 1, stopped after its first run and resumed, gives a statistics file of one
    sequence 1..n, the second run's after the saved steps."""
    import pyarrow.parquet as pq

    from batchspec_cli.job.assembly import RunsOn
    from batchspec_cli.engine.events import RowResult
    from batchspec_cli.store.outputs import stats_path_for

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    inp.write_text("".join(f'{{"prompt": "row {i}"}}\n' for i in range(6)))
    cfg = GenerateConfig(input=inp, output=out, target=str(tiny_model_dir), ray=True, quiet=True)

    def blocks_of_two(requests):  # each block a new engine run: steps 1, 2, then its rows
        requests = list(requests)
        for start in range(0, len(requests), 2):
            yield RunsOn(kernels="stock", dtype="float32", device="cpu")
            yield from steps(1, 2)
            yield from (RowResult(r.row, r.id, [5], "length") for r in requests[start:start + 2])

    with Generation.open(cfg) as job:
        for event in job.events(run=blocks_of_two):
            if isinstance(event, RowResult) and job.done_rows == 2:
                job.stop()
        assert job.interrupted and job.saved_rows == 2
    with Generation.open(cfg) as job:
        assert job.plan.last_step == 2
        list(job.events(run=blocks_of_two))
        job.finish()
    assert pq.read_table(stats_path_for(out)).column("step").to_pylist() == [1, 2, 3, 4, 5, 6]
