"""The `batchspec` command (and `python -m batchspec_cli`).

Importing the command line takes seconds (torch, transformers): a Ctrl-C meanwhile ends
with the interrupt's exit code (130) and one line, not a traceback of the import."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from .cli import app
    except KeyboardInterrupt:
        sys.stderr.write("interrupted before anything was done\n")
        raise SystemExit(130) from None
    app()


if __name__ == "__main__":
    main()
