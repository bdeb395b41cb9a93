"""The filesystem rules every file of the tool obeys.

What may be read (a regular file, nothing else), what may be written (an OUT that is not an
input, in a writable directory), and how a file is replaced: a temporary name beside the
target that names this process (created ``O_EXCL | O_NOFOLLOW``), fsync, rename, fsync of the
directory. A temporary file is removed only when it is ours by name and owner and its process
is gone (`pid_alive`, the one process-liveness check; checkpoint.py uses it for its lock).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Iterable

import pyarrow as pa

from ..errors import InputError, one_line


def check_readable_file(path: Path) -> None:
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
    """`path` can be written by a rename in its directory: the directory exists and takes a new file, and
    whatever `path` names now is a regular file or a link (a device or a FIFO is never replaced)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a file")
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None  # absent (or unreachable: the checks below say why)
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):  # a link is replaced, never followed
        raise InputError(f"{path}: is {_file_kind(mode)}, not a regular file; it is never replaced (--overwrite "
                         f"neither): give another path")
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
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def pid_alive(pid: int) -> bool:
    """Does a process with this id run on this machine? (One owned by another user counts.)"""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or an id no process can have
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


@contextlib.contextmanager
def naming(path: Path):
    """An OSError raised inside that names no file (a full disk under a writer that got no path) names ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or one_line(exc), str(path)) from exc


def replace_atomic(out: Path, write) -> None:
    """``write(binary file)`` into a temp file in OUT's directory, fsync, rename onto OUT, fsync the directory."""
    directory = out.parent
    tmp, fd = create_temp(out)
    try:
        with naming(out), os.fdopen(fd, "wb") as f:
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



def write_text_atomic(out: Path, text: str) -> None:
    """Write a UTF-8 text file atomically, as the Parquet files are."""
    write_text_stream_atomic(out, [text])


def write_text_stream_atomic(out: Path, texts: Iterable[str]) -> None:
    """Write a UTF-8 text file atomically from pieces, as ``texts`` yields them."""

    def write(f) -> None:
        for text in texts:
            f.write(text.encode("utf-8"))

    replace_atomic(Path(out), write)


@contextlib.contextmanager
def reading_parquet(path: Path):
    """Whatever reading the Parquet file ``path`` raises, as an InputError naming it."""
    try:
        yield
    except PermissionError:
        raise InputError(f"{path}: permission denied (cannot read the file)") from None
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InputError(f"{path}: not a valid Parquet file ({first_line(e)})") from None


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
