"""One `generate` job: input -> tokenize -> buckets -> engine -> output files.

``Generation.open(cfg)`` validates everything that can be validated before any work
(flags, input file, output path, model paths, vocabularies) and raises ``UsageError``
with a one-line message; ``events()`` then streams engine events; ``finish()`` writes the
completions and statistics files atomically.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from buckets import BucketError, build_buckets, is_bucket_dir, iter_bucket_rows, open_buckets, read_all_rows

from . import __version__
from . import io as bio
from . import models
from .engine import Engine, EngineConfig, ModelHandle
from .events import Request, RowResult, Sampling, StepStats

MODES = ("ar", "eqspec", "exspec")
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")


class UsageError(Exception):
    """A problem with the user's flags, files or models: one line, exit code 2."""


@dataclass
class GenerateConfig:
    input: Path
    output: Path
    stats: Path | None = None
    target: str | None = None
    draft: str | None = None
    mode: str = "exspec"
    k: int = 5
    batch_size: int = 8
    window: int | None = None  # default 4 x batch size
    max_new_tokens: int = 256
    prompt_column: str = "prompt"
    id_column: str = "id"
    chat: bool = True
    system: str | None = None
    stop: tuple[str, ...] = ()
    dtype: str = "auto"
    device: str = "auto"
    limit: int | None = None
    overwrite: bool = False
    quiet: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    bucket_width: int | None = None
    threads: int | None = None
    temperature_column: str | None = None  # per-row overrides read from input columns (null: the flag's value)
    seed_column: str | None = None
    max_new_tokens_column: str | None = None


@dataclass
class Started:
    """First event: what will run."""

    total_rows: int
    mode: str
    notes: list[str] = field(default_factory=list)


