"""Drafters behind one protocol: the draft model (``ModelDrafter``), ``ngram`` and ``suffix``.

Every drafter proposes up to k tokens for each row of a group and knows nothing of the
policy (which drafter a row verifies, and which k, is chosen in ``control``)::

    drafter.propose(rows, k) -> Proposal(tokens [G, k], lengths [G], source)

A row may get fewer than k tokens, or none (``lengths``; ``tokens`` holds filler past them).
The engine tells the model-free drafters a row's prompt at admission (``admit``), its
committed tokens after every round (``extend``) and its end (``finish``); ``preload``
rebuilds what an interrupted run had learnt from a saved row (a resumed job's rows), so a
resumed run drafts as the uninterrupted one would. The draft model learns nothing from
text outside its KV cache, so those calls are no-ops for it.

- ``model``: k greedy/coupled steps of the draft model over its persistent slot cache; its
  first forward feeds every column the cache has not seen (the catch-up).
- ``ngram``: the longest suffix (2..4 tokens) of the row's own prompt and completion that
  occurred earlier in it, and the tokens that followed its latest occurrence.
- ``suffix``: the row's own text plus an index over every prompt admitted and every
  completion finished so far in the job, with counts; the most frequent continuation,
  drafted while the running product of its frequencies stays above ``min_prob``. Its
  memory is bounded (``lookup.SuffixIndex``: oldest documents are evicted first).
- ``grammar``: on a constrained row, the tokens its grammar forces next (``{"``, a key,
  ``": "``, a closing brace: ``constraints.Guide.forced``); nothing on other rows.

Model-free drafts cost no forward; the data structures are in ``lookup``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..models.attention import group_forward
from ..policy import lookup
from . import sampling
from .align import Selection, SlotCache

NAMES = ("ngram", "suffix", "grammar")


@dataclass
class Rows:
    """The group a drafter proposes for. The model-free drafters read ``ids`` alone."""

    ids: list[int]  # [G] row ids
    index: Selection | None = None  # the group's slots (the draft model's cache rows)
    tokens: torch.Tensor | None = None  # [G, T] the group's committed tokens, left-padded
    pad: torch.Tensor | None = None  # [G] left padding
    reach: int = 0  # the draft cache covers columns [0, reach) of every row of the group
    pick: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # (logits [G, 1, V], draft position j) -> [G, 1]


@dataclass
class Proposal:
    """One drafter's drafts for a group: tokens [G, k] (filler past each row's length), lengths [G], who drafted."""

    tokens: torch.Tensor  # [G, k] int64
    lengths: list[int]  # [G] real drafts per row (host)
    source: str  # "model", a model-free drafter's name, or their names joined for a merged proposal
    fed: int = 0  # model: columns its first forward took (its catch-up)
    host: list[list[int]] | None = None  # [G] the real drafts on the host (model-free drafts); None: device only


class Drafter(Protocol):
    name: str

    def admit(self, row: int, prompt: list[int]) -> None: ...

    def extend(self, row: int, tokens: list[int]) -> None: ...

    def finish(self, row: int, completion: list[int]) -> None: ...

    def preload(self, prompt: list[int], completion: list[int] | None) -> None: ...

    def propose(self, rows: Rows, k: int) -> Proposal: ...


def _padded(drafts: list[list[int]], k: int, source: str) -> Proposal:
    tokens = torch.tensor([d[:k] + [0] * (k - len(d[:k])) for d in drafts], dtype=torch.long).reshape(len(drafts), k)
    return Proposal(tokens, [min(k, len(d)) for d in drafts], source)


class _Unlearning:
    """A drafter that learns nothing from text: the row events are no-ops, and a resumed run has nothing to
    rebuild (the draft model knows only its KV cache; the grammar's forced tokens depend on the row's prefix)."""

    def admit(self, row: int, prompt: list[int]) -> None:
        pass

    def extend(self, row: int, tokens: list[int]) -> None:
        pass

    def finish(self, row: int, completion: list[int]) -> None:
        pass

    def preload(self, prompt: list[int], completion: list[int] | None) -> None:
        pass


class ModelDrafter(_Unlearning):
    """The draft model and a run's draft slot cache (the slot table's, moved by realignment with the target's)."""

    name = "model"

    def __init__(self, model: torch.nn.Module, cache_kwarg: str, vocab: int, cache: SlotCache):
        self.model, self.cache_kwarg, self.vocab, self.cache = model, cache_kwarg, vocab, cache

    @torch.no_grad()
    def propose(self, rows: Rows, k: int) -> Proposal:
        """k tokens per row; the first forward feeds every column the cache has not seen (at least the last two)."""
        end = rows.tokens.shape[1]
        start = max(0, min(rows.reach, end - 2))
        inputs, fed = rows.tokens[:, start:end], end - start
        drafts = []
        for j in range(k):
            logits = group_forward(self.model, self.cache, self.cache_kwarg, rows.index, inputs, rows.pad, start,
                                   logits_to_keep=1)[:, -1:]
            token = rows.pick(self.to_target_vocab(logits), j)[:, 0]
            drafts.append(token)
            inputs, start = token[:, None], end + j
        return Proposal(torch.stack(drafts, 1), [k] * len(rows.ids), "model", fed)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Slice or pad draft logits [..., Vd] to the target's vocabulary size."""
        logits = sampling.up_cast(logits)
        extra = self.vocab - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.vocab]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=torch.finfo(logits.dtype).min)
        return logits


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

    def propose(self, rows: Rows, k: int) -> Proposal:
        return _padded([self.rows[row].propose(k) for row in rows.ids], k, self.name)

    def preload(self, prompt: list[int], completion: list[int] | None) -> None:
        """Nothing to rebuild: a row's lookup covers its own text only."""


