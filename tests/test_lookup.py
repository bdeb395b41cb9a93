"""Model-free drafters (batchspec_cli/policy/lookup.py) against brute-force references.

The oracles (tests/lookup_oracles.py): `_brute_prompt_lookup` scans every n and every earlier position;
`_brute_suffix_counts` scans every retained document at every position. The structures
must agree with them on random token streams over small vocabularies (so that matches,
ties and ambiguity are common), however the text arrived (whole or in random chunks) and
after evictions.
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc

import pytest

from batchspec_cli.engine import drafters
from batchspec_cli.policy.lookup import PromptLookup, SuffixCorpus, SuffixIndex
from lookup_oracles import (_brute_prompt_lookup, _brute_suffix_counts, _brute_suffix_draft, index_of, memory_estimate,
                            next_counts)


def _chunks(rng: random.Random, tokens: list[int]) -> list[list[int]]:
    out, i = [], 0
    while i < len(tokens):
        size = rng.choice([1, 1, 1, 2, 3, 7])
        out.append(tokens[i : i + size])
        i += size
    return out


def _simulate(row, continuation: list[int], k: int) -> tuple[int, int, int]:
    """Speculative rounds against a known continuation: (proposed, accepted, rounds).

    Each round the row proposes up to k tokens; the matching prefix is accepted and one
    more true token (the correction or bonus) is committed, as the verify step would.
    """
    proposed = accepted = rounds = 0
    i = 0
    while i < len(continuation):
        draft = row.propose(k)
        assert len(draft) <= k
        n = 0
        while n < len(draft) and i + n < len(continuation) and draft[n] == continuation[i + n]:
            n += 1
        proposed += len(draft)
        accepted += n
        rounds += 1
        row.extend(continuation[i : i + n + 1])
        i += n + 1
    return proposed, accepted, rounds


def _check_trie(index: SuffixIndex) -> None:
    """Structural invariants: counts positive, succ = Σ child counts, child count <= parent
    count, reachable nodes = index.nodes, depth <= max_depth, cached best = true best."""
    cnt, tok, succ = index._cnt, index._tok, index._succ
    total = 0
    stack = [(index.ROOT, 0)]
    while stack:
        node, depth = stack.pop()
        kids = index._children(node)
        assert depth <= index.max_depth
        if depth == index.max_depth:
            assert not kids
        assert succ[node] == sum(cnt[c] for c in kids)
        if index._best[node] >= 0:
            assert index._best[node] in kids
        if kids:
            expected = min(kids, key=lambda c: (-cnt[c], tok[c]))
            assert index._best_child(node) == expected
        for child in kids:
            assert cnt[child] > 0
            if node != index.ROOT:
                assert cnt[child] <= cnt[node]
            total += 1
            stack.append((child, depth + 1))
    assert total == index.nodes
    assert len(index._kids) == 1 + index.nodes + len(index._free)


# --- PromptLookup -------------------------------------------------------------------------


def test_prompt_lookup_matches_brute_force_on_random_streams():
    rng = random.Random(1)
    checks = 0
    for _ in range(400):
        vocab = rng.randint(2, 20)
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        completion = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        row = PromptLookup(prompt, min_n=min_n, max_n=max_n)
        text = list(prompt)
        for chunk in [[]] + _chunks(rng, completion):
            row.extend(chunk)
            text.extend(chunk)
            k = rng.randint(0, 9)
            assert row.propose(k) == _brute_prompt_lookup(text, k, min_n, max_n), (text, k, min_n, max_n)
            checks += 1
    assert checks > 2000


def test_prompt_lookup_prefers_longest_match_then_latest_occurrence():
    # "5 2 3" occurred once (followed by 8); "2 3" occurred later too (followed by 9).
    row = PromptLookup([5, 2, 3, 8, 2, 3, 9, 5, 2, 3], min_n=1, max_n=4)
    assert row.match()[0] == 3
    assert row.propose(2) == [8, 2]
    short = PromptLookup([5, 2, 3, 8, 2, 3, 9, 5, 2, 3], min_n=1, max_n=2)
    assert short.propose(2) == [9, 5]  # latest "2 3"
    # Never the current suffix itself: a text without repeats has no match.
    assert PromptLookup([1, 2, 3, 4], min_n=1).propose(3) == []
    # min_n: a single shared token is not a match with the default min_n=2.
    assert PromptLookup([7, 1, 7]).propose(3) == []
    assert PromptLookup([7, 1, 7], min_n=1).propose(3) == [1, 7, 1]


def test_prompt_lookup_copy_continues_past_the_end():
    assert PromptLookup([1, 2, 1, 2, 1], min_n=1).propose(6) == [2, 1, 2, 1, 2, 1]
    assert _brute_prompt_lookup([1, 2, 1, 2, 1], 6, 1, 4) == [2, 1, 2, 1, 2, 1]


def test_prompt_lookup_copied_passage_gets_long_correct_drafts():
    rng = random.Random(2)
    passage = [rng.randrange(1000, 2000) for _ in range(300)]
    prompt = [rng.randrange(1000) for _ in range(50)] + passage + [rng.randrange(1000) for _ in range(50)]
    row = PromptLookup(prompt)
    # The completion starts on its own, then copies the passage.
    lead_in = [rng.randrange(1000) for _ in range(5)]
    row.extend(lead_in + passage[:2])
    proposed, accepted, rounds = _simulate(row, passage[2:], k=8)
    assert accepted / proposed > 0.97
    assert (len(passage) - 2) / rounds > 7  # tokens per round close to k + 1 = 9


def test_prompt_lookup_validates_n():
    with pytest.raises(ValueError):
        PromptLookup(min_n=3, max_n=2)
    with pytest.raises(ValueError):
        PromptLookup(min_n=0)


# --- SuffixIndex --------------------------------------------------------------------------


def test_suffix_counts_and_first_token_match_brute_force():
    rng = random.Random(3)
    for trial in range(150):
        vocab = rng.randint(2, 12)
        depth = rng.randint(2, 7)
        docs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in range(rng.randint(1, 6))]
        index = SuffixIndex(max_depth=depth, min_prob=0.0)
        for doc in docs:
            if rng.random() < 0.5:
                index.add(doc)
            else:  # the same document arriving in chunks
                index.add([])
                for chunk in _chunks(rng, doc):
                    index.extend(chunk)
        _check_trie(index)
        for _ in range(20):
            if rng.random() < 0.5 and any(docs):
                doc = rng.choice([d for d in docs if d])
                cut = rng.randint(0, len(doc))
                context = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))] + doc[:cut]
            else:
                context = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
            want_d, want = _brute_suffix_counts(docs, context, depth)
            assert next_counts(index, context) == (want_d, want), (docs, context, depth)
            draft = index.draft(context, 4)
            assert draft.match == want_d
            if want:
                top = min(want, key=lambda t: (-want[t], t))
                assert draft.tokens[0] == top
                assert draft.probs[0] == pytest.approx(want[top] / sum(want.values()))
            else:
                assert draft.tokens == []
            for min_prob in (0.0, 0.3):
                k = rng.randint(0, 12)
                tokens, probs = _brute_suffix_draft(docs, context, k, depth, min_prob)
                draft = index.draft(context, k, min_prob=min_prob)
                assert draft.tokens == tokens, (docs, context, depth, k, min_prob)
                assert draft.probs == pytest.approx(probs)


def test_suffix_draft_follows_most_frequent_continuation():
    index = SuffixIndex(max_depth=4, min_prob=0.0)
    for doc in [[1, 2, 3, 4, 6], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7], [1, 2, 3, 5, 8]]:
        index.add(doc)
    draft = index.draft([9, 1, 2, 3], 3)
    assert draft.match == 3
    assert draft.tokens == [4, 6]  # 4 (3 of 4), then 6 (2 of 3); "2 3 4 6" ends every doc
    assert draft.probs == pytest.approx([0.75, 0.5])
    # Ties go to the smaller token id, whatever the order of the adds.
    for docs in ([[1, 2, 7], [1, 2, 3]], [[1, 2, 3], [1, 2, 7]]):
        assert index_of(docs, max_depth=4).propose([1, 2], 1) == [3]


def test_confidence_threshold_shortens_ambiguous_drafts_and_allows_long_ones():
    rng = random.Random(4)
    # Ambiguous: every token is followed by each of four tokens about equally often.
    noisy = SuffixIndex(max_depth=6, min_prob=0.2)
    for _ in range(40):
        noisy.add([rng.randrange(4) for _ in range(40)])
    lengths = [len(noisy.propose([rng.randrange(4) for _ in range(3)], 8)) for _ in range(50)]
    assert max(lengths) <= 2
    assert len(index_of(noisy.documents(), max_depth=6, min_prob=0.0).propose([0, 1, 2], 8)) == 8
    # Repeated: the same passage many times gives long drafts at the same threshold.
    passage = [rng.randrange(100) for _ in range(60)]
    repeated = index_of([passage] * 5, max_depth=6, min_prob=0.2)
    assert repeated.propose(passage[:10], 8) == passage[10:18]


def test_repeated_document_gives_its_own_continuation_in_full():
    rng = random.Random(5)
    doc = [rng.randrange(50) for _ in range(120)]
    index = SuffixIndex(max_depth=8)
    for i in range(30):
        index.add([rng.randrange(50) for _ in range(80)])
        if i in (10, 20):
            index.add(doc)
    # Far longer than max_depth: the walk backs off to the last max_depth - 1 tokens.
    draft = index.draft(doc[:15], len(doc) - 15)
    assert draft.tokens == doc[15:]
    assert draft.probs[-1] > 0.5


def test_suffix_index_is_deterministic():
    rng = random.Random(6)
    docs = [[rng.randrange(6) for _ in range(rng.randint(1, 40))] for _ in range(50)]
    a = index_of(docs, max_depth=5, max_nodes=300)
    b = index_of(docs, max_depth=5, max_nodes=300)
    for _ in range(100):
        context = [rng.randrange(6) for _ in range(rng.randint(0, 8))]
        assert a.draft(context, 6) == b.draft(context, 6)


def test_eviction_keeps_counts_exact_over_retained_documents():
    rng = random.Random(7)
    depth, max_nodes, max_tokens = 5, 400, 600
    index = SuffixIndex(max_depth=depth, max_nodes=max_nodes, max_tokens=max_tokens, min_prob=0.0)
    added = []
    for step in range(300):
        doc = [rng.randrange(8) for _ in range(rng.randint(0, 60))]
        index.add(doc)
        added.append(doc)
        kept = index.documents()
        assert kept == added[len(added) - len(kept) :]  # the oldest go first
        assert index.nodes <= max(max_nodes, depth * len(doc))
        assert index.tokens <= max(max_tokens, len(doc))
        if step % 10 == 0:
            _check_trie(index)
            for _ in range(10):
                context = [rng.randrange(8) for _ in range(rng.randint(0, 7))]
                assert next_counts(index, context) == _brute_suffix_counts(kept, context, depth)
    assert index.evicted > 200


def test_memory_stays_bounded_on_a_long_job_and_recent_documents_are_found():
    rng = random.Random(8)
    weights = [1 / (r + 1) for r in range(5000)]  # Zipf-like ids, as in real text
    vocab = list(range(5000))
    index = SuffixIndex(max_depth=8, max_nodes=60_000, max_tokens=40_000)
    pool = rng.choices(vocab, weights, k=400_000)
    start = time.process_time()  # this process's CPU time: a shared machine's load does not count
    recent = []
    pos = 0
    for i in range(20_000):
        size = rng.randint(5, 35)
        doc = pool[pos : pos + size]
        pos = (pos + size) % (len(pool) - 40)
        index.add(doc)
        assert index.nodes <= 60_000 and index.tokens <= 40_000
        if i >= 20_000 - 50:
            recent.append(doc)
    elapsed = time.process_time() - start
    assert index.evicted > 15_000
    assert memory_estimate(index) <= index.memory_bound()
    _check_trie(index)
    hits = 0
    for doc in recent:
        if len(doc) >= 12:
            hits += index.propose(doc[:8], len(doc) - 8) == doc[8:]
    assert hits >= 0.8 * sum(len(d) >= 12 for d in recent)
    assert elapsed < 20


def test_memory_estimate_bounds_the_measured_memory():
    rng = random.Random(9)
    gc.collect()
    tracemalloc.start()
    try:
        index = SuffixIndex(max_depth=16, max_nodes=10**9, max_tokens=10**9)
        for i in range(120):
            vocab = 5 if i % 3 == 0 else 49152  # branchy and chain-like tries both
            doc = [int(str(rng.randrange(vocab))) for _ in range(200)]  # fresh int objects
            index.add(doc)
        del doc
        gc.collect()
        measured, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.nodes > 100_000
    assert measured <= memory_estimate(index)


def test_extend_in_chunks_equals_one_add():
    rng = random.Random(10)
    for _ in range(30):
        docs = [[rng.randrange(5) for _ in range(rng.randint(0, 50))] for _ in range(4)]
        whole = index_of(docs, max_depth=6)
        chunked = SuffixIndex(max_depth=6)
        for doc in docs:
            chunked.add([])
            for chunk in _chunks(rng, doc):
                chunked.extend(chunk)
        assert chunked.nodes == whole.nodes and chunked.documents() == whole.documents()
        for _ in range(20):
            context = [rng.randrange(5) for _ in range(rng.randint(1, 8))]
            assert chunked.draft(context, 5) == whole.draft(context, 5)


# --- SuffixCorpus -------------------------------------------------------------------------


def test_suffix_drafter_copies_an_earlier_rows_completion():
    rng = random.Random(11)
    drafter = SuffixCorpus()
    answer = [rng.randrange(3000) for _ in range(150)]
    first = drafter.open([rng.randrange(3000) for _ in range(40)])
    first.extend(answer)
    first.finish()
    for _ in range(20):  # other rows in between
        other = drafter.open([rng.randrange(3000) for _ in range(40)])
        other.extend([rng.randrange(3000) for _ in range(60)])
        other.finish()
    second = drafter.open([rng.randrange(3000) for _ in range(40)])
    second.extend(answer[:3])
    proposed, accepted, rounds = _simulate(second, answer[3:], k=6)
    assert accepted / proposed > 0.95
    assert (len(answer) - 3) / rounds > 6


def test_suffix_drafter_uses_the_rows_own_text():
    rng = random.Random(12)
    drafter = SuffixCorpus()
    passage = [rng.randrange(3000) for _ in range(200)]
    row = drafter.open([rng.randrange(3000) for _ in range(30)] + passage + [rng.randrange(3000) for _ in range(30)])
    row.extend([rng.randrange(3000) for _ in range(4)] + passage[:3])
    proposed, accepted, rounds = _simulate(row, passage[3:], k=6)
    assert accepted / proposed > 0.95
    assert (len(passage) - 3) / rounds > 6
    # Text the row generated itself (a repeated list item) is found by the local index only.
    fresh = drafter.open([rng.randrange(3000) for _ in range(30)])
    item = [rng.randrange(3000, 4000) for _ in range(12)]
    fresh.extend(item + [7] + item[:4])
    assert drafter.index.propose(fresh.text, 6) == []
    assert fresh.propose(6) == item[4:10]


def test_suffix_drafter_preload_rebuilds_the_same_index():
    """A resumed job preloads its saved rows (prompt, completion or None) in run order: the index equals the
    one the uninterrupted run had built by drafting them."""
    rng = random.Random(13)
    live = drafters.SuffixDrafter(max_depth=6)
    pairs = []
    for i in range(30):
        prompt = [rng.randrange(20) for _ in range(rng.randint(1, 30))]
        live.admit(i, prompt)
        completion = [rng.randrange(20) for _ in range(rng.randint(1, 30))]
        for chunk in _chunks(rng, completion):
            live.extend(i, chunk)
        done = i % 4 != 3  # some rows did not finish before the interruption
        if done:
            live.finish(i, completion)
        pairs.append((prompt, completion if done else None))
    resumed = drafters.SuffixDrafter(max_depth=6)
    for prompt, completion in pairs:
        resumed.preload(prompt, completion)
    assert resumed.corpus.index.documents() == live.corpus.index.documents()
    assert resumed.corpus.index.nodes == live.corpus.index.nodes
    for _ in range(30):
        context = [rng.randrange(20) for _ in range(rng.randint(1, 20))]
        assert resumed.corpus.index.draft(context, 5) == live.corpus.index.draft(context, 5)


def test_suffix_indexing_waits_for_a_draft_and_then_equals_eager_indexing():
    """Rows that only take plain steps index nothing (auto's PLAIN arm pays no suffix bookkeeping); the first read
    of the global index, and a row's first draft, catch up to exactly the indexes built token by token."""
    rng = random.Random(14)
    corpus = SuffixCorpus(SuffixIndex(max_depth=6))
    eager, documents, rows = SuffixIndex(max_depth=6), [], []
    for i in range(16):
        prompt = [rng.randrange(20) for _ in range(rng.randint(1, 30))]
        row = corpus.open(prompt)
        documents.append(prompt)
        for chunk in _chunks(rng, [rng.randrange(20) for _ in range(rng.randint(1, 30))]):
            row.extend(chunk)
        if i % 3:
            row.finish()
            documents.append(corpus.completion_document(prompt, row.completion))
        else:
            rows.append(row)
    assert len(corpus.pending) == len(documents) and all(row.local is None for row in rows)  # nothing indexed yet
    for document in documents:
        eager.add(document)
    assert corpus.index.documents() == eager.documents() and corpus.index.nodes == eager.nodes
    assert not corpus.pending
    for row in rows:
        for _ in range(3):  # drafts between extensions: the local index follows the text
            local = SuffixIndex(max_depth=corpus.local_depth, max_nodes=1 << 62, max_tokens=1 << 62,
                                min_prob=corpus.min_prob)
            local.add(row.text)
            assert row.draft(5) in (local.draft(row.text, 5), eager.draft(row.text, 5))
            assert row.local.nodes == local.nodes and row.local.documents() == local.documents()
            row.extend([rng.randrange(20) for _ in range(rng.randint(1, 5))])


def test_documents_waiting_for_a_draft_keep_the_index_bound():
    """A job that never drafts holds no more waiting tokens than the index would keep (its oldest documents are
    dropped as the index would evict them), and the index read at last equals the eagerly built one."""
    rng = random.Random(15)
    corpus, eager = SuffixCorpus(SuffixIndex(max_depth=4, max_tokens=200)), SuffixIndex(max_depth=4, max_tokens=200)
    for _ in range(100):
        document = [rng.randrange(30) for _ in range(rng.randint(1, 40))]
        corpus.add(document)
        eager.add(document)
        assert corpus.pending_tokens <= 200 or len(corpus.pending) == 1
    assert eager.evicted > 50
    assert corpus.index.documents() == eager.documents() and corpus.index.nodes == eager.nodes
    for _ in range(30):
        context = [rng.randrange(30) for _ in range(rng.randint(1, 6))]
        assert corpus.index.draft(context, 4) == eager.draft(context, 4)


def test_drafters_propose_padded_tokens_and_per_row_lengths():
    """The drafter protocol: tokens [G, k] with filler past each row's length, lengths [G] (0: no draft)."""
    ngram, suffix = drafters.make(["ngram", "suffix"])
    for row, prompt in enumerate([[1, 2, 3, 1, 2], [4, 5, 6, 4, 5], [9]]):
        ngram.admit(row, prompt)
        suffix.admit(row, prompt)
    rows = drafters.Rows([0, 1, 2])
    proposal = ngram.propose(rows, 2)
    assert proposal.tokens.tolist() == [[3, 1], [6, 4], [0, 0]] and proposal.lengths == [2, 2, 0]
    assert proposal.source == "ngram" and proposal.tokens.shape == (3, 2)
    assert suffix.propose(rows, 3).lengths[2] == 0
