"""The `batchspec` command (and `python -m batchspec_cli`).

Importing the command line takes seconds (torch, transformers): a Ctrl-C meanwhile ends
with the interrupt's exit code (130) and one line, not a traceback of the import."""

from __future__ import annotations

import signal
import sys


def main() -> None:
    from . import interrupts

    try:
        with interrupts.kept() as swallowed:  # a Ctrl-C that lands in a finalizer while transformers imports
            from .cli import app
    except KeyboardInterrupt:
        swallowed = [signal.SIGINT]
    if swallowed:
        sys.stderr.write("interrupted before anything was done\n")
        raise SystemExit(130)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # a Ctrl-C before a command installs its own handlers (while the options are read) is the interrupt's exit
        # code too, not click's "Aborted!" and exit 1
        signal.signal(signal.SIGINT, interrupts.raise_stop)
    try:
        app()
    except interrupts.StopNow as stop:
        sys.stderr.write("interrupted\n")
        raise SystemExit(128 + stop.signum) from None


if __name__ == "__main__":
    main()
