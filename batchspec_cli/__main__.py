"""The `batchspec` command (and `python -m batchspec_cli`).

Importing the command line takes seconds (torch, transformers): a Ctrl-C, SIGTERM or SIGHUP
meanwhile ends with the signal's exit code (130, 143, 129), one line and, for `generate`, the
`interrupted` event in its `--log-json` file; not a traceback of the import. Once the command
has finished, its exit code stands: a stop signal during the interpreter's teardown is ignored."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main() -> None:
    from . import interrupts

    # While the command line imports, a stop signal is only recorded, and acted on once the imports are done: raised
    # inside an import it leaves a module half made (a later `numpy.matrix` is missing: a traceback, exit 1) or, in
    # torch's C++ import code, aborts the process.
    received: list[int] = []
    for signum in STOP_SIGNALS:
        if signum == signal.SIGINT or signal.getsignal(signum) is signal.SIG_DFL:  # under nohup SIGHUP stays ignored
            signal.signal(signum, lambda signum, frame: received.append(signum))
    with interrupts.kept() as swallowed:  # a stop raised in a finalizer meanwhile (none should be)
        from .cli import app
    received += swallowed
    if received:
        _log_interrupted(sys.argv[1:], received[0])
        sys.stderr.write("interrupted before anything was done\n")
        raise SystemExit(128 + received[0])
    for signum in STOP_SIGNALS:  # from here a stop acts at once, until a command installs its own handlers (a Ctrl-C
        if signal.getsignal(signum) is not signal.SIG_IGN:  # while the options are read: its exit code, not click's
            signal.signal(signum, interrupts.raise_stop)  # "Aborted!" and exit 1)
    try:
        app()
    except interrupts.StopNow as stop:
        _log_interrupted(sys.argv[1:], stop.signum)
        sys.stderr.write("interrupted\n")
        raise SystemExit(128 + stop.signum) from None
    finally:
        # The command has finished and its exit code stands: torch's and Python's teardown take about a second, and
        # a stop signal then would end the process by the signal (a finished job would look interrupted).
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


def _log_interrupted(args: list[str], signum: int) -> None:
    """A `generate` stopped before it could log: its `interrupted` event, appended to its --log-json file as the
    command would have, unless that file is one the command reads or writes (or cannot be opened)."""
    path, at = _option(args, "--log-json")
    if not args or args[0] != "generate" or not path:
        return
    from .errors import InputError
    from .eventlog import JsonLog, interrupted_before_start
    from .store.files import check_distinct

    named = [Path(a) for i, a in enumerate(args) if 0 < i != at and a and not a.startswith("-")]  # input, OUT...
    stats = [p.with_name(p.stem + ".stats.parquet") for p in named if p.name]  # OUT's default statistics file
    try:
        check_distinct(named + stats, [("--log-json", Path(path))])
        with JsonLog(Path(path)) as log:
            interrupted_before_start(log, signum)
    except (InputError, OSError):
        pass  # the command would have refused it: nothing is written


def _option(args: list[str], name: str) -> tuple[str | None, int | None]:
    """The value of ``name`` as click reads it (``--name VALUE`` or ``--name=VALUE``; the last one wins), and the
    index of its own token in ``args`` (None for the ``=`` form)."""
    value, at = None, None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == name and i + 1 < len(args):
            value, at = args[i + 1], i + 1
        elif arg.startswith(name + "="):
            value, at = arg[len(name) + 1:], None
    return value, at


if __name__ == "__main__":
    main()
