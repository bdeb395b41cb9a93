"""What the tool writes: the completions file, the statistics file and the checkpoint parts, and how `verify` and
`stats` read the first two back.

Outputs are Parquet files written atomically (files.replace_atomic); the run configuration
travels in the schema metadata under the key `batchspec`. Each output row is one input row,
in input order; the schemas of `RowResult` and `StepStats` follow their annotations.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..engine.events import RowResult, StepStats, TokenLogprob
from ..errors import InputError
from .files import check_readable_file, first_line, reading_parquet, replace_atomic

OUTPUT_COLUMNS: tuple[str, ...] = (
    "id",
    "completion",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "error",
    "drafted_tokens",
    "accepted_tokens",
    "rounds",
    "completion_token_ids",
)
LOGPROBS_COLUMN = "completion_logprobs"  # written only by a job that asks for log-probabilities
EXTRA_OUTPUT_COLUMNS: tuple[str, ...] = (LOGPROBS_COLUMN,)  # input columns may not take these names either

METADATA_KEY = b"batchspec"


def stats_path_for(out: Path) -> Path:
    """Default statistics path: out.parquet -> out.stats.parquet, same directory."""
    out = Path(out)
    return out.with_name(out.stem + ".stats.parquet")


def write_completions(
    out: Path, table: pa.Table, ids: list[str], results: list[RowResult], texts: list[str], metadata: dict,
    token_text: Callable[[int], str] | None = None,
) -> None:
    """Write one row per input row (``table``, its row ids ``ids``), in input order, in one piece; `texts[i]` is
    the text of `results[i]`. (A job's finish streams the same rows range by range: ``completions_table``.)

    Input columns pass through in place; an input `id` column (necessarily the id column,
    read_input refuses other clashes) is replaced in place by the string ids, otherwise
    `id` is appended after the input columns. The output columns follow, then
    `completion_logprobs` when `token_text` (a token id's text) is given.
    """
    n = table.num_rows
    if len(texts) != len(results):
        raise RuntimeError(f"{len(texts)} texts for {len(results)} results")
    by_row: list[tuple[RowResult, str] | None] = [None] * n
    for result, text in zip(results, texts):
        if not 0 <= result.row < n:
            raise RuntimeError(f"result for row {result.row}, but the input has {n} rows")
        if by_row[result.row] is not None:
            raise RuntimeError(f"two results for row {result.row}")
        by_row[result.row] = (result, text)
    missing = [i for i, r in enumerate(by_row) if r is None]
    if missing:
        raise RuntimeError(f"no result for rows {missing[:10]}")
    clashes = [c for c in table.column_names if c in OUTPUT_COLUMNS + EXTRA_OUTPUT_COLUMNS and c != "id"]
    if clashes:
        raise RuntimeError(f"input columns clash with output columns: {clashes}")

    pairs: list[tuple[RowResult, str]] = by_row  # type: ignore[assignment]
    rows = completions_table(table, ids, [r for r, _ in pairs], [t for _, t in pairs], token_text)
    _write_atomic(Path(out), rows, metadata)


def completions_table(table: pa.Table, ids, results: list[RowResult], texts: list[str],
                      token_text: Callable[[int], str] | None = None) -> pa.Table:
    """The output rows of ``table``'s rows (input columns, then the output columns; see write_completions):
    ``ids``, ``results`` and ``texts`` aligned with its rows. A slice of the input gives that slice of OUT."""
    ids = pa.array(ids, type=pa.string())
    columns: dict[str, pa.Array | pa.ChunkedArray] = {}
    for name in table.column_names:
        columns[name] = ids if name == "id" else table.column(name)
    rs = results  # aligned with the table's rows
    columns["id"] = ids
    columns["completion"] = pa.array(texts, type=pa.string())
    columns["prompt_tokens"] = pa.array([r.prompt_tokens for r in rs], type=pa.int32())
    columns["completion_tokens"] = pa.array([len(r.token_ids) for r in rs], type=pa.int32())
    columns["finish_reason"] = pa.array([r.finish_reason for r in rs], type=pa.string())
    columns["error"] = pa.array([r.error for r in rs], type=pa.string())
    columns["drafted_tokens"] = pa.array([r.drafted_tokens for r in rs], type=pa.int32())
    columns["accepted_tokens"] = pa.array([r.accepted_tokens for r in rs], type=pa.int32())
    columns["rounds"] = pa.array([r.rounds for r in rs], type=pa.int32())
    columns["completion_token_ids"] = pa.array(
        [[int(t) for t in r.token_ids] for r in rs], type=pa.list_(pa.int32())
    )
    if token_text is not None:
        columns[LOGPROBS_COLUMN] = logprobs_array(rs, token_text)
    return pa.table(columns)


def completions_from_parts(table: pa.Table, ids: pa.Array, part: pa.Table, texts: list[str]) -> pa.Table:
    """``completions_table`` of a range of rows read from checkpoint parts (``part``: the rows part format, sorted
    by row, aligned with ``table``'s rows), column by column, with no object per row."""
    columns: dict[str, pa.Array | pa.ChunkedArray] = {name: table.column(name) for name in table.column_names}
    int32 = lambda name: part.column(name).cast(pa.int32())  # noqa: E731
    token_ids = part.column("token_ids").cast(pa.list_(pa.int32()))
    columns.update({
        "id": ids.cast(pa.string()), "completion": pa.array(texts, type=pa.string()), "prompt_tokens": int32("prompt_tokens"),
        "completion_tokens": pc.list_value_length(token_ids).cast(pa.int32()),
        "finish_reason": part.column("finish_reason").cast(pa.string()), "error": part.column("error").cast(pa.string()),
        "drafted_tokens": int32("drafted_tokens"), "accepted_tokens": int32("accepted_tokens"), "rounds": int32("rounds"),
        "completion_token_ids": token_ids})
    return pa.table(columns)


_TOP_LOGPROB = pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64())])
LOGPROBS_TYPE = pa.list_(pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64()),
                                    ("top_logprobs", pa.list_(_TOP_LOGPROB))]))


