"""Model-free drafters: prompt lookup (``ngram``) and a job-wide suffix index (``suffix``).

Both propose draft tokens from text that already exists, so a draft costs no forward
(``c`` ≈ 0 in the goodput cost model of ``control``). Token ids are Python ints. Every structure grows as tokens
commit and is never rebuilt; none of them prints, and none can change an output (the
verify step decides every token), only how many drafts are accepted.

Vocabulary (defined once):

- *text* of a row: its prompt followed by its committed completion tokens.
- *document*: a token sequence added to a ``SuffixIndex`` (a prompt, or a finished
  completion preceded by the tail of its prompt).
- *match*: the longest suffix of the text that occurred earlier (``PromptLookup``) or that
  occurs in the index followed by some token (``SuffixIndex``).
- *prob* of a drafted token: the index's estimate that it will be accepted, the product of
  the next-token frequencies along the walk (``count(u·a) / Σ_b count(u·b)``). It assumes
  the steps are independent; it is a ranking signal for the policy, not a calibrated
  probability.

Per-row objects (``PromptLookup``, ``SuffixRow``) share one narrow interface::

    row.extend(tokens)             # committed tokens, in order
    row.draft(k) -> LookupDraft    # up to k tokens (maybe none) and their probs
    row.propose(k) -> list[int]    # the tokens alone

``drafters`` wraps them in the engine's drafter protocol. The brute-force references the
tests check them against live in ``tests/lookup_oracles.py``.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["LookupDraft", "PromptLookup", "SuffixIndex", "SuffixCorpus", "SuffixRow"]


@dataclass
class LookupDraft:
    """A row's proposal for one round."""

    tokens: list[int] = field(default_factory=list)  # [n], n <= k; may be empty
    probs: list[float] = field(default_factory=list)  # [n], non-increasing, in (0, 1]
    match: int = 0  # length of the matched suffix the draft continues (0: no match)

    @property
    def score(self) -> float:
        """Expected number of accepted draft tokens under the probs (their sum)."""
        return sum(self.probs)


# ---------------------------------------------------------------------------------------
# PromptLookup: the `ngram` drafter over one row's own text.
# ---------------------------------------------------------------------------------------


