"""Reading prompts: a JSON lines or Parquet prompts file as an `InputTable` (the per-row settings read from its
columns are `row_settings`; the tool's own output files, read back, are `outputs`).

Input is JSON lines (`.jsonl`, `.ndjson`) or Parquet (`.parquet`, `.pq`). Every failure a
user can cause with a bad file is an `InputError` whose one-line message names the file
and, where it applies, the line (JSONL, 1-based, blank lines counted) or row (Parquet,
1-based) and the column.

A JSONL file is parsed ``CHUNK_ROWS`` lines at a time (``jsonl_chunked_table``), and the prompts
and ids are never Python lists for the whole input: ``Prompts`` parses a chunk of the prompt
column when asked, ``Ids`` is one Arrow string array. Given a ``store`` path (a job's work
directory), a file's rows go to disk as they are read and the table is a ``StoredTable`` read a
row group at a time: reading a file of any size holds a chunk of it, its ids and its bad rows.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import InputError
from .files import check_readable_file, reading_parquet
from .outputs import EXTRA_OUTPUT_COLUMNS, OUTPUT_COLUMNS

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
DEFAULT_ID_COLUMN = "id"
DEFAULT_PROMPT_COLUMN = "prompt"
MESSAGES_COLUMN = "messages"  # the OpenAI and Hugging Face chat shape: the prompts where there is no `prompt` column
MAX_NESTING = 32  # a column nested deeper (lists / objects in lists...) is stored as JSON text: Parquet's limit is ~50

Prompt = str | list[dict]
CHUNK_ROWS = 8192  # rows parsed, validated and held as Python objects at a time (never the whole input)


class Ids(Sequence):
    """[rows] the rows' ids as strings, held as one Arrow string array (a few bytes a row, no Python objects)."""

    def __init__(self, array: pa.Array | pa.ChunkedArray):
        self.array = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.array[index].to_pylist()
        return self.array[index].as_py()

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __iter__(self):
        for start in range(0, len(self.array), CHUNK_ROWS):
            yield from self.array.slice(start, CHUNK_ROWS).to_pylist()


def id_array(ids: Sequence[str]) -> pa.Array:
    """[rows] ids as an Arrow string array (an ``Ids``' own array, no copy)."""
    return ids.array if isinstance(ids, Ids) else pa.array(list(ids), type=pa.string())


