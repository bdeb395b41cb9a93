"""One `generate` job: input -> tokenize -> buckets -> engine -> output files, resumable.

``Generation.open(cfg)`` validates everything that can be validated before any work
(flags, input file, output path, model paths, vocabularies), takes the output's lock and
raises ``UsageError`` with a one-line message; ``events()`` then streams events (engine
events plus ``Started``, ``BucketDone``, ``Interrupted``) while finished rows are saved to
checkpoint parts; ``finish()`` writes the completions and statistics files atomically and
removes the work directory; ``close()`` releases the lock (always call it, or use ``with``).

Resuming (see ``checkpoint``): a job is identified by a *fingerprint* of everything that
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
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from buckets import BucketError, build_buckets, is_bucket_dir, iter_bucket_rows, open_buckets, read_all_rows
from buckets import settings_hash

from . import __version__
from . import drafters
from . import io as bio
from . import logprobs as lp
from . import models
from . import openai_batch
from . import sources
from .checkpoint import CheckpointError, LockHeld, WorkDir, describe_changes, hash_files, model_signature
from .config import (FINGERPRINT_LABELS, GenerateConfig, UsageError, os_error_message, row_overrides, row_value,
                     settings_record, tokenizer_settings, validate)
from .engine import Engine, EngineConfig, ModelHandle, pool_window
from .events import Request, RowResult, Sampling, StepStats

Executor = Callable[[Iterable[Request]], Iterator[object]]
"""Requests in, engine events (``RowResult``, ``StepStats``, anything else passed through) out."""


@dataclass
class Started:
    """First event: what will run."""

    total_rows: int
    mode: str
    notes: list[str] = field(default_factory=list)
    resumed_rows: int = 0  # rows already saved by an interrupted run of this job, not generated again
    work_dir: str = ""


@dataclass
class BucketDone:
    """Every row of a length bucket has finished (saved rows of a resumed job excluded)."""

    bucket: int
    rows: int
    errors: int


@dataclass
class Interrupted:
    """Last event of a run ended by ``stop()`` before every row finished."""

    saved_rows: int  # rows durably saved (this run's and earlier runs')
    total_rows: int
    signal: int | None



def work_dir_for(out: Path) -> Path:
    return out.parent / f".{out.name}.batchspec-work"


class Generation:
    def __init__(self, cfg: GenerateConfig):
        self.cfg = cfg
        self.notes: list[str] = []
        self.lookup_names: list[str] = []  # model-free drafters (see _drafters)
        self.lookups: list = []
        self.preloads: list[tuple[list[int], list[int] | None]] = []  # saved rows (prompt, completion) drafters relearn
        self.results: dict[int, RowResult] = {}
        self.stats: list[StepStats] = []
        self.work = WorkDir(work_dir_for(cfg.output))
        self.resumed_rows = 0
        self.interrupted = False
        self._stop_signal: int | None = None
        self._stop_requested = False
        self._announce: list[RowResult] = []  # rows finished before the engine starts (prompt errors)
        self._unsaved_rows: list[RowResult] = []
        self._unsaved_stats: list[StepStats] = []
        self._last_save = time.monotonic()
        self._step_offset = 0
        self._threads_before: int | None = None  # the process's thread count before --threads (restored by close)
        self._prompt_errors: list[RowResult] = []  # error rows found while feeding the engine
        self._bucket_left: dict[int, int] = {}  # bucket -> rows handed out and not finished
        self._bucket_errors: dict[int, int] = {}
        self._bucket_rows: dict[int, int] = {}
        self._row_bucket: dict[int, int] = {}
        self._sealed: set[int] = set()  # buckets whose every row has been handed out
        self._announced: set[int] = set()

    # ------------------------------------------------------------------ setup
    @classmethod
    def open(cls, cfg: GenerateConfig) -> "Generation":
        validate(cfg)
        self = cls(cfg)
        try:
            self._open()
        except LockHeld as exc:
            raise UsageError(f"{cfg.output} is being written by another batchspec run"
                             f"{f' (pid {exc.pid})' if exc.pid else ''}; wait for it to finish, or remove "
                             f"{self.work.lock_path} if it is not running") from None
        except (bio.InputError, models.ModelError, BucketError, CheckpointError) as exc:
            self.close()
            raise UsageError(str(exc)) from None
        except OSError as exc:  # a full disk while writing the lock, the buckets or the first part
            self.close()
            raise UsageError(os_error_message(exc)) from None
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the lock; a work directory with nothing resumable in it is removed; --threads is undone."""
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if not self.work.locked:
            return
        try:
            if not os.path.lexists(self.work.job_path):
                self.work.remove()
        except (CheckpointError, OSError):
            pass  # a work directory that cannot be cleaned is left as it is (the error is reported already)
        self.work.unlock()

    def _open(self) -> None:
        cfg = self.cfg
        if cfg.threads:  # for this job: close() restores the process's thread count
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(cfg.threads)
        bio.check_output_path(cfg.output, overwrite=True)
        self.stats_path = cfg.stats or bio.stats_path_for(cfg.output)
        bio.check_distinct([cfg.input], [("OUT", cfg.output), ("--stats", self.stats_path)])
        bio.check_writable(self.stats_path)

        # One writer per output: the lock, before anything is read or written.
        self.work.lock()
        for path in (cfg.output, self.stats_path):  # what a process killed while writing them left
            bio.remove_stale_temps(path)
        job = None
        try:
            job = self.work.read_job()
        except CheckpointError as exc:
            if not cfg.restart:
                raise CheckpointError(f"{exc}; pass --restart to discard the interrupted run's work") from None
        if cfg.restart:
            self.work.clear()
            job = None
        finishing = bool(job and job.get("finishing"))  # a crash while writing the final files
        if not cfg.overwrite and not finishing:
            for path in (cfg.output, self.stats_path):
                if path.exists():
                    raise UsageError(f"{path} already exists; pass --overwrite to replace it")

        # Read the input before any model is loaded: bad input fails fast.
        self.bucket_dir: Path | None = None
        self.output_format = sources.output_format(cfg)
        if cfg.input.is_dir() and not sources.is_dataset_dir(cfg.input):
            if not is_bucket_dir(cfg.input):
                raise UsageError(f"{cfg.input}: a directory, but not a bucket directory (no manifest.json)")
            self.bucket_dir = cfg.input
            self.manifest = open_buckets(cfg.input)
            self.input_hash = hash_files([cfg.input / "manifest.json"] +
                                         [cfg.input / b.shard for b in self.manifest.buckets])
        else:
            self.inp, self.input_hash = sources.read(cfg)  # a file, a Hugging Face dataset or an OpenAI batch
            if "__row" in self.inp.table.column_names or "__prompt_ids" in self.inp.table.column_names:
                raise UsageError(f"{cfg.input}: column names __row and __prompt_ids are reserved")
            self.overrides = {**row_overrides(self.inp.table, cfg), **self.inp.overrides}

        # Tokenizers first (cheap): a mismatched draft is refused before loading weights.
        draft_spec, self.lookup_names = self._drafters()
        self.mode = cfg.mode
        if draft_spec is None and not self.lookup_names and self.mode != "ar":
            self.notes.append(f"no drafter available: running plain autoregressive decoding (--mode ar) "
                              f"instead of {self.mode}")
            self.mode = "ar"
        if self.mode == "ar":
            draft_spec, self.lookup_names = None, []
        target_tok, self.target_name = models.load_tokenizer(cfg.target, quiet=True)
        if draft_spec is not None and self.mode != "ar":
            draft_tok, draft_name = models.load_tokenizer(draft_spec, quiet=True)
            models.check_vocab(target_tok, draft_tok, self.target_name, draft_name)

        self.target = models.load_model(cfg.target, cfg.dtype, cfg.device, quiet=cfg.quiet)
        self.draft = None
        if draft_spec is not None and self.mode != "ar":
            self.draft = models.load_draft(draft_spec, self.target, cfg.dtype, cfg.device, quiet=cfg.quiet)
            if self.draft.model.device != self.target.model.device:
                raise UsageError("draft and target ended up on different devices")
        self.draft_spec = draft_spec if self.draft is not None else None  # what a distributed worker loads
        self.notes += use_kernels(cfg.kernels, self.target, self.draft)
        self.tokenizer = self.target.tokenizer
        self.eos_ids = models.eos_ids(self.target.model, self.tokenizer)

        # Resume the interrupted run of this very job, refuse another job's work, or start afresh.
        if self.bucket_dir is not None:
            self._open_bucket_dir()
        self.notes += openai_batch.model_notes(self.inp, self.target_name)
        fingerprint = self.fingerprint()
        if job is not None:
            changes = describe_changes(job["fingerprint"], fingerprint, FINGERPRINT_LABELS)
            if changes:
                raise UsageError(f"{cfg.output}: an interrupted run of this output used other settings "
                                 f"({'; '.join(changes)}); rerun it as it was to resume, or pass --restart "
                                 f"to discard its work")
            self._resume()
        else:
            self.work.clear()  # leftovers of a run that died before it was resumable
            self._announce = self._prepare_buckets()
            for result in self._announce:
                self.results[result.row] = result
            self.work.save_part(self._announce, [])  # saved before the job exists: resumable means complete
            self.work.start_job(fingerprint, self.total_rows)

    def _drafters(self) -> tuple[str | None, list[str]]:
        """(draft model spec or None, model-free drafter names) from --draft, or the defaults.

        ``--draft`` takes a model, ``ngram``, ``suffix``, or a comma list of them (one model
        at most). Without it: the shipped draft for the embedded default target, plus
        ``suffix`` under ``auto``; ``suffix`` for any other target, so every target gets
        speculation.
        """
        cfg = self.cfg
        if cfg.draft is not None:
            parts = [part.strip() for part in cfg.draft.split(",")]
            if not all(parts):
                raise UsageError(f"--draft {cfg.draft!r}: an empty name in the list")
            specs = [part for part in parts if part not in drafters.NAMES]
            if len(specs) > 1:
                raise UsageError(f"--draft {cfg.draft!r}: at most one draft model (besides ngram and suffix)")
            return (specs[0] if specs else None), [name for name in drafters.NAMES if name in parts]
        if cfg.mode == "ar":
            return None, []
        shipped = models.default_draft_path() if cfg.target is None else None
        if shipped is not None:
            return str(shipped), (["suffix"] if cfg.mode == "auto" else [])
        return None, ["suffix"]

    def fingerprint(self) -> dict:
        """Everything that decides the rows' completions; a resumed run must match it exactly."""
        return {**settings_record(self.cfg, "fingerprint", input=self.input_hash, mode=self.mode,
                                  target=model_signature(self.target.name, self.target.source),
                                  draft=model_signature(self.draft.name, self.draft.source) if self.draft else None),
                "rows": self.total_rows}

    def _open_bucket_dir(self) -> None:
        """A bucket directory as input: its rows (in input order), ids and per-row overrides."""
        cfg = self.cfg
        settings = tokenizer_settings(cfg, self.target_name)
        mismatched = {key: (self.manifest.settings.get(key), value) for key, value in settings.items()
                      if key != "id_column" and self.manifest.settings.get(key) != value}
        if mismatched:
            detail = "; ".join(f"{k}: bucketed with {a!r}, now {b!r}" for k, (a, b) in mismatched.items())
            raise UsageError(f"{cfg.input}: bucket directory was made with other settings ({detail}); "
                             f"rerun `batchspec bucket` with these settings")
        table = read_all_rows(self.bucket_dir, self.manifest)
        check_token_ids(table.column("__prompt_ids"), self.target.model.get_input_embeddings().num_embeddings,
                        cfg.input)
        id_column = self.manifest.settings.get("id_column", "id")
        ids = [str(v) for v in table.column(id_column).to_pylist()] if id_column in table.column_names \
            else [str(v) for v in table.column("__row").to_pylist()]
        table = table.drop_columns([c for c in ("__row", "__prompt_ids") if c in table.column_names])
        if cfg.limit is not None:
            table, ids = table.slice(0, cfg.limit), ids[: cfg.limit]
        self.inp = bio.InputTable(path=cfg.input, table=table, prompts=[], ids=ids)
        self.overrides = row_overrides(table, cfg)

    def _prepare_buckets(self) -> list[RowResult]:
        """Tokenize every prompt once and write the length buckets; returns the prompts that failed as error rows."""
        cfg = self.cfg
        self.limit_rows = set(range(self.total_rows)) if self.bucket_dir is not None else None
        if self.bucket_dir is not None:
            return []
        prompt_ids, failed = [], []
        most_tokens, what = self._prompt_token_limit()
        most_bytes = bio.max_prompt_bytes(self.tokenizer, most_tokens) if most_tokens is not None else None
        for row, prompt in enumerate(self.inp.prompts):
            if row in self.inp.errors:  # a request refused before generation (an OpenAI batch line)
                prompt_ids.append([])
                failed.append(RowResult(row, self.inp.ids[row], [], "error", error=self.inp.errors[row]))
                continue
            size = bio.prompt_bytes(prompt) if most_bytes is not None else 0
            if most_bytes is not None and size > most_bytes:  # refused untokenized: it can never fit
                prompt_ids.append([])
                failed.append(RowResult(row, self.inp.ids[row], [], "error",
                                        error=f"prompt has {size} bytes, more than {what} can hold "
                                              f"(at most {most_bytes} bytes)"))
                continue
            raw = openai_batch.is_text_completion(self.inp, row)  # a /v1/completions prompt: no template, no --system
            try:
                prompt_ids.append(bio.render_prompt(self.tokenizer, prompt, cfg.chat and not raw,
                                                    None if raw else cfg.system))
            except Exception as exc:  # noqa: BLE001 - a chat template may raise anything: that row fails, not the job
                prompt_ids.append([])  # never handed to the engine: the row is already finished
                failed.append(RowResult(row, self.inp.ids[row], [], "error",
                                        error=f"cannot render the prompt: {bio.one_line(exc)}"))
        self.bucket_dir = self.work.buckets
        self.manifest = build_buckets(self.bucket_dir, self.inp.table, prompt_ids,
                                      tokenizer_settings(cfg, self.target_name), width=cfg.bucket_width,
                                      min_rows=cfg.batch_size, overwrite=True)
        return failed

    def _prompt_token_limit(self) -> tuple[int | None, str]:
        """The most tokens a prompt may have (the model's context less one, --max-prompt-tokens), and its name."""
        context = int(getattr(self.target.model.config, "max_position_embeddings", 0) or 0) or None
        limits = [(context - 1, f"the model's context of {context} tokens")] if context else []
        if self.cfg.max_prompt_tokens is not None:
            limits.append((self.cfg.max_prompt_tokens, f"--max-prompt-tokens {self.cfg.max_prompt_tokens}"))
        return min(limits, default=(None, ""))

    def _resume(self) -> None:
        """Load the saved parts of this job and reuse its buckets (made again if damaged)."""
        saved = self.work.load()
        for name in saved.dropped:
            self.notes.append(f"discarded the unreadable checkpoint part {name}: its rows will be generated again")
        for result in saved.results:
            if not 0 <= result.row < self.total_rows or result.id != self.inp.ids[result.row]:
                raise CheckpointError(f"{self.work.path}: a saved row does not belong to this input; "
                                      f"pass --restart to discard the interrupted run's work")
            self.results[result.row] = result  # a row saved twice (never expected) is kept once
        self.stats = list(saved.stats)
        self._step_offset = max((s.step for s in self.stats), default=0)
        self.resumed_rows = len(self.results)
        if self.bucket_dir is None:
            settings = tokenizer_settings(self.cfg, self.target_name)
            try:
                self.manifest = open_buckets(self.work.buckets)
                ok = self.manifest.settings_hash == settings_hash(settings)
            except BucketError:
                ok = False
            if ok:
                self.bucket_dir, self.limit_rows = self.work.buckets, None
            else:  # tokenization is deterministic: make them again (prompt errors are already saved)
                self.notes.append("the saved length buckets were damaged: tokenizing again")
                shutil.rmtree(self.work.buckets, ignore_errors=True)
                self._announce = [r for r in self._prepare_buckets() if r.row not in self.results]
                for result in self._announce:
                    self._record(result)
        else:
            self.limit_rows = set(range(self.total_rows))

    @property
    def total_rows(self) -> int:
        return len(self.inp.ids)

    @property
    def saved_rows(self) -> int:
        return len(self.results) - len(self._unsaved_rows)

    # ------------------------------------------------------------------ running
    def requests(self) -> Iterator[Request]:
        """The rows still to generate, bucket by bucket; rows failing --max-prompt-tokens go to _prompt_errors."""
        cfg = self.cfg
        temperature, seed, max_new, top_p, stops, logprobs = (
            self.overrides.get(name) for name in ("temperature", "seed", "max_new_tokens", "top_p", "stop", "logprobs"))
        skip = set(self.results)
        current = None
        for bucket, batch in iter_bucket_rows(self.bucket_dir, self.manifest):
            if bucket.index != current:
                self._seal(current)
                current = bucket.index
            rows = batch.column("__row").to_pylist()
            ids = batch.column("__prompt_ids").to_pylist()
            for row, prompt in zip(rows, ids):
                if self.limit_rows is not None and row not in self.limit_rows:
                    continue
                if row in skip:  # saved by an interrupted run: what it taught the drafters is taught again
                    done = self.results[row]
                    self.preloads.append((prompt, done.token_ids if done.finish_reason != "error" else None))
                    for drafter in self.lookups:  # this process's engine (a Ray worker's: WorkerSpec.preload)
                        drafter.preload(*self.preloads[-1])
                    continue
                self._row_bucket[row] = bucket.index
                self._bucket_left[bucket.index] = self._bucket_left.get(bucket.index, 0) + 1
                self._bucket_rows[bucket.index] = self._bucket_rows.get(bucket.index, 0) + 1
                if cfg.max_prompt_tokens is not None and len(prompt) > cfg.max_prompt_tokens:
                    self._prompt_errors.append(RowResult(
                        row, self.inp.ids[row], [], "error", prompt_tokens=len(prompt),
                        error=f"prompt has {len(prompt)} tokens; --max-prompt-tokens is {cfg.max_prompt_tokens}"))
                    continue
                sampling = Sampling(temperature=row_value(temperature, row, cfg.temperature), top_k=cfg.top_k,
                                    top_p=row_value(top_p, row, cfg.top_p), seed=row_value(seed, row, cfg.seed))
                yield Request(row=row, id=self.inp.ids[row], prompt_ids=prompt,
                              max_new_tokens=row_value(max_new, row, cfg.max_new_tokens), sampling=sampling,
                              bucket=bucket.index, pad_to=bucket.hi, logprobs=row_value(logprobs, row, cfg.logprobs),
                              stop=row_value(stops, row, ()))
        self._seal(current)

    def _seal(self, bucket: int | None) -> None:
        if bucket is not None:
            self._sealed.add(bucket)

    def engine(self) -> Engine:
        engine = build_engine(self.cfg, self.mode, self.target, self.draft, self.eos_ids, self.lookup_names)
        self.lookups = engine.lookups
        return engine

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
        yield Started(total_rows=self.total_rows, mode=self.mode, notes=list(self.notes),
                      resumed_rows=self.resumed_rows, work_dir=str(self.work.path))
        yield from self._announce  # prompt errors: already recorded and saved
        stream = (run or self.engine().run)(self.requests())
        try:
            for event in stream:
                if isinstance(event, StepStats):
                    event = dataclasses.replace(event, step=event.step + self._step_offset)
                if isinstance(event, (RowResult, StepStats)):
                    self._record(event)
                yield event
                yield from self._drain()
                self._save_if_due()
                if self._stop_requested:
                    break
            else:
                yield from self._drain()
        finally:
            stream.close()
            self._save()  # a clean stop, a finished run or an exception: keep every finished row
        if self._stop_requested and len(self.results) < self.total_rows:
            self.interrupted = True
            yield Interrupted(saved_rows=self.saved_rows, total_rows=self.total_rows, signal=self._stop_signal)

    def _record(self, event: RowResult | StepStats) -> None:
        if isinstance(event, RowResult):
            if event.row in self.results:
                raise RuntimeError(f"row {event.row} finished twice")
            self.results[event.row] = event
            self._unsaved_rows.append(event)
            bucket = self._row_bucket.pop(event.row, None)
            if bucket is not None:
                self._bucket_left[bucket] -= 1
                self._bucket_errors[bucket] = self._bucket_errors.get(bucket, 0) + (event.finish_reason == "error")
        else:
            self.stats.append(event)
            self._unsaved_stats.append(event)

    def _drain(self) -> Iterator[RowResult | BucketDone]:
        """Error rows found while feeding the engine, then buckets that just completed."""
        while self._prompt_errors:
            result = self._prompt_errors.pop(0)
            self._record(result)
            yield result
        for bucket in sorted(self._sealed - self._announced):
            if self._bucket_left.get(bucket, 0) == 0:
                self._announced.add(bucket)
                if self._bucket_rows.get(bucket):
                    yield BucketDone(bucket=bucket, rows=self._bucket_rows[bucket],
                                     errors=self._bucket_errors.get(bucket, 0))

    def _save_if_due(self) -> None:
        due = len(self._unsaved_rows) >= self.cfg.checkpoint_rows or (
            time.monotonic() - self._last_save >= self.cfg.checkpoint_seconds)
        if due:
            self._save()

    def _save(self) -> None:
        """Write the rows and statistics not yet saved as one checkpoint part."""
        if self._unsaved_rows or self._unsaved_stats:
            self.work.save_part(self._unsaved_rows, self._unsaved_stats)
            self._unsaved_rows, self._unsaved_stats = [], []
        self._last_save = time.monotonic()

    # ------------------------------------------------------------------ output
    def metadata(self) -> dict:
        cfg = self.cfg
        model = self.target.model
        return {
            "batchspec_version": __version__, "torch_version": torch.__version__,
            "transformers_version": _transformers_version(),
            **settings_record(cfg, "metadata", target=self.target_name, draft=self.draft.name if self.draft else None,
                              mode=self.mode, window=pool_window(cfg.batch_size, cfg.window),
                              dtype=str(model.dtype).removeprefix("torch."), device=str(model.device)),
            "target_source": self.target.source, "draft_source": self.draft.source if self.draft else None,
            "drafters": (["model"] if self.draft else []) + self.lookup_names,
            "eos_token_ids": self.eos_ids, "resumed_rows": self.resumed_rows,
            **({"logprobs_distribution": lp.DESCRIPTIONS[cfg.logprobs_mode]} if self.wants_logprobs else {}),
        }

    @property
    def wants_logprobs(self) -> bool:
        """Whether any row asks for log-probabilities (--logprobs, --logprobs-column or an OpenAI request)."""
        return self.cfg.logprobs is not None or any(v is not None for v in self.overrides.get("logprobs") or ())

    def texts(self, results: list[RowResult]) -> list[str]:
        out = []
        for r in results:
            text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            if r.finish_reason == "stop_string":
                stops = self.cfg.stop + row_value(self.overrides.get("stop"), r.row, ())
                text = text[: min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))]
            out.append(text)
        return out

    def finish(self) -> dict:
        """Write both files atomically, remove the work directory; returns a summary."""
        self._save()
        results = [self.results[row] for row in sorted(self.results)]
        missing = self.total_rows - len(results)
        if missing:
            raise RuntimeError(f"{missing} rows have no result")
        meta = self.metadata()
        self.work.mark_finishing()
        token_text = (lambda token: self.tokenizer.decode([token])) if self.wants_logprobs else None
        if self.output_format == "openai":
            openai_batch.write_output(self.cfg.output, self.inp, results, self.texts(results), self.tokenizer,
                                      model=self.target_name, chat=self.cfg.chat, salt=self.input_hash)
        else:
            bio.write_completions(self.cfg.output, self.inp, results, self.texts(results), meta, token_text)
        bio.write_stats(self.stats_path, self.stats, meta)
        self.work.remove()
        errors = [r for r in results if r.finish_reason == "error"]
        return {
            "rows": len(results), "errors": len(errors), "resumed_rows": self.resumed_rows,
            "generated_rows": len(results) - self.resumed_rows,
            "completion_tokens": sum(len(r.token_ids) for r in results), "output": str(self.cfg.output),
            "stats": str(self.stats_path),
            "first_errors": [(r.row, r.id, r.error) for r in errors[:3]],
        }


