"""How many samples (``--n``) each input row asks for, and where they sit among the output rows.

The job's *output rows* are the input rows' samples, adjacent and in input order: input row ``i``
with ``n_i`` samples owns output rows ``first(i) .. first(i) + n_i - 1``, its sample ``j`` at
``first(i) + j``. Everything that counts finished rows (checkpoint parts, resume, the finish's merge,
the progress bar) counts output rows; the input's columns, ids and per-row settings stay indexed by
input row. With one n for every row (``--n``) ``first(i) = i * n`` is arithmetic; per-row counts
(``--n-column``, an OpenAI request's ``n``) keep their cumulative sums, 8 bytes an input row, only then.

Sample ``j`` of a row is keyed by (seed, id, j) (``sampling.row_key``): sample 0 is the row ``--n 1``
writes. A greedy row's samples are all equal: the job decodes it once and writes it ``n`` times
(``generation.Generation``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import MAX_N, GenerateConfig
from .input_table import InputTable

SAMPLE_COLUMN = "sample"  # the output column numbering an input row's samples 0 .. n-1


@dataclass(frozen=True)
class Samples:
    rows: int  # input rows
    n: int = 1  # every row's count, when ``counts`` is None
    counts: np.ndarray | None = None  # [rows] int64 per-row counts (--n-column, OpenAI n)
    written: bool = False  # the completions file has a ``sample`` column (the job asks for samples)
    _first: np.ndarray | None = field(default=None, repr=False, compare=False)  # [rows + 1] cumulative counts

    def __post_init__(self) -> None:
        if self.counts is not None:
            object.__setattr__(self, "_first", np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]))

    @property
    def total(self) -> int:
        """Output rows."""
        return int(self._first[-1]) if self._first is not None else self.rows * self.n

    @property
    def most(self) -> int:
        """The largest count of any row."""
        if self.counts is None:
            return self.n if self.rows else 0
        return int(self.counts.max()) if self.rows else 0

    def first(self, row: int) -> int:
        """The output row of input row ``row``'s sample 0."""
        return int(self._first[row]) if self._first is not None else row * self.n

    def count(self, row: int) -> int:
        return int(self.counts[row]) if self.counts is not None else self.n

    def input_rows(self, out: np.ndarray) -> np.ndarray:
        """[k] the input row of each output row."""
        out = np.asarray(out, dtype=np.int64)
        if self._first is None:
            return out // self.n
        return np.searchsorted(self._first, out, side="right") - 1

    def sample_of(self, out: np.ndarray) -> np.ndarray:
        """[k] each output row's sample number."""
        out = np.asarray(out, dtype=np.int64)
        if self._first is None:
            return out % self.n
        return out - self._first[self.input_rows(out)]

    def counts_of(self, rows: np.ndarray) -> np.ndarray:
        """[k] the counts of input rows ``rows``."""
        rows = np.asarray(rows, dtype=np.int64)
        return self.counts[rows] if self.counts is not None else np.full(len(rows), self.n, np.int64)

    def output_rows(self, rows: np.ndarray) -> np.ndarray:
        """Every sample's output row of input rows ``rows``, in their order (each row's samples adjacent)."""
        rows = np.asarray(rows, dtype=np.int64)
        counts = self.counts_of(rows)
        starts = self._first[rows] if self._first is not None else rows * self.n
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(starts, counts) + within


def job_samples(cfg: GenerateConfig, rows: int, per_row: list | None) -> Samples:
    """The job's samples: ``per_row`` [rows] a count or None (the flag's) from --n-column or the OpenAI requests."""
    written = cfg.n > 1 or cfg.n_column is not None or any(v is not None and v > 1 for v in per_row or ())
    if per_row is None or all(v is None for v in per_row):
        return Samples(rows, cfg.n, written=written)
    return Samples(rows, counts=np.array([cfg.n if v is None else v for v in per_row], np.int64), written=written)


def n_cells(inp: InputTable, cfg: GenerateConfig) -> list | None:
    """[rows] per-row counts from --n-column (None: the flag's); a cell that is no integer in 1 .. MAX_N makes
    its row an error row naming the column (``inp.errors``; the row then has one output row)."""
    column = cfg.n_column
    if column is None:
        return None
    from ..errors import InputError

    if column not in inp.table.column_names:
        raise InputError(f"{cfg.input}: --n-column names column {column!r}, which is not in the input")
    values = []
    for row, value in enumerate(inp.values(column)):
        if value is None or (isinstance(value, float) and value != value):
            values.append(None)
            continue
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and float(value).is_integer() \
            and 1 <= value <= MAX_N
        if not ok:
            inp.errors.setdefault(row, f"column {column!r} must be an integer in 1..{MAX_N}, got {value!r}")
        values.append(int(value) if ok else 1)
    return values
