"""Constrained decoding: a row's answer in the shape the job needs (JSON schema, any JSON object, regex, choice).

A constraint is a *mask* on the target's logits that is a pure function of the row's own
committed prefix (docs/design.md, "Constrained decoding"): at every position the row's token is
``argmax(warp(masked logits) + g)``, ``g`` the row's Gumbel noise (``sampling``; g = 0 for
greedy rows). Tokens the grammar refuses get ``-inf`` before temperature, top-k and top-p
(as vLLM applies its grammar bitmask); EOS is allowed only where the grammar accepts. Every
mode computes the same function of the same prefix, so a constrained row is the same under
``ar``, ``eqspec``, ``exspec`` and ``auto``, any drafter, k and batch.

- ``Constraint``: what a row must match, parsed from a flag or a ``response_format`` cell
  (``from_response_format``); ``problem`` names what is wrong with it (a bad schema, regex or
  unsupported keyword) before any row runs.
- ``Guide``: the run's per-row matchers, each holding exactly the row's committed tokens.
  Before a round's verification ``walk`` follows a row's drafts on its matcher, cuts them at
  the first token the grammar refuses (it can never be the target's masked choice), takes
  one mask per verify position (the committed prefix plus the drafts before it), and rolls
  the matcher back; ``extend`` then consumes what the round committed. Nothing a forward
  does touches a matcher, so an out-of-memory retry finds them as they were; a resumed run
  decodes its unfinished rows from their prompts, with matchers built afresh.
- ``drafters.GrammarDrafter`` drafts what ``Guide.forced`` says the grammar forces next (``{"``, a
  key, ``": "``, a closing brace); the target verifies those drafts like any other.

The grammar library is llguidance (no dependencies, an abi3 wheel, ``rollback``,
``compute_ff_tokens`` and per-draft-position masks) rather than xgrammar (which pulls in
triton); ``docs/design.md`` says more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import one_line


KINDS = ("json_schema", "json", "regex", "choice")
ANY_JSON_OBJECT = '{"type": "object"}'
# JSON is written as Python's json.dumps writes it: ", " and ": " separators and no other whitespace (a schema's
# own "x-guidance" options may say otherwise). Free whitespace would let a row pad its answer with blanks, and it
# leaves nothing forced: after "{" a blank is as allowed as the key, so the grammar drafter would have no drafts.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint that cannot be used; the message names the problem in one line."""


@dataclass(frozen=True)
class Constraint:
    """What a row's completion must match. ``text``: the schema (canonical JSON), the regex, or the choices as a
    JSON list; ``error``: why a row's own constraint cannot be used (that row becomes an error row)."""

    kind: str  # json_schema | json | regex | choice | invalid | text (a row's own: none, ``TEXT``)
    text: str = ""
    error: str | None = None

    def grammar(self) -> str:
        """The llguidance grammar (its validity is checked by ``problem``, or when a matcher is built)."""
        import llguidance

        if self.kind in ("json", "json_schema"):
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT if self.kind == "json" else self.text,
                                                                 defaults=JSON_STYLE)
        if self.kind == "regex":
            return llguidance.grammar_from("regex", self.text)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.text)
        raise ConstraintError(self.error or f"unknown constraint kind {self.kind!r}")

    def describe(self) -> str:
        """One line for messages and the fingerprint."""
        return self.kind if self.kind == "json" else f"{self.kind} {self.text}"


def invalid(error: str) -> Constraint:
    return Constraint("invalid", error=error)


# A row's own ``{"type": "text"}``: no constraint, whatever the job's. Not None, which is a missing or null
# response_format: that row takes the job's constraint (``of_row``).
TEXT = Constraint("text")


def of_row(own: Constraint | None, job: Constraint | None) -> Constraint | None:
    """The constraint a row decodes under: its own response_format's (``TEXT``: none), else the job's."""
    if own is None:
        return job
    return None if own == TEXT else own