def logprobs_array(results: list[RowResult], token_text: Callable[[int], str]) -> pa.Array:
    """The `completion_logprobs` column: per row, one struct per completion token (null: not asked)."""
    texts: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in texts:
            texts[token] = token_text(token)
        return texts[token]

    def entry(e: TokenLogprob) -> dict:
        return {"token": text(e.token_id), "token_id": e.token_id, "logprob": e.logprob,
                "top_logprobs": [{"token": text(t), "token_id": t, "logprob": v} for t, v in e.top]}

    return pa.array([None if r.logprobs is None else [entry(e) for e in r.logprobs] for r in results],
                    type=LOGPROBS_TYPE)


# Arrow types of RowResult / StepStats fields, from their annotations; KV counts may exceed int32.
_ANNOTATION_TYPES = {
    "int": pa.int32(),
    "float": pa.float64(),
    "str": pa.string(),
    "bool": pa.bool_(),
    "list[int]": pa.list_(pa.int32()),
    "list[float]": pa.list_(pa.float64()),
}
_TYPE_OVERRIDES = {
    StepStats: {"kv_moved": pa.int64(), "kv_gathered": pa.int64()},
    RowResult: {"row": pa.int64(), "logprobs": pa.list_(pa.struct([
        ("token_id", pa.int64()), ("logprob", pa.float64()),
        ("top", pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])))]))},
}


def _dataclass_schema(cls) -> pa.Schema:
    """One column per field; a field that is itself a record (``StepStats.trace``) gives one per field of its own."""
    fields = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            fields += list(_dataclass_schema(f.default_factory))
            continue
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        annotation = annotation.replace(" ", "").removesuffix("|None")
        arrow_type = _TYPE_OVERRIDES.get(cls, {}).get(f.name) or _ANNOTATION_TYPES.get(annotation)
        if arrow_type is None:
            raise RuntimeError(f"no Arrow type for {cls.__name__}.{f.name}: {f.type}")
        fields.append(pa.field(f.name, arrow_type))
    return pa.schema(fields)


def _stats_schema() -> pa.Schema:
    return _dataclass_schema(StepStats)


