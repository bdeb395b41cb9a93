"""Checkpoints of one `generate` job: resume after a crash, one writer per output.

A job keeps its state in a *work directory* beside ``OUT`` (``.OUT.batchspec-work/``)::

    lock                               the live writer: {"pid", "host", "boot_id", "start"}
    job.json                           the job's fingerprint (settings + input hash); written once,
                                       after buckets/ is complete: its presence means "resumable"
    buckets/                           the length buckets of a file input, reused on resume
    parts/part-000001.rows.parquet     rows finished since the previous part (RowResult fields)
    parts/part-000001.stats.parquet    step statistics produced since the previous part
    merge/                             the finish's rows regrouped by input range (``merge``), made again
                                       by a rerun
    input/rows.parquet                 the input's columns in input order: what OUT passes through, read a
                                       range at a time (made again at every open)
    reading/rows.parquet               a file input's rows as they are read, before the job is planned;
                                       then moved to input/

Every file is written under a temporary name, fsynced, renamed into place and its directory
fsynced, so a part exists whole or not at all, whatever stops the process (SIGKILL, power
loss, an OOM kill). A resumed job reads the parts' row numbers back (nothing else), skips
those rows and writes new parts after them; ``OUT`` is assembled from all parts at the end,
streamed a bounded number of rows at a time (``merge``), then the work directory is removed. Parts are independent: a part that cannot be read is dropped and its rows are
simply generated again.

Nothing here follows a symbolic link or deletes what it did not make: the work directory
must be a real directory owned by the running user, its files are opened ``O_NOFOLLOW``
and created ``O_EXCL``, and a link, a foreign owner or an entry of the wrong kind is a
``CheckpointError`` naming the path (exit 2). Only the names listed above (and this
tool's temporary names) are ever removed.

The lock is created with ``O_EXCL``. A lock whose process is gone (``os.kill(pid, 0)``
fails, the machine rebooted since, or the pid now names a younger process) is stale and
is taken over; a live one is refused with ``LockHeld``. Nothing here prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..engine.events import RowResult, StepStats
from ..errors import one_line
from .files import create_temp, fsync_directory, naming, pid_alive
from .outputs import part_schema, results_table, stats_table, write_parquet_stream_atomic, write_table_atomic

JOB_FORMAT = "batchspec-job"
JOB_VERSION = 1
LOCK_NAME, JOB_NAME, PARTS_NAME, BUCKETS_NAME, MERGE_NAME = "lock", "job.json", "parts", "buckets", "merge"
INPUT_NAME, READING_NAME = "input", "reading"
_UNREADABLE_LOCK_GRACE_S = 10.0  # an empty/garbled lock younger than this may be mid-write


class CheckpointError(Exception):
    """The work directory cannot be used as it is; the message is one line."""


class LockHeld(CheckpointError):
    """Another live process writes this output."""

    def __init__(self, message: str, pid: int | None):
        super().__init__(message)
        self.pid = pid


@dataclass
class Saved:
    """What resuming needs of an interrupted job's parts: which rows are done and how long their completions are,
    not the completions."""

    rows: np.ndarray  # [saved rows] int64 row numbers, in part order
    ids: pa.ChunkedArray  # [saved rows] their ids (string), aligned with rows
    lengths: np.ndarray  # [saved rows] int64 completion tokens, aligned with rows; -1: an error row
    last_step: int  # the highest step number saved (0: none)
    dropped: list[str]  # names of parts that could not be read (their rows will be redone)


class WorkDir:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock_path = self.path / LOCK_NAME
        self.job_path = self.path / JOB_NAME
        self.parts = self.path / PARTS_NAME
        self.buckets = self.path / BUCKETS_NAME
        self.merge = self.path / MERGE_NAME
        self.input = self.path / INPUT_NAME
        self.reading = self.path / READING_NAME
        self.locked = False
        self._next_part = 1

    # ------------------------------------------------------------------ lock
    def lock(self) -> None:
        """Become the one writer of this work directory, or raise LockHeld / CheckpointError."""
        created = False
        for _ in range(5):
            try:
                if not os.path.lexists(self.path):
                    self.path.mkdir()
                    created = True
                    fsync_directory(self.path.parent)  # the work directory itself survives a power loss
                check_own_directory(self.path)
                fd = os.open(self.lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                if os.path.lexists(self.lock_path):
                    self._take_over_if_stale()
                continue  # (or another run made the directory first)
            except FileNotFoundError:  # the directory vanished under us (a finishing writer): retry
                continue
            except OSError as exc:
                raise CheckpointError(f"cannot create the lock {self.lock_path} ({exc.strerror or exc})") from None
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(json.dumps(_own_lock_info()) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                fsync_directory(self.path)
            except OSError as exc:  # a full disk: the lock is ours, and useless
                self.lock_path.unlink(missing_ok=True)
                if created:
                    with contextlib.suppress(OSError):
                        self.path.rmdir()
                raise CheckpointError(f"cannot write the lock {self.lock_path} ({exc.strerror or exc})") from None
            self.locked = True
            return
        raise LockHeld(f"could not take the lock {self.lock_path}: other processes keep taking it", None)

    def _take_over_if_stale(self) -> None:
        try:
            check_own_file(self.lock_path, "the lock")
            raw = _read_no_follow(self.lock_path)
            age = time.time() - self.lock_path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: retry
        except OSError as exc:
            raise CheckpointError(f"cannot read the lock {self.lock_path} ({exc.strerror or exc})") from None
        info = _parse_lock(raw)
        if info is None:
            if age < _UNREADABLE_LOCK_GRACE_S:
                raise LockHeld(f"the lock {self.lock_path} is being written by another process", None)
        elif _alive(info):
            raise LockHeld(f"another batchspec run (pid {info['pid']}) holds {self.lock_path}", info["pid"])
        # Stale: move it aside (only one racer's rename succeeds), then check it is the lock we judged.
        aside = self.path / f".{LOCK_NAME}.stale-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(self.lock_path, aside)
        except FileNotFoundError:
            return
        if _read_no_follow(aside) != raw:  # a new owner replaced it between our read and rename: give it back
            try:
                os.link(aside, self.lock_path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            info = _parse_lock(raw) or {}
            raise LockHeld(f"another batchspec run holds {self.lock_path}", info.get("pid"))
        aside.unlink(missing_ok=True)

    def unlock(self) -> None:
        if self.locked:
            self.lock_path.unlink(missing_ok=True)
            self.locked = False

    # ------------------------------------------------------------------ job
    def read_job(self) -> dict | None:
        """The job.json of an earlier run, None when there is none; CheckpointError if unreadable."""
        try:
            if os.path.lexists(self.job_path):
                check_own_file(self.job_path, "the job file")
            body = json.loads(_read_no_follow(self.job_path).decode("utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.job_path} is unreadable ({one_line(exc)})") from None
        if not isinstance(body, dict) or body.get("format") != JOB_FORMAT or body.get("version") != JOB_VERSION \
                or not isinstance(body.get("fingerprint"), dict):
            raise CheckpointError(f"{self.job_path} is not a batchspec {JOB_VERSION} job file")
        return body

    def start_job(self, fingerprint: dict, total_rows: int) -> None:
        """Record the job (after buckets/ and any first part are in place): from now on it is resumable."""
        self._write_job({"format": JOB_FORMAT, "version": JOB_VERSION, "fingerprint": fingerprint,
                         "total_rows": total_rows, "created": time.time(), "finishing": False})

    def mark_finishing(self) -> None:
        """Every row is saved and the final files are being written (a rerun may replace them)."""
        job = self.read_job()
        if job is not None:
            self._write_job({**job, "finishing": True})

    def _write_job(self, body: dict) -> None:
        check_own_directory(self.path)
        tmp, fd = create_temp(self.job_path, mode=0o644)
        try:
            with naming(self.job_path), os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(body, indent=1, sort_keys=True, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.job_path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_directory(self.path)

    def clear(self) -> None:
        """Remove this tool's entries but the lock: the start of a new job."""
        self._remove_own_entries()
        self._next_part = 1

    def remove(self) -> None:
        """Delete the whole work directory (the job is complete); the lock goes last.

        Only entries this tool makes are deleted; a directory still holding anything else is left."""
        if not os.path.lexists(self.path):
            return
        check_own_directory(self.path)
        self._remove_own_entries()
        if self.locked:
            self.lock_path.unlink(missing_ok=True)
            self.locked = False
        try:
            self.path.rmdir()
        except OSError:
            pass  # another run took it meanwhile, or something else lives there: not ours to delete
        fsync_directory(self.path.parent)

    def _remove_own_entries(self) -> None:
        """Delete job.json, parts/, buckets/, merge/, input/, reading/ and the temporary files this tool leaves in the
        work directory."""
        check_own_directory(self.path)
        own = sorted((e for e in os.scandir(self.path) if _is_own_entry(e.name)), key=lambda e: e.name != JOB_NAME)
        for entry in own:  # refuse before deleting anything
            if entry.is_dir(follow_symlinks=False):
                _refuse_links_in(Path(entry.path))
            else:
                check_own_file(Path(entry.path), "an entry of the work directory")
        for entry in own:  # job.json first: from then on the job is no longer resumable
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)  # never follows symbolic links
            else:
                os.unlink(entry.path)

    # ------------------------------------------------------------------ parts
    def load(self) -> Saved:
        """The row numbers, ids and completion lengths of every readable rows part and the last saved step (the
        parts' other columns are not read); sets the number of the next part."""
        rows: list[np.ndarray] = []
        ids: list[pa.ChunkedArray] = []
        lengths: list[np.ndarray] = []
        last_step = 0
        dropped: list[str] = []
        numbers = []
        check_own_directory(self.path)
        if os.path.lexists(self.buckets):
            check_own_directory(self.buckets)
            _refuse_links_in(self.buckets)
        if os.path.lexists(self.parts):
            check_own_directory(self.parts)
            for path in sorted(self.parts.iterdir()):
                number, kind = _part_name(path.name)
                if number is None and not path.name.startswith("."):
                    continue
                check_own_file(path, "a checkpoint part")
                if number is None:  # a temporary file of an interrupted write
                    path.unlink(missing_ok=True)
                    continue
                numbers.append(number)
                try:
                    if kind == "rows":
                        table = _read_columns(path, part_schema("rows"), ["row", "id", "token_ids", "finish_reason"])
                        ok = pc.not_equal(table.column("finish_reason"), "error").to_numpy(zero_copy_only=False)
                        tokens = pc.list_value_length(table.column("token_ids")).to_numpy(zero_copy_only=False)
                        lengths.append(np.where(ok, tokens, -1).astype(np.int64))
                        rows.append(table.column("row").to_numpy())
                        ids.extend(table.column("id").chunks)
                    else:
                        steps = _read_columns(path, part_schema("stats"), ["step"]).column("step")
                        last_step = max(last_step, pc.max(steps).as_py() or 0)
                except Exception:  # noqa: BLE001 - a damaged part of any kind is dropped and redone
                    dropped.append(path.name)
                    path.unlink(missing_ok=True)
        self._next_part = max(numbers, default=0) + 1
        return Saved(rows=np.concatenate(rows) if rows else np.zeros(0, np.int64),
                     ids=pa.chunked_array(ids, type=pa.string()),
                     lengths=np.concatenate(lengths) if lengths else np.zeros(0, np.int64), last_step=last_step,
                     dropped=dropped)

    def fresh_merge(self) -> Path:
        """An empty merge/ for the finish (what a finish killed midway left there is removed first)."""
        return self._fresh(self.merge)

    def _fresh(self, directory: Path) -> Path:
        """``directory`` (one of the work directory's own) made again, empty."""
        check_own_directory(self.path)
        if os.path.lexists(directory):
            check_own_directory(directory)
            _refuse_links_in(directory)
            shutil.rmtree(directory)
        directory.mkdir()
        return directory

    def keep_input(self, table: pa.Table, group_rows: int) -> Path:
        """Write the input's columns (in input order, ``group_rows`` rows a row group) to input/rows.parquet,
        so the job need not hold them; returns its path. Made again at every open."""
        path = self._fresh(self.input) / "rows.parquet"
        pieces = (table.slice(first, group_rows) for first in range(0, table.num_rows, group_rows))
        write_parquet_stream_atomic(path, pieces, None, table.schema)
        return path

    def reading_store(self) -> Path:
        """Where a file input's rows go as they are read (reading/rows.parquet, in a reading/ made empty)."""
        return self._fresh(self.reading) / "rows.parquet"

    def keep_read_input(self, stored: Path) -> Path:
        """The input's rows written by reading (``reading_store``) moved to input/rows.parquet; returns its path."""
        check_own_file(stored, "the input's rows")
        path = self._fresh(self.input) / "rows.parquet"
        os.replace(stored, path)
        fsync_directory(self.input)
        return path

    def drop_reading(self) -> None:
        """Remove reading/ (what a read that is not kept left)."""
        if os.path.lexists(self.reading):
            check_own_directory(self.reading)
            _refuse_links_in(self.reading)
            shutil.rmtree(self.reading)

    def part_paths(self, kind: str) -> list[Path]:
        """The parts of one kind ("rows" or "stats"), in part order."""
        if not os.path.lexists(self.parts):
            return []
        check_own_directory(self.parts)
        found = []
        for path in self.parts.iterdir():
            number, found_kind = _part_name(path.name)
            if number is not None and found_kind == kind:
                check_own_file(path, "a checkpoint part")
                found.append((number, path))
        return [path for _, path in sorted(found)]

    def save_part(self, results: list[RowResult], stats: list[StepStats]) -> None:
        """Durably record finished rows and statistics as the next part."""
        if not results and not stats:
            return
        if not os.path.lexists(self.parts):
            self.parts.mkdir(exist_ok=True)
            fsync_directory(self.path)
        check_own_directory(self.parts)
        number, self._next_part = self._next_part, self._next_part + 1
        # Statistics first: a rows part on disk always has its statistics beside it.
        if stats:
            write_table_atomic(self.parts / f"part-{number:06d}.stats.parquet", stats_table(stats))
        if results:
            write_table_atomic(self.parts / f"part-{number:06d}.rows.parquet", results_table(results))


