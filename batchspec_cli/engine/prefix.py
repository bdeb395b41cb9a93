"""Shared prompt prefixes: rows that start with the same tokens take that prefix's KV instead of computing it.

A prefix's KV does not depend on where a row sits in its slot: positions count from the row's
first content column (``align``), so the K/V of a row's first ``n`` tokens are those of the
same ``n`` tokens prefilled alone from position 0 (DESIGN.md §16). Hence:

- **Where a prefix is found**: at admission, among the rows admitted together (a *chunk*: at
  most a batch of one length bucket) and against the prefix kept from earlier admissions
  (``share_groups``). Rows whose first ``min_tokens`` tokens are equal form a group; a group of
  two or more rows shares its longest common prefix, a lone row what it has in common with the
  kept prefix or with the next row to come. The job hands rows to the engine in token order
  within each batch it reads of a bucket (``neighbours``), so rows that share a prefix are
  admitted together.
- **How its KV is shared**: ``PrefixStore`` computes a prefix once per model in a one-row
  cache, then it is *copied* into each row's slot at that row's own content offset
  (``align.SlotTable.share_prefix``): the slot layout keeps each row's content contiguous after
  its own padding, so a row's columns cannot point at one shared copy. Each row's own suffix is
  then prefilled by one forward per group, from the first column where every row of the group
  has its prefix (a row with more padding recomputes a few of its own prefix columns).
- **Memory budget**: the store keeps the *last* prefix only, of at most ``max_tokens`` tokens: one
  row of each model's KV, as much as one more slot of that length (the pool holds at least a
  batch of them; the row's buffer grows as a slot's does, geometrically, when a prefix is extended). Later chunks of the bucket, and later buckets, reuse it without computing it
  again; a chunk with another prefix replaces it (the columns both share stay).
- A prefix shorter than ``min_tokens`` is not shared: copying and the extra forward would cost
  about what they save.

The target's cache covers a row's prompt but its last token (the first round feeds it), the
draft's all but its last two (``align``); the store covers what the rows asked of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.attention import Piece, group_forward, packable, packed_forward
from .align import SlotCache

MIN_TOKENS = 16  # a prefix shorter than this is not shared
MAX_TOKENS = 16384  # the kept prefix's most columns (its memory: one row of each model's KV this long)


def common_length(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` have in common from their start."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return int(np.argmax(np.asarray(a[:n]) != np.asarray(b[:n])))


def neighbours(rows: list[int], prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
    """(row, prompt) in token order (ties in the order given): rows that share a prefix become neighbours, so they
    are admitted together. The job sorts each batch it reads of a bucket's shard (a few hundred rows: its memory
    does not grow with the job; the shards themselves keep input order)."""
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    return [(rows[i], prompts[i]) for i in order]


@dataclass
class Group:
    """Rows of a chunk that share a prefix: the kept prefix must cover ``prefix`` for them."""

    rows: list[int]  # indexes into the chunk
    prefix: list[int]  # the tokens the rows share (at least min_tokens)


def share_groups(prompts: list[list[int]], kept: list[int], min_tokens: int = MIN_TOKENS,
                 max_tokens: int = MAX_TOKENS, reach: int = 1, ahead: list[int] | None = None) -> list[Group]:
    """Which rows of a chunk share which prefix, in the order of their first row (a pure function).

    ``reach``: a row's last ``reach`` prompt tokens are never shared (the target: 1, its last token is fed by the
    first round). Rows are grouped by their first ``min_tokens`` tokens; two or more rows share their longest
    common prefix, a lone row the longer of its common prefixes with ``kept`` and with ``ahead`` (the next prompt to
    come, which will reuse what the lone row leaves in the store); a prefix is cut at ``max_tokens``, and one
    shorter than ``min_tokens`` is no group.
    """
    by_start: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(prompts):
        if len(ids) - reach >= min_tokens:
            by_start.setdefault(tuple(ids[:min_tokens]), []).append(i)
    groups = []
    for rows in by_start.values():
        first = prompts[rows[0]]
        n = min(len(prompts[i]) - reach for i in rows)
        n = min(n, max_tokens, *(common_length(first, prompts[i]) for i in rows[1:]))
        if len(rows) == 1:
            n = min(n, max(common_length(first, kept), common_length(first, ahead or [])))
        if n >= min_tokens:
            groups.append(Group(rows, first[:n]))
    return groups


class PrefixStore:
    """The last shared prefix and its KV for each model (``"target"``, ``"draft"``), one row each.

    ``tokens`` is the prefix; ``covered[name]`` how many of its first columns the model's cache
    holds (the draft may cover less than the target, or nothing yet: it is filled when a row needs it).
    """

    def __init__(self, max_tokens: int = MAX_TOKENS):
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.caches: dict[str, SlotCache] = {}  # name -> one-row cache: per layer [1, kv_heads, capacity, head_dim]
        self.covered: dict[str, int] = {}

    def clear(self) -> None:
        """Forget the prefix and free its KV (out of memory)."""
        self.tokens, self.caches, self.covered = [], {}, {}

    def match(self, prompt: list[int]) -> int:
        return common_length(prompt, self.tokens)

    def hold(self, prefix: list[int]) -> None:
        """Make ``prefix`` (at most ``max_tokens``) the kept prefix's start: the columns it shares with the kept one
        stay; a longer kept prefix that starts with it stays whole."""
        prefix = prefix[: self.max_tokens]
        same = common_length(prefix, self.tokens)
        if same == len(prefix):
            return
        self.tokens = prefix
        for name in self.covered:
            self.covered[name] = min(self.covered[name], same)

    @torch.no_grad()
    def cover(self, name: str, model, cache_kwarg: str, n: int, device: torch.device) -> int:
        """Fill model ``name``'s cache with the prefix's first ``n`` columns; returns the columns computed now."""
        done = self.covered.get(name, 0)
        if n <= done:
            return 0
        cache = self.caches.get(name)
        if cache is None:
            cache = self.caches[name] = SlotCache(1, n)
        if packable(model, device):  # as a row's own prefill computes these columns (the same kernels, the same sums)
            tokens = torch.tensor([self.tokens[:n]], dtype=torch.long, device=device)
            packed_forward(model, cache, cache_kwarg, tokens, [Piece(0, 0, done, n)])
        else:
            tokens = torch.tensor([self.tokens[done:n]], dtype=torch.long, device=device)
            group_forward(model, cache, cache_kwarg, slice(0, 1), tokens,
                          torch.zeros(1, dtype=torch.long, device=device), done, logits_to_keep=1)
        self.covered[name] = n
        return n - done
