"""Tests for batchspec_cli/store/buckets.py: planning properties, Parquet round trip, streaming, manifest checks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from batchspec_cli.store import buckets as bucketing
from batchspec_cli.store.buckets import (
    MANIFEST_NAME,
    PROMPT_IDS_COLUMN,
    ROW_COLUMN,
    Bucket,
    BucketError,
    Manifest,
    auto_max_width,
    bucket_chunk,
    build_buckets,
    is_bucket_dir,
    iter_bucket_rows,
    open_buckets,
    plan_buckets,
    read_all_rows,
    settings_hash,
    write_buckets,
)

SETTINGS = {"tokenizer": "HuggingFaceTB/SmolLM2-135M", "chat": True, "system": None, "column": "prompt"}


def make_rows(lengths: list[int], seed: int = 0) -> tuple[pa.Table, list[list[int]]]:
    """An input table with a few column types, and prompt ids of the given lengths."""
    rng = random.Random(seed)
    prompt_ids = [[rng.randrange(0, 50_000) for _ in range(n)] for n in lengths]
    table = pa.table(
        {
            "prompt": [f"prompt {i} " + "x" * rng.randrange(5) for i in range(len(lengths))],
            "id": [f"r{i}" for i in range(len(lengths))],
            "score": [None if i % 3 == 0 else i / 7 for i in range(len(lengths))],
        }
    )
    return table, prompt_ids


def check_plan(lengths: list[int], ranges: list[tuple[int, int]], width: int | None) -> None:
    """Oracle for plan_buckets: sorted, disjoint, tight, covering, span-limited."""
    for lo, hi in ranges:
        assert lo <= hi
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi < lo
    occupied = set(lengths)
    covered = [sum(lo <= n <= hi for lo, hi in ranges) for n in lengths]
    assert all(c == 1 for c in covered)
    for lo, hi in ranges:
        assert lo in occupied and hi in occupied
    limit = width if width is not None else auto_max_width(lengths)
    for lo, hi in ranges:
        assert hi - lo + 1 <= limit


# --- planning ---------------------------------------------------------------------------

# Mostly short, clustered lengths (many repeats, merges within the 8-token floor) plus a
# spread up to 400 (the automatic max width grows to 40).
lengths_st = st.lists(
    st.one_of(st.integers(min_value=0, max_value=40), st.integers(min_value=0, max_value=400)),
    min_size=0,
    max_size=300,
)


@hsettings(database=None)
@given(lengths=lengths_st, width=st.one_of(st.none(), st.integers(1, 64)), min_rows=st.integers(1, 20))
def test_plan_covers_sorted_disjoint(lengths, width, min_rows):
    ranges = plan_buckets(lengths, width=width, min_rows=min_rows)
    check_plan(lengths, ranges, width)
    assert (ranges == []) == (lengths == [])


@hsettings(database=None)
@given(lengths=lengths_st, min_rows=st.integers(1, 20))
def test_auto_plan_small_ranges_cannot_merge(lengths, min_rows):
    """A range below min_rows exists only where neither neighbour fits in the max width."""
    ranges = plan_buckets(lengths, width=None, min_rows=min_rows)
    max_width = auto_max_width(lengths)
    for i, (lo, hi) in enumerate(ranges):
        rows = sum(lo <= n <= hi for n in lengths)
        if rows >= min_rows:
            continue
        if i > 0:
            assert hi - ranges[i - 1][0] + 1 > max_width
        if i + 1 < len(ranges):
            assert ranges[i + 1][1] - lo + 1 > max_width


@hsettings(database=None)
@given(lengths=lengths_st, width=st.integers(1, 64))
def test_fixed_plan_is_minimal(lengths, width):
    """Greedy windows anchored at occupied lengths: each next range starts beyond lo + width - 1."""
    ranges = plan_buckets(lengths, width=width)
    for (lo, _), (next_lo, _) in zip(ranges, ranges[1:]):
        assert next_lo > lo + width - 1


def test_fixed_width_example():
    assert plan_buckets([3, 4, 10, 11, 12, 30], width=4) == [(3, 4), (10, 12), (30, 30)]
    assert plan_buckets([5, 5, 5], width=1) == [(5, 5)]


def test_auto_width_merges_sparse_lengths():
    rng = random.Random(1234)
    lengths = [rng.randint(10, 300) for _ in range(480)]
    min_rows = 8
    ranges = plan_buckets(lengths, min_rows=min_rows)
    check_plan(lengths, ranges, None)
    distinct = len(set(lengths))
    assert distinct > 150
    assert len(ranges) < distinct / 3
    max_width = auto_max_width(lengths)
    assert max_width == 30
    for i, (lo, hi) in enumerate(ranges):
        rows = sum(lo <= n <= hi for n in lengths)
        if rows < min_rows:  # only where the max width stopped merging on both sides
            assert i == 0 or hi - ranges[i - 1][0] + 1 > max_width
            assert i == len(ranges) - 1 or ranges[i + 1][1] - lo + 1 > max_width


def test_auto_width_merges_small_tail_backwards():
    # forward pass: (0, 0) already holds min_rows, (1, 1) cannot reach 20; so 1 joins 0.
    assert plan_buckets([0, 0, 1, 20], min_rows=2) == [(0, 1), (20, 20)]


def test_auto_width_span_limit_is_inclusive():
    # one row per length 0..100, never enough rows: ranges grow to exactly 10 tokens
    ranges = plan_buckets(list(range(101)), min_rows=1000)
    assert auto_max_width(range(101)) == 10
    assert ranges == [(lo, lo + 9) for lo in range(0, 100, 10)] + [(100, 100)]


def test_auto_width_keeps_dense_lengths_exact():
    lengths = [20] * 8 + [21] * 10 + [22] * 3 + [23] * 5  # 20 holds exactly min_rows
    assert plan_buckets(lengths, min_rows=8) == [(20, 20), (21, 21), (22, 23)]


def test_auto_width_stops_at_max_width():
    # 1 row at each of 0, 100, 200: far apart, nothing may merge.
    assert plan_buckets([0, 100, 200], min_rows=8) == [(0, 0), (100, 100), (200, 200)]
    assert auto_max_width([0, 100, 200]) == 20
    assert auto_max_width([5]) == 8
    assert auto_max_width([3, 101]) == 11  # ceil(10 % of 101)


@pytest.mark.parametrize("width", [0, -3, 2.5, True])
def test_bad_width_refused(width):
    with pytest.raises(BucketError, match="width"):
        plan_buckets([1, 2, 3], width=width)


@pytest.mark.parametrize("lengths", [[1, -1], [1.5], ["3"]])
def test_bad_lengths_refused(lengths):
    with pytest.raises(BucketError, match="length"):
        plan_buckets(lengths)


def test_bad_min_rows_refused():
    with pytest.raises(BucketError, match="min_rows"):
        plan_buckets([1, 2], min_rows=0)


@hsettings(database=None)
@given(lengths=lengths_st, width=st.one_of(st.none(), st.integers(1, 64)), min_rows=st.integers(1, 20),
       dtype=st.sampled_from([np.int32, np.int64, np.uint16]))
def test_plan_of_an_array_is_the_plan_of_its_list(lengths, width, min_rows, dtype):
    array = np.array(lengths, dtype=dtype)
    assert plan_buckets(array, width=width, min_rows=min_rows) == plan_buckets(lengths, width=width, min_rows=min_rows)
    assert auto_max_width(array) == auto_max_width(lengths)


@pytest.mark.parametrize("array", [np.array([1, -1]), np.array([1.5]), np.array([True])])
def test_bad_length_arrays_refused(array):
    with pytest.raises(BucketError, match="length"):
        plan_buckets(array)


# --- building and reading ---------------------------------------------------------------


@hsettings(
    max_examples=25,
    deadline=None,
    database=None,  # keep .hypothesis/ out of the tree
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=120), min_size=1, max_size=120),
    width=st.one_of(st.none(), st.integers(1, 40)),
    min_rows=st.integers(1, 12),
)
def test_build_round_trip(lengths, width, min_rows):
    table, prompt_ids = make_rows(lengths)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "buckets"
        manifest = build_buckets(out, table, prompt_ids, SETTINGS, width=width, min_rows=min_rows)
        assert [(b.lo, b.hi) for b in manifest.buckets] == plan_buckets(lengths, width, min_rows)
        assert manifest.total_rows == len(lengths) == sum(b.rows for b in manifest.buckets)

        # every row lands in exactly one bucket, within its [lo, hi], in input order within it
        seen: list[int] = []
        for bucket, batch in iter_bucket_rows(out, manifest, batch_rows=7):
            assert batch.num_rows <= 7
            rows = batch.column(ROW_COLUMN).to_pylist()
            ids = batch.column(PROMPT_IDS_COLUMN).to_pylist()
            for row, row_ids in zip(rows, ids):
                assert bucket.lo <= len(row_ids) <= bucket.hi
                assert len(row_ids) == lengths[row]
            seen.extend(rows)
        assert sorted(seen) == list(range(len(lengths)))
        assert seen == [i for b in manifest.buckets for i in range(len(lengths)) if b.lo <= lengths[i] <= b.hi]

        # round trip: input order, input columns and prompt ids unchanged
        back = read_all_rows(out, manifest)
        assert back.column(ROW_COLUMN).to_pylist() == list(range(len(lengths)))
        assert back.column(PROMPT_IDS_COLUMN).to_pylist() == prompt_ids
        assert back.select(table.column_names).equals(table)
        assert back.schema.field(ROW_COLUMN).type == pa.int64()
        assert back.schema.field(PROMPT_IDS_COLUMN).type == pa.list_(pa.int32())


def test_streaming_batches_bounded(tmp_path):
    lengths = [random.Random(i).randint(1, 50) for i in range(700)]
    table, prompt_ids = make_rows(lengths)
    manifest = build_buckets(tmp_path / "b", table, prompt_ids, SETTINGS, width=100)
    assert len(manifest.buckets) == 1  # one big shard, so batching must split it
    sizes = [batch.num_rows for _, batch in iter_bucket_rows(tmp_path / "b", manifest, batch_rows=64)]
    assert max(sizes) <= 64
    assert len(sizes) >= 700 // 64
    assert sum(sizes) == 700
    with pytest.raises(BucketError, match="batch_rows"):
        next(iter_bucket_rows(tmp_path / "b", manifest, batch_rows=0))


def shards_of(directory: Path, manifest: Manifest) -> list[pa.Table]:
    return [pq.read_table(directory / b.shard) for b in manifest.buckets]


def test_more_buckets_than_open_shards_write_the_same_shards(tmp_path, monkeypatch):
    """With the writers bounded below the number of buckets (the spill swept once per window), and row groups
    small enough that buffers fill, join and flush, every shard holds its bucket's rows in input order, in
    full row groups but the last, the same as with every writer open at once."""
    lengths = np.random.default_rng(7).integers(0, 60, 3000).tolist()
    table, prompt_ids = make_rows(lengths)
    monkeypatch.setattr(bucketing, "ROW_GROUP_ROWS", 16)
    monkeypatch.setattr(bucketing, "MAX_PIECES", 3)
    monkeypatch.setattr(bucketing, "MAX_OPEN_SHARDS", 1000)
    wide = build_buckets(tmp_path / "wide", table, prompt_ids, SETTINGS, width=4)
    monkeypatch.setattr(bucketing, "MAX_OPEN_SHARDS", 4)
    narrow = build_buckets(tmp_path / "narrow", table, prompt_ids, SETTINGS, width=4)
    assert len(narrow.buckets) == 15 > 4  # lengths 0..59 in windows of 4 tokens
    assert narrow == wide
    assert shards_of(tmp_path / "narrow", narrow) == shards_of(tmp_path / "wide", wide)
    for bucket, shard in zip(narrow.buckets, shards_of(tmp_path / "narrow", narrow)):
        rows = [i for i in range(len(lengths)) if bucket.lo <= lengths[i] <= bucket.hi]
        assert shard.column(ROW_COLUMN).to_pylist() == rows
        assert shard.column(PROMPT_IDS_COLUMN).to_pylist() == [prompt_ids[i] for i in rows]
        assert shard.column("id").to_pylist() == [f"r{i}" for i in rows]
        metadata = pq.ParquetFile(tmp_path / "narrow" / bucket.shard).metadata
        sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        assert sizes[:-1] == [16] * (len(sizes) - 1) and 0 < sizes[-1] <= 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["narrow", "wide"]  # no spill, no temp dirs


def test_buffers_past_their_byte_bound_are_written_early_and_the_shards_hold_the_same_rows(tmp_path, monkeypatch):
    """Past ``BUFFER_BYTES`` in all, the fullest bucket's buffer is written as a shorter row group: the shards
    hold the same rows in the same order, in more row groups, and no buffer ever outgrows the bound by more than
    the row group just routed."""
    lengths = np.random.default_rng(3).integers(0, 60, 3000).tolist()
    table, prompt_ids = make_rows(lengths)
    monkeypatch.setattr(bucketing, "ROW_GROUP_ROWS", 64)
    roomy = build_buckets(tmp_path / "roomy", table, prompt_ids, SETTINGS, width=4)
    monkeypatch.setattr(bucketing, "BUFFER_BYTES", 4096)
    shards, held = [], []  # every shard writer, and what all of them held at each piece added
    make, add = bucketing._ShardWriter.__init__, bucketing._ShardWriter.add
    monkeypatch.setattr(bucketing._ShardWriter, "__init__", lambda self, *a: (make(self, *a), shards.append(self))[0])
    monkeypatch.setattr(bucketing._ShardWriter, "add",
                        lambda self, piece: (add(self, piece), held.append(sum(s.held for s in shards)))[0])
    tight = build_buckets(tmp_path / "tight", table, prompt_ids, SETTINGS, width=4)
    assert max(held) < 4096 + 64 * 400  # the bound plus at most one routed row group's rows (~300 bytes a row)
    assert tight == roomy
    assert shards_of(tmp_path / "tight", tight) == shards_of(tmp_path / "roomy", roomy)
    groups = {name: sum(pq.ParquetFile(tmp_path / name / b.shard).metadata.num_row_groups for b in roomy.buckets)
              for name in ("roomy", "tight")}
    assert groups["tight"] > groups["roomy"]


def _chunks(case: str) -> list:
    """Two chunks of three rows, spoiled as ``case`` says."""
    table, prompt_ids = make_rows([3, 4, 5, 6, 7, 8])
    first = bucket_chunk(0, pa.array(prompt_ids[:3], pa.list_(pa.int32())), table.slice(0, 3))
    second = bucket_chunk(3, pa.array(prompt_ids[3:], pa.list_(pa.int32())), table.slice(3, 3))
    if case == "not a table":
        second = second.to_batches()[0]
    elif case == "no rows column":
        first = first.drop_columns([ROW_COLUMN])
    elif case == "ids as int64":
        first = first.set_column(first.schema.get_field_index(PROMPT_IDS_COLUMN), PROMPT_IDS_COLUMN,
                                 first.column(PROMPT_IDS_COLUMN).cast(pa.list_(pa.int64())))
    elif case == "other columns":
        second = second.drop_columns(["score"])
    elif case == "rows out of order":
        second = bucket_chunk(4, second.column(PROMPT_IDS_COLUMN), table.slice(3, 3))
    elif case == "null ids":
        second = bucket_chunk(3, pa.array([[1], None, [2]], pa.list_(pa.int32())), table.slice(3, 3))
    elif case == "clash":
        first = bucket_chunk(0, first.column(PROMPT_IDS_COLUMN), first)
    elif case == "empty":
        first, second = first.slice(0, 0), second.slice(0, 0)
    return [first, second]


@pytest.mark.parametrize(
    "case, match",
    [
        ("not a table", "chunk 1 must be a pyarrow.Table"),
        ("no rows column", "chunk 0 must have a '__row' column of int64"),
        ("ids as int64", "chunk 0 must have a '__prompt_ids' column of list<item: int32>"),
        ("other columns", "chunk 1 has other columns than the first chunk"),
        ("rows out of order", "chunk 1: '__row' must count on from 3"),
        ("null ids", "chunk 1 has a null '__prompt_ids'"),
        ("clash", "input column '__row' clashes with a bucket column"),
        ("empty", "no prompts to bucket"),
    ],
)
def test_bad_chunks_refused(tmp_path, case, match):
    with pytest.raises(BucketError, match=match):
        write_buckets(tmp_path / "b", iter(_chunks(case)), SETTINGS)
    assert list(tmp_path.iterdir()) == []  # no spill, no temp dir left behind
    with pytest.raises(BucketError, match="no prompts to bucket"):
        write_buckets(tmp_path / "b", iter([]), SETTINGS)


# Buckets ``rows`` rows of 32..95 tokens (four buckets) from a generator of chunks, in a fresh process (Arrow's
# peak cannot be reset, and Parquet allocates from the default pool directly: a proxy pool misses it); prints
# [the most Arrow memory live when a chunk was asked for, the most live at any time].
BUCKETING_PROCESS = """
import json, sys
import numpy as np, pyarrow as pa
from batchspec_cli.store.buckets import bucket_chunk, write_buckets

