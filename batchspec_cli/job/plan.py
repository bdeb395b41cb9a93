"""What opening a `generate` job decides, once, before any row runs: one frozen ``JobPlan``.

``plan_job(cfg, work)`` reads as its four steps: check the output paths and take the
output's lock (``work``); read the input (bad input fails before any model is read); read
what the job needs of its models without their weights (``models.describe``: the tokenizer,
the vocabulary, the context, the EOS ids; a mismatched draft is refused here); then either
resume this job's interrupted run (its saved rows and steps, its length buckets, made again
when damaged), refuse another job's work (a different fingerprint), or tokenize every prompt
into length buckets in the work directory; last, keep the input's columns in the work
directory (``JobPlan.passthrough``): a prompts file's rows went there as they were read, a
chunk at a time; an open job holds the ids (one Arrow array), not the input.

A plan holds settings and facts, never a model or an engine: whoever runs the engine builds it
(``assembly.assemble``: ``generation.Generation`` in a single process, each ``distributed.Worker`` under
Ray), so a Ray driver reads, buckets and routes rows without loading a model. ``start_job``
then makes the job resumable, once its engine (if this process runs one) is built.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..config import (FINGERPRINT_LABELS, GenerateConfig, UsageError, bucket_rows, settings_record,
                      tokenizer_settings)
from ..engine import constraints
from ..engine import drafters
from ..engine.constraints import Constraint
from ..engine.events import RowResult
from ..errors import InputError
from ..io import openai_batch
from ..io import sources
from ..io.input_table import TEXT_COLUMNS, Ids, InputTable, StoredTable, id_array
from ..io.prompts import render_chunks
from ..io.row_settings import row_overrides, setting_columns
from ..io.samples import SAMPLE_COLUMN, Samples, job_samples, n_cells
from ..models import loading as models
from ..store import merge
from ..store.buckets import (PROMPT_IDS_COLUMN, ROW_COLUMN, BucketError, Manifest, bucket_chunk, is_bucket_dir,
                             open_buckets, read_all_rows, settings_hash, write_buckets)
from ..store.checkpoint import CheckpointError, WorkDir, describe_changes, hash_files, model_signature
from ..store.files import check_distinct, check_output_path, check_writable, naming, remove_stale_temps
from ..store.outputs import stats_path_for

@dataclass(frozen=True)
class JobPlan:
    """What ``Generation.open`` decided before any row runs; nothing in it changes while the job runs."""

    stats_path: Path
    output_format: str  # parquet | openai (sources.output_format)
    inp: InputTable  # the rows in input order (a bucket directory's: ids and columns, no prompts)
    input_hash: str
    overrides: dict[str, list]  # setting -> [rows] value or None (row_settings.row_overrides and the input's own)
    wants_logprobs: bool  # any row asks for log-probabilities (--logprobs, --logprobs-column, an OpenAI request)
    mode: str  # the mode run: --mode, or ar when nothing can draft
    target: models.ModelFacts  # read without its weights
    draft_spec: str | None  # the draft model's spec the engine loads (assembly.assemble); None without a draft
    draft_name: str | None  # its display name and resolved directory (the fingerprint's, the metadata's)
    draft_source: str | None
    lookup_names: tuple[str, ...]  # model-free drafters (drafters.NAMES)
    notes: tuple[str, ...]  # for the user (a fallback, a discarded part)
    bucket_dir: Path | None = None  # the length buckets the rows are read from (the work directory's, or the input)
    manifest: Manifest | None = None
    # [saved rows] the rows an interrupted run of this job saved, by number (their completions stay in its parts)
    resumed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # [saved rows] aligned with resumed: each saved row's completion tokens, -1 for an error row (what the drafters
    # learn again of it: done.Done.preloads)
    resumed_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_step: int = 0  # the highest step number the interrupted run saved
    resuming: bool = False  # an interrupted run of this job is resumed: its work directory is resumable already
    announce: tuple[RowResult, ...] = ()  # prompts that failed before generation (saved already), reported first
    constraint: Constraint | None = None  # the job's --json-schema / --regex / --choice / --json (rows may differ)
    # the input's columns in input order (WorkDir.keep_input / keep_read_input): OUT's passthrough columns, read
    # back a range at a time (input_table.StoredTable); ``inp.table`` then holds only the schema
    passthrough: Path | None = None
    samples: Samples = Samples(0)  # each input row's samples (--n) among the output rows

    @property
    def total_rows(self) -> int:
        """Output rows: every input row's samples (``samples``); what the checkpoint parts and the finish count."""
        return self.samples.total

    @property
    def input_rows(self) -> int:
        return len(self.inp.ids)

    @property
    def resumed_rows(self) -> int:
        return len(self.resumed)

    @property
    def target_name(self) -> str:
        return self.target.name

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def eos_ids(self) -> list[int]:
        return self.target.eos_ids


