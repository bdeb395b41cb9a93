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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from buckets import PROMPT_IDS_COLUMN, ROW_COLUMN, BucketError, iter_bucket_rows

from . import __version__
from . import constraints
from . import logprobs as lp
from . import lookup
from . import merge
from . import models
from . import openai_batch
from . import outputs
from .assembly import Assembly, RunsOn, assemble
from .bucket_progress import BucketDone, BucketProgress
from .checkpoint import CheckpointError, LockHeld, WorkDir
from .config import AUTO, GenerateConfig, UsageError, os_error_message, settings_record, validate
from .engine import Engine, pool_window
from .errors import InputError
from .events import Request, RowResult, Sampling, StepStats
from .files import write_text_stream_atomic
from .inputs import StoredTable, id_array
from .plan import JobPlan, plan_job, release_free_memory, start_job
from .row_settings import row_value
from .samples import SAMPLE_COLUMN
from .prefix import neighbours
from .stops import StopStrings

Executor = Callable[[Iterable[Request]], Iterator[object]]
"""Requests in, engine events (``RowResult``, ``StepStats``; ``RunsOn``: how the engine that ran them runs; anything
else passed through) out."""

__all__ = ["BucketDone", "Generation", "Interrupted", "JobPlan", "Started", "StepNumbering", "metadata",
           "work_dir_for"]


class Counted:
    """An iterable of requests that knows how many it holds at most (the rows left to generate), so the engine's
    policy can weigh a trial against the work ahead."""

    def __init__(self, requests: Iterable[Request], count: int):
        self.requests, self.count = requests, count

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __len__(self) -> int:
        return self.count


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


def metadata(cfg: GenerateConfig, plan: JobPlan, runs_on: RunsOn | None) -> dict:
    """What the output files record of the job (their Parquet schema metadata). ``runs_on``: how the engine ran (a
    Ray job's first worker's); None when no engine ran in this run (a resumed Ray job with no row left): the
    settings as given."""
    runs_on = runs_on or RunsOn(kernels=cfg.kernels, dtype=cfg.dtype, device=cfg.device)
    batch = runs_on.batch_size or cfg.batch_size  # --batch-size auto: the width the engine measured
    return {
        "batchspec_version": __version__, "torch_version": torch.__version__,
        "transformers_version": _transformers_version(),
        **settings_record(cfg, "metadata", target=plan.target_name, draft=plan.draft_name,
                          mode=plan.mode, window=pool_window(batch, cfg.window) if batch != AUTO else None,
                          batch_size=batch, kernels=runs_on.kernels, dtype=runs_on.dtype, device=runs_on.device),
        "dtype_reason": runs_on.dtype_reason, "target_source": plan.target.source, "draft_source": plan.draft_source,
        "drafters": (["model"] if plan.draft_spec else []) + list(plan.lookup_names),
        "eos_token_ids": plan.eos_ids, "resumed_rows": plan.resumed_rows,
        **({"logprobs_distribution": lp.DESCRIPTIONS[cfg.logprobs_mode]} if plan.wants_logprobs else {}),
        **({"constraint": {"kind": plan.constraint.kind, "text": plan.constraint.text}} if plan.constraint else {}),
        **({"sample_column": SAMPLE_COLUMN} if plan.samples.written else {}),
    }


class _Unsaved:
    """Finished rows and steps not yet in a checkpoint part; a part is due after ``checkpoint_rows``
    rows, ``MOST_TOKENS`` of their completion tokens (long rows, each perhaps with its logprobs, are
    held no more than 32 rows of 512 tokens were) or ``checkpoint_seconds`` since the previous one.
    Every ``RELEASE_SECONDS`` a save also hands the memory the decode freed back to the system: the C
    heap keeps freed chunks between live ones, and over a long job its resident size would creep with the
    rows (docs/history.md, "Figures once kept in the code")."""

    RELEASE_SECONDS = 10.0
    MOST_TOKENS = 16384

    def __init__(self, work: WorkDir, rows: int, seconds: float):
        self.work, self.most_rows, self.seconds = work, rows, seconds
        self.rows: list[RowResult] = []
        self.stats: list[StepStats] = []
        self.tokens = 0  # the completion tokens of ``rows``
        self.last_save = self.last_release = time.monotonic()

    def add(self, row: RowResult) -> None:
        self.rows.append(row)
        self.tokens += len(row.token_ids)

    def save_if_due(self) -> None:
        if len(self.rows) >= self.most_rows or self.tokens >= self.MOST_TOKENS \
                or time.monotonic() - self.last_save >= self.seconds:
            self.save()

    def save(self) -> None:
        """Write the rows and statistics not yet saved as one checkpoint part."""
        if self.rows or self.stats:
            self.work.save_part(self.rows, self.stats)
            self.rows, self.stats, self.tokens = [], [], 0
        self.last_save = time.monotonic()
        if self.last_save - self.last_release >= self.RELEASE_SECONDS:
            release_free_memory()
            self.last_release = time.monotonic()


