"""One `generate` job: input -> tokenize -> buckets -> engine -> output files, resumable.

``Generation.open(cfg)`` validates everything that can be validated before any work
(flags, input file, output path, model paths, vocabularies), takes the output's lock and
raises ``UsageError`` with a one-line message; what it decided is one ``plan.JobPlan`` (the
input, what it needs of the models, the buckets, the rows an interrupted run saved). A single
process then builds its engine (``assembly.assemble``); under ``--ray`` the workers build theirs
and this process loads no model. ``events()`` then
streams events (engine events plus ``Started``, ``BucketDone``, ``Interrupted``) while
finished rows are saved to checkpoint parts; ``finish()`` writes the completions and
statistics files atomically and removes the work directory; ``close()`` releases the lock
(always call it, or use ``with``).

A job in three parts, as vLLM keeps its engine core apart from its output processor:

- *what to run next*: this module. ``Generation.requests`` feeds the rows still to generate to the engine, bucket by
  bucket; ``Generation.events`` is the run loop, handing what the engine finished to the other two parts;
- *what is already done*: ``done.Done``, the rows saved or finished, the one step numbering (``done.StepNumbering``)
  and the saved rows the drafters learn again, from the resume state read once when the job opened;
- *what reaches disk*: ``writer.Writer``, the checkpoint parts, then the texts and the output files at the finish.

Resuming (see ``checkpoint`` and ``plan``): a job is identified by a *fingerprint* of everything that
decides its rows' completions (input bytes, models, mode, k, sampling, limits, prompt
rendering). Rerunning the same command after a crash loads the saved parts, skips their
rows and continues; a different fingerprint is refused (``--restart`` discards the old
work). Batch size, window, bucket width, threads and device may change between the runs:
a row's completion does not depend on them. ``stop()`` (from a signal handler) ends the
run cleanly after the current step, with every finished row saved.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from ..config import GenerateConfig, UsageError, os_error_message, validate
from ..engine import constraints
from ..engine.core import Engine
from ..engine.events import Request, RowResult, Sampling, StepStats
from ..engine.prefix import neighbours
from ..errors import InputError
from ..io.row_settings import row_value
from ..models import loading as models
from ..store.buckets import PROMPT_IDS_COLUMN, ROW_COLUMN, BucketError, iter_bucket_rows
from ..store.checkpoint import CheckpointError, LockHeld, WorkDir
from .assembly import Assembly, RunsOn, assemble
from .bucket_progress import BucketDone, BucketProgress
from .done import Done
from .plan import JobPlan, plan_job, start_job
from .writer import Writer

Executor = Callable[[Iterable[Request]], Iterator[object]]
"""Requests in, engine events (``RowResult``, ``StepStats``) out. A ``RunsOn`` (how an engine runs) opens each engine
run's events: the steps after it number from 1 again (a Ray block's). Anything else is passed through."""

__all__ = ["BucketDone", "Generation", "Interrupted", "JobPlan", "Started", "work_dir_for"]


class Counted:
    """An iterable of requests that knows how many it holds at most (the rows left to generate), so the engine's
    policy can weigh a trial against the work ahead; the longest padded prompt among them (``longest``), so that
    the engine can reserve its KV buffers once; and the padded prompt length of its median row (``typical``), the
    context at which ``--batch-size auto`` times its widths."""

    def __init__(self, requests: Iterable[Request], count: int, longest: int | None = None,
                 typical: int | None = None):
        self.requests, self.count, self.longest, self.typical = requests, count, longest, typical

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __len__(self) -> int:
        return self.count


def median_padded(buckets) -> int | None:
    """The padded prompt length (``hi``) of the job's median row: the buckets' lengths, weighted by their rows."""
    half, seen = sum(b.rows for b in buckets) / 2, 0
    for bucket in sorted(buckets, key=lambda b: b.hi):
        seen += bucket.rows
        if seen >= half:
            return bucket.hi
    return None


@dataclass
class Started:
    """First event: what will run."""

    total_rows: int
    mode: str
    notes: list[str] = field(default_factory=list)
    resumed_rows: int = 0  # rows already saved by an interrupted run of this job, not generated again
    work_dir: str = ""
    dtype: str = ""  # the dtype the target runs in
    dtype_reason: str = ""  # why (models.choose_dtype)


@dataclass
class Interrupted:
    """Last event of a run ended by ``stop()`` before every row finished."""

    saved_rows: int  # rows durably saved (this run's and earlier runs')
    total_rows: int
    signal: int | None


def work_dir_for(out: Path) -> Path:
    return out.parent / f".{out.name}.batchspec-work"


class Generation:
    """A job being run: its ``plan`` (fixed at ``open``), this process's engine (``assembly``; None under
    ``--ray``, whose workers build their own) and what the run adds to them — which rows are done (``done``: a
    row's number, never its completion), what reaches disk (``writer``: the checkpoint parts, then the output
    files), the buckets done (``BucketProgress``)."""

    def __init__(self, cfg: GenerateConfig, work: WorkDir, plan: JobPlan, assembly: Assembly | None = None,
                 threads_before: int | None = None):
        self.cfg, self.work, self.plan, self.assembly = cfg, work, plan, assembly
        self.runs_on = assembly.runs_on if assembly is not None else None  # a Ray job's: its first worker's
        self.done = Done(plan, work)
        self.writer = Writer(cfg, work, plan)
        self._preloaded = False  # whether this process's engine has learnt the saved rows (engine())
        self.interrupted = False
        self._stop_signal: int | None = None
        self._stop_requested = False
        self._progress = BucketProgress()
        self._prompt_errors: list[RowResult] = []  # error rows found while feeding the engine
        # a greedy row decoded once for several samples: output row decoded -> the output rows that copy it
        self._copies: dict[int, list[int]] = {}
        self._threads_before = threads_before  # the process's thread count before --threads (restored by close)

    # ------------------------------------------------------------------ setup
    @classmethod
    def open(cls, cfg: GenerateConfig) -> "Generation":
        validate(cfg)
        work = WorkDir(work_dir_for(cfg.output))
        threads_before = None
        if cfg.threads:  # for this job: close() restores the process's thread count
            threads_before = torch.get_num_threads()
            torch.set_num_threads(cfg.threads)
        try:
            try:
                plan = plan_job(cfg, work)
                assembly = None
                if not cfg.distributed:  # this process runs the engine; under --ray each worker builds its own
                    assembly = assemble(cfg, plan.mode, plan.draft_spec, list(plan.lookup_names), quiet=cfg.quiet)
                start_job(cfg, work, plan)
            except LockHeld as exc:
                raise UsageError(f"{cfg.output} is being written by another batchspec run"
                                 f"{f' (pid {exc.pid})' if exc.pid else ''}; wait for it to finish, or remove "
                                 f"{work.lock_path} if it is not running") from None
            except (InputError, models.ModelError, BucketError, CheckpointError) as exc:
                raise UsageError(str(exc)) from None
            except OSError as exc:  # a full disk while writing the lock, the buckets or the first part
                raise UsageError(os_error_message(exc)) from None
        except BaseException:
            _release(work, threads_before)
            raise
        return cls(cfg, work, plan, assembly, threads_before)

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the lock; a work directory with nothing resumable in it is removed; --threads is undone."""
        _release(self.work, self._threads_before)
        self._threads_before = None

    @property
    def total_rows(self) -> int:
        return self.plan.total_rows

    @property
    def done_rows(self) -> int:
        return self.done.rows

    @property
    def saved_rows(self) -> int:
        return self.done.rows - len(self.writer.unsaved.rows)

    # ------------------------------------------------------------------ running
    def requests(self) -> Iterator[Request]:
        """The samples still to generate, bucket by bucket, in token order within each batch of a bucket read (rows that
        share a prompt prefix come together: ``prefix.neighbours``), each input row's adjacent (one request per output
        row: ``samples``); rows failing --max-prompt-tokens go to _prompt_errors. A greedy row's samples are equal: it
        is decoded once, as its first unsaved sample, and written to the others (``_copies``)."""
        cfg, plan, samples = self.cfg, self.plan, self.plan.samples
        temperature, seed, max_new, top_p, stops, logprobs, formats = (
            plan.overrides.get(name) for name in ("temperature", "seed", "max_new_tokens", "top_p", "stop", "logprobs",
                                                  "response_format"))
        saved = self.done.before
        current = None
        for bucket, batch in iter_bucket_rows(plan.bucket_dir, plan.manifest):
            if bucket.index != current:
                if current is not None:
                    self._progress.seal(current)
                current = bucket.index
            rows = batch.column(ROW_COLUMN).to_pylist()
            ids = batch.column(PROMPT_IDS_COLUMN).to_pylist()
            for row, prompt in neighbours(rows, ids):
                if row >= plan.input_rows:  # a bucket directory's row beyond --limit
                    continue
                first = samples.first(row)
                # saved by an interrupted run (its drafters' lessons: preloads)
                outs = [out for out in range(first, first + samples.count(row)) if not saved[out]]
                if not outs:
                    continue
                for out in outs:
                    self._progress.handed_out(out, bucket.index)
                if cfg.max_prompt_tokens is not None and len(prompt) > cfg.max_prompt_tokens:
                    self._prompt_errors += [RowResult(
                        out, plan.inp.ids[row], [], "error", prompt_tokens=len(prompt),
                        error=f"prompt has {len(prompt)} tokens; --max-prompt-tokens is {cfg.max_prompt_tokens}")
                        for out in outs]
                    continue
                sampling = Sampling(temperature=row_value(temperature, row, cfg.temperature), top_k=cfg.top_k,
                                    top_p=row_value(top_p, row, cfg.top_p), seed=row_value(seed, row, cfg.seed))
                if sampling.greedy and len(outs) > 1:
                    self._copies[outs[0]] = outs[1:]
                    outs = outs[:1]
                for out in outs:
                    yield Request(row=out, id=plan.inp.ids[row], prompt_ids=prompt,
                                  max_new_tokens=row_value(max_new, row, cfg.max_new_tokens), sampling=sampling,
                                  bucket=bucket.index, pad_to=bucket.hi,
                                  logprobs=row_value(logprobs, row, cfg.logprobs), stop=row_value(stops, row, ()),
                                  constraint=constraints.of_row(row_value(formats, row, None), plan.constraint),
                                  sample=out - first)
        if current is not None:
            self._progress.seal(current)

    def engine(self) -> Engine:
        """This process's engine, taught the saved rows of an interrupted run once."""
        if self.assembly is None:
            raise RuntimeError("this job's engines run on its Ray workers (distributed.RayExecutor)")
        if not self._preloaded:
            self.assembly.engine.preload(self.done.preloads())
            self._preloaded = True
        return self.assembly.engine

    def stop(self, signal: int | None = None) -> None:
        """Ask the run to end after the current step (safe to call from a signal handler)."""
        self._stop_signal = signal
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def events(self, run: Executor | None = None) -> Iterator[Started | RowResult | StepStats | BucketDone | Interrupted]:
        """The job's events. ``run`` turns the requests into engine events (default: this process's
        engine; ``distributed.RayExecutor.run`` spreads them over workers). Events of other types
        that it yields (a worker's progress) are passed through unrecorded."""
        plan = self.plan
        notes = list(plan.notes) + (self.assembly.notes if self.assembly is not None else [])
        runs_on = self.assembly.runs_on if self.assembly is not None else None  # Ray: each worker decides
        yield Started(total_rows=plan.total_rows, mode=plan.mode, notes=notes,
                      resumed_rows=plan.resumed_rows, work_dir=str(self.work.path),
                      dtype=runs_on.dtype if runs_on else "", dtype_reason=runs_on.dtype_reason if runs_on else "")
        yield from plan.announce  # prompt errors: already recorded and saved
        buckets = plan.manifest.buckets if plan.manifest is not None else []
        longest = max((b.hi for b in buckets), default=None)
        stream = (run or self.engine().run)(Counted(self.requests(), plan.total_rows - self.done.rows, longest,
                                                    median_padded(buckets)))
        try:
            for event in stream:
                if isinstance(event, RunsOn):  # a Ray block's, before its events: a new engine run
                    self.runs_on = self.runs_on or event  # the metadata records the first
                    self.done.steps.next_run()
                    continue
                if isinstance(event, StepStats):
                    event = self.done.steps(event)
                if isinstance(event, (RowResult, StepStats)):
                    self._record(event)
                yield event
                if isinstance(event, RowResult) and event.row in self._copies:
                    yield from self._copy(event)
                yield from self._drain()
                self.writer.unsaved.save_if_due()
                if self._stop_requested:
                    break
            else:
                yield from self._drain()
        finally:
            stream.close()
            self.writer.unsaved.save()  # a clean stop, a finished run or an exception: keep every finished row
        if self._stop_requested and self.done.rows < plan.total_rows:
            self.interrupted = True
            yield Interrupted(saved_rows=self.saved_rows, total_rows=plan.total_rows, signal=self._stop_signal)

    def _record(self, event: RowResult | StepStats) -> None:
        if isinstance(event, RowResult):
            self.done.record(event.row)
            self.writer.unsaved.add(event)
            self._progress.finished(event.row, error=event.finish_reason == "error")
        else:
            self.writer.unsaved.stats.append(event)

    def _copy(self, result: RowResult) -> Iterator[RowResult]:
        """A greedy row's other samples: its result again, at their output rows (recorded, as the engine's are)."""
        for out in self._copies.pop(result.row):
            copy = dataclasses.replace(result, row=out, token_ids=list(result.token_ids))
            self._record(copy)
            yield copy

    def _drain(self) -> Iterator[RowResult | BucketDone]:
        """Error rows found while feeding the engine, then buckets that just completed."""
        while self._prompt_errors:
            result = self._prompt_errors.pop(0)
            self._record(result)
            yield result
        yield from self._progress.completed()

    def finish(self) -> dict:
        """Write both files atomically (``writer.Writer.finish``), every row saved first, then remove the work
        directory; returns a summary. A kill meanwhile leaves the parts: the rerun writes the files again."""
        self.writer.unsaved.save()
        missing = self.plan.total_rows - self.done.rows
        if missing:
            raise RuntimeError(f"{missing} rows have no result")
        return self.writer.finish(self.assembly.runs_on if self.assembly is not None else self.runs_on)


def _release(work: WorkDir, threads_before: int | None) -> None:
    """Undo what opening a job did: --threads, the lock, and a work directory with nothing resumable in it."""
    if threads_before is not None:
        torch.set_num_threads(threads_before)
    if not work.locked:
        return
    try:
        if not os.path.lexists(work.job_path):
            work.remove()
    except (CheckpointError, OSError):
        pass  # a work directory that cannot be cleaned is left as it is (the error is reported already)
    work.unlock()