class SuffixDrafter:
    name = "suffix"

    def __init__(self, **index_options):
        self.corpus = lookup.SuffixCorpus(lookup.SuffixIndex(**index_options) if index_options else None)
        self.rows: dict[int, lookup.SuffixRow] = {}

    def admit(self, row: int, prompt: list[int]) -> None:
        self.rows[row] = self.corpus.open(prompt)

    def extend(self, row: int, tokens: list[int]) -> None:
        self.rows[row].extend(tokens)

    def finish(self, row: int, completion: list[int]) -> None:
        state = self.rows.pop(row, None)
        if state is not None:
            state.finish(add_to_index=bool(completion))

    def propose(self, rows: Rows, k: int) -> Proposal:
        return _padded([self.rows[row].propose(k) for row in rows.ids], k, self.name)

    def preload(self, prompt: list[int], completion: list[int] | None) -> None:
        self.corpus.add(prompt)
        if completion:
            self.corpus.add(self.corpus.completion_document(prompt, completion))


class GrammarDrafter(_Unlearning):
    """Drafts what a constrained row's grammar forces next; the engine gives it the run's ``constraints.Guide``
    (``bind``), which holds the rows' matchers, so it keeps no state of its own."""

    name = "grammar"

    def __init__(self):
        self.guide = None  # constraints.Guide

    def bind(self, guide) -> None:
        self.guide = guide

    def propose(self, rows: Rows, k: int) -> Proposal:
        return _padded([self.guide.forced(row, k) if self.guide is not None else [] for row in rows.ids], k,
                       self.name)


def continue_forced(proposals: dict[str, Proposal]) -> None:
    """Where another drafter's proposal for a row begins with the grammar's whole forced run and goes on, that
    row's ``grammar`` proposal becomes it: the forced tokens are the target's constrained choice, and what follows
    them is the other drafter's guess, verified as any draft (so no output changes). In place."""
    forced = proposals.get("grammar")
    if forced is None or not any(forced.lengths):
        return
    others = [p for name, p in proposals.items() if name != "grammar"]
    runs = forced.tokens.tolist()  # [G, k]
    for i, f in enumerate(forced.lengths):
        longest = max((p for p in others if p.lengths[i] > f and p.tokens[i, :f].tolist() == runs[i][:f]),
                      key=lambda p: p.lengths[i], default=None) if f else None
        if longest is not None:
            forced.tokens[i] = longest.tokens[i]
            forced.lengths[i] = longest.lengths[i]


def make(names: list[str]) -> list:
    """Model-free drafters by name, in a fixed order (the policy ranks their proposals per row)."""
    kinds = {"ngram": NgramDrafter, "suffix": SuffixDrafter, "grammar": GrammarDrafter}
    return [kinds[name]() for name in NAMES if name in names]


def merge(proposals: dict[str, Proposal], drafters: list[str], k: int, device: torch.device) -> Proposal:
    """One proposal of k columns from the model-free ones: row i takes ``drafters[i]``'s ("" none)."""
    names = list(proposals)
    stacked = torch.stack([p.tokens[:, :k] for p in proposals.values()])  # [P, G, k]
    which = torch.tensor([names.index(d) if d else 0 for d in drafters])
    tokens = stacked[which, torch.arange(len(drafters))]  # [G, k] on the host, as the drafters made them
    lengths = [min(k, proposals[d].lengths[i]) if d else 0 for i, d in enumerate(drafters)]
    host = [row[:n] for row, n in zip(tokens.tolist(), lengths)]  # for the grammar walk: no read from the device
    return Proposal(tokens.to(device), lengths, label([d if n else "" for d, n in zip(drafters, lengths)]), host=host)


def label(drafters: list[str]) -> str:
    """Who drafted a round, from [G] who drafted each row ("" none): their names, sorted and joined ("" none)."""
    return ",".join(sorted({d for d in drafters if d}))
