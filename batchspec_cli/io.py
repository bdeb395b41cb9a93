"""Reading prompts and writing completions / statistics (DESIGN.md §7).

Input is JSON lines (`.jsonl`, `.ndjson`) or Parquet (`.parquet`, `.pq`). Every failure a
user can cause with a bad file is an `InputError` whose one-line message names the file
and, where it applies, the line (JSONL, 1-based, blank lines counted) or row (Parquet,
1-based) and the column. Outputs are Parquet files written atomically (temp file in the
same directory, fsync, rename, fsync of the directory); the run configuration travels in
the schema metadata under the key `batchspec`.

The library never prints.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from batchspec_cli.events import RowResult, StepStats, TokenLogprob


class InputError(Exception):
    """A problem with the user's input or output paths; the message is one line."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line of a user message: whitespace collapsed, at most `limit` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


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

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
METADATA_KEY = b"batchspec"
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


# ---------------------------------------------------------------------------- reading


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
    _check_readable_file(path)

    if suffix in JSONL_SUFFIXES:
        table, raw_rows, where = _read_jsonl(path, limit)

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
        _check_unique(ids, path, id_column)
    else:
        ids = [str(i) for i in range(table.num_rows)]
    return InputTable(path=path, table=table, prompts=prompts, ids=ids)


def _check_readable_file(path: Path) -> None:
    """A regular file we may read; anything else (missing, a loop, a FIFO, a device) is an InputError.

    Only regular files are read: a FIFO or a device would be opened (and drained) more than once."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise InputError(f"{path}: {_stat_problem(path, e)}") from None
    if stat.S_ISDIR(info.st_mode):
        raise InputError(f"{path}: is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{path}: is {_file_kind(info.st_mode)}, not a regular file; copy it to a file first")
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise InputError(f"{path}: permission denied (cannot read the file)") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read the file ({e.strerror or e})") from None


def _stat_problem(path: Path, e: OSError) -> str:
    """What is wrong with a path that cannot be stat'ed, in words."""
    if e.errno == errno.ELOOP:
        return "a symbolic link loop (too many levels of symbolic links)"
    if e.errno == errno.ENOENT:
        return "a symbolic link to a missing file" if os.path.islink(path) else "no such file"
    if e.errno == errno.EACCES:
        return "permission denied (cannot look at the file)"
    return f"cannot read the file ({e.strerror or e})"


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def _read_jsonl(path: Path, limit: int | None) -> tuple[pa.Table, list[dict], list[str]]:
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
            return _parse_messages(value, at)
    if isinstance(value, list) and not value:
        raise InputError(f"{at} is an empty list")
    raise InputError(
        f"{at}: expected a string, a list of strings or a list of chat messages, "
        f"got {type(value).__name__}"
    )


def _parse_messages(value: list[dict], at: str) -> list[dict]:
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


def _check_unique(ids: list[str], path: Path, column: str) -> None:
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


# ---------------------------------------------------------------------------- prompts


def render_prompt(tokenizer, prompt: Prompt, chat: bool, system: str | None) -> list[int]:
    """Token ids of one prompt: through the chat template when asked and available."""
    if chat and getattr(tokenizer, "chat_template", None):
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [dict(m) for m in prompt]
        if system is not None and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return _as_int_list(out)
    text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
    if system is not None:
        text = f"{system}\n\n{text}"
    return _as_int_list(tokenizer(text, add_special_tokens=True)["input_ids"])


MIN_BYTES_PER_TOKEN = 16  # the byte bound below never assumes tokens shorter than this


def max_prompt_bytes(tokenizer, max_tokens: int) -> int:
    """The most bytes of prompt text that could still tokenize to at most ``max_tokens`` tokens.

    No token stands for more bytes than the longest entry of the vocabulary in UTF-8 (a
    byte-level or SentencePiece token string is never shorter than the bytes it decodes
    to), so a longer prompt can never fit and needs no tokenizing to be refused."""
    longest = max((len(token.encode("utf-8")) for token in tokenizer.get_vocab()), default=0)
    return max_tokens * max(MIN_BYTES_PER_TOKEN, longest)


