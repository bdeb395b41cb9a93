"""Reading prompts: a JSON lines or Parquet prompts file as an `InputTable`, the per-row settings read from its
columns, and the tool's own output files read back (`verify`, `stats`).

Input is JSON lines (`.jsonl`, `.ndjson`) or Parquet (`.parquet`, `.pq`). Every failure a
user can cause with a bad file is an `InputError` whose one-line message names the file
and, where it applies, the line (JSONL, 1-based, blank lines counted) or row (Parquet,
1-based) and the column.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import constraints
from .config import MAX_TOP_LOGPROBS, GenerateConfig
from .constraints import Constraint
from .errors import InputError
from .files import check_readable_file
from .outputs import EXTRA_OUTPUT_COLUMNS, METADATA_KEY, OUTPUT_COLUMNS

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
DEFAULT_ID_COLUMN = "id"

Prompt = str | list[dict]


@dataclass
class InputTable:
    path: Path
    table: pa.Table  # every input column as read (after --limit), in input order
    prompts: list[Prompt]  # [rows] a plain string, or chat messages [{"role", "content"}]
    ids: list[str]  # [rows] the row's id as a string
    # Only for inputs that carry their own per-row requests (an OpenAI batch file, see openai_batch):
    overrides: dict[str, list] = field(default_factory=dict)  # setting -> [rows] value or None (as row_overrides)
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it fails before generation (an error row)
    endpoints: list[str] | None = None  # [rows] "/v1/chat/completions" | "/v1/completions"


def read_input(
    path: Path,
    prompt_column: str = "prompt",
    id_column: str = DEFAULT_ID_COLUMN,
    limit: int | None = None,
) -> InputTable:
    """Read a prompts file, validate it, and extract prompts and ids.

    Ids come from `id_column` when that column exists, else from the 0-based row index.
    A missing `id_column` is an error only when it is not the default `"id"` (i.e. the
    caller named a column explicitly).
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise InputError(f"{path}: --limit must be at least 1 (got {limit})")
    suffix = path.suffix.lower()
    if suffix not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        accepted = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
        shown = f"'{path.suffix}'" if path.suffix else "no suffix"
        raise InputError(f"{path}: unsupported input format ({shown}); accepted: {accepted}")
    check_readable_file(path)

    if suffix in JSONL_SUFFIXES:
        table, raw_rows, where = read_jsonl(path, limit)

        def column_values(name: str) -> list[Any]:
            return [row.get(name) for row in raw_rows]
    else:
        table = _read_parquet(path, limit)
        where = [f"row {i + 1}" for i in range(table.num_rows)]

        def column_values(name: str) -> list[Any]:
            return table.column(name).to_pylist()

    return table_input(path, table, prompt_column, id_column, where, column_values)


def table_input(path: Path, table: pa.Table, prompt_column: str, id_column: str, where: list[str] | None = None,
                column_values=None) -> InputTable:
    """Validate a table read from any source and extract prompts and ids (see read_input).

    ``where[i]`` names row i in messages (default "row i+1"); ``column_values(name)`` gives a
    column's cells (default: the table's own)."""
    where = where if where is not None else [f"row {i + 1}" for i in range(table.num_rows)]
    column_values = column_values or (lambda name: table.column(name).to_pylist())
    if table.num_rows == 0:
        raise InputError(f"{path}: no rows")
    names = table.column_names
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise InputError(f"{path}: duplicate column names: {', '.join(map(repr, dupes))}")
    if prompt_column not in names:
        raise InputError(
            f"{path}: no prompt column '{prompt_column}'; columns are: "
            + ", ".join(repr(n) for n in names)
        )
    if id_column not in names and id_column != DEFAULT_ID_COLUMN:
        raise InputError(
            f"{path}: no id column '{id_column}'; columns are: " + ", ".join(repr(n) for n in names)
        )
    for name in names:
        if name in OUTPUT_COLUMNS + EXTRA_OUTPUT_COLUMNS and not (name == "id" and id_column == "id"):
            raise InputError(
                f"{path}: input column '{name}' clashes with an output column; rename it"
            )

    prompts = [
        parse_prompt(value, path, where[i], prompt_column)
        for i, value in enumerate(column_values(prompt_column))
    ]
    if id_column in names:
        ids = [_parse_id(v, path, where[i], id_column) for i, v in enumerate(column_values(id_column))]
        check_unique(ids, path, id_column)
    else:
        ids = [str(i) for i in range(table.num_rows)]
    return InputTable(path=path, table=table, prompts=prompts, ids=ids)


