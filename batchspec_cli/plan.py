"""What opening a `generate` job decides, once, before any row runs: one frozen ``JobPlan``.

``plan_job(cfg, work)`` checks the output paths, takes the output's lock (``work``), reads
the input (bad input fails before any model loads), loads the tokenizers (a mismatched
draft is refused before its weights load) and the models, then either resumes this job's
interrupted run (its saved rows and steps, its length buckets, made again when damaged),
refuses another job's work (a different fingerprint), or tokenizes every prompt into
length buckets in the work directory. ``job.Generation`` runs the plan.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

from buckets import BucketError, Manifest, build_buckets, is_bucket_dir, open_buckets, read_all_rows, settings_hash

from . import constraints
from . import drafters
from . import models
from . import openai_batch
from . import sources
from .checkpoint import CheckpointError, WorkDir, describe_changes, hash_files, model_signature
from .config import FINGERPRINT_LABELS, GenerateConfig, UsageError, settings_record, tokenizer_settings
from .constraints import Constraint
from .errors import InputError
from .events import RowResult, StepStats
from .files import check_distinct, check_output_path, check_writable, remove_stale_temps
from .inputs import InputTable, row_overrides
from .outputs import stats_path_for
from .prompts import render_prompts

PACKED_MEMORY_SHARE = 0.5  # --kernels auto packs only when the packed copies take at most this share of free memory


@dataclass(frozen=True)
class JobPlan:
    """What ``Generation.open`` decided before any row runs; nothing in it changes while the job runs."""

    stats_path: Path
    output_format: str  # parquet | openai (sources.output_format)
    inp: InputTable  # the rows in input order (a bucket directory's: ids and columns, no prompts)
    input_hash: str
    overrides: dict[str, list]  # setting -> [rows] value or None (inputs.row_overrides and the input's own)
    wants_logprobs: bool  # any row asks for log-probabilities (--logprobs, --logprobs-column, an OpenAI request)
    mode: str  # the mode run: --mode, or ar when nothing can draft
    target_name: str
    target: models.LoadedModel
    draft: models.LoadedModel | None
    draft_spec: str | None  # the draft model's spec a distributed worker loads; None without a draft
    lookup_names: tuple[str, ...]  # model-free drafters (drafters.NAMES)
    eos_ids: list[int]
    kernels: str  # the kernels that run: stock | packed (use_kernels)
    notes: tuple[str, ...]  # for the user (a fallback, a kernel that cannot apply, a discarded part)
    bucket_dir: Path | None = None  # the length buckets the rows are read from (the work directory's, or the input)
    manifest: Manifest | None = None
    resumed: tuple[RowResult, ...] = ()  # rows an interrupted run of this job saved
    resumed_stats: tuple[StepStats, ...] = ()
    announce: tuple[RowResult, ...] = ()  # prompts that failed before generation (saved already), reported first
    constraint: Constraint | None = None  # the job's --json-schema / --regex / --choice / --json (rows may differ)

    @property
    def total_rows(self) -> int:
        return len(self.inp.ids)

    @property
    def resumed_rows(self) -> int:
        return len(self.resumed)

    @property
    def tokenizer(self):
        return self.target.tokenizer


def fingerprint(cfg: GenerateConfig, plan: JobPlan) -> dict:
    """Everything that decides the rows' completions; a resumed run must match it exactly (a JSON schema file by
    its contents; per-row constraints are the input's)."""
    schema = {"json_schema": plan.constraint.text} if cfg.json_schema is not None else {}
    return {**settings_record(cfg, "fingerprint", input=plan.input_hash, mode=plan.mode,
                              target=model_signature(plan.target.name, plan.target.source),
                              draft=model_signature(plan.draft.name, plan.draft.source) if plan.draft else None,
                              **schema),
            "rows": plan.total_rows}


