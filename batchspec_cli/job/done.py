"""What a job has already done: which output rows are finished, how its steps are numbered, and what the drafters
learn again of the rows an interrupted run saved.

A row is done when an interrupted run of the job saved it (``plan.resumed``: read once, when the job opened, from the
checkpoint parts by ``checkpoint.WorkDir.load``), when its prompt failed before generation (``plan.announce``), or
once this run finishes it (``Done.record``). Steps are numbered here and nowhere else: ``StepNumbering`` makes the
engine's per-run step numbers one sequence after the saved ones, whether the job runs one engine or a Ray block per
engine run::

    saved steps 1..7;  engine run A: 1 2 3  ->  8 9 10;  engine run B (a later Ray block): 1 2  ->  11 12
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from ..engine.events import StepStats
from ..policy import lookup
from ..store import outputs
from ..store.buckets import PROMPT_IDS_COLUMN, ROW_COLUMN, iter_bucket_rows
from ..store.checkpoint import WorkDir
from .plan import JobPlan

Preload = tuple[list[int], list[int] | None]  # a saved row as the drafters learn it: (prompt, completion or None)


class StepNumbering:
    """The steps of several engine runs as one sequence, as the statistics file numbers them.

    Every run numbers its own steps from the start; ``next_run()`` makes the following run's
    steps continue after the highest step numbered so far: a resumed job's after the saved
    ones (``last``), each Ray block's after the blocks that arrived before it.
    """

    def __init__(self, last: int = 0):
        self.last = last  # the highest step numbered so far
        self.base = last  # added to the current run's steps

    def next_run(self) -> None:
        self.base = self.last

    def __call__(self, stats: StepStats) -> StepStats:
        stats = dataclasses.replace(stats, step=stats.step + self.base)
        self.last = max(self.last, stats.step)
        return stats


class Done:
    """Which output rows of a job are done (``before``: when this run started; ``mask``: now) and the job's
    ``steps``."""

    def __init__(self, plan: JobPlan, work: WorkDir):
        self.plan, self.work = plan, work
        self.before = np.zeros(plan.total_rows, dtype=bool)  # [output rows] saved, or failed before generation
        self.before[plan.resumed] = True
        self.before[[r.row for r in plan.announce]] = True
        self.mask = self.before.copy()  # [output rows] done before this run, or finished by it
        self.rows = int(self.mask.sum())
        self.steps = StepNumbering(last=plan.last_step)

    def record(self, row: int) -> None:
        """A row finished in this run."""
        if self.mask[row]:
            raise RuntimeError(f"row {row} finished twice")
        self.mask[row] = True
        self.rows += 1

    def preloads(self) -> list[Preload]:
        """The rows an interrupted run saved, as the drafters learn them again: (prompt, completion or None for an
        error row), in bucket order; only the last ones whose documents fit the suffix index's token bound (the
        index would evict the earlier ones: keeping them would make the job's memory grow with the job). The buckets
        are read once, keeping the rows that still fit; the parts once, for those rows' completions."""
        plan, samples = self.plan, self.plan.samples
        if not plan.resumed_rows:
            return []
        index = lookup.SuffixIndex()
        bound, tail = index.max_tokens, index.max_depth - 1
        length = np.full(plan.total_rows, -1, np.int64)  # [output rows] saved completion length (-1: none, error)
        length[plan.resumed] = plan.resumed_lengths
        kept: deque[tuple[int, list[int], int]] = deque()  # (output row, prompt, its document's tokens), bucket order
        held = 0  # the tokens of kept's documents
        for _, batch in iter_bucket_rows(plan.bucket_dir, plan.manifest):
            for row, prompt in zip(batch.column(ROW_COLUMN).to_pylist(), batch.column(PROMPT_IDS_COLUMN).to_pylist()):
                if row >= plan.input_rows:  # a bucket directory's row beyond --limit
                    continue
                first = samples.first(row)
                for out in range(first, first + samples.count(row)):
                    if not self.before[out]:
                        continue
                    # each sample's documents: its prompt; a completion, with the prompt's last tokens before it
                    tokens = len(prompt) + (min(len(prompt), tail) + int(length[out]) if length[out] > 0 else 0)
                    kept.append((out, prompt, tokens))
                    held += tokens
                    while held - kept[0][2] > bound:  # the rows relearned after the first fill the index already
                        held -= kept.popleft()[2]
        wanted = np.array([out for out, _, _ in kept], np.int64)
        relearn: dict[int, list[int] | None] = {}
        for path in self.work.part_paths("rows"):
            table = outputs.read_table(path).select(["row", "token_ids", "finish_reason"])
            table = table.filter(np.isin(table.column("row").to_numpy(), wanted))
            for row, ids, reason in zip(*(table.column(c).to_pylist() for c in table.column_names)):
                relearn[row] = ids if reason != "error" else None
        return [(prompt, relearn[out]) for out, prompt, _ in kept if out in relearn]
