"""The settings of one `generate` job: `GenerateConfig`, what each setting means outside it
(fingerprint, output metadata, its flag), and their validation (the per-row overrides read from input columns are
row_settings.row_overrides).

Nothing here loads a model or touches a file but the input table it is given: `generation.Generation`
turns a validated config into a run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import one_line

# The values a setting may take (the modules that act on them import them from here).
MODES = ("auto", "ar", "eqspec", "exspec")  # --mode (engine.py)
KERNELS = ("auto", "stock", "packed")
DTYPES = ("auto", "float32", "bfloat16", "mixed", "float16", "float64")
INPUT_FORMATS = ("auto", "table", "openai")  # table: rows with a prompt column; openai: OpenAI Batch requests
OUTPUT_FORMATS = ("auto", "parquet", "openai")
LOGPROBS_MODES = ("raw", "processed")  # --logprobs-mode (logprobs.py)
MAX_TOP_LOGPROBS = 20  # alternatives per token at most (as OpenAI's top_logprobs)
MAX_N = 128  # --n: samples per input row at most (OpenAI's bound for n)


class UsageError(Exception):
    """A problem with the user's flags, files or models: one line, exit code 2."""


def os_error_message(exc: OSError) -> str:
    """An error of the machine (a full disk, a read-only filesystem) as one line naming the file."""
    return f"{exc.filename or 'a file'}: {exc.strerror or one_line(exc)}"


def setting(default=dataclasses.MISSING, *, fingerprint: bool = False, metadata: bool = False,
            name: str | None = None, label: str | None = None, recent: bool = False):
    """A `GenerateConfig` field that is part of the job's fingerprint and/or its output metadata (see `Setting`)."""
    return field(default=default, metadata={"fingerprint": fingerprint, "metadata": metadata, "name": name,
                                            "label": label, "recent": recent})