def plan_job(cfg: GenerateConfig, work: WorkDir) -> JobPlan:
    """Check the output, take the lock, read the input, load the models, then resume this job's saved
    work or tokenize the prompts into length buckets: everything ``Generation`` needs, decided once."""
    constraint = job_constraint(cfg)  # a bad schema or regex is refused before anything is read
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

    # Read the input before any model is loaded: bad input fails fast.
    output_format = sources.output_format(cfg)
    bucket_dir, manifest, inp, overrides = None, None, None, {}
    if cfg.input.is_dir() and not sources.is_dataset_dir(cfg.input):
        if not is_bucket_dir(cfg.input):
            raise UsageError(f"{cfg.input}: a directory, but not a bucket directory (no manifest.json)")
        bucket_dir, manifest = cfg.input, open_buckets(cfg.input)
        input_hash = hash_files([cfg.input / "manifest.json"] + [cfg.input / b.shard for b in manifest.buckets])
    else:
        inp, input_hash = sources.read(cfg)  # a file, a Hugging Face dataset or an OpenAI batch
        if "__row" in inp.table.column_names or "__prompt_ids" in inp.table.column_names:
            raise UsageError(f"{cfg.input}: column names __row and __prompt_ids are reserved")
        overrides = {**row_overrides(inp.table, cfg), **inp.overrides}

    # Tokenizers first (cheap): a mismatched draft is refused before loading weights.
    notes = []
    constrained = constraint is not None or cfg.response_format_column is not None \
        or any(overrides.get("response_format") or ())
    draft_spec, lookup_names = _drafters(cfg, constrained)
    mode = cfg.mode
    if draft_spec is None and not lookup_names and mode != "ar":
        notes.append(f"no drafter available: running plain autoregressive decoding (--mode ar) instead of {mode}")
        mode = "ar"
    if mode == "ar":
        draft_spec, lookup_names = None, []
    target_tok, target_name = models.load_tokenizer(cfg.target, quiet=True)
    if draft_spec is not None:
        draft_tok, draft_name = models.load_tokenizer(draft_spec, quiet=True)
        models.check_vocab(target_tok, draft_tok, target_name, draft_name)

    target = models.load_model(cfg.target, cfg.dtype, cfg.device, quiet=cfg.quiet)
    draft = None
    if draft_spec is not None:
        draft = models.load_draft(draft_spec, target, cfg.dtype, cfg.device, quiet=cfg.quiet)
        if draft.model.device != target.model.device:
            raise UsageError("draft and target ended up on different devices")
    kernels_run, kernel_notes = use_kernels(cfg.kernels, target, draft)
    notes += kernel_notes

    if bucket_dir is not None:
        inp, overrides = _read_bucket_dir(cfg, manifest, target_name, target)
    notes += openai_batch.model_notes(inp, target_name)
    plan = JobPlan(
        stats_path=stats_path, output_format=output_format, inp=inp, input_hash=input_hash,
        overrides=overrides, mode=mode, target_name=target_name, target=target, draft=draft, draft_spec=draft_spec,
        lookup_names=tuple(lookup_names), eos_ids=models.eos_ids(target.model, target.tokenizer), kernels=kernels_run,
        notes=tuple(notes),
        wants_logprobs=cfg.logprobs is not None or any(v is not None for v in overrides.get("logprobs") or ()),
        bucket_dir=bucket_dir, manifest=manifest, constraint=constraint)

    # Resume the interrupted run of this very job, refuse another job's work, or start afresh.
    if saved_job is not None:
        changes = describe_changes(saved_job["fingerprint"], fingerprint(cfg, plan), FINGERPRINT_LABELS)
        if changes:
            raise UsageError(f"{cfg.output}: an interrupted run of this output used other settings "
                             f"({'; '.join(changes)}); rerun it as it was to resume, or pass --restart "
                             f"to discard its work")
        return _resume(cfg, work, plan)
    work.clear()  # leftovers of a run that died before it was resumable
    if plan.bucket_dir is None:
        plan = _make_buckets(cfg, work, plan)
    work.save_part(list(plan.announce), [])  # saved before the job exists: resumable means complete
    work.start_job(fingerprint(cfg, plan), plan.total_rows)
    return plan


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


def _read_bucket_dir(cfg: GenerateConfig, manifest: Manifest, target_name: str,
                     target: models.LoadedModel) -> tuple[InputTable, dict[str, list]]:
    """A bucket directory as input: its rows (in input order), ids and per-row overrides."""
    settings = tokenizer_settings(cfg, target_name)
    mismatched = {key: (manifest.settings.get(key), value) for key, value in settings.items()
                  if key != "id_column" and manifest.settings.get(key) != value}
    if mismatched:
        detail = "; ".join(f"{k}: bucketed with {a!r}, now {b!r}" for k, (a, b) in mismatched.items())
        raise UsageError(f"{cfg.input}: bucket directory was made with other settings ({detail}); "
                         f"rerun `batchspec bucket` with these settings")
    table = read_all_rows(cfg.input, manifest)
    check_token_ids(table.column("__prompt_ids"), target.model.get_input_embeddings().num_embeddings, cfg.input)
    id_column = manifest.settings.get("id_column", "id")
    ids = [str(v) for v in table.column(id_column).to_pylist()] if id_column in table.column_names \
        else [str(v) for v in table.column("__row").to_pylist()]
    table = table.drop_columns([c for c in ("__row", "__prompt_ids") if c in table.column_names])
    if cfg.limit is not None:
        table, ids = table.slice(0, cfg.limit), ids[: cfg.limit]
    return InputTable(path=cfg.input, table=table, prompts=[], ids=ids), row_overrides(table, cfg)