def fingerprint(cfg: GenerateConfig, plan: JobPlan) -> dict:
    """Everything that decides the rows' completions; a resumed run must match it exactly (a JSON schema file by
    its contents; per-row constraints are the input's)."""
    schema = {"json_schema": plan.constraint.text} if cfg.json_schema is not None else {}
    return {**settings_record(cfg, "fingerprint", input=plan.input_hash, mode=plan.mode,
                              target=model_signature(plan.target.name, plan.target.source),
                              draft=model_signature(plan.draft_name, plan.draft_source) if plan.draft_spec
                              else None,
                              **schema),
            "rows": plan.input_rows}


def plan_job(cfg: GenerateConfig, work: WorkDir) -> JobPlan:
    """Check the output and take the lock, read the input and what the job needs of its models (no weights), then
    resume this job's saved work or tokenize the prompts into length buckets: everything ``Generation`` needs,
    decided once. ``start_job`` makes a new job resumable."""
    constraint = job_constraint(cfg)  # a bad schema or regex is refused before anything is read
    stats_path, saved_job = _check_output(cfg, work)
    try:
        source = _read_input(cfg, work)  # before any model is loaded: bad input fails fast
        plan = _describe(cfg, stats_path, source, constraint)
        # Resume the interrupted run of this very job, refuse another job's work, or start afresh.
        if saved_job is not None:
            changes = describe_changes(saved_job["fingerprint"], fingerprint(cfg, plan), FINGERPRINT_LABELS)
            if changes:
                raise UsageError(f"{cfg.output}: an interrupted run of this output used other settings "
                                 f"({'; '.join(changes)}); rerun it as it was to resume, or pass --restart "
                                 f"to discard its work")
            return _keep_input(work, dataclasses.replace(_resume(cfg, work, plan), resuming=True))
        if plan.bucket_dir is None:
            plan = _make_buckets(cfg, work, plan)
        plan = _keep_input(work, plan)
    except BaseException:
        try:  # the input as read is not kept: an interrupted run's work directory is left as it was
            work.drop_reading()
        except (CheckpointError, OSError):
            pass
        raise
    return plan


def start_job(cfg: GenerateConfig, work: WorkDir, plan: JobPlan) -> None:
    """Make a new job resumable: its prompt errors saved, then its fingerprint (a resumed job's stands already).
    Called once whatever can refuse the job before it starts (its engine, where this process builds one) has
    passed: a job refused before this leaves no work directory behind."""
    if plan.resuming:
        return
    work.save_part(list(plan.announce), [])  # saved before the job exists: resumable means complete
    work.start_job(fingerprint(cfg, plan), plan.total_rows)


def _keep_input(work: WorkDir, plan: JobPlan) -> JobPlan:
    """The plan with its input's columns on disk (``passthrough``) and out of memory: the ids stay (an Arrow
    array), the table keeps its schema only."""
    inp = plan.inp
    if isinstance(inp.table, StoredTable):  # written to the work directory as it was read: moved, not copied
        path = work.keep_read_input(inp.table.path)
    else:
        path = work.keep_input(inp.table, merge.range_rows(plan.input_rows))
    work.drop_reading()
    kept = dataclasses.replace(inp, table=inp.table.schema.empty_table(), prompts=(), written={})
    plan = dataclasses.replace(plan, inp=kept, passthrough=path)
    gc.collect()  # the input read refers to itself (its Prompts): it goes now, not at a later collection
    release_free_memory()
    return plan


def release_free_memory() -> None:
    """Hand the memory that reading, tokenizing and bucketing freed back to the system (Arrow's pool and the C
    heap keep freed memory for reuse, and the job's later peaks would stand on top of it; docs/history.md,
    "Figures once kept in the code")."""
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL(None).malloc_trim(0)  # glibc; elsewhere there is no such call and nothing to do
    except (OSError, AttributeError):
        pass


