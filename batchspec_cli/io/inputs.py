"""Reading prompts: a JSON lines or Parquet prompts file as an `InputTable` (``input_table``; what one cell of it
stands for is ``cells``, how JSON lines become a table ``jsonl``; the per-row settings read from its columns are
`row_settings`; the tool's own output files, read back, are `outputs`).

Input is JSON lines (`.jsonl`, `.ndjson`) or Parquet (`.parquet`, `.pq`). Every failure a
user can cause with a bad file is an `InputError` whose one-line message names the file and,
where it applies, the line (JSONL, 1-based, blank lines counted) or row (Parquet,
1-based) and the column.

A JSONL file is parsed ``CHUNK_ROWS`` lines at a time (``jsonl.jsonl_chunked_table``), and the prompts
and ids are never Python lists for the whole input: ``Prompts`` parses a chunk of the prompt
column when asked, ``Ids`` is one Arrow string array. Given a ``store`` path (a job's work
directory), a file's rows go to disk as they are read and the table is a ``StoredTable`` read a
row group at a time: reading a file of any size holds a chunk of it, its ids and its bad rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import InputError
from ..store.files import check_readable_file, reading_parquet
from ..store.outputs import EXTRA_OUTPUT_COLUMNS, OUTPUT_COLUMNS
from .cells import DEFAULT_PROMPT_COLUMN, BadPrompt, check_unique, parse_id, parse_prompt, prompt_column_in
from .input_table import CHUNK_ROWS, Ids, InputTable, Prompts, StoredTable, storable, storable_schema
from .jsonl import JSONL_SUFFIXES, jsonl_chunked_table, jsonl_table, read_jsonl

PARQUET_SUFFIXES = (".parquet", ".pq")
DEFAULT_ID_COLUMN = "id"


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
    prompt_column = _checked_prompt_column(path, table, prompt_column, id_column)
    written = dict(written or {})
    if isinstance(table, pa.Table):
        table, written = storable(table, written)
    inp = InputTable(path=path, table=table, prompts=[], ids=[], errors=dict(errors or {}), written=written,
                     prompt_column=prompt_column)
    inp.prompts = Prompts(inp, prompt_column)
    has_ids = id_column in table.column_names
    ids = []  # [chunks] the ids of each chunk of rows
    for start in range(0, table.num_rows, CHUNK_ROWS):
        stop = min(table.num_rows, start + CHUNK_ROWS)
        _mark_bad_prompts(inp, start, stop)
        if has_ids:
            ids.append(_chunk_ids(inp, id_column, start, stop, where))
    inp.ids = _unique_ids(ids, path, id_column) if has_ids \
        else Ids(pc.cast(pa.array(np.arange(table.num_rows)), pa.string()))
    return inp


def _checked_prompt_column(path: Path, table: pa.Table | StoredTable, prompt_column: str, id_column: str) -> str:
    """The column the prompts are read from (``prompt_column_in``), once the table's columns are checked: InputError
    for a table without rows, a column name given twice, no such prompt column, no id column of the name given, or an
    input column named as an output column (``_refuse_output_names``)."""
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
    _refuse_output_names(path, names, id_column)
    return prompt_column


def _refuse_output_names(path: Path, names: list[str], id_column: str) -> None:
    """InputError for an input column the output would write again (the id column `id` is the output's `id`)."""
    for name in names:
        if name in OUTPUT_COLUMNS + EXTRA_OUTPUT_COLUMNS and not (name == "id" and id_column == "id"):
            raise InputError(
                f"{path}: input column '{name}' clashes with an output column; rename it"
            )


def _mark_bad_prompts(inp: InputTable, start: int, stop: int) -> None:
    """Rows [start, stop) whose prompt cell is no prompt become error rows (``inp.errors``, with the reason)."""
    for row, value in enumerate(inp.cells(inp.prompt_column, start, stop), start=start):
        if row not in inp.errors:
            try:
                parse_prompt(value, inp.prompt_column)
            except BadPrompt as exc:
                inp.errors[row] = str(exc)


def _chunk_ids(inp: InputTable, column: str, start: int, stop: int, where: Callable[[int], str]) -> pa.Array:
    """[stop - start] the ids of rows [start, stop) as strings; InputError for a null one."""
    return pa.array([parse_id(v, inp.path, where, row, column)
                     for row, v in enumerate(inp.cells(column, start, stop), start=start)], type=pa.string())


def _unique_ids(chunks: list[pa.Array], path: Path, column: str) -> Ids:
    """The ids of every chunk as one ``Ids``; InputError naming the ids given twice."""
    ids = Ids(pa.chunked_array(chunks, type=pa.string()))
    if _repeats(ids.array):
        check_unique(list(ids), path, column)
    return ids


def _read_parquet(path: Path, limit: int | None) -> pa.Table:
    with reading_parquet(path), open(path, "rb") as f:
        table = pq.read_table(f)
    if limit is not None:
        table = table.slice(0, limit)
    return table


def _store_parquet(path: Path, limit: int | None, store: Path) -> tuple[StoredTable, dict[str, list]]:
    """The first ``limit`` rows of a Parquet file copied to ``store`` ``CHUNK_ROWS`` at a time, as ``storable``
    leaves them, and the values as written of the columns it made text."""
    written: dict[str, list] = {}
    left = limit
    with reading_parquet(path):
        f = open(path, "rb")
    with f:
        with reading_parquet(path):
            found = pq.ParquetFile(f)
            batches = found.iter_batches(batch_size=CHUNK_ROWS)
        with pq.ParquetWriter(store, storable_schema(found.schema_arrow)) as writer:
            while left is None or left > 0:
                with reading_parquet(path):
                    batch = next(batches, None)
                if batch is None:
                    break
                batch = batch if left is None else batch.slice(0, left)
                left = None if left is None else left - batch.num_rows
                table, written = storable(pa.Table.from_batches([batch]), written)
                writer.write_table(table)
    return StoredTable(store), written


def _repeats(values: pa.Array) -> bool:
    """Does a value occur twice? Sorted order compared a chunk at a time: 8 bytes a row and a chunk (a hash of
    every value, ``count_distinct``, peaks near 100 bytes a row)."""
    order = pc.array_sort_indices(values)
    for start in range(0, max(0, len(values) - 1), CHUNK_ROWS):
        run = values.take(order.slice(start, CHUNK_ROWS + 1))
        if pc.any(pc.equal(run.slice(1), run.slice(0, len(run) - 1))).as_py():
            return True
    return False
