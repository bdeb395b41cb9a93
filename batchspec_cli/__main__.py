"""The `batchspec` command (and `python -m batchspec_cli`).

Importing the command line takes seconds (torch, transformers): a Ctrl-C meanwhile ends
with the interrupt's exit code (130) and one line, not a traceback of the import."""

from __future__ import annotations

import sys


def main() -> None:
    from . import interrupts

    try:
        with interrupts.kept() as swallowed:  # a Ctrl-C that lands in a finalizer while transformers imports
            from .cli import app
    except KeyboardInterrupt:
        pass
    else:
        if not swallowed:
            app()
            return
    sys.stderr.write("interrupted before anything was done\n")
    raise SystemExit(130)


if __name__ == "__main__":
    main()