def _check_output(cfg: GenerateConfig, work: WorkDir) -> tuple[Path, dict | None]:
    """Check the output paths and take the output's lock; returns the statistics path and the job.json of an
    interrupted run to resume (None: none, or --restart)."""
    check_output_path(cfg.output, overwrite=True)
    stats_path = cfg.stats or stats_path_for(cfg.output)
    check_distinct([cfg.input], [("OUT", cfg.output), ("--stats", stats_path)])
    check_writable(stats_path)

    # One writer per output: the lock, before anything is read or written.
    work.lock()
    for path in (cfg.output, stats_path):  # what a process killed while writing them left
        remove_stale_temps(path)
    saved_job = None  # the job.json of an interrupted run
    try:
        saved_job = work.read_job()
    except CheckpointError as exc:
        if not cfg.restart:
            raise CheckpointError(f"{exc}; pass --restart to discard the interrupted run's work") from None
    if cfg.restart:
        work.clear()
        saved_job = None
    finishing = bool(saved_job and saved_job.get("finishing"))  # a crash while writing the final files
    if not cfg.overwrite and not finishing:
        for path in (cfg.output, stats_path):
            if path.exists():
                raise UsageError(f"{path} already exists; pass --overwrite to replace it")
    if saved_job is None:
        work.clear()  # leftovers of a run that died before it was resumable
    return stats_path, saved_job


@dataclass
class _Source:
    """The input as read before any model loads."""

    output_format: str
    input_hash: str
    inp: InputTable | None = None  # None for a bucket directory (read once the target is loaded)
    overrides: dict[str, list] = dataclasses.field(default_factory=dict)
    bucket_dir: Path | None = None
    manifest: Manifest | None = None


def _read_input(cfg: GenerateConfig, work: WorkDir) -> _Source:
    """A prompts file read into the work directory a chunk at a time (``WorkDir.reading_store``); a Hugging
    Face dataset or an OpenAI batch read whole; a bucket directory opened."""
    output_format = sources.output_format(cfg)
    if cfg.input.is_dir() and not sources.is_dataset_dir(cfg.input):
        if not is_bucket_dir(cfg.input):
            raise UsageError(f"{cfg.input}: a directory, but not a bucket directory (no manifest.json)")
        manifest = open_buckets(cfg.input)
        input_hash = hash_files([cfg.input / "manifest.json"] + [cfg.input / b.shard for b in manifest.buckets])
        return _Source(output_format, input_hash, bucket_dir=cfg.input, manifest=manifest)
    inp, input_hash = sources.read(cfg, work.reading_store())
    if ROW_COLUMN in inp.table.column_names or PROMPT_IDS_COLUMN in inp.table.column_names:
        raise UsageError(f"{cfg.input}: column names {ROW_COLUMN} and {PROMPT_IDS_COLUMN} are reserved")
    counts = n_cells(inp, cfg)  # a bad cell makes its row an error row (inp.errors)
    return _Source(output_format, input_hash, inp,
                   {**row_overrides(inp, cfg), **({"n": counts} if counts is not None else {}), **inp.overrides})


def _describe(cfg: GenerateConfig, stats_path: Path, source: _Source, constraint: Constraint | None) -> JobPlan:
    """Choose the drafters, check the tokenizers and the draft's config, and read the target's facts: no weights
    are read (``assembly.assemble`` loads them where the engine runs)."""
    notes = []
    formats = source.overrides.get("response_format") or ()  # an OpenAI batch's own (TEXT: none)
    constrained = constraint is not None or cfg.response_format_column is not None \
        or any(c not in (None, constraints.TEXT) for c in formats)
    if constrained and (cfg.stop or cfg.stop_column):  # allowed, as OpenAI and vLLM allow it (README)
        notes.append("stop strings cut constrained answers too: a row cut by one ends stop_string, and its text may "
                     "not be valid under its constraint")
    draft_spec, lookup_names = _drafters(cfg, constrained)
    mode = cfg.mode
    if draft_spec is None and not lookup_names and mode != "ar":
        notes.append(f"no drafter available: running plain autoregressive decoding (--mode ar) instead of {mode}")
        mode = "ar"
    if mode == "ar":
        draft_spec, lookup_names = None, []
    draft_name = draft_source = None
    if draft_spec is not None:
        models.check_draft_vocab(cfg.target, draft_spec)
        draft_name, folder = models.check_draft(draft_spec, None, quiet=cfg.quiet)  # the embeddings: assemble's
        draft_source = str(folder)

    target = models.describe(cfg.target, quiet=cfg.quiet)
    inp, overrides = source.inp, source.overrides
    if source.bucket_dir is not None:
        inp, overrides = _read_bucket_dir(cfg, source.manifest, target)
    notes += openai_batch.model_notes(inp, target.name)
    if inp.prompt_column not in (None, cfg.prompt_column):  # no `prompt` column: its `messages` are the prompts
        notes.append(f"no '{cfg.prompt_column}' column: the prompts are the chat messages of column "
                     f"'{inp.prompt_column}'")
    samples = job_samples(cfg, len(inp.ids), overrides.get("n"))
    if samples.written and SAMPLE_COLUMN in inp.table.column_names:
        raise UsageError(f"{cfg.input}: input column {SAMPLE_COLUMN!r} clashes with the output's sample column "
                         f"(--n, --n-column); rename it")
    return JobPlan(
        stats_path=stats_path, output_format=source.output_format, inp=inp, input_hash=source.input_hash,
        overrides=overrides, mode=mode, target=target, draft_spec=draft_spec, draft_name=draft_name,
        draft_source=draft_source, lookup_names=tuple(lookup_names), notes=tuple(notes),
        wants_logprobs=cfg.logprobs is not None or any(v is not None for v in overrides.get("logprobs") or ()),
        bucket_dir=source.bucket_dir, manifest=source.manifest, constraint=constraint, samples=samples)