def part_schema(kind: str) -> pa.Schema:
    """The schema of a checkpoint part: "rows" (RowResult fields) or "stats" (StepStats fields)."""
    return _dataclass_schema({"rows": RowResult, "stats": StepStats}[kind])


def stats_table(stats: list[StepStats]) -> pa.Table:
    return pa.Table.from_pylist([s.record() for s in stats], schema=_stats_schema())


def results_table(results: list[RowResult]) -> pa.Table:
    """Finished rows as a table (the checkpoint part format: RowResult fields, one row each)."""
    return pa.Table.from_pylist([dataclasses.asdict(r) for r in results], schema=_dataclass_schema(RowResult))


def _from_table(cls, table: pa.Table, build=None) -> list:
    """``cls`` objects from a table of their columns (``build``: from one row's dict; default ``cls(**row)``)."""
    names = set(_dataclass_schema(cls).names)
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if not required <= set(table.column_names):
        raise ValueError(f"not a {cls.__name__} table: missing {sorted(required - set(table.column_names))}")
    keep = [c for c in table.column_names if c in names]
    build = build or (lambda row: cls(**row))
    return [build(row) for row in table.select(keep).to_pylist()]


def results_from_table(table: pa.Table) -> list[RowResult]:
    results = _from_table(RowResult, table)
    for r in results:
        if r.logprobs is not None:
            r.logprobs = [TokenLogprob.from_record(e) for e in r.logprobs]
    return results


def stats_from_table(table: pa.Table) -> list[StepStats]:
    return _from_table(StepStats, table, StepStats.from_record)


def read_table(path: Path) -> pa.Table:
    """A whole Parquet file (no validation: callers check the columns). ``ParquetFile.read``, not
    ``pq.read_table``: a finish reads thousands of small parts, and the dataset layer costs ~1 ms a file."""
    with open(path, "rb") as f:
        return pq.ParquetFile(f).read()


def write_stats(path: Path, stats: list[StepStats], metadata: dict) -> None:
    """One row per speculative step; a valid (empty) file when there are none."""
    _write_atomic(Path(path), stats_table(stats), metadata)


def write_table_atomic(path: Path, table: pa.Table, metadata: dict | None = None) -> None:
    """Write a Parquet file atomically (temp file, fsync, rename, fsync of the directory)."""
    _write_atomic(Path(path), table, metadata)


def write_parquet_stream_atomic(out: Path, tables: Iterable[pa.Table], metadata: dict | None,
                                empty_schema: pa.Schema | None = None) -> None:
    """Write a Parquet file atomically, one row group per table as ``tables`` yields them (the first one's
    schema; ``empty_schema`` when there is none): the file's rows are never all in memory."""

    def write(f) -> None:
        writer = None
        try:
            for table in tables:
                if writer is None:
                    schema = table.schema
                    writer = pq.ParquetWriter(f, _with_metadata(schema, metadata))
                writer.write_table(table.cast(schema))
            if writer is None:
                writer = pq.ParquetWriter(f, _with_metadata(empty_schema, metadata))
        finally:
            if writer is not None:
                writer.close()

    replace_atomic(Path(out), write)


def _with_metadata(schema: pa.Schema, metadata: dict | None) -> pa.Schema:
    if metadata is None:
        return schema
    return schema.with_metadata({METADATA_KEY: json.dumps(metadata, default=str, sort_keys=True).encode("utf-8")})


def _write_atomic(out: Path, table: pa.Table, metadata: dict | None) -> None:
    """Temp file in OUT's directory, fsync, rename onto OUT, fsync the directory."""
    if metadata is not None:
        encoded = json.dumps(metadata, default=str, sort_keys=True).encode("utf-8")
        table = table.replace_schema_metadata({METADATA_KEY: encoded})
    replace_atomic(out, lambda f: pq.write_table(table, f))


# ---------------------------------------------------------------------------- the tool's own files, read back


def read_run_metadata(path: Path) -> dict:
    """The `metadata` dict given to write_completions / write_stats."""
    path = Path(path)
    check_readable_file(path)
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InputError(f"{path}: not a valid Parquet file ({first_line(e)})") from None
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
    with reading_parquet(path), open(path, "rb") as f:
        return pq.read_table(f)
