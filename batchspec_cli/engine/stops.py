"""Stop strings: where a row's completion is cut when it produces one (the engine's commit asks).

``StopChecker`` is what the engine calls after every round; ``StopStrings`` is the one kind
the job builds (the job's ``--stop`` strings plus each row's own), and the one place that
says where a stop string cuts: in the tokens (``__call__``) and in the text the output
holds (``text``).
"""

from __future__ import annotations

from typing import Callable

StopChecker = Callable[[list[int], int, tuple[str, ...]], int | None]
"""(completion token ids so far, number of tokens added this round, the row's own stop strings)
-> cut length or None."""


class StopStrings:
    """Finds the first stop string in a completion; returns the token cut (shortest prefix holding it).

    Called after every round with the row's whole completion, it decodes only the tail a new
    stop string can lie in: the round's tokens plus enough earlier ones to hold the longest
    stop string. Every token but a skipped special one decodes to at least one byte, so
    ``longest stop in UTF-8 bytes + MARGIN_TOKENS`` earlier tokens (special ones not counted)
    cover any stop string ending in the new text, with room for what a window's first tokens
    decode to differently (a partial UTF-8 character, a stripped leading space). The work
    per call is bounded, so a row costs linear time, not quadratic; the cut is what decoding
    the whole completion every round would give.
    """

    MARGIN_TOKENS = 8

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.skipped = set(tokenizer.all_special_ids)  # decoded with skip_special_tokens: no text

    def _hit(self, ids: list[int], stops: tuple[str, ...]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in stops)

    def _window_start(self, ids: list[int], n_new: int, stops: tuple[str, ...]) -> int:
        """First index of the tail to decode: the new tokens and enough text tokens before them."""
        start, need = len(ids) - n_new, max(len(s.encode("utf-8")) for s in stops) + self.MARGIN_TOKENS
        while start > 0 and need > 0:
            start -= 1
            need -= ids[start] not in self.skipped
        return start

    def __call__(self, ids: list[int], n_new: int, row_stops: tuple[str, ...] = ()) -> int | None:
        """The cut for the job's stop strings plus the row's own (``Request.stop``), or None."""
        stops = self.stops + tuple(row_stops)
        if not stops:
            return None
        start = self._window_start(ids, n_new, stops)
        if not self._hit(ids[start:], stops):
            return None
        for cut in range(max(1, len(ids) - n_new + 1), len(ids) + 1):
            if self._hit(ids[start:cut], stops):
                return cut
        return len(ids)

    def text(self, ids: list[int], row_stops: tuple[str, ...] = ()) -> str:
        """The text of a completion that ended on a stop string (its cut ``ids``), up to the first stop string,
        which is excluded: what the output holds of such a row."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        found = [i for i in (text.find(s) for s in self.stops + tuple(row_stops)) if i >= 0]
        return text[: min(found, default=len(text))]
