"""JSON lines as Arrow tables: a prompts file (or an OpenAI batch file) parsed line by line, a chunk at a time.

Every failure a user can cause with a bad line is an ``InputError`` whose one-line message names the file and the
line (1-based, blank lines counted). The objects' keys become columns in first-seen order; a column whose values do
not share one Arrow type is held as JSON text (``_column_array``), and so is one nested deeper than Parquet reads back
(``input_table.storable``). A file of any size is parsed ``CHUNK_ROWS`` lines at a time (``jsonl_chunked_table``),
each chunk to disk as it is parsed when the caller gives a ``store``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputError
from .input_table import CHUNK_ROWS, StoredTable, storable, storable_schema, text_array

JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass
class JsonLines:
    rows: list[dict]  # [rows] each line's object
    where: list[str]  # [rows] "line N" (1-based, blank lines counted)
    bad: dict[int, str] = field(default_factory=dict)  # row -> why its `soft` field cannot be used (an error row)


def read_jsonl(path: Path, limit: int | None, soft: str | None = None) -> JsonLines:
    """Parse JSON lines (InputError naming the line on anything malformed), the whole file at once.

    A lone UTF-16 surrogate escape (``"\\ud800"``) cannot be stored as UTF-8: in the field
    ``soft`` (the prompt) it makes the row an error row, the field kept with the escape as
    text; anywhere else it refuses the file, naming the line and column."""
    out = JsonLines([], [])
    for chunk in iter_jsonl(path, limit, soft, rows=None):
        out.rows += chunk.rows
        out.where += chunk.where
        out.bad.update({len(out.rows) - len(chunk.rows) + i: why for i, why in chunk.bad.items()})
    return out


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes without the newline) of a file, read a buffer at a time."""
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte order mark
                    raw = raw[3:]
                yield lineno, raw.removesuffix(b"\n")
    except OSError as e:
        raise InputError(f"{path}: cannot read the file ({e.strerror or e})") from None


def iter_jsonl(path: Path, limit: int | None, soft: str | None = None,
               rows: int | None = CHUNK_ROWS) -> Iterator[JsonLines]:
    """``read_jsonl`` ``rows`` objects at a time (None: all); ``bad`` is keyed by the row within its chunk."""
    out, total = JsonLines([], []), 0
    for lineno, raw in _lines(path):
        if limit is not None and total >= limit:
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
        if _SURROGATE_ESCAPE.search(line):  # only an escape can make one: the line itself is valid UTF-8
            for key in list(value):
                if _has_surrogate(key) or (key != soft and _has_surrogate(value[key])):
                    what = "a column name" if _has_surrogate(key) else f"column {key!r}"
                    raise InputError(f"{path}: line {lineno}{_surrogate_column(line)}: {what} holds a lone UTF-16 "
                                     f"surrogate escape, which UTF-8 cannot store")
            if soft in value and _has_surrogate(value[soft]):
                out.bad[len(out.rows)] = (f"column {soft!r} holds a lone UTF-16 surrogate escape, which UTF-8 cannot "
                                          f"store (kept as its escape text)")
                value[soft] = _escape_surrogates(value[soft])
        out.rows.append(value)
        out.where.append(f"line {lineno}")
        total += 1
        if rows is not None and len(out.rows) >= rows:
            yield out
            out = JsonLines([], [])
    if out.rows or rows is None:
        yield out


