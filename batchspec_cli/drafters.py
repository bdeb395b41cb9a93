"""Model-free drafters for the engine: ``ngram`` (prompt lookup) and ``suffix`` (a job-wide index).

Both follow ``engine.LookupDrafter``: the engine tells them a row's prompt at admission
(``admit``), its committed tokens after every round (``extend``) and its end (``finish``),
and asks for up to k tokens for each row of a group (``propose``); a row may get fewer,
or none. They cost no forward; the data structures are in ``lookup``.

- ``ngram``: the longest suffix (2..4 tokens) of the row's own prompt and completion that
  occurred earlier in it, and the tokens that followed its latest occurrence.
- ``suffix``: the row's own text plus an index over every prompt admitted and every
  completion finished so far in the job, with counts; the most frequent continuation,
  drafted while the running product of its frequencies stays above ``min_prob``. Its
  memory is bounded (``lookup.SuffixIndex``: oldest documents are evicted first).

``preload`` rebuilds what an interrupted run had indexed (a resumed job's saved rows), so
that a resumed run drafts as the uninterrupted one would.
"""

from __future__ import annotations

from . import lookup

NAMES = ("ngram", "suffix")


class NgramDrafter:
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.rows: dict[int, lookup.PromptLookup] = {}

    def admit(self, row: int, prompt: list[int]) -> None:
        self.rows[row] = lookup.PromptLookup(prompt, min_n=self.min_n, max_n=self.max_n)

    def extend(self, row: int, tokens: list[int]) -> None:
        self.rows[row].extend(tokens)

    def finish(self, row: int, completion: list[int]) -> None:
        self.rows.pop(row, None)

    def propose(self, rows: list[int], k: int) -> list[list[int]]:
        return [self.rows[row].propose(k) for row in rows]

    def preload(self, prompt: list[int], completion: list[int] | None) -> None:
        """Nothing to rebuild: a row's lookup covers its own text only."""


class SuffixDrafter:
    name = "suffix"

    def __init__(self, **index_options):
        self.job = lookup.SuffixDrafter(lookup.SuffixIndex(**index_options) if index_options else None)
        self.rows: dict[int, lookup.SuffixRow] = {}

    def admit(self, row: int, prompt: list[int]) -> None:
        self.rows[row] = self.job.open(prompt)

    def extend(self, row: int, tokens: list[int]) -> None:
        self.rows[row].extend(tokens)

    def finish(self, row: int, completion: list[int]) -> None:
        state = self.rows.pop(row, None)
        if state is not None:
            state.finish(add_to_index=bool(completion))

    def propose(self, rows: list[int], k: int) -> list[list[int]]:
        return [self.rows[row].propose(k) for row in rows]

    def preload(self, prompt: list[int], completion: list[int] | None) -> None:
        self.job.index.add(prompt)
        if completion:
            self.job.index.add(self.job.completion_document(prompt, completion))


def make(names: list[str]) -> list:
    """Drafters by name, in a fixed order (the engine prefers none: each row takes the best proposal)."""
    return [{"ngram": NgramDrafter, "suffix": SuffixDrafter}[name]() for name in NAMES if name in names]