def read_jsonl(path: Path, limit: int | None) -> tuple[pa.Table, list[dict], list[str]]:
    """Parse JSON lines; return the table, the parsed rows and each row's 'line N'."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"{path}: cannot read the file ({e.strerror or e})") from None
    if data.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte order mark
        data = data[3:]
    rows: list[dict] = []
    where: list[str] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if limit is not None and len(rows) >= limit:
            break
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                f"{path}: line {lineno}: invalid UTF-8 (byte {e.start + 1} of the line)"
            ) from None
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(
                f"{path}: line {lineno}: malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
            ) from None
        except RecursionError:
            raise InputError(f"{path}: line {lineno}: JSON nested too deeply") from None
        if not isinstance(value, dict):
            raise InputError(
                f"{path}: line {lineno}: expected a JSON object, got {_json_kind(value)}"
            )
        rows.append(value)
        where.append(f"line {lineno}")

    names: dict[str, None] = {}  # ordered union of keys, first-seen order
    for row in rows:
        names.update(dict.fromkeys(row))
    columns = {name: _column_array([row.get(name) for row in rows]) for name in names}
    table = pa.table(columns) if columns else pa.table({})
    return table, rows, where


def _column_array(values: list[Any]) -> pa.Array:
    """Values of one JSONL column as an Arrow array.

    A column whose values do not unify into one Arrow type (a string in one row, a list in
    another) becomes a string column: strings stay as they were, every other value is its
    JSON text (nulls stay null)."""
    try:
        array = pa.array(values)
        if not _has_empty_struct(array.type):  # Parquet cannot store struct<>
            return array
    except (pa.ArrowException, OverflowError, TypeError, ValueError, RecursionError):
        pass
    return pa.array([v if v is None or isinstance(v, str) else json.dumps(v) for v in values], type=pa.string())


def _has_empty_struct(t: pa.DataType) -> bool:
    if pa.types.is_struct(t):
        return t.num_fields == 0 or any(_has_empty_struct(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _has_empty_struct(t.value_type)
    return False


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"


def _read_parquet(path: Path, limit: int | None) -> pa.Table:
    try:
        with open(path, "rb") as f:
            table = pq.read_table(f)
    except PermissionError:
        raise InputError(f"{path}: permission denied (cannot read the file)") from None
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InputError(f"{path}: not a valid Parquet file ({_first_line(e)})") from None
    if limit is not None:
        table = table.slice(0, limit)
    return table


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def parse_prompt(value: Any, path: Path, where: str, column: str) -> Prompt:
    """One prompt cell as a string or chat messages; InputError naming the row and column."""
    at = f"{path}: {where}: column '{column}'"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise InputError(f"{at} is null")
    if isinstance(value, str):
        if not value.strip():
            raise InputError(f"{at} is empty")
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):  # Spec-Bench `turns`: use the first turn
            if not value[0].strip():
                raise InputError(f"{at}: first turn is empty")
            return value[0]
        if all(isinstance(v, dict) for v in value):
            return parse_messages(value, at)
    if isinstance(value, list) and not value:
        raise InputError(f"{at} is an empty list")
    raise InputError(
        f"{at}: expected a string, a list of strings or a list of chat messages, "
        f"got {type(value).__name__}"
    )


def parse_messages(value: list[dict], at: str) -> list[dict]:
    messages = []
    for j, m in enumerate(value, start=1):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise InputError(f"{at}: message {j} has no string 'role'")
        if not isinstance(content, str):
            raise InputError(f"{at}: message {j} has no string 'content'")
        # Parquet structs give every field to every message: drop the null ones.
        messages.append({k: v for k, v in m.items() if v is not None})
    if not any(m["content"].strip() for m in messages):
        raise InputError(f"{at}: every message is empty")
    return messages


def _parse_id(value: Any, path: Path, where: str, column: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise InputError(f"{path}: {where}: id column '{column}' is null")
    return str(value)


def check_unique(ids: list[str], path: Path, column: str) -> None:
    seen: set[str] = set()
    dupes: dict[str, None] = {}
    for i in ids:
        if i in seen:
            dupes[i] = None
        seen.add(i)
    if dupes:
        shown = ", ".join(repr(d) for d in list(dupes)[:5])
        more = f" and {len(dupes) - 5} more" if len(dupes) > 5 else ""
        raise InputError(f"{path}: duplicate ids in column '{column}': {shown}{more}")


# ---------------------------------------------------------------------------- the tool's own files, read back


def read_run_metadata(path: Path) -> dict:
    """The `metadata` dict given to write_completions / write_stats."""
    path = Path(path)
    check_readable_file(path)
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InputError(f"{path}: not a valid Parquet file ({_first_line(e)})") from None
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise InputError(f"{path}: no batchspec run metadata (not written by batchspec?)")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InputError(f"{path}: batchspec run metadata is not valid JSON") from None


def read_completions(path: Path) -> pa.Table:
    """A completions file as written by write_completions."""
    path = Path(path)
    check_readable_file(path)
    return _read_parquet(path, None)


# ---------------------------------------------------------------------------- per-row settings from input columns


def row_value(values: list | None, row: int, default):
    """A per-row override's value for ``row`` (``row_overrides``), or ``default`` where it has none."""
    if values is None or values[row] is None:
        return default
    return values[row]


