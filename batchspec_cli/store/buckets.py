"""Length buckets: prompts grouped by token length ahead of generation.

Why buckets
-----------
EXSPEC keeps a *pool* of in-flight sequences and, every round, picks a *group* of
sequences that have the same length, so they stack into one rectangle and need no
realignment (DESIGN.md §1). Exact prompt lengths rarely coincide: Spec-Bench has 241
distinct lengths in 480 prompts, so a pool filled in input order would almost never find
a same-length group and would keep falling back to EQSPEC realignment. We therefore cut
the prompt lengths into contiguous ranges, *buckets*, put each prompt in the bucket of its
length, and the runner fills its pool from one bucket at a time.

Padding at admission
--------------------
The EXSPEC grouping key may be the *padded* length (DESIGN.md §11): rows with equal padded
length stack with their own masks and position ids. A row admitted from bucket
``[lo, hi]`` is left-padded to ``hi``, so every row of a bucket shares one padded length
from the first step, and same-length groups are common from the start::

    bucket [5, 7]       prompt tokens      admitted as (P = pad)
    row 0 (length 5)    a b c d e          P P a b c d e
    row 1 (length 7)    f g h i j k l      f g h i j k l
    row 2 (length 6)    m n o p q r        P m n o p q r    -> one [3, 7] rectangle

Width trade-off
---------------
A wider bucket puts more rows behind one padded length, so more same-length groups and
fewer realignments, but a row of length ``lo`` carries ``hi - lo`` pad tokens through
every forward pass (padding compute, and KV cache entries that are never attended). A
narrower bucket wastes less padding but gives smaller, rarer groups.

``plan_buckets`` has two policies:

* ``width=W`` (fixed): windows of at most ``W`` tokens, each anchored at the shortest
  length not yet assigned (``lo .. lo + W - 1``), then tightened to the lengths that
  actually occur. Anchoring at occupied lengths means no window is ever empty, and it
  needs the fewest windows of span ``<= W`` that cover the lengths.
* ``width=None`` (automatic): start from one range per distinct length and merge
  neighbouring ranges while a range holds fewer than ``min_rows`` rows and the merged
  span stays within the automatic maximum width
  ``auto_max_width(lengths) = max(8, ceil(0.10 * longest length))`` tokens. So a
  well-populated length keeps its own bucket (no padding at all), sparse lengths are
  pooled, and no row is ever padded by more than ~10 % of the longest prompt (or 8
  tokens for short prompts). A range may stay below ``min_rows`` only where neither
  neighbour can be merged within that maximum width.

"Span" always counts tokens inclusively: range ``[lo, hi]`` has span ``hi - lo + 1``.

On disk
-------
``write_buckets`` writes one Parquet shard per bucket, rows in input order within a shard,
with two columns besides the input's own: ``__row`` (int64, 0-based input index) and
``__prompt_ids`` (list<int32>), plus ``manifest.json`` describing the buckets and the
settings that produced the token ids (tokenizer, chat template, system prompt...), with a
hash so a caller can tell whether a cached bucket directory is still valid. Nothing needs
length order within a bucket: every row of it is admitted left-padded to its ``hi``. The
directory is written atomically: into a temporary directory beside the target, fsynced,
renamed.

Two passes
----------
The rows arrive as chunks in input order (tokenized a chunk at a time), and the builder
never holds them all, so its memory does not grow with the input but for four bytes a row:

1. *Spill*: each chunk is written to ``spill.parquet`` in the temporary directory as it
   comes; only its prompt lengths are kept (``[rows]`` int32). The lengths plan the ranges.
2. *Route*: the spill is read back a row group at a time; each row goes to its bucket (the
   first range whose ``hi`` is not below its length), whose buffer becomes a row group of
   its shard once it holds ``ROW_GROUP_ROWS`` rows: less than a row group of rows waits per
   bucket, and ``BUFFER_BYTES`` at most in all (past it, the fullest buffer is written as a
   shorter row group: long prompts would otherwise hold a row group of every open shard).
   At most ``MAX_OPEN_SHARDS`` shards are written at once; with more buckets the
   spill is read once per window of that many. The spill is removed before publishing
   (until then the temporary directory holds the rows twice).

``build_buckets`` feeds ``write_buckets`` slices of a table already in memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = [
    "BucketError",
    "Bucket",
    "Manifest",
    "MANIFEST_NAME",
    "ROW_COLUMN",
    "PROMPT_IDS_COLUMN",
    "auto_max_width",
    "settings_hash",
    "plan_buckets",
    "bucket_chunk",
    "build_buckets",
    "write_buckets",
    "open_buckets",
    "is_bucket_dir",
    "iter_bucket_rows",
    "read_all_rows",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "batchspec-buckets"  # marks a manifest.json as ours
MANIFEST_VERSION = 1
ROW_COLUMN = "__row"  # int64: 0-based index of the row in the input
PROMPT_IDS_COLUMN = "__prompt_ids"  # list<int32>: the prompt's token ids, unpadded
AUTO_MIN_WIDTH = 8  # automatic max width never goes below this many tokens
AUTO_WIDTH_FRACTION = 0.10  # ... and is otherwise this share of the longest length
ROW_GROUP_ROWS = 1024  # Parquet row-group size: bounds memory when streaming a shard
MAX_OPEN_SHARDS = 64  # shards written at once; more buckets read the spill once per this many
MAX_PIECES = 64  # small tables a bucket's buffer holds before they are joined into one
BUFFER_BYTES = 8 << 20  # the most all buckets' buffers hold at once (the fullest is written past it)
SPILL_NAME = "spill.parquet"  # the rows as they came, in the temporary directory until the shards are written
DATA_PAGE_BYTES = 64 * 1024  # Parquet data page size: the buffers an open writer keeps (1 MiB by default)


class BucketError(Exception):
    """A bucket plan, directory or manifest is invalid; the message is one line."""


@dataclass(frozen=True)
class Bucket:
    index: int  # position in Manifest.buckets, 0-based
    lo: int  # shortest prompt length (tokens) in this bucket
    hi: int  # longest prompt length; rows are admitted left-padded to hi
    rows: int  # number of prompts in this bucket, > 0
    shard: str  # file name of its Parquet shard inside the bucket directory


@dataclass
class Manifest:
    version: int  # manifest format version (MANIFEST_VERSION)
    settings: dict  # the caller's settings, as canonical JSON values
    settings_hash: str  # sha256 hex of the canonical JSON of settings
    total_rows: int  # rows in the input == sum of bucket rows
    width: int  # fixed width, or the automatic max width when planned with width=None
    buckets: list[Bucket]  # sorted by lo, disjoint


# ---------------------------------------------------------------------------
# settings


def _canonical_json(settings: dict) -> str:
    if not isinstance(settings, dict):
        raise BucketError(f"settings must be a dict, got {type(settings).__name__}")
    try:
        return json.dumps(
            settings,
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
            default=_json_default,
        )
    except (TypeError, ValueError) as exc:
        raise BucketError(f"settings are not JSON-serialisable: {exc}") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} value {value!r} is not JSON-serialisable")


def _normalise_settings(settings: dict) -> dict:
    """The settings as they read back from manifest.json (paths -> str, tuples -> lists)."""
    return json.loads(_canonical_json(settings))


def settings_hash(settings: dict) -> str:
    """sha256 hex digest of the canonical JSON (sorted keys, compact) of ``settings``."""
    return hashlib.sha256(_canonical_json(settings).encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------
# planning


def _as_length(value: Any) -> int:
    if isinstance(value, bool):
        raise BucketError(f"prompt length must be an integer, got {value!r}")
    try:
        length = operator.index(value)
    except TypeError:
        raise BucketError(f"prompt length must be an integer, got {value!r}") from None
    if length < 0:
        raise BucketError(f"prompt length must be >= 0, got {length}")
    return length


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BucketError(f"{name} must be a positive integer, got {value!r}")
    return value


def _checked_array(lengths: np.ndarray) -> np.ndarray:
    """A numpy array of lengths, refused unless it holds integers >= 0."""
    if lengths.dtype.kind not in "iu":
        raise BucketError(f"prompt lengths must be integers, got an array of {lengths.dtype}")
    if lengths.size and lengths.min() < 0:
        raise BucketError(f"prompt length must be >= 0, got {int(lengths.min())}")
    return lengths


def _length_counts(lengths: Sequence[int] | np.ndarray) -> dict[int, int]:
    """Rows per distinct length, sorted by length; counted by numpy for an array (no Python loop per row)."""
    if isinstance(lengths, np.ndarray):
        distinct, counts = np.unique(_checked_array(lengths), return_counts=True)
        return dict(zip(distinct.tolist(), counts.tolist()))
    counts: dict[int, int] = {}
    for value in lengths:
        length = _as_length(value)
        counts[length] = counts.get(length, 0) + 1
    return dict(sorted(counts.items()))


def auto_max_width(lengths: Sequence[int] | np.ndarray) -> int:
    """Largest span (tokens) the automatic policy lets a bucket reach."""
    if isinstance(lengths, np.ndarray):
        longest = int(_checked_array(lengths).max()) if lengths.size else 0
    else:
        longest = max((_as_length(n) for n in lengths), default=0)
    return max(AUTO_MIN_WIDTH, math.ceil(AUTO_WIDTH_FRACTION * longest))


def plan_buckets(
    lengths: Sequence[int] | np.ndarray, width: int | None = None, min_rows: int = 8
) -> list[tuple[int, int]]:
    """Cut the prompt lengths into contiguous inclusive ranges ``[(lo, hi), ...]``.

    Ranges are sorted, disjoint, tight (``lo`` and ``hi`` both occur in ``lengths``) and
    cover every length. See the module docstring for the two policies. ``lengths`` may be a
    numpy integer array (one per row, a million rows counted without a Python loop).
    """
    if width is not None:
        _check_positive_int("bucket width", width)
    _check_positive_int("min_rows", min_rows)
    counts = _length_counts(lengths)
    distinct = list(counts)
    if width is not None:
        return _plan_fixed(distinct, width)
    return _plan_auto(distinct, counts, min_rows, auto_max_width(distinct))


def _plan_fixed(distinct: list[int], width: int) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for length in distinct:
        if ranges and length <= ranges[-1][0] + width - 1:
            ranges[-1] = (ranges[-1][0], length)
        else:
            ranges.append((length, length))
    return ranges


def _plan_auto(
    distinct: list[int], counts: dict[int, int], min_rows: int, max_width: int
) -> list[tuple[int, int]]:
    # 1. Forward: grow a range over the next lengths while it is short of min_rows and
    #    the span still fits.
    forward: list[list[int]] = []  # [lo, hi, rows]
    for length in distinct:
        if forward:
            lo, _, rows = forward[-1]
            if rows < min_rows and length - lo + 1 <= max_width:
                forward[-1][1] = length
                forward[-1][2] += counts[length]
                continue
        forward.append([length, length, counts[length]])
    # 2. Backward: a range still short of min_rows joins its left neighbour if the span
    #    fits (its right neighbour was already out of reach in step 1).
    merged: list[list[int]] = []
    for lo, hi, rows in forward:
        if merged and rows < min_rows and hi - merged[-1][0] + 1 <= max_width:
            merged[-1][1] = hi
            merged[-1][2] += rows
        else:
            merged.append([lo, hi, rows])
    return [(lo, hi) for lo, hi, _ in merged]


# ---------------------------------------------------------------------------
# manifest


def _manifest_to_json(manifest: Manifest) -> str:
    body = {"format": MANIFEST_FORMAT, **asdict(manifest)}
    return json.dumps(body, indent=2, ensure_ascii=False) + "\n"


def _require(condition: bool, path: Path, what: str) -> None:
    if not condition:
        raise BucketError(f"invalid bucket manifest {path}: {what}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _manifest_from_json(text: str, path: Path) -> Manifest:
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BucketError(f"corrupt bucket manifest {path}: {exc}") from None
    _require(isinstance(body, dict), path, "not a JSON object")
    _require(body.get("format") == MANIFEST_FORMAT, path, f"format is not {MANIFEST_FORMAT!r}")
    version = body.get("version")
    _require(version == MANIFEST_VERSION, path, f"unsupported version {version!r}")
    settings = body.get("settings")
    _require(isinstance(settings, dict), path, "settings is not an object")
    digest = body.get("settings_hash")
    _require(digest == settings_hash(settings), path, "settings_hash does not match settings")
    total_rows, width = body.get("total_rows"), body.get("width")
    _require(_is_int(total_rows) and total_rows > 0, path, "total_rows is not a positive integer")
    _require(_is_int(width) and width > 0, path, "width is not a positive integer")
    raw_buckets = body.get("buckets")
    _require(isinstance(raw_buckets, list) and raw_buckets, path, "buckets is not a non-empty list")
    fields = ("index", "lo", "hi", "rows", "shard")
    buckets: list[Bucket] = []
    for position, raw in enumerate(raw_buckets):
        _require(
            isinstance(raw, dict) and set(raw) == set(fields), path, f"bucket {position} malformed"
        )
        bucket = Bucket(**raw)
        ints_ok = all(_is_int(getattr(bucket, name)) for name in fields[:4])
        _require(ints_ok and bucket.index == position, path, f"bucket {position} malformed")
        _require(0 <= bucket.lo <= bucket.hi and bucket.rows > 0, path, f"bucket {position} malformed")
        _require(
            isinstance(bucket.shard, str) and _is_plain_file_name(bucket.shard),
            path,
            f"bucket {position} shard is not a plain file name",
        )
        if buckets:
            _require(buckets[-1].hi < bucket.lo, path, f"bucket {position} overlaps the previous one")
        buckets.append(bucket)
    _require(sum(b.rows for b in buckets) == total_rows, path, "bucket rows do not sum to total_rows")
    return Manifest(
        version=version,
        settings=settings,
        settings_hash=digest,
        total_rows=total_rows,
        width=width,
        buckets=buckets,
    )


def _is_plain_file_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name


def open_buckets(directory: Path) -> Manifest:
    """Read and validate ``directory/manifest.json``; every shard it names must exist."""
    path = Path(directory) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BucketError(f"bucket manifest {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BucketError(f"cannot read bucket manifest {path}: {exc}") from None
    manifest = _manifest_from_json(text, path)
    for bucket in manifest.buckets:
        shard = Path(directory) / bucket.shard
        if not shard.is_file():
            raise BucketError(f"bucket shard {shard} named in {path} is missing")
    return manifest


def is_bucket_dir(path: Path) -> bool:
    """True when ``path`` is a directory holding a manifest.json written by this module."""
    manifest = Path(path) / MANIFEST_NAME
    try:
        body = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(body, dict) and body.get("format") == MANIFEST_FORMAT


# ---------------------------------------------------------------------------
# building


def _shard_name(index: int) -> str:
    return f"bucket-{index:05d}.parquet"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise BucketError(f"bucket directory {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise BucketError(f"bucket directory {out_dir} exists and is not empty (use overwrite)")
        if not is_bucket_dir(out_dir):
            raise BucketError(f"refusing to overwrite {out_dir}: it is not a bucket directory")


def bucket_chunk(start: int, prompt_ids: pa.Array | pa.ChunkedArray, table: pa.Table | None = None) -> pa.Table:
    """A chunk for ``write_buckets``: ``table``'s rows (none: the two bucket columns only) numbered ``start``,
    ``start + 1``, ... in ``__row``, with their ``prompt_ids`` (list<int32>) in ``__prompt_ids``."""
    rows = pa.array(np.arange(start, start + len(prompt_ids)), type=pa.int64())
    if table is None or table.num_columns == 0:
        return pa.table({ROW_COLUMN: rows, PROMPT_IDS_COLUMN: prompt_ids})
    return table.append_column(ROW_COLUMN, rows).append_column(PROMPT_IDS_COLUMN, prompt_ids)


def build_buckets(
    out_dir: Path,
    table: pa.Table,
    prompt_ids: Sequence[Sequence[int]] | pa.Array | pa.ChunkedArray,
    settings: dict,
    width: int | None = None,
    min_rows: int = 8,
    overwrite: bool = False,
) -> Manifest:
    """Bucket ``table``'s rows by the length of their ``prompt_ids`` and write them to ``out_dir``.

    ``table`` holds the input rows (any columns) aligned with ``prompt_ids``. With
    ``overwrite`` an existing bucket directory is replaced; any other non-empty
    directory is refused. ``write_buckets`` on slices of ``table``: for input that is
    already whole in memory (tests, small inputs).
    """
    if not isinstance(table, pa.Table):
        raise BucketError(f"table must be a pyarrow.Table, got {type(table).__name__}")
    if table.num_rows != len(prompt_ids):
        raise BucketError(
            f"table has {table.num_rows} rows but {len(prompt_ids)} prompt id lists were given"
        )
    if table.num_rows == 0:
        raise BucketError("no prompts to bucket")
    for name in (ROW_COLUMN, PROMPT_IDS_COLUMN):
        if name in table.column_names:
            raise BucketError(f"input column {name!r} clashes with a bucket column")
    try:
        ids_array = prompt_ids.cast(pa.list_(pa.int32())) if isinstance(prompt_ids, (pa.Array, pa.ChunkedArray)) \
            else pa.array(prompt_ids, type=pa.list_(pa.int32()))
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise BucketError(f"prompt ids are not lists of int32 token ids: {exc}") from None
    chunks = (bucket_chunk(start, ids_array.slice(start, ROW_GROUP_ROWS), table.slice(start, ROW_GROUP_ROWS))
              for start in range(0, table.num_rows, ROW_GROUP_ROWS))
    return write_buckets(out_dir, chunks, settings, width=width, min_rows=min_rows, overwrite=overwrite)


def write_buckets(
    out_dir: Path,
    chunks: Iterable[pa.Table],
    settings: dict,
    width: int | None = None,
    min_rows: int = 8,
    overwrite: bool = False,
) -> Manifest:
    """Bucket the rows of ``chunks`` by prompt length and write them to ``out_dir``, never holding them all.

    ``chunks`` are the input's rows in input order, read once and lazily: tables of one schema, each with
    ``__row`` (int64, counting on from the previous chunk's, from 0) and ``__prompt_ids`` (list<int32>)
    besides any input columns (``bucket_chunk`` makes one). With ``overwrite`` an existing bucket directory
    is replaced; any other non-empty directory is refused. The two passes are in the module docstring.
    """
    out_dir = Path(out_dir)
    if width is not None:
        _check_positive_int("bucket width", width)
    _check_positive_int("min_rows", min_rows)
    canonical_settings = _normalise_settings(settings)
    _check_target(out_dir, overwrite)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp_dir.chmod(0o755)  # mkdtemp makes it 0700; the published directory is ordinary
        # 1. Spill the rows to one file in the temporary directory, keeping only their lengths.
        spill = tmp_dir / SPILL_NAME
        lengths = _spill(spill, chunks)  # [rows] int32
        # 2. Plan the ranges.
        ranges = plan_buckets(lengths, width=width, min_rows=min_rows)
        used_width = width if width is not None else auto_max_width(lengths)
        # 3. Send each row of the spill to its bucket's shard; the spill goes.
        rows = _write_shards(spill, tmp_dir, lengths, ranges)
        spill.unlink()
        buckets = [Bucket(index=index, lo=lo, hi=hi, rows=rows[index], shard=_shard_name(index))
                   for index, (lo, hi) in enumerate(ranges)]
        manifest = Manifest(
            version=MANIFEST_VERSION,
            settings=canonical_settings,
            settings_hash=settings_hash(canonical_settings),
            total_rows=len(lengths),
            width=used_width,
            buckets=buckets,
        )
        with open(tmp_dir / MANIFEST_NAME, "w", encoding="utf-8") as handle:
            handle.write(_manifest_to_json(manifest))
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_path(tmp_dir)
        # 4. Publish: rename into place (an old bucket directory is moved aside first).
        _publish(tmp_dir, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return manifest


def _spill(path: Path, chunks: Iterable[pa.Table]) -> np.ndarray:
    """Write ``chunks`` to one Parquet file at ``path`` as they come; return their prompt lengths ([rows] int32)."""
    lengths: list[np.ndarray] = []
    total = 0
    writer: pq.ParquetWriter | None = None
    try:
        for position, chunk in enumerate(chunks):
            _check_chunk(chunk, position, total, writer.schema if writer is not None else None)
            if writer is None:
                writer = _parquet_writer(path, chunk.schema)
            if chunk.num_rows:
                writer.write_table(chunk, row_group_size=ROW_GROUP_ROWS)
                ids = chunk.column(PROMPT_IDS_COLUMN)
                lengths.append(pc.list_value_length(ids).to_numpy().astype(np.int32, copy=False))
                total += chunk.num_rows
    finally:
        if writer is not None:
            writer.close()
    if total == 0:
        raise BucketError("no prompts to bucket")
    return np.concatenate(lengths)


def _check_chunk(chunk: Any, position: int, first_row: int, schema: pa.Schema | None) -> None:
    """Refuse a chunk that is no table, lacks a bucket column (or has it twice), differs from the first chunk's
    schema, has a null prompt, or whose ``__row`` does not count on from ``first_row``."""
    if not isinstance(chunk, pa.Table):
        raise BucketError(f"chunk {position} must be a pyarrow.Table, got {type(chunk).__name__}")
    for name, kind in ((ROW_COLUMN, pa.int64()), (PROMPT_IDS_COLUMN, pa.list_(pa.int32()))):
        found = chunk.schema.get_all_field_indices(name)
        if len(found) > 1:
            raise BucketError(f"input column {name!r} clashes with a bucket column")
        if not found or chunk.schema.field(name).type != kind:
            raise BucketError(f"chunk {position} must have a {name!r} column of {kind}")
    if schema is not None and not chunk.schema.equals(schema):
        raise BucketError(f"chunk {position} has other columns than the first chunk")
    if chunk.column(PROMPT_IDS_COLUMN).null_count:
        raise BucketError(f"chunk {position} has a null {PROMPT_IDS_COLUMN!r}: every row needs its token ids")
    rows = chunk.column(ROW_COLUMN)
    expected = np.arange(first_row, first_row + chunk.num_rows)
    if rows.null_count or not np.array_equal(rows.to_numpy(), expected):
        raise BucketError(f"chunk {position}: {ROW_COLUMN!r} must count on from {first_row} (input order)")


def _write_shards(spill: Path, tmp_dir: Path, lengths: np.ndarray, ranges: list[tuple[int, int]]) -> list[int]:
    """Write each bucket's shard from the spill; return each bucket's row count.

    The spill is read a row group at a time, once per window of ``MAX_OPEN_SHARDS`` buckets; a row group's
    rows of the window go to their buckets' shards (``_ShardWriter``), in input order."""
    highs = np.array([hi for _, hi in ranges], dtype=np.int64)  # [buckets] each bucket's hi, ascending
    rows = np.bincount(np.searchsorted(highs, lengths), minlength=len(ranges))
    with pq.ParquetFile(spill) as source:
        group_rows = [source.metadata.row_group(g).num_rows for g in range(source.num_row_groups)]
        for window_start in range(0, len(ranges), MAX_OPEN_SHARDS):
            window = range(window_start, min(len(ranges), window_start + MAX_OPEN_SHARDS))
            shards = {index: _ShardWriter(tmp_dir / _shard_name(index), source.schema_arrow) for index in window}
            try:
                first = 0
                for group, count in enumerate(group_rows):
                    bucket_of = np.searchsorted(highs, lengths[first:first + count])  # [count] bucket index
                    first += count
                    mine = np.flatnonzero((bucket_of >= window.start) & (bucket_of < window.stop))
                    if not len(mine):
                        continue
                    mine = mine[np.argsort(bucket_of[mine], kind="stable")]  # by bucket, input order within
                    table = source.read_row_group(group)
                    cuts = np.flatnonzero(np.diff(bucket_of[mine])) + 1
                    for taken in np.split(mine, cuts):
                        shards[int(bucket_of[taken[0]])].add(table.take(pa.array(taken)))
                    while sum(shard.held for shard in shards.values()) > BUFFER_BYTES:
                        max(shards.values(), key=lambda shard: shard.held).flush()
            finally:
                for shard in shards.values():
                    shard.close()
            for index in window:
                _fsync_path(tmp_dir / _shard_name(index))
    return rows.tolist()


def _parquet_writer(path: Path, schema: pa.Schema) -> pq.ParquetWriter:
    """A Parquet writer for the spill or a shard. The two bucket columns are not dictionary-encoded (token ids
    and row numbers gain nothing from it on disk) and pages are small: an open writer then keeps about 0.2 MiB
    of buffers instead of 1.8, which ``MAX_OPEN_SHARDS`` writers would otherwise multiply."""
    dictionary = [name for name in schema.names if name not in (ROW_COLUMN, PROMPT_IDS_COLUMN)]
    return pq.ParquetWriter(path, schema, use_dictionary=dictionary, data_page_size=DATA_PAGE_BYTES)


class _ShardWriter:
    """One bucket's shard being written: rows are buffered until they make a row group of ``ROW_GROUP_ROWS``
    rows, so less than one row group's rows wait at a time (as few small tables: see ``MAX_PIECES``)."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.writer = _parquet_writer(path, schema)
        self.pieces: list[pa.Table] = []  # the buffered rows, in input order
        self.buffered = 0  # rows in pieces
        self.held = 0  # bytes of the buffers the pieces keep alive

    def add(self, piece: pa.Table) -> None:
        self.pieces.append(piece)
        self.buffered += piece.num_rows
        if self.buffered >= ROW_GROUP_ROWS:
            table = pa.concat_tables(self.pieces)
            self.writer.write_table(table.slice(0, ROW_GROUP_ROWS), row_group_size=ROW_GROUP_ROWS)
            rest = table.slice(ROW_GROUP_ROWS)
            self.pieces, self.buffered = ([rest] if rest.num_rows else []), rest.num_rows
        elif len(self.pieces) >= MAX_PIECES:  # a sparse bucket: a row or two a row group, in one table instead
            self.pieces = [pa.concat_tables(self.pieces).combine_chunks()]
        self.held = sum(piece.get_total_buffer_size() for piece in self.pieces)

    def flush(self) -> None:
        """Write the rows buffered as one row group (shorter than ``ROW_GROUP_ROWS``: a shorter last one, or
        ``BUFFER_BYTES`` reached)."""
        if self.pieces:
            self.writer.write_table(pa.concat_tables(self.pieces), row_group_size=ROW_GROUP_ROWS)
        self.pieces, self.buffered, self.held = [], 0, 0

    def close(self) -> None:
        """Write the rows still buffered and close the file."""
        self.flush()
        self.writer.close()


def _publish(tmp_dir: Path, out_dir: Path, overwrite: bool) -> None:
    _check_target(out_dir, overwrite)  # re-check: the directory may have changed meanwhile
    old_dir: Path | None = None
    if out_dir.is_dir() and any(out_dir.iterdir()):
        old_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old_dir)  # replaces the empty placeholder directory
    elif out_dir.is_dir():
        out_dir.rmdir()
    os.replace(tmp_dir, out_dir)
    _fsync_path(out_dir.parent)
    if old_dir is not None:
        shutil.rmtree(old_dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# reading


def _shard_file(directory: Path, bucket: Bucket) -> pq.ParquetFile:
    path = Path(directory) / bucket.shard
    try:
        shard = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise BucketError(f"cannot read bucket shard {path}: {exc}") from None
    if shard.metadata.num_rows != bucket.rows:
        shard.close()
        raise BucketError(
            f"bucket shard {path} has {shard.metadata.num_rows} rows, manifest says {bucket.rows}"
        )
    return shard


def iter_bucket_rows(
    directory: Path, manifest: Manifest, batch_rows: int = 256
) -> Iterator[tuple[Bucket, pa.RecordBatch]]:
    """Stream every bucket's rows, bucket by bucket, in record batches of <= batch_rows rows.

    Rows come in shard order (input order within a bucket); only one row group of one
    shard is held in memory at a time.
    """
    _check_positive_int("batch_rows", batch_rows)
    for bucket in manifest.buckets:
        with _shard_file(directory, bucket) as shard:
            for batch in shard.iter_batches(batch_size=batch_rows):
                if batch.num_rows:
                    yield bucket, batch


def read_all_rows(directory: Path, manifest: Manifest) -> pa.Table:
    """The whole dataset in input order (sorted by ``__row``), bucket columns included."""
    tables = []
    for bucket in manifest.buckets:
        with _shard_file(directory, bucket) as shard:
            tables.append(shard.read())
    try:
        table = pa.concat_tables(tables)
    except pa.ArrowInvalid as exc:
        raise BucketError(f"bucket shards in {directory} have different schemas: {exc}") from None
    table = table.sort_by(ROW_COLUMN)
    rows = table.column(ROW_COLUMN).to_pylist()
    if rows != list(range(manifest.total_rows)):
        raise BucketError(f"bucket shards in {directory} do not hold rows 0..{manifest.total_rows - 1}")
    return table