def job_constraint(cfg: GenerateConfig) -> Constraint | None:
    """The job's --json-schema / --regex / --choice / --json; UsageError (one line) when it cannot be used."""
    try:
        if cfg.json_schema is not None:
            try:
                text = Path(cfg.json_schema).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise constraints.ConstraintError(f"cannot read it ({getattr(exc, 'strerror', None) or exc})")
            constraint = constraints.json_schema(text)
        elif cfg.regex is not None:
            constraint = constraints.regex(cfg.regex)
        elif cfg.choice:
            constraint = constraints.choice(cfg.choice)
        elif cfg.json:
            constraint = constraints.any_json()
        else:
            return None
        error = constraints.problem(constraint)
        if error:
            raise constraints.ConstraintError(error)
    except constraints.ConstraintError as exc:
        flag = ("--json-schema " + str(cfg.json_schema) if cfg.json_schema is not None else
                "--regex" if cfg.regex is not None else "--choice" if cfg.choice else "--json")
        raise UsageError(f"{flag}: {exc}") from None
    return constraint


def _drafters(cfg: GenerateConfig, constrained: bool = False) -> tuple[str | None, list[str]]:
    """(draft model spec or None, model-free drafter names) from --draft, or the defaults.

    ``--draft`` takes a model, ``ngram``, ``suffix``, ``grammar``, or a comma list of them
    (one model at most). Without it: the shipped draft for the embedded default target, plus
    ``suffix`` under ``auto``; ``suffix`` for any other target, so every target gets
    speculation; and ``grammar`` when rows are constrained (it drafts the forced tokens).
    """
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
    grammar = ["grammar"] if constrained else []
    shipped = models.default_draft_path() if cfg.target is None else None
    if shipped is not None:
        return str(shipped), (["suffix"] if cfg.mode == "auto" else []) + grammar
    return None, ["suffix"] + grammar


def _read_bucket_dir(cfg: GenerateConfig, manifest: Manifest,
                     target: models.ModelFacts) -> tuple[InputTable, dict[str, list]]:
    """A bucket directory as input: its rows (in input order), ids and per-row overrides."""
    recorded = {"allow_special_tokens": False, **manifest.settings}  # recorded only when given
    settings = {"allow_special_tokens": False, **tokenizer_settings(cfg, target.name)}
    mismatched = {key: (recorded.get(key), value) for key, value in settings.items()
                  if key != "id_column" and recorded.get(key) != value}
    if mismatched:
        detail = "; ".join(f"{k}: bucketed with {a!r}, now {b!r}" for k, (a, b) in mismatched.items())
        raise UsageError(f"{cfg.input}: bucket directory was made with other settings ({detail}); "
                         f"rerun `batchspec bucket` with these settings")
    as_text = [c for c in setting_columns(cfg) if c in (manifest.settings.get(TEXT_COLUMNS) or ())]
    if as_text:
        raise UsageError(f"{cfg.input}: column {as_text[0]!r} mixes kinds of values (strings and lists, say), and a "
                         f"bucket directory keeps it as text; give `generate` the prompts file itself")
    table = read_all_rows(cfg.input, manifest)
    check_token_ids(table.column(PROMPT_IDS_COLUMN), target.vocab_size, cfg.input)
    id_column = manifest.settings.get("id_column", "id")
    ids = [str(v) for v in table.column(id_column).to_pylist()] if id_column in table.column_names \
        else [str(v) for v in table.column(ROW_COLUMN).to_pylist()]
    table = table.drop_columns([c for c in (ROW_COLUMN, PROMPT_IDS_COLUMN) if c in table.column_names])
    if cfg.limit is not None:
        table, ids = table.slice(0, cfg.limit), ids[: cfg.limit]
    inp = InputTable(path=cfg.input, table=table, prompts=[], ids=Ids(pa.array(ids, type=pa.string())))
    counts = n_cells(inp, cfg)
    if inp.errors:  # a bucket directory's rows are all tokenized: there is no error row to make
        row, error = min(inp.errors.items())
        raise InputError(f"{cfg.input}: row {row + 1}: {error}")
    return inp, {**row_overrides(inp, cfg), **({"n": counts} if counts is not None else {})}