@dataclass
class GenerateConfig:
    """One `generate` job. Every setting is declared here, once.

    `setting(fingerprint=True)` marks what decides the rows' completions: it goes in the
    job's fingerprint, and a resumed run must match it (the order below is the order changes
    are reported in); `metadata=True`: it is recorded in the output files. The `generate`
    command has one parameter per field, named as `Setting.name` (the field's name unless
    given), with the flag ``--name-with-dashes`` (tests/test_settings.py checks that they
    correspond). Anything else (batch size, threads, device...) may change between a run and
    its resumption. A new setting is a field here plus its Typer option; a new fingerprint setting is
    `recent=True`, so the work directory of a run by an older version, which never had it, still resumes.
    """

    input: Path = setting(fingerprint=True, metadata=True, label="the input's contents")
    output: Path = setting()
    # Input and output kinds (sources.py): auto | table | openai; auto (by OUT's suffix) | parquet | openai.
    input_format: str = setting("auto", fingerprint=True, metadata=True, recent=True)
    output_format: str = setting("auto", metadata=True)
    split: str = setting("train", fingerprint=True, metadata=True, recent=True)  # of a Hugging Face dataset
    dataset_config: str | None = setting(None, fingerprint=True, metadata=True, recent=True, name="config")
    # What decides the completions.
    limit: int | None = setting(None, fingerprint=True)
    target: str | None = setting(None, fingerprint=True, metadata=True)
    draft: str | None = setting(None, fingerprint=True, metadata=True)
    mode: str = setting("auto", fingerprint=True, metadata=True)
    k: int = setting(5, fingerprint=True, metadata=True, name="draft_tokens")
    max_new_tokens: int = setting(256, fingerprint=True, metadata=True)
    max_prompt_tokens: int | None = setting(None, fingerprint=True, metadata=True)  # longer prompts: error rows
    temperature: float = setting(0.0, fingerprint=True, metadata=True)
    top_k: int = setting(0, fingerprint=True, metadata=True)
    top_p: float = setting(1.0, fingerprint=True, metadata=True)
    seed: int = setting(0, fingerprint=True, metadata=True)
    # Per-row overrides read from input columns (null: the flag's value).
    temperature_column: str | None = setting(None, fingerprint=True, metadata=True)
    seed_column: str | None = setting(None, fingerprint=True, metadata=True)
    max_new_tokens_column: str | None = setting(None, fingerprint=True, metadata=True)
    top_p_column: str | None = setting(None, fingerprint=True, metadata=True, recent=True)
    stop_column: str | None = setting(None, fingerprint=True, metadata=True, recent=True)  # string or list of them
    stop: tuple[str, ...] = setting((), fingerprint=True, metadata=True)
    # Samples per input row (samples.py): N output rows each, sample j keyed by (seed, id, j); per-row from a column.
    n: int = setting(1, fingerprint=True, metadata=True, recent=True)
    n_column: str | None = setting(None, fingerprint=True, metadata=True, recent=True)
    chat: bool = setting(True, fingerprint=True, metadata=True, label="--chat/--no-chat")
    # A control token's string in a prompt's text becomes that control token (prompts.render_prompt).
    allow_special_tokens: bool = setting(False, fingerprint=True, metadata=True, recent=True)
    system: str | None = setting(None, fingerprint=True, metadata=True)
    prompt_column: str = setting("prompt", fingerprint=True, metadata=True)
    id_column: str = setting("id", fingerprint=True, metadata=True)
    dtype: str = setting("auto", fingerprint=True, metadata=True)
    # The shape every completion must have (constraints.py): at most one of these for the whole job, and per-row
    # response_format cells (an OpenAI response_format object or a bare JSON schema; null: the job's).
    json_schema: Path | None = setting(None, fingerprint=True, metadata=True, recent=True)
    regex: str | None = setting(None, fingerprint=True, metadata=True, recent=True)
    choice: tuple[str, ...] | None = setting(None, fingerprint=True, metadata=True, recent=True)
    json: bool = setting(False, fingerprint=True, metadata=True, recent=True)  # any JSON object
    response_format_column: str | None = setting(None, fingerprint=True, metadata=True, recent=True)
    # What the output holds besides the completions.
    logprobs: int | None = setting(None, fingerprint=True, metadata=True, recent=True)  # the top N alternatives too
    logprobs_column: str | None = setting(None, fingerprint=True, metadata=True, recent=True)  # per-row N
    logprobs_mode: str = setting("raw", fingerprint=True, metadata=True, recent=True)  # raw | processed (logprobs.py)
    # How the job runs.
    batch_size: int | str = setting("auto", metadata=True)  # rows a step runs at most, or "auto" (measured: engine)
    window: int | None = setting(None, metadata=True)  # default 4 x batch size
    device: str = setting("auto", metadata=True)
    stats: Path | None = None
    bucket_width: int | None = None
    threads: int | None = None
    # packed: oneDNN-prepacked linear layers on a CPU (kernels.py) and batchspec's attention and layer kernels
    # (native.py, layers.py); auto: packed for float32 and bfloat16 on a CPU when the memory allows. The output metadata records the kernels that
    # ran (assembly.use_kernels).
    kernels: str = setting("auto", metadata=True)
    # Scale-out (see distributed.py): how the job is spread, never what it computes.
    ray: bool = False
    ray_address: str | None = None  # implies ray
    ray_workers: int | None = None
    ray_block_rows: int | None = None
    overwrite: bool = False
    restart: bool = False  # discard the saved work of an interrupted run instead of resuming it
    quiet: bool = False
    # save a part after this many finished rows ... (a fast job's parts are then ~1k rows, not 32: the finish reads
    # every part, and many small ones cost it most; docs/history.md, "Figures once kept in the code")
    checkpoint_rows: int = 1024
    checkpoint_seconds: float = 10.0  # ... or this long after the previous part, whichever comes first

    def __post_init__(self) -> None:
        self.stop = tuple(self.stop or ())  # the CLI gives a list, or None when no --stop is given
        self.choice = tuple(self.choice) if self.choice else None

    @property
    def distributed(self) -> bool:
        """Run on Ray workers (``--ray`` or ``--ray-address``): this process plans and records, and loads no model."""
        return self.ray or self.ray_address is not None


AUTO = "auto"
AUTO_BUCKET_ROWS = 8  # --batch-size auto: the rows a length bucket holds at least (a fixed size: that size)
AUTO_BLOCK_WIDTH = 64  # --batch-size auto on Ray: a block holds a pool of this width (4 x 64 rows)


def parse_batch_size(value: str | int) -> int | str:
    """``--batch-size``: a positive integer, or ``auto``; UsageError otherwise."""
    text = str(value).strip().lower()
    if text == AUTO:
        return AUTO
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise UsageError(f"--batch-size must be a positive integer or auto, got {value!r}")
    return size


def bucket_rows(cfg: "GenerateConfig") -> int:
    """The rows a length bucket holds at least: the batch size, or ``AUTO_BUCKET_ROWS`` for an automatic one."""
    return AUTO_BUCKET_ROWS if cfg.batch_size == AUTO else cfg.batch_size


DEFAULT = GenerateConfig(input=Path(), output=Path())
"""Every setting at its default: the `generate` command's options take their defaults from it."""


@dataclass(frozen=True)
class Setting:
    """How one `GenerateConfig` field appears outside the config."""

    field: str  # the GenerateConfig attribute
    name: str  # the `generate` parameter, and the key in the fingerprint and in the output metadata
    label: str  # how messages name it: its flag, or a phrase
    fingerprint: bool  # decides the rows' completions: a resumed run must have the same value
    metadata: bool  # recorded in the output files' metadata
    recent: bool = False  # newer than existing work directories: in the fingerprint only away from its default


def settings() -> list[Setting]:
    """Every `GenerateConfig` field, in declaration order."""
    out = []
    for f in dataclasses.fields(GenerateConfig):
        name = f.metadata.get("name") or f.name
        out.append(Setting(field=f.name, name=name, label=f.metadata.get("label") or "--" + name.replace("_", "-"),
                           fingerprint=f.metadata.get("fingerprint", False),
                           metadata=f.metadata.get("metadata", False), recent=f.metadata.get("recent", False)))
    return out


