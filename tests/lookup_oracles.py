"""Brute-force references for the model-free drafters of ``batchspec_cli.lookup`` (test oracles).

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
    """Reference for ``SuffixIndex.next_counts``: scan every document at every position.

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