def prompt_bytes(prompt: Prompt) -> int:
    """UTF-8 bytes of a prompt's own text (a chat template only adds to it)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    return sum(len(m["content"].encode("utf-8")) for m in prompt)


def _as_int_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):  # tensor / ndarray
        ids = ids.tolist()
    ids = list(ids)
    if len(ids) == 1 and isinstance(ids[0], (list, tuple)):  # a batch of one
        ids = list(ids[0])
    return [int(t) for t in ids]


# ---------------------------------------------------------------------------- writing


def check_output_path(out: Path, overwrite: bool) -> None:
    """Refuse an output path that cannot be (or should not be) written, before any work."""
    out = Path(out)
    if out.is_dir():
        raise InputError(f"{out}: is a directory; give a .parquet file path")
    if out.suffix.lower() not in (".parquet", ".jsonl"):
        raise InputError(f"{out}: output must be a .parquet file (or .jsonl for the OpenAI Batch output format)")
    if out.exists() and not overwrite:
        raise InputError(f"{out} already exists; pass --overwrite to replace it")
    check_writable(out)


def check_writable(path: Path) -> None:
    """`path` can be written by a rename in its directory: the directory exists and takes a new file."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a file")
    parent = path.parent
    if not parent.exists():
        raise InputError(f"{path}: directory {parent} does not exist")
    if not parent.is_dir():
        raise InputError(f"{path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{path}: directory {parent} is not writable")
    try:
        probe, fd = create_temp(path, "probe.tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"{path}: cannot write in {parent} ({e.strerror or e})") from None


def check_distinct(inputs: list[Path], outputs: list[tuple[str, Path]]) -> None:
    """Refuse an output that is an input file, lies in an input directory, or is another output.

    Paths are compared resolved (symbolic links followed) and, where they exist, by inode
    (hard links). `outputs` are (how the message names it, path) pairs."""
    seen: list[tuple[str, Path, Path, tuple | None]] = []
    # A glob input (a Hugging Face dataset given as data files) is every file it matches.
    expanded = [Path(p) for path in inputs
                for p in (sorted(glob.glob(str(path))) or [path] if glob.has_magic(str(path)) else [path])]
    for path in expanded:
        real, inode = _identity(path)
        seen.append(("the input", Path(path), real, inode))
    for label, path in outputs:
        real, inode = _identity(path)
        for other_label, other, other_real, other_inode in seen:
            same = real == other_real or (inode is not None and inode == other_inode)
            if same or (other_label == "the input" and Path(os.path.realpath(other)).is_dir()
                        and other_real in real.parents):
                what = f"{other_label} {other}" if same else f"inside the input directory {other}"
                raise InputError(f"{label} {path} is {what}; give it another path (--overwrite does not change "
                                 f"this)")
        seen.append((label, Path(path), real, inode))


def _identity(path: Path) -> tuple[Path, tuple | None]:
    try:
        info = os.stat(path)
        inode = (info.st_dev, info.st_ino)
    except OSError:
        inode = None
    return Path(os.path.realpath(path)), inode


def temp_path(target: Path, kind: str = "tmp") -> Path:
    """A temporary name beside `target` that names this process: ``.NAME.<pid>.<hex>.tmp``."""
    target = Path(target)
    return target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.{kind}"


def create_temp(target: Path, kind: str = "tmp", mode: int = 0o666) -> tuple[Path, int]:
    """Create a new temporary file beside `target` (see `temp_path`); returns its path and an fd open for writing.

    ``O_EXCL | O_NOFOLLOW``: an existing entry of that name (a link planted there) is never
    opened, written or removed; another name is tried."""
    for _ in range(100):
        path = temp_path(target, kind)
        try:
            return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(target))


def remove_stale_temps(target: Path) -> list[Path]:
    """Remove the temporary files of `target` (see `temp_path`) left by dead processes of this user.

    Only regular files named as this tool names them, owned by the running user, whose pid
    is gone, are removed; returns them."""
    target = Path(target)
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.[0-9a-f]{{8}}\.(?:probe\.)?tmp")
    removed = []
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def stats_path_for(out: Path) -> Path:
    """Default statistics path: out.parquet -> out.stats.parquet, same directory."""
    out = Path(out)
    return out.with_name(out.stem + ".stats.parquet")