class PromptLookup:
    """Prompt lookup over one row's text (HF ``prompt_lookup_num_tokens``, vLLM ``ngram``).

    ``propose(k)`` takes the longest suffix of the text of length ``n`` in
    ``[min_n, max_n]`` that occurred earlier with a successor, jumps to its *latest* earlier
    occurrence and copies up to ``k`` tokens that followed it. When the copy reaches the end
    of the text it goes on copying its own output (LZ77-style): under the hypothesis "the
    text repeats what followed the earlier occurrence", that is what comes next, so a text
    with period ``p < k`` still gets ``k`` tokens. No match: an empty list.

    Defaults ``min_n=2, max_n=4``: a single shared token (",", " the") says little about what
    follows and a wrong draft costs nearly a full token of compute at batch 8-16 on the CPU
    (docs/history.md); two tokens already pin down copy spans, and beyond four the longer key rarely
    changes which occurrence is chosen (vLLM's documented ``prompt_lookup_max`` is 4).

    Structure: a trie over the text read *backwards*, cut at depth ``max_n``. The node
    reached by ``text[p-1], text[p-2], ..., text[p-d]`` stores the latest position ``p``
    whose preceding ``d`` tokens are that n-gram. A position is inserted only once its token
    is known, so the n-grams ending at the end of the text (which have no successor yet) are
    never in the trie and the current suffix cannot match itself.

    Cost: ``extend`` O(max_n) dict operations per token; ``propose`` O(max_n + k).
    Memory: at most ``max_n`` trie entries per token of text (each a dict slot plus a
    2-element list, about 150 bytes), i.e. ≈ 600 B per token with ``max_n=4``.
    """

    def __init__(self, tokens: Sequence[int] = (), *, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []  # [len] the row's text
        # token -> [latest successor position, children dict or None]
        self._root: dict[int, list] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens. O(max_n) per token."""
        text = self.tokens
        max_n = self.max_n
        for t in tokens:
            p = len(text)  # position of t: the n-grams ending at p-1 now have a successor
            level = self._root
            for d in range(1, min(max_n, p) + 1):
                key = text[p - d]
                entry = level.get(key)
                if entry is None:
                    entry = level[key] = [p, None]
                else:
                    entry[0] = p
                if d < max_n:
                    if entry[1] is None:
                        entry[1] = {}
                    level = entry[1]
            text.append(t)

    def match(self) -> tuple[int, int]:
        """(length n of the longest earlier-seen suffix, successor position); (0, -1) if none."""
        text = self.tokens
        level = self._root
        best_n, best_pos = 0, -1
        for d in range(1, min(self.max_n, len(text)) + 1):
            if level is None:
                break
            entry = level.get(text[-d])
            if entry is None:
                break
            if d >= self.min_n:
                best_n, best_pos = d, entry[0]
            level = entry[1]
        return best_n, best_pos

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the match."""
        return self.draft(k).tokens

    def draft(self, k: int) -> LookupDraft:
        """``propose`` as a ``LookupDraft``; probs are all 1.0 (prompt lookup has no estimate)."""
        n, pos = self.match()
        if n == 0 or k <= 0:
            return LookupDraft(match=n)
        out = _copy_forward(self.tokens, pos, k)
        return LookupDraft(tokens=out, probs=[1.0] * len(out), match=n)


def _copy_forward(text: Sequence[int], pos: int, k: int) -> list[int]:
    """``k`` tokens of ``text`` from ``pos`` on, continuing into the copy itself past the end."""
    out = list(text[pos : pos + k])
    period = len(text) - pos  # > 0: pos is a successor position inside the text
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


# ---------------------------------------------------------------------------------------
# SuffixIndex: frequency-counted, depth-bounded suffix trie over documents.
# ---------------------------------------------------------------------------------------


class SuffixIndex:
    """Counts of every substring of length <= ``max_depth`` over a window of documents.

    A trie whose node for string ``u`` holds ``count(u)``, the number of occurrences of ``u``
    in the retained documents, and ``succ(u) = Σ_a count(u·a)``, those followed by a token.
    ``draft(context, k)`` finds the longest suffix ``u`` of ``context`` (at most
    ``max_depth - 1`` tokens) with ``succ(u) > 0``, then walks forward: at each step it takes
    the child ``a`` with the largest count (ties: the smaller token id), multiplies the
    running prob by ``count(u·a) / succ(u)``, stops when that product drops below
    ``min_prob`` or at ``k`` tokens, and appends ``a`` to the context. Where ``u·a`` has no
    successor (a document's end, or depth ``max_depth``) the walk backs off to the longest
    shorter suffix that has one, so drafts can be longer than the depth. Every step thus
    uses the counts after the longest suffix (<= ``max_depth - 1`` tokens) of context +
    draft that has a successor: the brute-force references are in ``tests/lookup_oracles.py``; counts are
    exact over the retained documents.

    Documents: ``add(tokens)`` starts a document, ``extend(tokens)`` appends to the newest
    one (how a row's own text grows). Keeping the trie's nodes for the suffixes of the
    newest document's end (at most ``max_depth``) makes both cost O(max_depth) per token,
    so a document of L tokens costs O(L × max_depth). ``draft`` costs O(max_depth²) for the
    match (longest first, each try stops at its first miss; usually far less) plus O(1)
    per drafted token, O(max_depth²) per back-off (at most one per token; at full depth).

    Layout: nodes are integer ids into flat arrays (token, count, succ, cached best child)
    plus one list of children, each entry None, the only child's id, or a dict token -> id.
    Ints, int arrays and int-only dicts are invisible to Python's cyclic garbage collector;
    a million small node objects were not, and full collections tripled the cost of ``add``.
    Freed ids are reused.

    Memory bound: when the trie holds more than ``max_nodes`` nodes or the documents more
    than ``max_tokens`` tokens, the *oldest documents* are evicted whole (least recently
    added first) by replaying them with decrements; nodes whose count reaches 0 are
    unlinked, so children never dangle and all counts stay exact sums over what is
    retained. The newest document is never evicted, so after every ``add``/``extend``::

        nodes  <= max(max_nodes, max_depth × len(newest document))
        bytes  ≈ nodes × NODE_BYTES + tokens × TOKEN_BYTES

    and during a call the trie may exceed that by ``max_depth`` nodes per token of that
    call. ``NODE_BYTES`` = 100 is an upper bound measured with tracemalloc on CPython 3.11
    (four 4-byte array slots, a list slot, the child id int in the parent, a share of the
    parent's dict when it branches). With the defaults the bound is
    2_000_000 × 100 B + 4_000_000 × 4 B ≈ 216 MB, about 120k tokens of novel text at depth
    16 (repeated text shares nodes). Deterministic: the same sequence of calls gives the
    same drafts (ties between continuations go to the smaller token id).
    """

    NODE_BYTES = 100  # per trie node, upper bound (see the class docstring)
    TOKEN_BYTES = 4  # per retained document token (array('i'))
    ROOT = 0

    def __init__(
        self,
        *,
        max_depth: int = 16,
        max_nodes: int = 2_000_000,
        max_tokens: int = 4_000_000,
        min_prob: float = 0.1,
    ) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        if max_nodes < 1 or max_tokens < 1:
            raise ValueError("max_nodes and max_tokens must be positive")
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.max_tokens = max_tokens
        self.min_prob = min_prob
        # Per node id; the root is id 0.
        self._tok = array("i", [-1])  # [ids] last token of u
        self._cnt = array("i", [0])  # [ids] count(u) over retained documents
        self._succ = array("i", [0])  # [ids] Σ count(u·a)
        self._best = array("i", [-1])  # [ids] child with max count (ties: smaller token); -1 = rescan
        self._kids: list[None | int | dict[int, int]] = [None]  # [ids]
        self._free: list[int] = []  # ids of unlinked nodes, reused first
        self.nodes = 0  # trie nodes, the root not counted
        self.tokens = 0  # tokens in retained documents
        self.evicted = 0  # documents evicted so far
        self._docs: deque[array] = deque()  # retained documents, oldest first
        self._active: list[int] = []  # ids for the newest document's last 0..max_depth-1 tokens

    def __len__(self) -> int:
        """Number of retained documents."""
        return len(self._docs)

    def documents(self) -> list[list[int]]:
        """The retained documents, oldest first (for tests and debugging)."""
        return [list(doc) for doc in self._docs]

    def memory_bound(self) -> int:
        """The bound's bytes at the caps (a newest document longer than ``max_nodes / max_depth`` tokens may add its
        own ``max_depth`` nodes per token)."""
        return self.max_nodes * self.NODE_BYTES + self.max_tokens * self.TOKEN_BYTES

    # -- nodes --------------------------------------------------------------------------

    def _new(self, token: int) -> int:
        self.nodes += 1
        if self._free:
            node = self._free.pop()
            self._tok[node] = token
            self._cnt[node] = self._succ[node] = 0
            self._best[node] = -1
            self._kids[node] = None
            return node
        self._tok.append(token)
        self._cnt.append(0)
        self._succ.append(0)
        self._best.append(-1)
        self._kids.append(None)
        return len(self._kids) - 1

    def _child(self, node: int, token: int) -> int:
        """The child of ``node`` spelling ``u·token``; -1 if absent."""
        kids = self._kids[node]
        if kids is None:
            return -1
        if kids.__class__ is int:
            return kids if self._tok[kids] == token else -1
        return kids.get(token, -1)

    def _children(self, node: int) -> list[int]:
        kids = self._kids[node]
        if kids is None:
            return []
        if kids.__class__ is int:
            return [kids]
        return list(kids.values())

    def _best_child(self, node: int) -> int:
        best = self._best[node]
        if best < 0:
            cnt, tok = self._cnt, self._tok
            for child in self._children(node):
                if best < 0 or (cnt[child], -tok[child]) > (cnt[best], -tok[best]):
                    best = child
            self._best[node] = best
        return best

    # -- growth -------------------------------------------------------------------------

    def add(self, tokens: Sequence[int]) -> None:
        """Add a new document (it becomes the one ``extend`` appends to). O(L × max_depth)."""
        self._docs.append(array("i"))
        self._active = [self.ROOT]
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the newest document. O(max_depth) per token."""
        if not self._docs:
            self.add(tokens)
            return
        doc = self._docs[-1]
        depth_cap = self.max_depth
        tok, cnt, succ, best_of, kids_of = self._tok, self._cnt, self._succ, self._best, self._kids
        active = self._active
        for t in tokens:
            new_active = [self.ROOT]
            for parent in active:  # parent spells doc[-d:], d = 0..max_depth-1
                kids = kids_of[parent]
                if kids is None:
                    child = kids_of[parent] = best_of[parent] = self._new(t)
                elif kids.__class__ is int:
                    if tok[kids] == t:
                        child = kids
                    else:
                        child = self._new(t)
                        kids_of[parent] = {tok[kids]: kids, t: child}
                else:
                    child = kids.get(t, -1)
                    if child < 0:
                        child = kids[t] = self._new(t)
                cnt[child] += 1
                succ[parent] += 1
                best = best_of[parent]
                if best >= 0 and best != child:
                    if cnt[child] > cnt[best] or (cnt[child] == cnt[best] and t < tok[best]):
                        best_of[parent] = child
                new_active.append(child)
            if len(new_active) > depth_cap:
                new_active.pop()  # a node at depth max_depth has no children
            active = new_active
            doc.append(t)
        self._active = active
        self.tokens += len(tokens)
        self._evict()

    def _evict(self) -> None:
        while len(self._docs) > 1 and (self.nodes > self.max_nodes or self.tokens > self.max_tokens):
            self._remove(self._docs.popleft())
            self.evicted += 1

    def _remove(self, doc: array) -> None:
        """Undo a document's counts: replay it, decrementing; unlink nodes that reach 0."""
        depth_cap = self.max_depth
        tok, cnt, succ, best_of, kids_of = self._tok, self._cnt, self._succ, self._best, self._kids
        freed = []
        active = [self.ROOT]
        for t in doc:
            new_active = [self.ROOT]
            for parent in active:
                child = self._child(parent, t)
                cnt[child] -= 1
                succ[parent] -= 1
                if best_of[parent] == child:
                    best_of[parent] = -1  # it may no longer be the max: rescan lazily
                if cnt[child] == 0:  # no occurrence left; its descendants reach 0 in turn
                    kids = kids_of[parent]
                    if kids.__class__ is int:
                        kids_of[parent] = None
                    else:
                        del kids[tok[child]]
                        if len(kids) == 1:
                            (kids_of[parent],) = kids.values()
                    freed.append(child)
                new_active.append(child)
            if len(new_active) > depth_cap:
                new_active.pop()
            active = new_active
        self.nodes -= len(freed)
        self._free.extend(freed)  # reusable only now: the replay still walked through them
        self.tokens -= len(doc)

    # -- lookup -------------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int]) -> int:
        node = self.ROOT
        for t in tokens:
            node = self._child(node, t)
            if node < 0:
                return -1
        return node

    def _match(self, tail: list[int]) -> tuple[int, int]:
        """Longest suffix of ``tail`` whose node has a successor: (its length, node id or -1)."""
        for d in range(len(tail), 0, -1):
            node = self._walk(tail[len(tail) - d :])
            if node >= 0 and self._succ[node] > 0:
                return d, node
        return 0, -1

    def draft(self, context: Sequence[int], k: int, min_prob: float | None = None) -> LookupDraft:
        """Walk the most frequent continuation of ``context``'s longest match; see the class."""
        floor = self.min_prob if min_prob is None else min_prob
        path = list(context[-(self.max_depth - 1) :])
        d, node = self._match(path)
        out = LookupDraft(match=d)
        if node < 0 or k <= 0:
            return out
        prob = 1.0
        while len(out.tokens) < k:
            if self._succ[node] == 0:  # a document's end, or depth max_depth: back off
                d, node = self._match(path[len(path) - (d - 1) :] if d > 1 else [])
                if node < 0:
                    break
            best = self._best_child(node)
            prob *= self._cnt[best] / self._succ[node]
            if prob < floor:
                break
            token = self._tok[best]
            out.tokens.append(token)
            out.probs.append(prob)
            path.append(token)
            node = best
            d += 1
        return out

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """The tokens of ``draft(context, k)``."""
        return self.draft(context, k).tokens


# ---------------------------------------------------------------------------------------
# SuffixCorpus: the job-wide index of the `suffix` drafter, and each row's own text.
# ---------------------------------------------------------------------------------------


MIN_MATCH = 2  # SuffixRow prefers drafts from suffix matches at least this long


class SuffixCorpus:
    """The job-wide side of the ``suffix`` drafter (SuffixDecoding-style; ``drafters.SuffixDrafter`` wraps it).

    Holds the global ``SuffixIndex`` over every admitted prompt and every finished
    completion. ``open(prompt)`` adds the prompt and returns the row's ``SuffixRow``,
    which keeps a small local index over the row's own text (prompt + completion so far);
    a row's draft is the better of the local and the global draft by ``LookupDraft.score``
    (expected accepted tokens; ties go to the local one, the row's own text being the more
    specific evidence). ``SuffixRow.finish()`` adds the completion, preceded by the last
    ``max_depth - 1`` prompt tokens so the index learns how answers start after a prompt's
    end (those tail tokens are then counted twice, once per document: counts are over
    documents as added).

    Memory: the global index's bound (see ``SuffixIndex``) plus, per open row, a local
    index of at most ``local_depth × len(text)`` nodes (≈ 8 × 1300 × 100 B ≈ 1 MB for a
    1000-token prompt and 300 generated tokens with the defaults).

    Indexing is lazy: documents wait in ``pending`` until the global index is read (``index``),
    and a row builds its local index on its first draft. A job that drafts nothing (auto's PLAIN
    arm) pays for neither; the first draft after plain rounds catches up, in the order the
    documents came, so the index is the one eager indexing would have built.
    """

    def __init__(
        self,
        index: SuffixIndex | None = None,
        *,
        local_depth: int = 8,
        min_prob: float = 0.1,
    ) -> None:
        self._index = index if index is not None else SuffixIndex(min_prob=min_prob)
        self.pending: deque[array] = deque()  # documents not yet in the index, oldest first
        self.pending_tokens = 0
        self.local_depth = local_depth
        self.min_prob = min_prob

    @property
    def index(self) -> SuffixIndex:
        """The global index, every document added so far in it. O(pending tokens × depth) after plain rounds."""
        for document in self.pending:
            self._index.add(document)
        self.pending.clear()
        self.pending_tokens = 0
        return self._index

    def add(self, document: Sequence[int]) -> None:
        """A new document for the global index (indexed when the index is next read). The waiting documents keep
        the index's token bound: those the index would evict once the newer ones are in are dropped now, so a job
        that never drafts holds no more than the index would."""
        self.pending.append(array("i", document))
        self.pending_tokens += len(document)
        while len(self.pending) > 1 and self.pending_tokens > self._index.max_tokens:
            self.pending_tokens -= len(self.pending.popleft())
            self._index.evicted += 1

    def completion_document(self, prompt: Sequence[int], completion: Sequence[int]) -> list[int]:
        """The document a finished row adds: its prompt's tail, then its completion."""
        tail = self._index.max_depth - 1
        return list(prompt[-tail:]) + list(completion)

    def open(self, prompt: Sequence[int]) -> SuffixRow:
        """Admit a row: add its prompt to the global index, return its per-row drafter."""
        self.add(prompt)
        return SuffixRow(self, prompt)


class SuffixRow:
    """One row of a ``SuffixCorpus``: its text, a local index over it, and the global one."""

    def __init__(self, drafter: SuffixCorpus, prompt: Sequence[int]) -> None:
        self.drafter = drafter
        self.prompt = list(prompt)  # [prompt_len]
        self.completion: list[int] = []  # [generated]
        self.text = list(prompt)  # [prompt_len + generated]
        self.local: SuffixIndex | None = None  # over text[:local.tokens] (it never evicts); built on the first draft
        self.finished = False

    def extend(self, tokens: Sequence[int]) -> None:
        """Committed tokens (indexed locally on the next draft, O(local_depth) per token then)."""
        self.text.extend(tokens)
        self.completion.extend(tokens)

    def _local(self) -> SuffixIndex:
        """The local index over the whole text: built on the first draft, then extended by what came since."""
        if self.finished:
            raise RuntimeError("drafting a finished row")
        if self.local is None:
            self.local = SuffixIndex(max_depth=self.drafter.local_depth, max_nodes=1 << 62, max_tokens=1 << 62,
                                     min_prob=self.drafter.min_prob)
            self.local.add(self.text)
        else:
            self.local.extend(self.text[self.local.tokens:])
        return self.local

    def draft(self, k: int) -> LookupDraft:
        """The better of the local and the global draft by score, then by match length (ties: local).

        A draft from a match shorter than ``MIN_MATCH`` tokens (one token seen once says
        little) loses to one from a longer match whatever its score.

        O(depth² + k·depth)."""
        local = self._local().draft(self.text, k)
        shared = self.drafter.index.draft(self.text, k)
        if shared.match < MIN_MATCH <= local.match:
            return local
        if local.match < MIN_MATCH <= shared.match:
            return shared
        return shared if (shared.score, shared.match) > (local.score, local.match) else local

    def propose(self, k: int) -> list[int]:
        return self.draft(k).tokens

    def finish(self, add_to_index: bool = True) -> None:
        """The row is done: add its completion document to the job index (once); free the local."""
        if not self.finished and add_to_index:
            self.drafter.add(self.drafter.completion_document(self.prompt, self.completion))
        self.finished = True
        self.local = None  # drafting a finished row is a caller error