def check_token_ids(prompt_ids, vocab_size: int, where: Path) -> None:
    """Refuse prompt token ids (a list<int> column) outside the model's vocabulary [0, vocab_size)."""
    import pyarrow.compute as pc

    flat = pc.list_flatten(prompt_ids)
    if len(flat) == 0:
        return
    bounds = pc.min_max(flat)
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise bio.InputError(f"{where}: token id {bad} is outside the model's vocabulary (0..{vocab_size - 1}); "
                             f"was the bucket directory made for another model?")


def use_kernels(name: str, *loaded: models.LoadedModel | None) -> list[str]:
    """Apply ``--kernels`` to the loaded models; returns notes for the user (a kernel that cannot apply)."""
    if name == "stock":
        return []
    from . import kernels

    if not kernels.available():
        return ["--kernels packed needs a PyTorch build with oneDNN: running the stock kernels"]
    done = sum(kernels.packed_layers(kernels.prepack(m.model)) for m in loaded if m is not None)
    return [] if done else ["--kernels packed applies to float32 models on a CPU: running the stock kernels"]


def build_engine(cfg: GenerateConfig, mode: str, target: models.LoadedModel, draft: models.LoadedModel | None,
                 eos_ids: list[int], lookup_names: list[str]) -> Engine:
    """The engine of one job for a set of loaded models: the one place an ``Engine`` is built
    (a single-process run and every distributed worker go through it)."""
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    econf = EngineConfig(mode=mode, k=cfg.k, batch_size=cfg.batch_size, window=cfg.window,
                         pad_id=pad_id, logprobs_mode=cfg.logprobs_mode)
    target_handle = ModelHandle(target.model, models.cache_kwarg(target.model))
    draft_handle = ModelHandle(draft.model, models.cache_kwarg(draft.model)) if draft else None
    checker = StopStrings(tokenizer, cfg.stop)  # always: rows may bring their own stop strings
    return Engine(target_handle, draft_handle, eos_ids, econf, stop_checker=checker,
                  lookups=drafters.make(lookup_names))



