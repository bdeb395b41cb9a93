"""Length buckets: prompts grouped by token length ahead of generation.

Why buckets
-----------
EXSPEC keeps a *pool* of in-flight sequences and, every round, picks a *group* of
sequences that have the same length, so they stack into one rectangle and need no
realignment (DESIGN.md §1). Exact prompt lengths rarely coincide: Spec-Bench has 241
distinct lengths in 480 prompts, so a pool filled in input order would almost never find
a same-length group and would keep falling back to EQSPEC realignment. We therefore sort
the prompts by length and cut them into contiguous length ranges, *buckets*, and the
runner fills its pool from one bucket at a time.

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
``build_buckets`` writes one Parquet shard per bucket, rows sorted by length then input
index, with two columns added to the input's own: ``__row`` (int64, 0-based input index)
and ``__prompt_ids`` (list<int32>), plus ``manifest.json`` describing the buckets and the
settings that produced the token ids (tokenizer, chat template, system prompt...), with a
hash so a caller can tell whether a cached bucket directory is still valid. The directory
is written atomically: into a temporary directory beside the target, fsynced, renamed.
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
from typing import Any, Iterator, Sequence

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
    "build_buckets",
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
    directory is refused.
    """
    out_dir = Path(out_dir)
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
    canonical_settings = _normalise_settings(settings)
    _check_target(out_dir, overwrite)

    # 1. Plan the ranges.
    try:
        ids_array = prompt_ids.cast(pa.list_(pa.int32())) if isinstance(prompt_ids, (pa.Array, pa.ChunkedArray)) \
            else pa.array(prompt_ids, type=pa.list_(pa.int32()))
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise BucketError(f"prompt ids are not lists of int32 token ids: {exc}") from None
    length_array = pc.list_value_length(ids_array).to_numpy(zero_copy_only=False)
    lengths = length_array.tolist()
    ranges = plan_buckets(lengths, width=width, min_rows=min_rows)
    used_width = width if width is not None else auto_max_width(lengths)

    # 2. Sort rows by (length, input index); each bucket is then one contiguous slice of the order, taken
    #    and written one row group at a time (never a sorted copy of the whole table).
    order = np.argsort(length_array, kind="stable")
    full = table.append_column(ROW_COLUMN, pa.array(np.arange(len(lengths)), type=pa.int64()))
    full = full.append_column(PROMPT_IDS_COLUMN, ids_array)
    sorted_lengths = length_array[order]

    # 3. Write shards and manifest into a temporary directory beside out_dir.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp_dir.chmod(0o755)  # mkdtemp makes it 0700; the published directory is ordinary
        buckets: list[Bucket] = []
        start = 0
        for index, (lo, hi) in enumerate(ranges):
            stop = int(np.searchsorted(sorted_lengths, hi, side="right"))
            shard = _shard_name(index)
            with pq.ParquetWriter(tmp_dir / shard, full.schema) as writer:  # one row group in memory at a time
                for first in range(start, max(stop, start + 1), ROW_GROUP_ROWS):
                    taken = order[first:min(stop, first + ROW_GROUP_ROWS)]
                    writer.write_table(full.take(pa.array(taken, type=pa.int64())), row_group_size=ROW_GROUP_ROWS)
            _fsync_path(tmp_dir / shard)
            buckets.append(Bucket(index=index, lo=lo, hi=hi, rows=stop - start, shard=shard))
            start = stop
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

    Rows come in shard order (length, then input index); only one row group of one
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