out, rows = sys.argv[1], int(sys.argv[2])
lengths = np.random.default_rng(rows).integers(32, 96, rows)
live_at_chunk = []

def chunks():
    for start in range(0, rows, 1024):
        live_at_chunk.append(pa.total_allocated_bytes())
        offsets = np.concatenate([[0], np.cumsum(lengths[start:start + 1024])])
        values = np.random.default_rng(start).integers(0, 50_000, int(offsets[-1]))
        ids = pa.ListArray.from_arrays(pa.array(offsets).cast(pa.int32()), pa.array(values).cast(pa.int32()))
        yield bucket_chunk(start, ids)  # in Arrow's memory (the casts copy): live_at_chunk counts a chunk held

manifest = write_buckets(out, chunks(), {}, width=16)
assert len(manifest.buckets) == 4 and manifest.total_rows == rows
print(json.dumps([max(live_at_chunk), pa.default_memory_pool().max_memory()]))
"""


def arrow_memory_while_bucketing(out: Path, rows: int) -> tuple[int, int]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", BUCKETING_PROCESS, str(out), str(rows)], env=env,
                          capture_output=True, text=True, check=True)
    return tuple(json.loads(done.stdout))


def test_write_buckets_holds_about_a_row_group_per_bucket_whatever_the_rows(tmp_path):
    """The chunks are read as they are made, and no more than a few row groups per bucket are held at once:
    ten times the rows (49 MiB of token ids against 4.9) take no more Arrow memory at any point, but for the
    four bytes a row of the lengths (about 4 MiB at either size, from the Parquet writers and readers)."""
    small_live, small_peak = arrow_memory_while_bucketing(tmp_path / "small", 20_000)
    big_live, big_peak = arrow_memory_while_bucketing(tmp_path / "big", 200_000)
    lengths = 4 * (200_000 - 20_000)  # bytes the big input's lengths hold more
    assert big_live - lengths < 2 * max(small_live, 1 << 20)
    assert big_peak - lengths < 2 * small_peak
    assert big_peak < 200_000 * 64 * 4 / 4  # a quarter of the big input's token ids (64 tokens a row on average)


def test_manifest_round_trip(tmp_path):
    lengths = [5, 5, 6, 9, 40, 41, 41, 200]
    table, prompt_ids = make_rows(lengths)
    settings = {**SETTINGS, "input": tmp_path / "prompts.jsonl", "stop": ("a", "b")}
    manifest = build_buckets(tmp_path / "b", table, prompt_ids, settings, min_rows=2)
    assert isinstance(manifest, Manifest)
    assert all(isinstance(b, Bucket) for b in manifest.buckets)
    assert manifest.settings["input"] == str(tmp_path / "prompts.jsonl")  # stored as JSON
    assert manifest.settings_hash == settings_hash(settings)
    assert manifest.width == auto_max_width(lengths)
    assert open_buckets(tmp_path / "b") == manifest
    assert is_bucket_dir(tmp_path / "b")
    text = (tmp_path / "b" / MANIFEST_NAME).read_text()
    assert "\n  " in text  # indented, human-readable
    assert json.loads(text)["total_rows"] == 8
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(
        [MANIFEST_NAME] + [b.shard for b in manifest.buckets]
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_settings_hash_tracks_settings():
    base = settings_hash(SETTINGS)
    assert base == settings_hash(dict(reversed(list(SETTINGS.items()))))  # key order irrelevant
    assert len(base) == 64
    for key, value in [("chat", False), ("system", "be brief"), ("tokenizer", "other"), ("extra", 1)]:
        assert settings_hash({**SETTINGS, key: value}) != base
    with pytest.raises(BucketError, match="settings"):
        settings_hash({"x": object()})
    with pytest.raises(BucketError, match="settings"):
        settings_hash({"x": float("nan")})


def _write_manifest(directory: Path, mutate) -> None:
    path = directory / MANIFEST_NAME
    body = json.loads(path.read_text())
    mutate(body)
    path.write_text(json.dumps(body))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda body: body.update(settings_hash="0" * 64),
        lambda body: body["settings"].update(chat=False),
        lambda body: body.update(total_rows=body["total_rows"] + 1),
        lambda body: body.update(version=99),
        lambda body: body.pop("format"),
        lambda body: body["buckets"][0].update(shard="../escape.parquet"),
        lambda body: body["buckets"][1].update(lo=body["buckets"][0]["hi"]),
        lambda body: body["buckets"][0].update(rows="3"),
        lambda body: body.update(buckets=[]),
    ],
)
def test_invalid_manifest_refused(tmp_path, mutate):
    table, prompt_ids = make_rows([1, 2, 3, 30, 31, 90])
    build_buckets(tmp_path / "b", table, prompt_ids, SETTINGS, width=4)
    _write_manifest(tmp_path / "b", mutate)
    with pytest.raises(BucketError, match="manifest.json"):
        open_buckets(tmp_path / "b")


def test_corrupt_or_missing_manifest(tmp_path):
    with pytest.raises(BucketError, match="manifest.json.*not found"):
        open_buckets(tmp_path)
    assert not is_bucket_dir(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text('{"version": 1, "buck')
    with pytest.raises(BucketError, match="corrupt.*manifest.json") as info:
        open_buckets(tmp_path)
    assert "\n" not in str(info.value)
    assert not is_bucket_dir(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text('{"version": 1}')  # someone else's manifest
    assert not is_bucket_dir(tmp_path)


def test_missing_or_wrong_shard(tmp_path):
    table, prompt_ids = make_rows([1, 2, 3, 30, 31, 90])
    manifest = build_buckets(tmp_path / "b", table, prompt_ids, SETTINGS, width=4)
    shard0 = tmp_path / "b" / manifest.buckets[0].shard
    shard1 = tmp_path / "b" / manifest.buckets[1].shard
    shard0.write_bytes(shard1.read_bytes())  # valid Parquet, wrong row count
    with pytest.raises(BucketError, match="rows"):
        read_all_rows(tmp_path / "b", manifest)
    shard0.unlink()
    with pytest.raises(BucketError, match="missing"):
        open_buckets(tmp_path / "b")


def test_existing_dir_refused_without_overwrite(tmp_path):
    out = tmp_path / "b"
    table, prompt_ids = make_rows([3, 4, 5])
    first = build_buckets(out, table, prompt_ids, SETTINGS)
    table2, prompt_ids2 = make_rows([7, 8, 9, 10], seed=1)
    with pytest.raises(BucketError, match="not empty"):
        build_buckets(out, table2, prompt_ids2, SETTINGS)
    assert open_buckets(out) == first  # untouched
    second = build_buckets(out, table2, prompt_ids2, {**SETTINGS, "chat": False}, overwrite=True)
    assert open_buckets(out) == second
    assert read_all_rows(out, second).column(PROMPT_IDS_COLUMN).to_pylist() == prompt_ids2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # old copy and temp dirs removed


def test_empty_dir_is_used_and_foreign_dir_never_replaced(tmp_path):
    table, prompt_ids = make_rows([3, 4, 5])
    (tmp_path / "empty").mkdir()
    build_buckets(tmp_path / "empty", table, prompt_ids, SETTINGS)
    assert is_bucket_dir(tmp_path / "empty")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("keep me")
    with pytest.raises(BucketError, match="not a bucket directory"):
        build_buckets(tmp_path / "foreign", table, prompt_ids, SETTINGS, overwrite=True)
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(BucketError, match="not a directory"):
        build_buckets(tmp_path / "file", table, prompt_ids, SETTINGS, overwrite=True)


def test_width_zero_refused_by_build(tmp_path):
    table, prompt_ids = make_rows([3, 4, 5])
    with pytest.raises(BucketError, match="width"):
        build_buckets(tmp_path / "b", table, prompt_ids, SETTINGS, width=0)
    assert not (tmp_path / "b").exists()
    assert list(tmp_path.iterdir()) == []  # no temp dir left behind


@pytest.mark.parametrize(
    "case, match",
    [
        ("misaligned", "rows"),
        ("empty", "no prompts"),
        ("clash", "clashes"),
        ("overflow", "int32"),
    ],
)
def test_bad_build_inputs(tmp_path, case, match):
    table, prompt_ids = make_rows([3, 4, 5])
    if case == "misaligned":
        prompt_ids = prompt_ids[:2]
    elif case == "empty":
        table, prompt_ids = table.slice(0, 0), []
    elif case == "clash":
        table = table.append_column(ROW_COLUMN, pa.array([0, 1, 2]))
    elif case == "overflow":
        prompt_ids[1][0] = 2**40
    with pytest.raises(BucketError, match=match):
        build_buckets(tmp_path / "b", table, prompt_ids, SETTINGS)
    assert list(tmp_path.iterdir()) == []
