"""The input as a job holds it: an ``InputTable`` (every column as read, the prompts, the ids, the rows that fail
before generation), never the whole input as Python objects: ``Ids`` is one Arrow string array, ``Prompts`` parses a
chunk of the prompt column when asked, and a ``StoredTable`` reads the columns from disk a row group at a time.

A column nested deeper than Parquet reads back (``MAX_NESTING``) is held as JSON text (``storable``), with its values
as written beside it (``InputTable.written``); a bucket directory records which columns those are (``TEXT_COLUMNS``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import pyarrow as pa
import pyarrow.parquet as pq

from .cells import BadPrompt, Prompt, parse_prompt

CHUNK_ROWS = 8192  # rows parsed, validated and held as Python objects at a time (never the whole input)
MAX_NESTING = 32  # a column nested deeper (lists / objects in lists...) is stored as JSON text: Parquet's limit is ~50
TEXT_COLUMNS = "text_columns"  # a bucket directory's setting: the columns it holds as JSON text (InputTable.written)


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


def storable(table: pa.Table, written: dict[str, list]) -> tuple[pa.Table, dict[str, list]]:
    """The table with every column nested deeper than MAX_NESTING as JSON text (Parquet could not read it back),
    and the values as written of those columns appended to ``written`` (a table read a chunk at a time: once a
    chunk, in order)."""
    for index, name in enumerate(table.column_names):
        if _nesting(table.schema.field(index).type) > MAX_NESTING:
            values = table.column(name).to_pylist()
            written.setdefault(name, []).extend(values)
            table = table.set_column(index, name, text_array(values))
    return table, written


def storable_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` as ``storable`` leaves it (every column nested deeper than MAX_NESTING: a string)."""
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


def text_array(values: list[Any]) -> pa.Array:
    """Strings as they are, every other value as its JSON text, nulls as nulls."""
    return pa.array([v if v is None or isinstance(v, str) else json.dumps(v) for v in values], type=pa.string())
