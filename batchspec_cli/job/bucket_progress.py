"""Which length buckets of a job are complete: the one place a ``BucketDone`` is decided.

A bucket is complete once it is *sealed* (every row of it has been handed out to the
engine) and every row handed out has finished. Rows an interrupted run saved are never
handed out, so a bucket of saved rows only is sealed with nothing to report::

    progress.handed_out(row=0, bucket=3); progress.handed_out(row=1, bucket=3); progress.seal(3)
    progress.finished(0, error=False); progress.completed()  # [] (row 1 is running)
    progress.finished(1, error=True); progress.completed()   # [BucketDone(bucket=3, rows=2, errors=1)]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass
class BucketDone:
    """Every row of a length bucket has finished (saved rows of a resumed job excluded)."""

    bucket: int
    rows: int
    errors: int


class BucketProgress:
    def __init__(self) -> None:
        self._bucket_of: dict[int, int] = {}  # row -> its bucket, while the row runs
        self._rows: Counter[int] = Counter()  # bucket -> rows handed out
        self._left: Counter[int] = Counter()  # bucket -> rows handed out and not finished
        self._errors: Counter[int] = Counter()  # bucket -> rows finished as errors
        self._sealed: set[int] = set()
        self._reported: set[int] = set()  # buckets whose completion was returned (or had nothing to report)

    def handed_out(self, row: int, bucket: int) -> None:
        self._bucket_of[row] = bucket
        self._rows[bucket] += 1
        self._left[bucket] += 1

    def seal(self, bucket: int) -> None:
        """Every row of ``bucket`` has been handed out."""
        self._sealed.add(bucket)

    def finished(self, row: int, error: bool) -> None:
        """A row finished; rows never handed out (saved before this run) are ignored."""
        bucket = self._bucket_of.pop(row, None)
        if bucket is not None:
            self._left[bucket] -= 1
            self._errors[bucket] += error

    def completed(self) -> list[BucketDone]:
        """The buckets completed since the last call, by bucket index, each once."""
        done = []
        for bucket in sorted(self._sealed - self._reported):
            if self._left[bucket] == 0:
                self._reported.add(bucket)
                if self._rows[bucket]:
                    done.append(BucketDone(bucket=bucket, rows=self._rows[bucket], errors=self._errors[bucket]))
        return done