class StopStrings:
    """Finds the first stop string in a completion; returns the token cut (shortest prefix holding it).

    Called after every round with the row's whole completion, it decodes only the tail a new
    stop string can lie in: the round's tokens plus enough earlier ones to hold the longest
    stop string. Every token but a skipped special one decodes to at least one byte, so
    ``longest stop in UTF-8 bytes + MARGIN_TOKENS`` earlier tokens (special ones not counted)
    cover any stop string ending in the new text, with room for what a window's first tokens
    decode to differently (a partial UTF-8 character, a stripped leading space). The work
    per call is bounded, so a row costs linear time, not quadratic; the cut is what decoding
    the whole completion every round would give.
    """

    MARGIN_TOKENS = 8

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.skipped = set(tokenizer.all_special_ids)  # decoded with skip_special_tokens: no text

    def _hit(self, ids: list[int], stops: tuple[str, ...]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in stops)

    def _window_start(self, ids: list[int], n_new: int, stops: tuple[str, ...]) -> int:
        """First index of the tail to decode: the new tokens and enough text tokens before them."""
        start, need = len(ids) - n_new, max(len(s.encode("utf-8")) for s in stops) + self.MARGIN_TOKENS
        while start > 0 and need > 0:
            start -= 1
            need -= ids[start] not in self.skipped
        return start

    def __call__(self, ids: list[int], n_new: int, row_stops: tuple[str, ...] = ()) -> int | None:
        """The cut for the job's stop strings plus the row's own (``Request.stop``), or None."""
        stops = self.stops + tuple(row_stops)
        if not stops:
            return None
        start = self._window_start(ids, n_new, stops)
        if not self._hit(ids[start:], stops):
            return None
        for cut in range(max(1, len(ids) - n_new + 1), len(ids) + 1):
            if self._hit(ids[start:cut], stops):
                return cut
        return len(ids)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__