_OWN_ENTRY = re.compile(rf"({re.escape(JOB_NAME)}|{PARTS_NAME}|{BUCKETS_NAME}|{MERGE_NAME}|{INPUT_NAME}|{READING_NAME}|\.{re.escape(JOB_NAME)}\..+\.tmp"
                        rf"|\.{LOCK_NAME}\.stale-.+|\.{BUCKETS_NAME}\.(tmp|old)-.+)")


def _is_own_entry(name: str) -> bool:
    """Is this a name this tool gives an entry of the work directory (the lock aside)?"""
    return _OWN_ENTRY.fullmatch(name) is not None


def check_own_directory(path: Path) -> None:
    """`path` is a real directory (not a symbolic link) owned by the running user, or CheckpointError."""
    info = _lstat(path, "the work directory")
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(f"{path} is a symbolic link; this tool never follows one for its work directory: "
                              f"remove the link")
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointError(f"{path} exists and is not a directory; move it away (it is where this tool keeps "
                              f"the work of a run)")
    if info.st_uid != os.geteuid():
        raise CheckpointError(f"{path} belongs to another user (uid {info.st_uid}); refusing to use it")


def check_own_file(path: Path, what: str) -> None:
    """`path` is a regular file (not a symbolic link, not a directory), or CheckpointError naming it."""
    info = _lstat(path, what)
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(f"{path} ({what}) is a symbolic link; this tool never makes one and never follows "
                              f"one: remove the link")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} ({what}) is not a regular file; move it away")


