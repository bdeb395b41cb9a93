"""Brute-force references for the model-free drafters of ``batchspec_cli.policy.lookup`` (test oracles).

They scan every position of every text instead of keeping an index: slow, and obviously right.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def _brute_prompt_lookup(tokens: Sequence[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Reference for ``PromptLookup.propose``: scan every n and every earlier position."""
    text = list(tokens)
    size = len(text)
    if k <= 0:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = text[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest first; start + n < size
            if text[start : start + n] == suffix:
                out = []
                virtual = text[:]  # the text goes on as the copy
                for i in range(k):
                    virtual.append(virtual[start + n + i])
                    out.append(virtual[-1])
                return out
    return []


def _brute_suffix_counts(
    documents: Sequence[Sequence[int]], context: Sequence[int], max_depth: int
) -> tuple[int, dict[int, int]]:
    """Reference for ``next_counts`` (below): scan every document at every position.

    The longest suffix ``u`` of ``context`` with ``len(u) <= max_depth - 1`` that occurs in
    some document followed by a token, and the counts of those following tokens.
    """
    context = list(context)
    for d in range(min(max_depth - 1, len(context)), 0, -1):
        u = context[len(context) - d :]
        counts: Counter[int] = Counter()
        for doc in documents:
            doc = list(doc)
            for start in range(len(doc) - d):
                if doc[start : start + d] == u:
                    counts[doc[start + d]] += 1
        if counts:
            return d, dict(counts)
    return 0, {}


def _brute_suffix_draft(
    documents: Sequence[Sequence[int]], context: Sequence[int], k: int, max_depth: int, min_prob: float
) -> tuple[list[int], list[float]]:
    """Reference for ``SuffixIndex.draft``: each step takes the most frequent next token
    (ties: smaller id) after the longest suffix of context + draft that has a successor."""
    path, tokens, probs, prob = list(context), [], [], 1.0
    while len(tokens) < k:
        _, counts = _brute_suffix_counts(documents, path, max_depth)
        if not counts:
            break
        top = min(counts, key=lambda t: (-counts[t], t))
        prob *= counts[top] / sum(counts.values())
        if prob < min_prob:
            break
        tokens.append(top)
        probs.append(prob)
        path.append(top)
    return tokens, probs


# What the tests read of a ``SuffixIndex`` beyond its drafts (the library has no use for these).


def index_of(documents: Sequence[Sequence[int]], **kwargs):
    """A ``SuffixIndex`` built by adding ``documents`` in order."""
    from batchspec_cli.policy.lookup import SuffixIndex

    index = SuffixIndex(**kwargs)
    for doc in documents:
        index.add(doc)
    return index


def next_counts(index, context: Sequence[int]) -> tuple[int, dict[int, int]]:
    """(match length, {next token: count}) for the longest matched suffix of ``context``, read from the index."""
    d, node = index._match(list(context[-(index.max_depth - 1) :]))
    if node < 0:
        return 0, {}
    return d, {index._tok[c]: index._cnt[c] for c in index._children(node)}


def memory_estimate(index) -> int:
    """Bytes held, by the class's bound formula (nodes x NODE_BYTES + tokens x TOKEN_BYTES, and the documents)."""
    return index.nodes * index.NODE_BYTES + index.tokens * index.TOKEN_BYTES + len(index._docs) * 100
