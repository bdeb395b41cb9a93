"""The finish's merge: checkpoint parts (rows in the order they finished) to rows in input order, streamed.

``regroup`` reads the rows parts one at a time and sorts their rows by input *range*
(``range_rows`` consecutive rows each) into small files of the work directory's ``merge/``,
holding at most ``BUFFER_BYTES`` of rows between writes (each piece in its own buffers, its own cost
counted as ``PIECE_BYTES``; each range's pieces compacted every ``COMPACT_TABLES``); ``ranges`` then reads one range at a time, sorted by row, and checks it
holds every row of the range exactly once. The finish writes each range as it comes (a row
group of OUT, beside the same range of the kept input), so its memory is one part, the buffer
and one range: never the job. ``merge/`` is scratch: a finish killed midway makes it again.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import outputs

MIN_RANGE_ROWS = 4096  # rows per range (one row group of OUT), unless the job has more than MAX_RANGES of them
MAX_RANGES = 256
BUFFER_BYTES = 4 << 20  # rows held between writes to merge/: what the finish holds does not grow with the rows
COMPACT_TABLES = 64  # small tables held together are copied into one: each costs far more than its rows' bytes
PIECE_BYTES = 4096  # what a small table held costs beside its rows' bytes (its objects and buffers), counted
STATS_GROUP_ROWS = 8192  # steps per row group of the statistics file: a group is held, compacted and encoded at
# once (~270 B a step), so its size is the finish's own peak (the sizes tried: docs/history.md, "Figures once kept
# in the code")


def range_rows(total_rows: int) -> int:
    return max(MIN_RANGE_ROWS, math.ceil(total_rows / MAX_RANGES))


def regroup(parts: list[Path], directory: Path, total_rows: int) -> None:
    """Write the rows of ``parts`` into ``directory`` (empty), one file per range and flush."""
    size, schema = range_rows(total_rows), outputs.part_schema("rows")
    held: dict[int, list[pa.Table]] = defaultdict(list)
    held_bytes: dict[int, int] = defaultdict(int)
    files = 0

    def flush(key: int) -> None:
        nonlocal files
        table = pa.concat_tables(held.pop(key))
        held_bytes.pop(key)
        files += 1
        with open(directory / f"{key:08d}-{files:08d}.parquet", "xb") as f:
            pq.write_table(table, f)

    for path in parts:
        table = outputs.read_table(path).select(schema.names).cast(schema)
        keys = pc.divide(table.column("row"), size).to_numpy()  # integer division
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        for start, end in zip(starts, np.r_[starts[1:], len(keys)]):
            # each range's rows taken into their own buffers (a slice would keep the whole part alive)
            key, piece = int(keys[start]), table.take(pa.array(order[start:end]))
            held[key].append(piece)
            held_bytes[key] += piece.nbytes + PIECE_BYTES
            if len(held[key]) >= COMPACT_TABLES:
                held[key] = [compact(held[key])]
                held_bytes[key] = held[key][0].nbytes + PIECE_BYTES
        del table
        while held_bytes and sum(held_bytes.values()) > BUFFER_BYTES:
            flush(max(held_bytes, key=held_bytes.__getitem__))
    for key in list(held):
        flush(key)


def ranges(directory: Path, total_rows: int) -> Iterator[tuple[int, pa.Table]]:
    """(first row, the range's rows sorted by row) for every range, in input order; a row saved twice (never
    expected) is kept once, a row missing is a RuntimeError."""
    size = range_rows(total_rows)
    files: dict[int, list[str]] = defaultdict(list)
    for name in sorted(os.listdir(directory)):
        files[int(name.split("-")[0])].append(name)
    for key in range(math.ceil(total_rows / size)):
        first, end = key * size, min(total_rows, (key + 1) * size)
        tables = [outputs.read_table(directory / name) for name in files.pop(key, [])]
        table = pa.concat_tables(tables) if tables else outputs.part_schema("rows").empty_table()
        rows, keep = np.unique(table.column("row").to_numpy(), return_index=True)
        if len(rows) != end - first:
            missing = np.setdiff1d(np.arange(first, end), rows)
            raise RuntimeError(f"no result for rows {missing[:10].tolist()}")
        yield first, table.take(pa.array(keep))
    if files:
        raise RuntimeError(f"rows beyond the input's {total_rows} in the checkpoint parts")


def batched(tables: Iterable[pa.Table], rows: int = STATS_GROUP_ROWS) -> Iterator[pa.Table]:
    """Tables concatenated into tables of at least ``rows`` rows (the last may have fewer)."""
    held, count = [], 0
    for table in tables:
        held.append(table)
        count += table.num_rows
        if count >= rows:
            yield compact(held)
            held, count = [], 0
        elif len(held) >= COMPACT_TABLES:
            held = [compact(held)]
    if held:
        yield compact(held)


def compact(tables: list[pa.Table]) -> pa.Table:
    """The tables as one table in one chunk a column, owning its buffers (a slice keeps its whole parent, and
    every small table its own objects and buffers: thousands of one-part tables weigh far more than their rows)."""
    return pa.concat_tables(tables).combine_chunks()