class Generation:
    """A job being run: its ``plan`` (fixed at ``open``), this process's engine (``assembly``; None under
    ``--ray``, whose workers build their own) and what the run adds to them — which rows are done
    (``done``: a row's number, never its completion), the checkpoint parts not yet written (``_Unsaved``),
    the buckets done (``BucketProgress``). A row reaches disk in a checkpoint part and leaves memory; the
    finish streams the parts into the output files."""

    def __init__(self, cfg: GenerateConfig, work: WorkDir, plan: JobPlan, assembly: Assembly | None = None,
                 threads_before: int | None = None):
        self.cfg, self.work, self.plan, self.assembly = cfg, work, plan, assembly
        self.runs_on = assembly.runs_on if assembly is not None else None  # a Ray job's: its first worker's
        self.done = np.zeros(plan.total_rows, dtype=bool)  # [rows] saved, or finished by this run
        self.done[plan.resumed] = True
        self.done[[r.row for r in plan.announce]] = True
        self.done_rows = int(self.done.sum())
        self._preloaded = False  # whether this process's engine has learnt the saved rows (engine())
        self.interrupted = False
        self._stop_signal: int | None = None
        self._stop_requested = False
        self._unsaved = _Unsaved(work, cfg.checkpoint_rows, cfg.checkpoint_seconds)
        self._steps = StepNumbering(last=plan.last_step)
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
    def saved_rows(self) -> int:
        return self.done_rows - len(self._unsaved.rows)

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
        saved = self.done.copy()
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

    def preloads(self) -> list[tuple[list[int], list[int] | None]]:
        """The rows an interrupted run saved, as the drafters learn them again: (prompt, completion or None for an
        error row), in bucket order; only the last ones whose documents fit the suffix index's token bound (the
        index would evict the earlier ones: keeping them would make the job's memory grow with the job). Read
        from the buckets and the parts only when the job resumed."""
        plan, samples = self.plan, self.plan.samples
        if not plan.resumed_rows:
            return []
        bound, tail = lookup.SuffixIndex().max_tokens, lookup.SuffixIndex().max_depth - 1
        completion = np.full(plan.total_rows, -1, np.int64)  # [output rows] saved completion length (-1: none, error)
        for path in self.work.part_paths("rows"):
            table = outputs.read_table(path).select(["row", "token_ids", "finish_reason"])
            ok = pc.not_equal(table.column("finish_reason"), "error").to_numpy(zero_copy_only=False)
            lengths = pc.list_value_length(table.column("token_ids")).to_numpy(zero_copy_only=False)
            completion[table.column("row").to_numpy()] = np.where(ok, lengths, -1)
        order, tokens = [], []  # saved rows in bucket order, and the tokens their documents hold
        for _, batch in iter_bucket_rows(plan.bucket_dir, plan.manifest):
            rows = batch.column(ROW_COLUMN).to_numpy()
            prompt = pc.list_value_length(batch.column(PROMPT_IDS_COLUMN)).to_numpy(zero_copy_only=False)
            inside = rows < plan.input_rows
            rows, prompt = rows[inside], prompt[inside]
            prompt = np.repeat(prompt, samples.counts_of(rows))  # each sample's document holds the prompt
            rows = samples.output_rows(rows)
            mine = self.done[rows]
            rows, prompt = rows[mine], prompt[mine]
            length = completion[rows]
            order.append(rows)
            tokens.append(prompt + np.where(length > 0, np.minimum(prompt, tail) + length, 0))
        order, tokens = np.concatenate(order), np.concatenate(tokens)
        after = np.cumsum(tokens[::-1])[::-1] - tokens  # [saved rows] tokens of the rows relearned after it
        wanted = order[after <= bound]
        relearn: dict[int, list[int] | None] = {}
        for path in self.work.part_paths("rows"):
            table = outputs.read_table(path).select(["row", "token_ids", "finish_reason"])
            table = table.filter(np.isin(table.column("row").to_numpy(), wanted))
            for row, ids, reason in zip(*(table.column(c).to_pylist() for c in table.column_names)):
                relearn[row] = ids if reason != "error" else None
        saved = []
        for _, batch in iter_bucket_rows(plan.bucket_dir, plan.manifest):
            for row, prompt in zip(batch.column(ROW_COLUMN).to_pylist(), batch.column(PROMPT_IDS_COLUMN).to_pylist()):
                if row >= plan.input_rows:
                    continue
                for out in range(samples.first(row), samples.first(row) + samples.count(row)):
                    if out in relearn:
                        saved.append((prompt, relearn[out]))
        return saved

    def engine(self) -> Engine:
        """This process's engine, taught the saved rows of an interrupted run once."""
        if self.assembly is None:
            raise RuntimeError("this job's engines run on its Ray workers (distributed.RayExecutor)")
        if not self._preloaded:
            self.assembly.engine.preload(self.preloads())
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
        stream = (run or self.engine().run)(Counted(self.requests(), plan.total_rows - self.done_rows))
        try:
            for event in stream:
                if isinstance(event, RunsOn):  # a Ray worker's: the metadata records the first
                    self.runs_on = self.runs_on or event
                    continue
                if isinstance(event, StepStats):
                    event = self._steps(event)
                if isinstance(event, (RowResult, StepStats)):
                    self._record(event)
                yield event
                if isinstance(event, RowResult) and event.row in self._copies:
                    yield from self._copy(event)
                yield from self._drain()
                self._unsaved.save_if_due()
                if self._stop_requested:
                    break
            else:
                yield from self._drain()
        finally:
            stream.close()
            self._unsaved.save()  # a clean stop, a finished run or an exception: keep every finished row
        if self._stop_requested and self.done_rows < plan.total_rows:
            self.interrupted = True
            yield Interrupted(saved_rows=self.saved_rows, total_rows=plan.total_rows, signal=self._stop_signal)

    def _record(self, event: RowResult | StepStats) -> None:
        if isinstance(event, RowResult):
            if self.done[event.row]:
                raise RuntimeError(f"row {event.row} finished twice")
            self.done[event.row] = True
            self.done_rows += 1
            self._unsaved.add(event)
            self._progress.finished(event.row, error=event.finish_reason == "error")
        else:
            self._unsaved.stats.append(event)

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

    # ------------------------------------------------------------------ output
    def texts(self, results: list[RowResult]) -> list[str]:
        """The rows' completions as text, decoded in one batch (see ``texts_of``)."""
        return self.texts_of([r.row for r in results], [r.token_ids for r in results],
                             [r.finish_reason for r in results])

    def texts_of(self, rows: list[int], token_ids: list[list[int]], reasons: list[str]) -> list[str]:
        """Completions as text, decoded in one batch (a stop string and what follows it excluded:
        ``StopStrings.text``); ``rows``, ``token_ids`` and ``reasons`` aligned."""
        tokenizer, overrides = self.plan.tokenizer, self.plan.overrides.get("stop")
        plain = tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        if "stop_string" not in reasons:
            return plain
        stops = StopStrings(tokenizer, self.cfg.stop)
        return [stops.text(ids, row_value(overrides, row, ())) if reason == "stop_string" else text
                for row, ids, reason, text in zip(rows, token_ids, reasons, plain)]

    def finish(self) -> dict:
        """Write both files atomically, streamed from the checkpoint parts one range of rows at a time (see
        ``merge``), then remove the work directory; returns a summary. A kill meanwhile leaves the parts: the
        rerun writes the files again."""
        cfg, plan = self.cfg, self.plan
        self._unsaved.save()
        missing = plan.total_rows - self.done_rows
        if missing:
            raise RuntimeError(f"{missing} rows have no result")
        began = time.perf_counter()
        meta = metadata(cfg, plan, self.assembly.runs_on if self.assembly is not None else self.runs_on)
        self.work.mark_finishing()
        merge.regroup(self.work.part_paths("rows"), self.work.fresh_merge(), plan.total_rows)
        release_free_memory()  # what regrouping freed, before the ranges are written
        summary = {"rows": 0, "errors": 0, "completion_tokens": 0, "first_errors": []}
        pieces = self._output_pieces(summary)
        if plan.output_format == "openai":
            write_text_stream_atomic(cfg.output, pieces)
        else:
            outputs.write_parquet_stream_atomic(cfg.output, pieces, meta)
        schema = outputs.part_schema("stats")
        steps = (outputs.read_table(path).select(schema.names).cast(schema) for path in self.work.part_paths("stats"))
        outputs.write_parquet_stream_atomic(plan.stats_path, merge.batched(steps), meta, schema)
        self.work.remove()
        return {**summary, "resumed_rows": plan.resumed_rows, "generated_rows": summary["rows"] - plan.resumed_rows,
                "output": str(cfg.output), "stats": str(plan.stats_path), "finish_s": time.perf_counter() - began}

    def _output_pieces(self, summary: dict) -> Iterator:
        """OUT's rows, one range of output rows at a time in input order (a table, or the OpenAI file's text);
        counts them into ``summary``. An input row's samples are adjacent output rows: the table repeats its input
        columns for each (with a ``sample`` column when the job asks for samples); the OpenAI file answers it in one
        line of ``n`` choices, so a row whose samples continue in the next range waits for them."""
        cfg, plan, samples = self.cfg, self.plan, self.plan.samples
        token_text = (lambda token: plan.tokenizer.decode([token])) if plan.wants_logprobs else None
        created = int(time.time())
        passthrough = StoredTable(plan.passthrough) if plan.passthrough is not None else plan.inp.table
        waiting: tuple[list, list] = ([], [])  # (results, texts) of an input row whose samples continue
        for first, table in merge.ranges(self.work.merge, plan.total_rows):
            out_rows = table.column("row").to_numpy()
            in_rows = samples.input_rows(out_rows)  # [range] the input row of each output row
            token_ids = table.column("token_ids").to_pylist()
            reasons = table.column("finish_reason").to_pylist()
            texts = self.texts_of(in_rows.tolist(), token_ids, reasons)
            errors = pc.equal(table.column("finish_reason"), "error")
            summary["rows"] += table.num_rows
            summary["errors"] += pc.sum(errors).as_py() or 0
            summary["completion_tokens"] += pc.sum(pc.list_value_length(table.column("token_ids"))).as_py() or 0
            first_errors = table.filter(errors).slice(0, 3 - len(summary["first_errors"]))
            summary["first_errors"] += list(zip(samples.input_rows(first_errors.column("row").to_numpy()).tolist(),
                                                *(first_errors.column(c).to_pylist() for c in ("id", "error"))))
            if plan.output_format == "openai" or plan.wants_logprobs:
                results = outputs.results_from_table(table)  # per row objects, one range at a time
            if plan.output_format == "openai":
                results = waiting[0] + [dataclasses.replace(r, row=int(row)) for r, row in zip(results, in_rows)]
                texts = waiting[1] + texts
                last = int(in_rows[-1])
                cut = len(results)
                if samples.first(last) + samples.count(last) > first + table.num_rows:  # continues in the next range
                    cut = next(i for i, r in enumerate(results) if r.row == last)
                waiting = (results[cut:], texts[cut:])
                yield openai_batch.output_text(plan.inp, results[:cut], texts[:cut], plan.tokenizer,
                                               model=plan.target_name, chat=cfg.chat, salt=plan.input_hash,
                                               created=created)
                continue
            low = int(in_rows[0])
            inputs = passthrough.slice(low, int(in_rows[-1]) + 1 - low)
            if inputs.num_rows != int(in_rows[-1]) + 1 - low:
                raise RuntimeError(f"the kept input has {inputs.num_rows} rows from row {low}, not "
                                   f"{int(in_rows[-1]) + 1 - low}")
            ids = id_array(plan.inp.ids).slice(low, inputs.num_rows)
            if samples.total != plan.input_rows:  # each input row once per sample
                at = pa.array(in_rows - low)
                inputs, ids = inputs.take(at), ids.take(at)
            if plan.wants_logprobs:
                piece = outputs.completions_table(inputs, ids.to_pylist(), results, texts, token_text)
            else:
                piece = outputs.completions_from_parts(inputs, ids, table, texts)
            if samples.written:
                piece = piece.add_column(piece.schema.get_field_index("id") + 1, SAMPLE_COLUMN,
                                         pa.array(samples.sample_of(out_rows), pa.int32()))
            yield piece


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


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