class StoredTable:
    """The input's columns in a Parquet file, in input order, read a row group at a time: the part of
    ``pa.Table``'s interface the job reads its input through (``num_rows``, ``schema``, ``column_names``,
    ``slice``, ``column``), so an input of any size is never in memory whole."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            found = pq.ParquetFile(f)
            self.schema = found.schema_arrow
            sizes = [found.metadata.row_group(i).num_rows for i in range(found.metadata.num_row_groups)]
        self.num_rows = int(sum(sizes))
        self._starts = np.cumsum([0, *sizes])  # [row groups + 1] the first row of each row group, then the end
        self._held: tuple[tuple[int, int], pa.Table] | None = None  # the row groups read last: rows are read in order

    @property
    def column_names(self) -> list[str]:
        return self.schema.names

    def slice(self, offset: int = 0, length: int | None = None) -> pa.Table:
        """Rows [offset, offset + length) with every column (the row groups they lie in are read)."""
        stop = self.num_rows if length is None else min(self.num_rows, offset + length)
        if offset >= stop:
            return self.schema.empty_table()
        first = int(np.searchsorted(self._starts, offset, side="right")) - 1
        last = int(np.searchsorted(self._starts, stop, side="left")) - 1
        if self._held is None or self._held[0] != (first, last):
            with open(self.path, "rb") as f:
                self._held = (first, last), pq.ParquetFile(f).read_row_groups(range(first, last + 1))
        return self._held[1].slice(offset - int(self._starts[first]), stop - offset)

    def column(self, name: str) -> pa.ChunkedArray:
        """One column whole (a per-row setting's)."""
        with open(self.path, "rb") as f:
            return pq.ParquetFile(f).read(columns=[name]).column(0)


class Prompts(Sequence):
    """[rows] the rows' prompts, parsed from the table's prompt column a chunk at a time when asked for (none is
    held): a plain string, or chat messages; "" for a row whose cell is no prompt (its reason is in the table's
    ``errors``)."""

    def __init__(self, inp: "InputTable", column: str):
        self.inp, self.column = inp, column

    def __len__(self) -> int:
        return self.inp.table.num_rows

    def chunk(self, start: int, stop: int) -> list[Prompt]:
        """The prompts of rows [start, stop)."""
        out = []
        for row, value in enumerate(self.inp.cells(self.column, start, stop), start=start):
            try:
                out.append("" if row in self.inp.errors else parse_prompt(value, self.column))
            except BadPrompt:
                out.append("")
        return out

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = index + len(self) if index < 0 else index
        if not 0 <= row < len(self):
            raise IndexError(index)
        return self.chunk(row, row + 1)[0]

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __iter__(self):
        for start in range(0, len(self), CHUNK_ROWS):
            yield from self.chunk(start, min(len(self), start + CHUNK_ROWS))


@dataclass
class InputTable:
    path: Path
    # every input column as read (after --limit), in input order: what the output passes through (on disk when read
    # with a store)
    table: pa.Table | StoredTable
    prompts: Sequence[Prompt]  # [rows] a plain string, or chat messages [{"role", "content"}]; "" for a row in errors
    ids: Sequence[str]  # [rows] the row's id as a string (a file's: ``Ids``, an Arrow array)
    # Only for inputs that carry their own per-row requests (an OpenAI batch file, see openai_batch):
    # setting -> [rows] value or None (as row_settings.row_overrides)
    overrides: dict[str, list] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it fails before generation (an error row)
    endpoints: list[str] | None = None  # [rows] "/v1/chat/completions" | "/v1/completions"
    prompt_column: str | None = None  # a table's: the column its prompts were read from (``prompt_column_in``)
    # column -> [rows] its values as the input wrote them, for the columns `table` holds as JSON text (a JSONL
    # column that mixes kinds, one nested deeper than MAX_NESTING): what the per-row settings read (`values`).
    written: dict[str, list] = field(default_factory=dict)

    def values(self, column: str) -> list:
        """[rows] a column's values as the input wrote them (a list stays a list; not its text in `table`)."""
        return self.written[column] if column in self.written else self.table.column(column).to_pylist()

    def cells(self, column: str, start: int, stop: int) -> list:
        """A column's values of rows [start, stop) as the input wrote them (see ``values``)."""
        if column in self.written:
            return self.written[column][start:stop]
        return self.table.slice(start, stop - start).column(column).to_pylist()


class BadPrompt(ValueError):
    """A prompt cell that is no prompt (null, empty, a message without text...): its row becomes an error row."""


def prompt_column_in(names: list[str], asked: str) -> str:
    """The column the prompts are read from: ``asked`` (--prompt-column), or, where that is the default `prompt`
    and the input has no such column but a `messages` one, `messages` (rows of chat messages)."""
    if asked == DEFAULT_PROMPT_COLUMN and asked not in names and MESSAGES_COLUMN in names:
        return MESSAGES_COLUMN
    return asked


def read_input(
    path: Path,
    prompt_column: str = DEFAULT_PROMPT_COLUMN,
    id_column: str = DEFAULT_ID_COLUMN,
    limit: int | None = None,
    store: Path | None = None,
) -> InputTable:
    """Read a prompts file, validate it, and extract prompts and ids.

    Ids come from `id_column` when that column exists, else from the 0-based row index.
    A missing `id_column` is an error only when it is not the default `"id"` (i.e. the
    caller named a column explicitly). With ``store`` (a path in a directory of the caller's), the rows are
    written there as they are read and the table is a ``StoredTable`` over it; a JSONL file whose columns
    change kind between chunks is read whole all the same.
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
    if suffix in PARQUET_SUFFIXES:
        if store is None:
            return table_input(path, _read_parquet(path, limit), prompt_column, id_column)
        table, written = _store_parquet(path, limit, store)
        return table_input(path, table, prompt_column, id_column, written=written)
    table, line_numbers, bad, written = jsonl_chunked_table(path, limit, soft=prompt_column, store=store)
    if table is None:  # a column whose kind changes between chunks: read as one, as a whole-file reader would
        lines = read_jsonl(path, limit, soft=prompt_column)
        table, written = jsonl_table(lines.rows)
        return table_input(path, table, prompt_column, id_column, lines.where.__getitem__, written, lines.bad)
    return table_input(path, table, prompt_column, id_column, lambda i: f"line {line_numbers[i]}", written, bad)


def table_input(path: Path, table: pa.Table | StoredTable, prompt_column: str, id_column: str,
                where: Callable[[int], str] | None = None, written: dict[str, list] | None = None,
                errors: dict[int, str] | None = None) -> InputTable:
    """Validate a table read from any source and extract prompts and ids (see read_input).

    ``where(i)`` names row i in messages (default "row i+1"); ``written``: the values as written of the
    columns the table holds as text (InputTable.written; a ``StoredTable`` holds them as text already);
    ``errors``: rows already refused (an error row each).
    The prompts are read from ``prompt_column_in(names, prompt_column)``.
    A prompt cell that is no prompt makes its row an error row; a bad id or column refuses the input.
    Prompts and ids are checked a chunk of rows at a time: the input's rows are never all Python objects."""
    where = where if where is not None else (lambda i: f"row {i + 1}")
    if table.num_rows == 0:
        raise InputError(f"{path}: no rows")
    names = table.column_names
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise InputError(f"{path}: duplicate column names: {', '.join(map(repr, dupes))}")
    prompt_column = prompt_column_in(names, prompt_column)
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
    written = dict(written or {})
    if isinstance(table, pa.Table):
        table, written = _storable(table, written)
    inp = InputTable(path=path, table=table, prompts=[], ids=[], errors=dict(errors or {}), written=written,
                     prompt_column=prompt_column)
    inp.prompts = Prompts(inp, prompt_column)
    ids = []
    for start in range(0, table.num_rows, CHUNK_ROWS):
        stop = min(table.num_rows, start + CHUNK_ROWS)
        for row, value in enumerate(inp.cells(prompt_column, start, stop), start=start):
            if row not in inp.errors:
                try:
                    parse_prompt(value, prompt_column)
                except BadPrompt as exc:
                    inp.errors[row] = str(exc)
        if id_column in names:
            ids.append(pa.array([_parse_id(v, path, where, row, id_column)
                                 for row, v in enumerate(inp.cells(id_column, start, stop), start=start)],
                                type=pa.string()))
    if id_column in names:
        inp.ids = Ids(pa.chunked_array(ids, type=pa.string()))
        if _repeats(inp.ids.array):
            check_unique(list(inp.ids), path, id_column)
    else:
        inp.ids = Ids(pc.cast(pa.array(np.arange(table.num_rows)), pa.string()))
    return inp


def _storable(table: pa.Table, written: dict[str, list]) -> tuple[pa.Table, dict[str, list]]:
    """The table with every column nested deeper than MAX_NESTING as JSON text (Parquet could not read it back),
    and the values as written of those columns appended to ``written`` (a table read a chunk at a time: once a
    chunk, in order)."""
    for index, name in enumerate(table.column_names):
        if _nesting(table.schema.field(index).type) > MAX_NESTING:
            values = table.column(name).to_pylist()
            written.setdefault(name, []).extend(values)
            table = table.set_column(index, name, _text_array(values))
    return table, written


def _storable_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` as ``_storable`` leaves it (every column nested deeper than MAX_NESTING: a string)."""
    return pa.schema([pa.field(f.name, pa.string()) if _nesting(f.type) > MAX_NESTING else f for f in schema],
                     metadata=schema.metadata)


def _nesting(t: pa.DataType) -> int:
    """How deeply lists and structs nest in an Arrow type (a flat type: 0)."""
    if pa.types.is_struct(t):
        return 1 + max((_nesting(t.field(i).type) for i in range(t.num_fields)), default=0)
    if pa.types.is_map(t):
        return 1 + max(_nesting(t.key_type), _nesting(t.item_type))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return 1 + _nesting(t.value_type)
    return 0


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
        with pq.ParquetWriter(store, _storable_schema(schema)) as writer:
            for piece in pieces:
                with pa.memory_map(str(piece)) as source:  # written while the file is mapped: no copy is made
                    table, written = _storable(_conform(pa.ipc.open_file(source).read_all(), schema), written)
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
    return _text_array(values), True


def _text_array(values: list[Any]) -> pa.Array:
    """Strings as they are, every other value as its JSON text, nulls as nulls."""
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
    with reading_parquet(path), open(path, "rb") as f:
        table = pq.read_table(f)
    if limit is not None:
        table = table.slice(0, limit)
    return table


def _store_parquet(path: Path, limit: int | None, store: Path) -> tuple[StoredTable, dict[str, list]]:
    """The first ``limit`` rows of a Parquet file copied to ``store`` ``CHUNK_ROWS`` at a time, as ``_storable``
    leaves them, and the values as written of the columns it made text."""
    written: dict[str, list] = {}
    left = limit
    with reading_parquet(path):
        f = open(path, "rb")
    with f:
        with reading_parquet(path):
            found = pq.ParquetFile(f)
            batches = found.iter_batches(batch_size=CHUNK_ROWS)
        with pq.ParquetWriter(store, _storable_schema(found.schema_arrow)) as writer:
            while left is None or left > 0:
                with reading_parquet(path):
                    batch = next(batches, None)
                if batch is None:
                    break
                batch = batch if left is None else batch.slice(0, left)
                left = None if left is None else left - batch.num_rows
                table, written = _storable(pa.Table.from_batches([batch]), written)
                writer.write_table(table)
    return StoredTable(store), written


def parse_prompt(value: Any, column: str) -> Prompt:
    """One prompt cell as a string or chat messages; BadPrompt saying what is wrong with it."""
    at = f"column '{column}'"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise BadPrompt(f"{at} is null")
    if isinstance(value, str):
        if not value.strip():
            raise BadPrompt(f"{at} {_blank(value)}")
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):  # Spec-Bench `turns`: use the first turn
            if not value[0].strip():
                raise BadPrompt(f"{at}: first turn {_blank(value[0])}")
            return value[0]
        if all(isinstance(v, dict) for v in value):
            return parse_messages(value, at)
    if isinstance(value, list) and not value:
        raise BadPrompt(f"{at} is an empty list")
    raise BadPrompt(f"{at}: expected a string, a list of strings or a list of chat messages, "
                    f"got {type(value).__name__}")


def parse_messages(value: list[dict], at: str) -> list[dict]:
    """Chat messages with a string role and text content; content parts of type text (OpenAI's
    ``[{"type": "text", "text": ...}]``) are joined by newlines. BadPrompt naming the message."""
    messages = []
    for j, m in enumerate(value, start=1):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise BadPrompt(f"{at}: message {j} has no string 'role'")
        if isinstance(content, list):
            content = _joined_parts(content, f"{at}: message {j}")
        if not isinstance(content, str):
            raise BadPrompt(f"{at}: message {j} has no string 'content'")
        # Parquet structs give every field to every message: drop the null ones.
        messages.append({k: v for k, v in m.items() if v is not None} | {"content": content})
    if not any(m["content"].strip() for m in messages):
        raise BadPrompt(f"{at}: every message is empty" if not any(m["content"] for m in messages) else
                        f"{at}: every message is empty or only whitespace")
    return messages


def _blank(text: str) -> str:
    """What a string without text is, for a message: "is empty" or "is only whitespace"."""
    return "is only whitespace" if text else "is empty"


def _joined_parts(parts: list, at: str) -> str:
    """The text of content parts, all of type text, joined by newlines (as vLLM does)."""
    parts = [{k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part for part in parts]
    if not parts or not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                            for p in parts):
        raise BadPrompt(f"{at}: only text content parts are supported")
    return "\n".join(part["text"] for part in parts)


def _parse_id(value: Any, path: Path, where: Callable[[int], str], row: int, column: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise InputError(f"{path}: {where(row)}: id column '{column}' is null")
    return str(value)


def _repeats(values: pa.Array) -> bool:
    """Does a value occur twice? Sorted order compared a chunk at a time: 8 bytes a row and a chunk (a hash of
    every value, ``count_distinct``, peaks near 100 bytes a row)."""
    order = pc.array_sort_indices(values)
    for start in range(0, max(0, len(values) - 1), CHUNK_ROWS):
        run = values.take(order.slice(start, CHUNK_ROWS + 1))
        if pc.any(pc.equal(run.slice(1), run.slice(0, len(run) - 1))).as_py():
            return True
    return False


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


TEXT_COLUMNS = "text_columns"  # a bucket directory's setting: the columns it holds as JSON text (InputTable.written)