def write_completions(
    out: Path, inp: InputTable, results: list[RowResult], texts: list[str], metadata: dict,
    token_text: Callable[[int], str] | None = None,
) -> None:
    """Write one row per input row, in input order; `texts[i]` is the text of `results[i]`.

    Input columns pass through in place; an input `id` column (necessarily the id column,
    read_input refuses other clashes) is replaced in place by the string ids, otherwise
    `id` is appended after the input columns. The output columns follow, then
    `completion_logprobs` when `token_text` (a token id's text) is given.
    """
    n = inp.table.num_rows
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
    clashes = [c for c in inp.table.column_names if c in OUTPUT_COLUMNS + EXTRA_OUTPUT_COLUMNS and c != "id"]
    if clashes:
        raise RuntimeError(f"input columns clash with output columns: {clashes}")

    pairs: list[tuple[RowResult, str]] = by_row  # type: ignore[assignment]
    table = completions_table(inp.table, inp.ids, [r for r, _ in pairs], [t for _, t in pairs], token_text)
    _write_atomic(Path(out), table, metadata)


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
    fields = []
    for f in dataclasses.fields(cls):
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
    return pa.Table.from_pylist([dataclasses.asdict(s) for s in stats], schema=_stats_schema())


def results_table(results: list[RowResult]) -> pa.Table:
    """Finished rows as a table (the checkpoint part format: RowResult fields, one row each)."""
    return pa.Table.from_pylist([dataclasses.asdict(r) for r in results], schema=_dataclass_schema(RowResult))


def _from_table(cls, table: pa.Table) -> list:
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if not required <= set(table.column_names):
        raise ValueError(f"not a {cls.__name__} table: missing {sorted(required - set(table.column_names))}")
    keep = [c for c in table.column_names if c in names]
    return [cls(**row) for row in table.select(keep).to_pylist()]


def results_from_table(table: pa.Table) -> list[RowResult]:
    results = _from_table(RowResult, table)
    for r in results:
        if r.logprobs is not None:
            r.logprobs = [TokenLogprob.from_record(e) for e in r.logprobs]
    return results


def stats_from_table(table: pa.Table) -> list[StepStats]:
    return _from_table(StepStats, table)


def read_table(path: Path) -> pa.Table:
    """A whole Parquet file (no validation: callers check the columns)."""
    with open(path, "rb") as f:
        return pq.read_table(f)


def write_stats(path: Path, stats: list[StepStats], metadata: dict) -> None:
    """One row per speculative step; a valid (empty) file when there are none."""
    _write_atomic(Path(path), stats_table(stats), metadata)


def write_table_atomic(path: Path, table: pa.Table, metadata: dict | None = None) -> None:
    """Write a Parquet file atomically (temp file, fsync, rename, fsync of the directory)."""
    _write_atomic(Path(path), table, metadata)


def _write_atomic(out: Path, table: pa.Table, metadata: dict | None) -> None:
    """Temp file in OUT's directory, fsync, rename onto OUT, fsync the directory."""
    if metadata is not None:
        encoded = json.dumps(metadata, default=str, sort_keys=True).encode("utf-8")
        table = table.replace_schema_metadata({METADATA_KEY: encoded})
    _replace_atomic(out, lambda f: pq.write_table(table, f))


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

    _replace_atomic(Path(out), write)


def _with_metadata(schema: pa.Schema, metadata: dict | None) -> pa.Schema:
    if metadata is None:
        return schema
    return schema.with_metadata({METADATA_KEY: json.dumps(metadata, default=str, sort_keys=True).encode("utf-8")})


def write_text_atomic(out: Path, text: str) -> None:
    """Write a UTF-8 text file atomically, as the Parquet files are."""
    write_text_stream_atomic(out, [text])


def write_text_stream_atomic(out: Path, texts: Iterable[str]) -> None:
    """Write a UTF-8 text file atomically from pieces, as ``texts`` yields them."""

    def write(f) -> None:
        for text in texts:
            f.write(text.encode("utf-8"))

    _replace_atomic(Path(out), write)


def _replace_atomic(out: Path, write) -> None:
    """``write(binary file)`` into a temp file in OUT's directory, fsync, rename onto OUT, fsync the directory."""
    directory = out.parent
    tmp, fd = create_temp(out)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    """fsync a directory so a rename in it is durable (best effort where refused)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- reading back


def read_run_metadata(path: Path) -> dict:
    """The `metadata` dict given to write_completions / write_stats."""
    path = Path(path)
    _check_readable_file(path)
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
    _check_readable_file(path)
    return _read_parquet(path, None)