def jsonl_chunked_table(path: Path, limit: int | None, soft: str | None, store: Path | None = None
                        ) -> tuple[pa.Table | StoredTable | None, np.ndarray, dict, dict[str, list]]:
    """A JSONL file as one table built ``CHUNK_ROWS`` lines at a time: (table, [rows] line numbers, bad rows,
    the values as written of the columns a ``StoredTable`` holds as text).

    The table equals ``jsonl_table`` of the whole file wherever every column has one kind of value throughout
    (a chunk where a column is all null or missing takes the other chunks' type); the table is None where it
    would not (a column whose type differs between chunks, or one held as JSON text): read the file whole.
    With ``store``, each chunk goes to disk as it is parsed (an Arrow file beside ``store``), then every chunk
    with its columns' one type into ``store``: the table is a ``StoredTable``."""
    pieces, lines, bad, rows = [], [], {}, 0  # pieces: the chunks' tables, or with a store their files
    names: dict[str, None] = {}
    types: dict[str, set] = {}
    try:
        for chunk in iter_jsonl(path, limit, soft, CHUNK_ROWS):
            table, written = jsonl_table(chunk.rows)
            if written:
                return None, np.zeros(0, np.int64), {}, {}
            names.update(dict.fromkeys(table.column_names))
            for field_ in table.schema:
                if not pa.types.is_null(field_.type):
                    types.setdefault(field_.name, set()).add(field_.type)
            if any(len(kinds) > 1 for kinds in types.values()):
                return None, np.zeros(0, np.int64), {}, {}
            pieces.append(table if store is None else _spill(table, store.with_name(f"{store.name}.{len(pieces)}")))
            lines.append(np.array([int(w.removeprefix("line ")) for w in chunk.where], np.int64))
            bad.update({rows + i: why for i, why in chunk.bad.items()})
            rows += len(chunk.rows)
        schema = pa.schema([(name, next(iter(types.get(name, {pa.null()})))) for name in names])
        line_numbers = np.concatenate(lines) if lines else np.zeros(0, np.int64)
        if not pieces or not names:
            return pa.table({}), line_numbers, bad, {}
        if store is None:
            return pa.concat_tables([_conform(table, schema) for table in pieces]), line_numbers, bad, {}
        written: dict[str, list] = {}
        with pq.ParquetWriter(store, storable_schema(schema)) as writer:
            for piece in pieces:
                with pa.memory_map(str(piece)) as source:  # written while the file is mapped: no copy is made
                    table, written = storable(_conform(pa.ipc.open_file(source).read_all(), schema), written)
                    writer.write_table(table)
                    del table
        return StoredTable(store), line_numbers, bad, written
    finally:
        for piece in pieces:
            if isinstance(piece, Path):
                piece.unlink(missing_ok=True)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A chunk's table with ``schema``'s columns and types (a column it lacks: nulls)."""
    def column(name: str):
        kind = schema.field(name).type
        if name not in table.column_names:
            return pa.nulls(table.num_rows, kind)
        have = table.column(name)
        return have if have.type == kind else have.cast(kind)  # pyarrow's identity cast breaks list<null>
    return pa.table({name: column(name) for name in schema.names}, schema=schema)


def _spill(table: pa.Table, path: Path) -> Path:
    """``table`` written to an Arrow file at ``path`` (read back exactly, types and all)."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    return False


def _escape_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate written as its escape text (``\\ud800``)."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, list):
        return [_escape_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_escape_surrogates(k): _escape_surrogates(v) for k, v in value.items()}
    return value


def _surrogate_column(line: str) -> str:
    """", column N" of the first lone surrogate escape in a JSON line ("" where none is found)."""
    escapes = list(_SURROGATE_ESCAPE.finditer(line))
    for i, match in enumerate(escapes):
        high = match.group()[3] in "89abAB"
        paired = high and i + 1 < len(escapes) and escapes[i + 1].start() == match.end() \
            and escapes[i + 1].group()[3] not in "89abAB"
        after_high = i > 0 and escapes[i - 1].end() == match.start() and escapes[i - 1].group()[3] in "89abAB"
        if not paired and not (not high and after_high):
            return f", column {match.start() + 1}"
    return ""


def jsonl_table(rows: list[dict]) -> tuple[pa.Table, dict[str, list]]:
    """JSON objects as a table (columns in first-seen order) and the values as written of the columns held as
    JSON text (see `_column_array`)."""
    names: dict[str, None] = {}  # ordered union of keys, first-seen order
    for row in rows:
        names.update(dict.fromkeys(row))
    columns, written = {}, {}
    for name in names:
        values = [row.get(name) for row in rows]
        columns[name], as_text = _column_array(values)
        if as_text:
            written[name] = values
    return (pa.table(columns) if columns else pa.table({})), written


def _column_array(values: list[Any]) -> tuple[pa.Array, bool]:
    """Values of one JSONL column as an Arrow array, and whether it holds them as text.

    A column whose values do not unify into one Arrow type (a string in one row, a list in
    another, an integer too big for 64 bits, a boolean among numbers) becomes a string column: strings stay as
    they were, every other value is its JSON text (nulls stay null)."""
    try:
        array = pa.array(values)
        if pa.types.is_floating(array.type) and any(v is True or v is False for v in values):
            pass  # Arrow made the booleans 1.0 and 0.0: not the values as written
        elif not _has_empty_struct(array.type):  # Parquet cannot store struct<>
            return array, False
    except (pa.ArrowException, OverflowError, TypeError, ValueError, RecursionError):
        pass
    return text_array(values), True


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
