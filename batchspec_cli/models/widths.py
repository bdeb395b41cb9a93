"""What a job measured of this machine, remembered: the batch width ``--batch-size auto`` measured, so that the same
command runs at the same width run after run and its rows are the same too (a bfloat16 row depends on its batch's
layout: README), and the rows from which ``--kernels auto`` packs a model's linears (``kernels.measure_min_rows``),
so that a given input size takes the same kernel run after run.

One JSON file in the tool's cache directory (``models.cache_dir()``), keyed by the machine, the model and the job's
shape, written whole through a temporary file and a rename, never through a symlink. A cache only: a file that
cannot be read or written costs a measurement, nothing else. Delete it to measure again.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path

FILE_NAME = "widths.json"
MAX_ENTRIES = 256  # the oldest are dropped beyond this


def cpuinfo(*fields: str) -> str | None:
    """The first of ``fields`` that ``/proc/cpuinfo`` gives (Linux), else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(fields)), None)
    except OSError:
        return None


def machine(device: str) -> dict:
    """What makes one machine's timings another's: the processor (or GPU) and its cores."""
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = cpuinfo("model name") or platform.processor() or platform.machine()
    return {"device": device, "processor": name, "cores": os.cpu_count()}


class MachineMemory:
    """Entries measured before, by (the machine and model facts given here, the facts given at each call)."""

    def __init__(self, path: Path, facts: dict):
        self.path, self.facts = path, facts

    def get(self, job: dict):
        """The entry remembered for ``job``, or None."""
        return self._read().get(self._key(job))

    def put(self, job: dict, entry) -> None:
        entries = self._read()
        key = self._key(job)
        entries.pop(key, None)
        entries[key] = entry
        entries = dict(list(entries.items())[-MAX_ENTRIES:])
        parent = self.path.parent
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
            return  # not a file this tool wrote
        tmp = None
        try:
            parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=parent, prefix=".widths-", suffix=".tmp", delete=False,
                                             encoding="utf-8") as f:
                tmp = f.name
                json.dump(entries, f)
            os.replace(tmp, self.path)
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _key(self, job: dict) -> str:
        return json.dumps({**self.facts, **job}, sort_keys=True)

    def _read(self) -> dict:
        if self.path.is_symlink() or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


class WidthMemory(MachineMemory):
    """Widths measured before, by (the machine and model facts given here, the job's facts given at each call)."""

    def recall(self, job: dict) -> tuple[int, dict[int, float]] | None:
        """(width, rates by width) measured before for this job's shape, or None."""
        entry = self.get(job)
        try:
            return int(entry["width"]), {int(w): float(r) for w, r in entry["rates"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def remember(self, job: dict, width: int, rates: dict[int, float]) -> None:
        self.put(job, {"width": width, "rates": {str(w): r for w, r in rates.items()}})