def _refuse_links_in(directory: Path) -> None:
    """CheckpointError if an entry of `directory` is a symbolic link (this tool never makes one)."""
    for entry in os.scandir(directory):
        if entry.is_symlink():
            check_own_file(Path(entry.path), f"an entry of {directory.name}/")


def _lstat(path: Path, what: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot look at {what} {path} ({exc.strerror or exc})") from None


def _read_no_follow(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _read_columns(path: Path, schema: pa.Schema, columns: list[str]) -> pa.Table:
    """Some columns of a part (its footer checked against the part format: a damaged part raises)."""
    with open(path, "rb") as f:
        found = pq.ParquetFile(f)
        for name in columns:
            if found.schema_arrow.field(name).type != schema.field(name).type:
                raise ValueError(f"{path.name}: column {name} is not {schema.field(name).type}")
        return found.read(columns=columns)


def _part_name(name: str) -> tuple[int | None, str]:
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "parquet" or parts[1] not in ("rows", "stats") \
            or not parts[0].startswith("part-") or not parts[0][5:].isdigit():
        return None, ""
    return int(parts[0][5:]), parts[1]


# ---------------------------------------------------------------------------- fingerprints


def describe_changes(old: dict, new: dict, labels: dict[str, str]) -> list[str]:
    """One short phrase per setting that differs between two fingerprints."""
    changes = []
    for key in sorted(set(old) | set(new), key=lambda k: list(labels).index(k) if k in labels else len(labels)):
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        label = labels.get(key, key)
        if key == "input":
            changes.append(f"{label} changed")
        elif isinstance(before, dict) and isinstance(after, dict) and before.get("name") == after.get("name"):
            changes.append(f"{label} {after.get('name')!r}: the model files changed")
        else:
            show = lambda v: _short(v.get("name") if isinstance(v, dict) else v)  # noqa: E731
            changes.append(f"{label}: was {show(before)}, now {show(after)}")
    return changes


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def hash_files(paths: list[Path]) -> str:
    """sha256 over the bytes of the files, in order (each prefixed by its size)."""
    import hashlib

    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f"{os.fstat(f.fileno()).st_size}:".encode())
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def model_signature(name: str, source: str) -> dict:
    """What identifies a model for resuming: the name given, the resolved directory, its files' sizes.

    (A hub model resolves to a snapshot directory named by its commit; a GGUF file to a
    conversion keyed by its path, size and mtime.) Weights are not hashed: too slow for big models.
    """
    files = {}
    folder = Path(source)
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.is_file() and (path.suffix in (".safetensors", ".bin", ".json", ".gguf", ".model")):
                files[path.name] = path.stat().st_size
    return {"name": name, "source": source, "files": files}


# ---------------------------------------------------------------------------- lock helpers


def _own_lock_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": _boot_id(),
            "start": _process_start(os.getpid()), "created": time.time()}


def _parse_lock(raw: bytes) -> dict | None:
    """{"pid": int, ...} from a lock file (JSON, or a bare pid); None if unreadable."""
    try:
        text = raw.decode("utf-8").strip()
        value = json.loads(text) if text.startswith("{") else {"pid": int(text)}
    except (UnicodeDecodeError, ValueError):
        return None
    pid = value.get("pid") if isinstance(value, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    return value


def _alive(info: dict) -> bool:
    """Is the lock's owner still running? Unknown (another machine) counts as alive."""
    if info.get("host") and info["host"] != socket.gethostname():
        return True  # a shared filesystem: we cannot look at that machine's processes
    boot = _boot_id()
    if info.get("boot_id") and boot and info["boot_id"] != boot:
        return False  # the machine restarted since the lock was taken
    if not pid_alive(info["pid"]):
        return False
    start = info.get("start")
    if start is not None and _process_start(info["pid"]) not in (None, start):
        return False  # the pid was reused by a younger process
    return True


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (Linux), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