OVERRIDES = {  # name -> (config attribute naming the column, type, smallest value, flag)
    "temperature": ("temperature_column", float, 0.0, "--temperature-column"),
    "seed": ("seed_column", int, None, "--seed-column"),
    "max_new_tokens": ("max_new_tokens_column", int, 1, "--max-new-tokens-column"),
    "top_p": ("top_p_column", float, 0.0, "--top-p-column"),  # in (0, 1]: 0 itself is refused below
    "logprobs": ("logprobs_column", int, 0, "--logprobs-column"),
}
LARGEST = {"logprobs": MAX_TOP_LOGPROBS}  # overrides with an upper bound


def row_overrides(table, cfg: GenerateConfig) -> dict[str, list]:
    """Per-row temperature / seed / max_new_tokens / top_p / stop strings from input columns; InputError on a bad
    cell."""
    out = {}
    for name, (attr, kind, smallest, flag) in OVERRIDES.items():
        column = getattr(cfg, attr)
        if column is None:
            continue
        if column not in table.column_names:
            raise InputError(f"{cfg.input}: {flag} names column {column!r}, which is not in the input")
        values = []
        for i, value in enumerate(table.column(column).to_pylist()):
            if value is None or (isinstance(value, float) and value != value):
                values.append(None)
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if ok and kind is int:
                ok = float(value).is_integer()
            largest = LARGEST.get(name)
            if not ok or (smallest is not None and value < smallest) or (largest is not None and value > largest) \
                    or (name == "top_p" and not 0 < value <= 1):
                bound = (" in (0, 1]" if name == "top_p" else
                         f"{'' if smallest is None else f' >= {smallest:g}'}{'' if largest is None else f' and <= {largest:g}'}")
                raise InputError(f"{cfg.input}: row {i + 1}: column {column!r} must be "
                                 f"{'a number' if kind is float else 'an integer'}{bound}, got {value!r}")
            values.append(kind(value))
        out[name] = values
    if cfg.stop_column is not None:
        out["stop"] = stop_cells(table, cfg.stop_column, cfg.input)
    if cfg.response_format_column is not None:
        out["response_format"] = response_format_cells(table, cfg.response_format_column, cfg.input)
    return out


def stop_cells(table, column: str, source) -> list[tuple[str, ...]]:
    """Per-row stop strings from a column of strings or lists of strings (null: none of its own)."""
    if column not in table.column_names:
        raise InputError(f"{source}: --stop-column names column {column!r}, which is not in the input")
    out = []
    for i, value in enumerate(table.column(column).to_pylist()):
        stops = () if value is None else (value,) if isinstance(value, str) else value
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise InputError(f"{source}: row {i + 1}: column {column!r} must be a non-empty string or a list "
                             f"of them, got {value!r}")
        out.append(tuple(stops))
    return out


def response_format_cells(table, column: str, source) -> list[Constraint | None]:
    """Per-row constraints from a column of response_format objects or JSON schemas (as objects or JSON text;
    null: the job's). A cell that cannot be used is an ``invalid`` constraint: that row becomes an error row."""
    if column not in table.column_names:
        raise InputError(f"{source}: --response-format-column names column {column!r}, which is not in the "
                             f"input")
    out = []
    for value in table.column(column).to_pylist():
        if value is None:
            out.append(None)
            continue
        try:
            constraint = constraints.from_response_format(value)
            error = constraints.problem(constraint) if constraint is not None else None
        except constraints.ConstraintError as exc:
            error = str(exc)
        out.append(constraints.invalid(f"column {column!r}: {error}") if error else constraint)
    return out