def _parsed(value, what: str):
    """JSON text parsed (anything else as it is); ConstraintError naming ``what`` when it is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"{what} is not valid JSON: {exc}") from None


def json_schema(schema) -> Constraint:
    """A JSON schema given as a dict or as JSON text."""
    schema = _parsed(schema, "the JSON schema")
    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))  # the properties in their order


def regex(pattern: str) -> Constraint:
    if not pattern:
        raise ConstraintError("the regex is empty")
    return Constraint("regex", pattern)


def choice(options) -> Constraint:
    options = list(options)
    if not options or not all(isinstance(o, str) and o for o in options):
        raise ConstraintError(f"choices must be non-empty strings, got {options!r}")
    return Constraint("choice", json.dumps(options, ensure_ascii=False))


def any_json() -> Constraint:
    return Constraint("json")


def from_response_format(value) -> Constraint:
    """An OpenAI ``response_format`` object (as a dict or JSON text), or a bare JSON schema; ``TEXT`` for
    ``{"type": "text"}`` (no constraint, not even the job's). ConstraintError names what is wrong with it."""
    value = _without_nulls(_parsed(value, "response_format"))
    if not isinstance(value, dict):
        raise ConstraintError(f"response_format must be a JSON object, got {value!r}")
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return TEXT
    if kind == "json_object":
        return any_json()
    if kind == "json_schema" and "properties" not in value:
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintError("response_format of type json_schema needs a 'json_schema' object")
        if "schema" not in spec:
            raise ConstraintError("response_format json_schema has no 'schema'")
        return json_schema(spec["schema"])
    return json_schema(value)  # a bare schema


def _without_nulls(value):
    """An object without null members (a table's struct column gives every row the keys other rows have)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _invalid(constraint: Constraint, error) -> str:
    """One line: what kind of constraint cannot be used, and llguidance's reason (an exception or its text)."""
    return f"invalid {constraint.kind.replace('_', ' ')}: {one_line(error)}"


def problem(constraint: Constraint) -> str | None:
    """What is wrong with a constraint (an invalid schema or regex, an unsupported keyword), or None."""
    if constraint.error is not None:
        return constraint.error
    if constraint == TEXT:
        return None
    from llguidance import LLMatcher

    try:
        message = LLMatcher.validate_grammar(constraint.grammar())
    except ValueError as exc:
        message = str(exc)
    if message:
        return _invalid(constraint, message)
    return None


def tokenizer_for(hf_tokenizer, eos_ids: list[int]):
    """llguidance's view of a Hugging Face fast tokenizer, with the model's whole EOS set (about a second)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=sorted(set(eos_ids)))


class Guide:
    """The constrained rows of a run: one matcher per row, holding exactly its committed tokens.

    ``tokenizer``: a callable that returns the ``LLTokenizer`` (built on first use: unconstrained jobs never
    pay for it), or None when constraints cannot be used; ``vocab``: the target's logit width (ids past the
    tokenizer's vocabulary, embedding padding, are always masked on constrained rows)."""

    def __init__(self, tokenizer: Callable[[], object] | None, vocab: int):
        self._make_tokenizer, self.vocab = tokenizer, vocab
        self._tokenizer = None
        self.matchers: dict[int, object] = {}  # row -> llguidance.LLMatcher

    @property
    def tokenizer(self):
        if self._tokenizer is None and self._make_tokenizer is not None:
            self._tokenizer = self._make_tokenizer()
        return self._tokenizer

    def clear(self) -> None:
        self.matchers.clear()

    def admit(self, row: int, constraint: Constraint | None) -> str | None:
        """Build the row's matcher; the problem with its constraint (the row's error), or None."""
        if constraint is None:
            return None
        if constraint.error is not None:
            return constraint.error
        if self._make_tokenizer is None:
            return "constrained decoding needs the target's tokenizer"
        from llguidance import LLMatcher

        try:
            matcher = LLMatcher(self.tokenizer, constraint.grammar(), log_level=0)
        except ValueError as exc:
            return _invalid(constraint, exc)
        if matcher.is_error():
            return _invalid(constraint, matcher.get_error())
        self.matchers[row] = matcher
        return None

    def any(self, rows: list[int]) -> bool:
        return bool(self.matchers) and any(r in self.matchers for r in rows)

    def extend(self, row: int, tokens: list[int]) -> None:
        """The row committed ``tokens`` (each one its mask allowed)."""
        matcher = self.matchers.get(row)
        if matcher is not None and tokens and not matcher.is_stopped():
            matcher.consume_tokens(tokens)

    def finish(self, row: int) -> None:
        self.matchers.pop(row, None)

    def forced(self, row: int, k: int) -> list[int]:
        """Up to k tokens the grammar forces next (none for an unconstrained row)."""
        matcher = self.matchers.get(row)
        if matcher is None or matcher.is_stopped():
            return []
        return matcher.compute_ff_tokens()[:k]

    def walk(self, rows: list[int], drafts: list[list[int]], eos: set[int], n: int) -> tuple[list[int], torch.Tensor]:
        """Cut each row's drafts at the first token its grammar refuses and take its masks.

        rows: [G] row ids; drafts: [G] each row's real drafts (fewer than ``n``); eos: the EOS set;
        n: verify positions. Returns (lengths [G]: drafts kept, masks [G, n, V] bool on the CPU):
        ``masks[i, j]`` allows what the grammar allows after the row's committed tokens and its
        drafts before j (all True for unconstrained rows, and past a row's cut). The matchers are
        rolled back: they hold the committed tokens only, whatever happens next.
        """
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        words = (self.tokenizer.vocab_size + 31) // 32
        bitmask = allocate_token_bitmask(len(rows) * n, self.tokenizer.vocab_size)  # all allowed
        constrained = torch.zeros(len(rows) * n, dtype=torch.bool)
        lengths = []
        for i, (row, row_drafts) in enumerate(zip(rows, drafts)):
            matcher = self.matchers.get(row)
            if matcher is None:
                lengths.append(len(row_drafts))
                continue
            consumed = kept = 0
            try:
                for j in range(len(row_drafts) + 1):
                    at = i * n + j
                    fill_next_token_bitmask(matcher, bitmask, at)
                    constrained[at] = True
                    if j == len(row_drafts):
                        break
                    token = row_drafts[j]
                    if not 0 <= token < 32 * words or not (int(bitmask[at, token // 32]) >> (token % 32)) & 1:
                        break
                    kept = j + 1
                    if token in eos:  # the row ends here: later positions are never committed
                        break
                    matcher.consume_token(token)
                    consumed += 1
            finally:
                if consumed:
                    matcher.rollback(consumed)
            lengths.append(kept)
        return lengths, self._unpack(bitmask, constrained).reshape(len(rows), n, self.vocab)

    def _unpack(self, bitmask: torch.Tensor, constrained: torch.Tensor) -> torch.Tensor:
        """[N, words] int32 bits -> [N, vocab] bool; unconstrained rows all True, padding ids of the others False."""
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [N, words, 32]
        allowed = bits.reshape(bitmask.shape[0], -1).bool()[:, : min(self.vocab, self.tokenizer.vocab_size)]
        if allowed.shape[1] < self.vocab:
            allowed = torch.nn.functional.pad(allowed, (0, self.vocab - allowed.shape[1]), value=False)
        allowed |= ~constrained[:, None]
        return allowed | ~allowed.any(-1, keepdim=True)  # a position after the row's end: anything (never kept)