def _make_buckets(cfg: GenerateConfig, work: WorkDir, plan: JobPlan) -> JobPlan:
    """Tokenize every prompt once and write the length buckets into the work directory; the prompts
    that failed become ``announce`` error rows."""
    most_tokens, what = _prompt_token_limit(cfg, plan.target)
    rendered = render_prompts(plan.inp, plan.tokenizer, cfg.chat, cfg.system, most_tokens, what)
    manifest = build_buckets(work.buckets, plan.inp.table, rendered.ids, tokenizer_settings(cfg, plan.target_name),
                             width=cfg.bucket_width, min_rows=cfg.batch_size, overwrite=True)
    failed = tuple(RowResult(row, plan.inp.ids[row], [], "error", error=error)
                   for row, error in sorted(rendered.errors.items()))
    return dataclasses.replace(plan, bucket_dir=work.buckets, manifest=manifest, announce=failed)


def _prompt_token_limit(cfg: GenerateConfig, target: models.LoadedModel) -> tuple[int | None, str]:
    """The most tokens a prompt may have (the model's context less one, --max-prompt-tokens), and its name."""
    context = int(getattr(target.model.config, "max_position_embeddings", 0) or 0) or None
    limits = [(context - 1, f"the model's context of {context} tokens")] if context else []
    if cfg.max_prompt_tokens is not None:
        limits.append((cfg.max_prompt_tokens, f"--max-prompt-tokens {cfg.max_prompt_tokens}"))
    return min(limits, default=(None, ""))


def _resume(cfg: GenerateConfig, work: WorkDir, plan: JobPlan) -> JobPlan:
    """Load the saved parts of this job and reuse its buckets (made again if damaged)."""
    saved = work.load()
    notes = [f"discarded the unreadable checkpoint part {name}: its rows will be generated again"
             for name in saved.dropped]
    resumed: dict[int, RowResult] = {}
    for result in saved.results:
        if not 0 <= result.row < plan.total_rows or result.id != plan.inp.ids[result.row]:
            raise CheckpointError(f"{work.path}: a saved row does not belong to this input; "
                                  f"pass --restart to discard the interrupted run's work")
        resumed[result.row] = result  # a row saved twice (never expected) is kept once
    plan = dataclasses.replace(plan, resumed=tuple(resumed.values()), resumed_stats=tuple(saved.stats))
    if plan.bucket_dir is None:
        settings = tokenizer_settings(cfg, plan.target_name)
        try:
            manifest = open_buckets(work.buckets)
            ok = manifest.settings_hash == settings_hash(settings)
        except BucketError:
            ok = False
        if ok:
            plan = dataclasses.replace(plan, bucket_dir=work.buckets, manifest=manifest)
        else:  # tokenization is deterministic: make them again (prompt errors are already saved)
            notes.append("the saved length buckets were damaged: tokenizing again")
            shutil.rmtree(work.buckets, ignore_errors=True)
            plan = _make_buckets(cfg, work, plan)
            plan = dataclasses.replace(plan, announce=tuple(r for r in plan.announce if r.row not in resumed))
            work.save_part(list(plan.announce), [])
    return dataclasses.replace(plan, notes=plan.notes + tuple(notes))


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


def use_kernels(name: str, *loaded: models.LoadedModel | None) -> tuple[str, list[str]]:
    """Apply ``--kernels`` to the loaded models. Returns the kernels that run (stock or packed) and notes for the
    user (packed kernels that cannot apply, or that ``auto`` leaves out for want of memory)."""
    if name == "stock":
        return "stock", []
    from . import kernels

    present = [m.model for m in loaded if m is not None]
    if not kernels.available():
        return "stock", [] if name == "auto" else ["--kernels packed needs a PyTorch build with oneDNN: "
                                                   "running the stock kernels"]
    extra = sum(kernels.packable_bytes(m) for m in present)
    if extra == 0:  # a GPU, or another dtype than float32
        return "stock", [] if name == "auto" else ["--kernels packed applies to float32 models on a CPU: "
                                                   "running the stock kernels"]
    free = kernels.memory_available()
    if name == "auto" and free is not None and PACKED_MEMORY_SHARE * free < extra:
        return "stock", [f"the packed CPU kernels would take {extra / 2**20:.0f} MiB more memory, and "
                         f"{free / 2**20:.0f} MiB is available: running the stock kernels (--kernels packed "
                         f"forces them)"]
    for model in present:
        kernels.prepack(model)
    return "packed", []