def settings_record(cfg: GenerateConfig, kind: str, **resolved) -> dict:
    """The settings of one kind ("fingerprint" or "metadata") by name, as JSON values.

    ``resolved`` replaces the configured value of those settings the job works out itself
    (a model's signature for its spec, the mode actually run, the dtype loaded).
    """
    defaults = {f.name: f.default for f in dataclasses.fields(GenerateConfig)}
    record = {s.name: resolved.pop(s.name) if s.name in resolved else _json_value(getattr(cfg, s.field))
              for s in settings() if getattr(s, kind)
              and not (kind == "fingerprint" and s.recent and getattr(cfg, s.field) == defaults[s.field])}
    if resolved:
        raise KeyError(f"not {kind} settings: {', '.join(sorted(resolved))}")
    return record


def _json_value(value):
    if isinstance(value, tuple):
        return list(value)
    return str(value) if isinstance(value, Path) else value


# Fingerprint keys and how to name them to the user, in the order they are reported.
FINGERPRINT_LABELS = {s.name: s.label for s in settings() if s.fingerprint} | {"rows": "the number of input rows"}


def validate(cfg: GenerateConfig) -> None:
    checks = [
        (cfg.batch_size == AUTO or (isinstance(cfg.batch_size, int) and cfg.batch_size >= 1),
         f"--batch-size must be a positive integer or auto, got {cfg.batch_size}"),
        (cfg.max_new_tokens >= 1, f"--max-new-tokens must be a positive integer, got {cfg.max_new_tokens}"),
        (cfg.max_prompt_tokens is None or cfg.max_prompt_tokens >= 1,
         f"--max-prompt-tokens must be a positive integer, got {cfg.max_prompt_tokens}"),
        (1 <= cfg.k <= 32, f"--draft-tokens must be between 1 and 32, got {cfg.k}"),
        (cfg.window is None or cfg.window >= 1, f"--window must be a positive integer, got {cfg.window}"),
        (cfg.limit is None or cfg.limit >= 1, f"--limit must be a positive integer, got {cfg.limit}"),
        (cfg.mode in MODES, f"--mode must be one of {', '.join(MODES)}, got {cfg.mode!r}"),
        (cfg.kernels in KERNELS, f"--kernels must be one of {', '.join(KERNELS)}, got {cfg.kernels!r}"),
        (cfg.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}"),
        (cfg.input_format in INPUT_FORMATS,
         f"--input-format must be one of {', '.join(INPUT_FORMATS)}, got {cfg.input_format!r}"),
        (cfg.output_format in OUTPUT_FORMATS,
         f"--output-format must be one of {', '.join(OUTPUT_FORMATS)}, got {cfg.output_format!r}"),
        (math.isfinite(cfg.temperature) and cfg.temperature >= 0,
         f"--temperature must be a finite number >= 0, got {cfg.temperature}"),
        (cfg.logprobs is None or 0 <= cfg.logprobs <= MAX_TOP_LOGPROBS,
         f"--logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {cfg.logprobs}"),
        (cfg.logprobs_mode in LOGPROBS_MODES, f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, "
                                        f"got {cfg.logprobs_mode!r}"),
        (cfg.top_k >= 0, f"--top-k must be >= 0, got {cfg.top_k}"),
        (1 <= cfg.n <= MAX_N, f"--n must be between 1 and {MAX_N}, got {cfg.n}"),
        (0 < cfg.top_p <= 1, f"--top-p must be in (0, 1], got {cfg.top_p}"),
        (cfg.bucket_width is None or cfg.bucket_width >= 1, f"--bucket-width must be positive, got {cfg.bucket_width}"),
        (cfg.threads is None or cfg.threads >= 1, f"--threads must be a positive integer, got {cfg.threads}"),
        (cfg.checkpoint_rows >= 1, f"--checkpoint-rows must be a positive integer, got {cfg.checkpoint_rows}"),
        (cfg.checkpoint_seconds > 0, f"--checkpoint-seconds must be positive, got {cfg.checkpoint_seconds}"),
        (all(cfg.stop), "--stop strings must not be empty"),
        (sum(map(bool, (cfg.json_schema, cfg.regex is not None, cfg.choice, cfg.json))) <= 1,
         "--json-schema, --regex, --choice and --json are exclusive: give one"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


def tokenizer_settings(cfg: GenerateConfig, target_name: str) -> dict:
    """What determines the prompt token ids (the bucket directory's settings; --allow-special-tokens only when
    given, so the buckets of an earlier version still match)."""
    return {"target": target_name, "chat": cfg.chat, "system": cfg.system, "prompt_column": cfg.prompt_column,
            "id_column": cfg.id_column, **({"allow_special_tokens": True} if cfg.allow_special_tokens else {})}
