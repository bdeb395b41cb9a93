"""The `--log-json` file: one JSON object per line for schedulers, flushed as it is written, appended across reruns.

Imports nothing heavy, so `__main__` can write the `interrupted` event of a run stopped while the command line
still loads (torch and transformers take seconds to import), as `cli.generate` writes it once it runs.
"""

from __future__ import annotations

import datetime
import json
import signal
from pathlib import Path


class JsonLog:
    """One JSON object per line, flushed at once, for schedulers (`--log-json`); appends across reruns."""

    def __init__(self, path: Path | None):
        self.file = open(path, "a", encoding="utf-8") if path is not None else None

    def write(self, event: str, **fields) -> None:
        if self.file is None:
            return
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        self.file.write(json.dumps({"event": event, "time": now, **fields}, default=str) + "\n")
        self.file.flush()

    def __enter__(self) -> "JsonLog":
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()


def signal_name(signum: int | None) -> str | None:
    return None if signum is None else signal.Signals(signum).name


def interrupted_before_start(log: JsonLog, signum: int) -> None:
    """The `interrupted` event of a run stopped before any row was generated (no job, so no row counts)."""
    log.write("interrupted", signal=signal_name(signum), rows_saved=0, total_rows=None, exit_code=128 + signum)