def _make_buckets(cfg: GenerateConfig, work: WorkDir, plan: JobPlan) -> JobPlan:
    """Tokenize every prompt once, a chunk at a time, into the length buckets of the work directory; the prompts
    that failed become ``announce`` error rows. The shards hold the row numbers and token ids only: the input's
    columns are kept apart (``_keep_input``)."""
    most_tokens, what = _prompt_token_limit(cfg, plan.target)
    errors: dict[int, str] = {}
    chunks = (bucket_chunk(start, ids) for start, ids in render_chunks(
        plan.inp, plan.tokenizer, cfg.chat, cfg.system, errors, most_tokens, what, cfg.allow_special_tokens))
    with naming(work.buckets):
        manifest = write_buckets(work.buckets, chunks, tokenizer_settings(cfg, plan.target_name),
                                 width=cfg.bucket_width, min_rows=bucket_rows(cfg), overwrite=True)
    samples = plan.samples  # a prompt that failed fails each of its samples
    failed = tuple(RowResult(out, plan.inp.ids[row], [], "error", error=error)
                   for row, error in sorted(errors.items())
                   for out in range(samples.first(row), samples.first(row) + samples.count(row)))
    return dataclasses.replace(plan, bucket_dir=work.buckets, manifest=manifest, announce=failed)


def _prompt_token_limit(cfg: GenerateConfig, target: models.ModelFacts) -> tuple[int | None, str]:
    """The most tokens a prompt may have (the model's context less one, --max-prompt-tokens), and its name."""
    context = target.context
    limits = [(context - 1, f"the model's context of {context} tokens")] if context else []
    if cfg.max_prompt_tokens is not None:
        limits.append((cfg.max_prompt_tokens, f"--max-prompt-tokens {cfg.max_prompt_tokens}"))
    return min(limits, default=(None, ""))


def _resume(cfg: GenerateConfig, work: WorkDir, plan: JobPlan) -> JobPlan:
    """Load the saved parts of this job and reuse its buckets (made again if damaged)."""
    saved = work.load()
    notes = [f"discarded the unreadable checkpoint part {name}: its rows will be generated again"
             for name in saved.dropped]
    rows = saved.rows
    if len(rows) and (rows.min() < 0 or rows.max() >= plan.total_rows
                      or not pc.all(pc.equal(saved.ids, id_array(plan.inp.ids).take(
                          pa.array(plan.samples.input_rows(rows))))).as_py()):
        raise CheckpointError(f"{work.path}: a saved row does not belong to this input; "
                              f"pass --restart to discard the interrupted run's work")
    resumed, last = np.unique(rows[::-1], return_index=True)  # a row saved twice (never expected) is kept once: its last
    plan = dataclasses.replace(plan, resumed=resumed, resumed_lengths=saved.lengths[::-1][last],
                               last_step=saved.last_step)
    if plan.bucket_dir is None:
        settings = tokenizer_settings(cfg, plan.target_name)
        try:
            manifest = open_buckets(work.buckets)
            ok = manifest.settings_hash == settings_hash(settings) and all(
                _readable(work.buckets / b.shard) for b in manifest.buckets)
        except BucketError:
            ok = False
        if ok:
            plan = dataclasses.replace(plan, bucket_dir=work.buckets, manifest=manifest)
        else:  # tokenization is deterministic: make them again (prompt errors are already saved)
            notes.append("the saved length buckets were damaged: tokenizing again")
            shutil.rmtree(work.buckets, ignore_errors=True)
            plan = _make_buckets(cfg, work, plan)
            saved_before = np.isin([r.row for r in plan.announce], resumed)
            plan = dataclasses.replace(plan, announce=tuple(r for r, s in zip(plan.announce, saved_before) if not s))
            work.save_part(list(plan.announce), [])
    return dataclasses.replace(plan, notes=plan.notes + tuple(notes))


def _readable(shard: Path) -> bool:
    """Does a bucket shard open? (An earlier version could write one that Parquet cannot read back.)"""
    try:
        pq.read_schema(shard)
    except (OSError, pa.ArrowException):
        return False
    return True


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
        raise InputError(f"{where}: token id {bad} is outside the model's vocabulary (0..{vocab_size - 1}); "
                         f"was the bucket directory made for another model?")
