"""Which requests enter the engine's pool, and when they are read: the run's request stream.

An ``Admission`` reads the run's requests one at a time, as free slots ask for them (a job
of a million rows is never held whole). It cuts them into *chunks* of at most a batch of
one length bucket (one prefill pads to one bucket's length), holds back the first request
of the next bucket for the next chunk, refuses a request that cannot run (an error row,
from the engine's ``check``), and knows how much work is left (``tokens_left``: the
policy's horizon). Where the admitted rows go, and their prefill, is the engine's
(``Engine._admit``).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Callable, Iterable, Iterator

from .events import Request, RowResult


def error_row(req: Request, error: str) -> RowResult:
    """The result of a row that could not run (``error``): no tokens."""
    return RowResult(req.row, req.id, [], "error", error=error, prompt_tokens=len(req.prompt_ids))


class Admission:
    def __init__(self, requests: Iterable[Request], batch_size: int):
        self.total = len(requests) if isinstance(requests, Sized) else None  # rows to come, when known
        self.longest: int | None = getattr(requests, "longest", None)  # the longest padded prompt to come, when known
        self.typical: int | None = getattr(requests, "typical", None)  # the median row's padded prompt, when known
        self.stream = iter(requests)
        self.batch_size = batch_size
        self.exhausted = False  # the stream has ended (a held-back request may still wait)
        self.pulled = 0  # requests read from the stream
        self.limits_seen = self.rows_seen = 0  # the admitted rows' token limits, summed, and their count
        self.held_back: Request | None = None  # read from the stream, held back for the next chunk (another bucket)

    def chunks(self, free: list[int], is_free: Callable[[int], bool],
               check: Callable[[Request], str | None]) -> Iterator[tuple[list[Request], list[int]] | RowResult]:
        """(chunk, the slots free for it) for the free slots ``free``, the caller placing each chunk before it asks
        for the next; a request that ``check`` refuses comes as its error row. Then one request is read ahead,
        so that whether rows are left to come is known (the policy's horizon)."""
        while free and not self.exhausted:
            chunk = []
            while len(chunk) < min(len(free), self.batch_size):
                req, self.held_back = self.held_back or self._pull(), None
                if req is None:
                    self.exhausted = True
                    break
                error = check(req)
                if error:
                    yield error_row(req, error)
                    continue
                if chunk and req.bucket != chunk[0].bucket:  # one prefill pads to one bucket's length, not the next
                    self.held_back = req
                    break
                chunk.append(req)
            if chunk:
                yield chunk, free
                free = [s for s in free if is_free(s)]
        if not self.exhausted and self.held_back is None:  # whether rows are left to come (the policy's horizon)
            self.held_back = self._pull()
            self.exhausted = self.held_back is None

    def peek(self) -> Request | None:
        """The next request, read ahead and held back for the next chunk; None when the stream has ended."""
        if self.held_back is None and not self.exhausted:
            self.held_back = self._pull()
            self.exhausted = self.held_back is None
        return self.held_back

    @property
    def done(self) -> bool:
        """Every request has been read and handed out."""
        return self.exhausted and self.held_back is None

    def admitted(self, limits: list[int]) -> None:
        """Rows with these token limits entered the pool (the mean limit prices the rows to come)."""
        self.limits_seen, self.rows_seen = self.limits_seen + sum(limits), self.rows_seen + len(limits)

    def tokens_left(self, in_flight: int) -> int | None:
        """The most tokens the job has left: ``in_flight`` (the rows in the pool's), and rows to come at the mean
        limit of the rows admitted so far (the run's requests have a length, or the stream has ended); None when
        unknown."""
        if self.done:
            return in_flight
        if self.total is None:
            return None
        to_come = max(0, self.total - self.pulled) + (self.held_back is not None)
        return in_flight + to_come * self.limits_seen // max(1, self.rows_seen)

    def _pull(self) -> Request | None:
        req = next(self.stream, None)
        self.pulled += req is not None
        return req