def validate(cfg: GenerateConfig) -> None:
    checks = [
        (cfg.batch_size >= 1, f"--batch-size must be a positive integer, got {cfg.batch_size}"),
        (cfg.max_new_tokens >= 1, f"--max-new-tokens must be a positive integer, got {cfg.max_new_tokens}"),
        (1 <= cfg.k <= 32, f"--draft-tokens must be between 1 and 32, got {cfg.k}"),
        (cfg.window is None or cfg.window >= 1, f"--window must be a positive integer, got {cfg.window}"),
        (cfg.limit is None or cfg.limit >= 1, f"--limit must be a positive integer, got {cfg.limit}"),
        (cfg.mode in MODES, f"--mode must be one of {', '.join(MODES)}, got {cfg.mode!r}"),
        (cfg.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}"),
        (cfg.temperature >= 0, f"--temperature must be >= 0, got {cfg.temperature}"),
        (cfg.top_k >= 0, f"--top-k must be >= 0, got {cfg.top_k}"),
        (0 < cfg.top_p <= 1, f"--top-p must be in (0, 1], got {cfg.top_p}"),
        (cfg.bucket_width is None or cfg.bucket_width >= 1, f"--bucket-width must be positive, got {cfg.bucket_width}"),
        (cfg.threads is None or cfg.threads >= 1, f"--threads must be a positive integer, got {cfg.threads}"),
        (all(cfg.stop), "--stop strings must not be empty"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


def work_dir_for(out: Path) -> Path:
    return out.parent / f".{out.name}.batchspec-work"


def tokenizer_settings(cfg: GenerateConfig, target_name: str) -> dict:
    """What determines the prompt token ids (the bucket directory's settings)."""
    return {"target": target_name, "chat": cfg.chat, "system": cfg.system, "prompt_column": cfg.prompt_column,
            "id_column": cfg.id_column}


class Generation:
    def __init__(self, cfg: GenerateConfig):
        self.cfg = cfg
        self.notes: list[str] = []
        self.results: dict[int, RowResult] = {}
        self.stats: list[StepStats] = []

    # ------------------------------------------------------------------ setup
    @classmethod
    def open(cls, cfg: GenerateConfig) -> "Generation":
        validate(cfg)
        self = cls(cfg)
        try:
            self._open()
        except (bio.InputError, models.ModelError, BucketError) as exc:
            raise UsageError(str(exc)) from None
        return self

    def _open(self) -> None:
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        bio.check_output_path(cfg.output, cfg.overwrite)
        self.stats_path = cfg.stats or bio.stats_path_for(cfg.output)
        if self.stats_path.resolve() == cfg.output.resolve():
            raise UsageError("--stats must differ from the output file")
        if self.stats_path.exists() and not cfg.overwrite:
            raise UsageError(f"{self.stats_path} already exists; pass --overwrite to replace it")

        # Read the input before any model is loaded: bad input fails fast.
        self.bucket_dir: Path | None = None
        if cfg.input.is_dir():
            if not is_bucket_dir(cfg.input):
                raise UsageError(f"{cfg.input}: a directory, but not a bucket directory (no manifest.json)")
            self.bucket_dir = cfg.input
            self.manifest = open_buckets(cfg.input)
        else:
            self.inp = bio.read_input(cfg.input, cfg.prompt_column, cfg.id_column, cfg.limit)
            self.overrides = row_overrides(self.inp.table, cfg)

        # Tokenizers first (cheap): a mismatched draft is refused before loading weights.
        draft_spec = cfg.draft
        if draft_spec is None and cfg.target is None and cfg.mode != "ar":
            shipped = models.default_draft_path()
            if shipped is not None:
                draft_spec = str(shipped)
        self.mode = cfg.mode
        if draft_spec is None and self.mode != "ar":
            self.notes.append(f"no draft model available: running plain autoregressive decoding (--mode ar) "
                              f"instead of {self.mode}")
            self.mode = "ar"
        target_tok, self.target_name = models.load_tokenizer(cfg.target, quiet=True)
        if draft_spec is not None and self.mode != "ar":
            draft_tok, draft_name = models.load_tokenizer(draft_spec, quiet=True)
            models.check_vocab(target_tok, draft_tok, self.target_name, draft_name)

        self.target = models.load_model(cfg.target, cfg.dtype, cfg.device, quiet=cfg.quiet)
        self.draft = None
        if draft_spec is not None and self.mode != "ar":
            self.draft = models.load_model(draft_spec, cfg.dtype, cfg.device, quiet=cfg.quiet)
            if self.draft.model.device != self.target.model.device:
                raise UsageError("draft and target ended up on different devices")
            self.draft.model.to(self.target.model.dtype)
        self.tokenizer = self.target.tokenizer
        self.eos_ids = models.eos_ids(self.target.model, self.tokenizer)
        self._prepare_buckets()

    def _prepare_buckets(self) -> None:
        """Tokenize every prompt once and write (or reuse) the length buckets."""
        cfg = self.cfg
        settings = tokenizer_settings(cfg, self.target_name)
        if self.bucket_dir is not None:
            mismatched = {key: (self.manifest.settings.get(key), value) for key, value in settings.items()
                          if key != "id_column" and self.manifest.settings.get(key) != value}
            if mismatched:
                detail = "; ".join(f"{k}: bucketed with {a!r}, now {b!r}" for k, (a, b) in mismatched.items())
                raise UsageError(f"{cfg.input}: bucket directory was made with other settings ({detail}); "
                                 f"rerun `batchspec bucket` with these settings")
            table = read_all_rows(self.bucket_dir, self.manifest)
            id_column = self.manifest.settings.get("id_column", "id")
            ids = [str(v) for v in table.column(id_column).to_pylist()] if id_column in table.column_names \
                else [str(v) for v in table.column("__row").to_pylist()]
            table = table.drop_columns([c for c in ("__row", "__prompt_ids") if c in table.column_names])
            if cfg.limit is not None:
                table, ids = table.slice(0, cfg.limit), ids[: cfg.limit]
            self.inp = bio.InputTable(path=cfg.input, table=table, prompts=[], ids=ids)
            self.overrides = row_overrides(table, cfg)
            self.limit_rows = set(range(len(ids)))
            return
        prompt_ids = [bio.render_prompt(self.tokenizer, p, cfg.chat, cfg.system) for p in self.inp.prompts]
        self.bucket_dir = work_dir_for(cfg.output) / "buckets"
        table = self.inp.table
        if "__row" in table.column_names or "__prompt_ids" in table.column_names:
            raise UsageError(f"{cfg.input}: column names __row and __prompt_ids are reserved")
        self.manifest = build_buckets(self.bucket_dir, table, prompt_ids, settings, width=cfg.bucket_width,
                                      min_rows=cfg.batch_size, overwrite=True)
        self.limit_rows = None

    @property
    def total_rows(self) -> int:
        return len(self.inp.ids)

    # ------------------------------------------------------------------ running
    def requests(self) -> Iterator[Request]:
        cfg = self.cfg
        temperature, seed, max_new = (self.overrides.get(name) for name in ("temperature", "seed", "max_new_tokens"))
        for bucket, batch in iter_bucket_rows(self.bucket_dir, self.manifest):
            rows = batch.column("__row").to_pylist()
            ids = batch.column("__prompt_ids").to_pylist()
            for row, prompt in zip(rows, ids):
                if self.limit_rows is not None and row not in self.limit_rows:
                    continue
                sampling = Sampling(temperature=_pick(temperature, row, cfg.temperature), top_k=cfg.top_k,
                                    top_p=cfg.top_p, seed=_pick(seed, row, cfg.seed))
                yield Request(row=row, id=self.inp.ids[row], prompt_ids=prompt,
                              max_new_tokens=_pick(max_new, row, cfg.max_new_tokens), sampling=sampling,
                              bucket=bucket.index, pad_to=bucket.hi)

    def engine(self) -> Engine:
        cfg = self.cfg
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        econf = EngineConfig(mode=self.mode, k=cfg.k, batch_size=cfg.batch_size,
                             window=cfg.window or 4 * cfg.batch_size, pad_id=pad_id)
        target = ModelHandle(self.target.model, models.cache_kwarg(self.target.model))
        draft = ModelHandle(self.draft.model, models.cache_kwarg(self.draft.model)) if self.draft else None
        checker = StopStrings(self.tokenizer, cfg.stop) if cfg.stop else None
        return Engine(target, draft, self.eos_ids, econf, stop_checker=checker)

    def events(self) -> Iterator[Started | RowResult | StepStats]:
        yield Started(total_rows=self.total_rows, mode=self.mode, notes=list(self.notes))
        for event in self.engine().run(self.requests()):
            if isinstance(event, RowResult):
                self.results[event.row] = event
            else:
                self.stats.append(event)
            yield event

    # ------------------------------------------------------------------ output
    def metadata(self) -> dict:
        cfg = self.cfg
        return {
            "batchspec_version": __version__, "torch_version": torch.__version__,
            "transformers_version": _transformers_version(),
            "target": self.target_name, "target_source": self.target.source,
            "draft": self.draft.name if self.draft else None, "draft_source": self.draft.source if self.draft else None,
            "mode": self.mode, "draft_tokens": cfg.k, "batch_size": cfg.batch_size,
            "window": cfg.window or 4 * cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature, "temperature_column": cfg.temperature_column,
            "seed_column": cfg.seed_column, "max_new_tokens_column": cfg.max_new_tokens_column, "top_k": cfg.top_k, "top_p": cfg.top_p, "seed": cfg.seed,
            "chat": cfg.chat, "system": cfg.system, "stop": list(cfg.stop), "prompt_column": cfg.prompt_column,
            "id_column": cfg.id_column, "dtype": str(self.target.model.dtype).removeprefix("torch."),
            "device": str(self.target.model.device), "eos_token_ids": self.eos_ids, "input": str(cfg.input),
        }

    def texts(self, results: list[RowResult]) -> list[str]:
        out = []
        for r in results:
            text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            if r.finish_reason == "stop_string":
                text = text[: min((i for i in (text.find(s) for s in self.cfg.stop) if i >= 0), default=len(text))]
            out.append(text)
        return out

    def finish(self) -> dict:
        """Write both files atomically; returns a summary."""
        results = [self.results[row] for row in sorted(self.results)]
        missing = self.total_rows - len(results)
        if missing:
            raise RuntimeError(f"{missing} rows have no result")
        meta = self.metadata()
        bio.write_completions(self.cfg.output, self.inp, results, self.texts(results), meta)
        bio.write_stats(self.stats_path, self.stats, meta)
        shutil.rmtree(work_dir_for(self.cfg.output), ignore_errors=True)
        return {
            "rows": len(results), "errors": sum(r.finish_reason == "error" for r in results),
            "completion_tokens": sum(len(r.token_ids) for r in results), "output": str(self.cfg.output),
            "stats": str(self.stats_path),
        }


def _pick(values: list | None, row: int, default):
    if values is None or values[row] is None:
        return default
    return values[row]


OVERRIDES = {  # name -> (config attribute naming the column, type, smallest value, flag)
    "temperature": ("temperature_column", float, 0.0, "--temperature-column"),
    "seed": ("seed_column", int, None, "--seed-column"),
    "max_new_tokens": ("max_new_tokens_column", int, 1, "--max-new-tokens-column"),
}


def row_overrides(table, cfg: GenerateConfig) -> dict[str, list]:
    """Per-row temperature / seed / max_new_tokens from input columns; InputError on a bad cell."""
    out = {}
    for name, (attr, kind, smallest, flag) in OVERRIDES.items():
        column = getattr(cfg, attr)
        if column is None:
            continue
        if column not in table.column_names:
            raise bio.InputError(f"{cfg.input}: {flag} names column {column!r}, which is not in the input")
        values = []
        for i, value in enumerate(table.column(column).to_pylist()):
            if value is None or (isinstance(value, float) and value != value):
                values.append(None)
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok and kind is int:
                ok = float(value).is_integer()
            if not ok or (smallest is not None and value < smallest):
                raise bio.InputError(f"{cfg.input}: row {i + 1}: column {column!r} must be a "
                                     f"{'number' if kind is float else 'integer'}"
                                     f"{'' if smallest is None else f' >= {smallest:g}'}, got {value!r}")
            values.append(kind(value))
        out[name] = values
    return out


class StopStrings:
    """Finds the first stop string in a completion; returns the token cut (shortest prefix holding it)."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops

    def _hit(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def __call__(self, ids: list[int], n_new: int) -> int | None:
        if not self._hit(ids):
            return None
        for cut in range(max(1, len(ids) - n_new + 1), len(ids) + 1):
            if self._hit(ids[:cut]):
                return cut
        return len(ids)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__

