"""Dataclasses at the boundaries of the engine: what goes in, what comes out.

Vocabulary (used across the package):
- *target*: the model whose output we must reproduce; *draft*: the small model that proposes.
- *round*: draft k tokens per row, verify them in one target forward, accept, commit.
- *accepted*: drafts equal to (greedy) or accepted against (sampling) the target.
- *correction*: the target's own token at the first rejected position; *bonus*: the
  target's extra token when all k drafts were accepted. A round emits accepted + 1 tokens.
- *acceptance length*: tokens a row commits per speculative round (k > 0), **counting** the
  correction/bonus token: 1 + accepted drafts / row-rounds of speculative rounds; plain steps
  do not count (``stats.acceptance_length``, the one definition).
- *group*: the rows that go through one round together; *pool*: the in-flight sequences
  of the EXSPEC runner; *realignment*: moving KV so a group is one left-padded rectangle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .constraints import Constraint


class NonFiniteLogits(RuntimeError):
    """The target gave a NaN or infinite logit for a live row: the round is refused, nothing of it committed."""


@dataclass(frozen=True)
class Sampling:
    """How one row picks its tokens. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Request:
    """One prompt, tokenized, ready for the engine."""

    row: int  # index of the input row (output order)
    id: str  # the row's id (key of its random streams)
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    bucket: int = 0
    pad_to: int = 0  # left-pad the prompt to this length at admission (bucket's longest)
    logprobs: int | None = None  # None: none wanted; N >= 0: each token's log-probability and the top N (<= 20)
    stop: tuple[str, ...] = ()  # the row's own stop strings, in addition to the job's --stop
    constraint: "Constraint | None" = None  # the shape the completion must have (constraints.py); None: free text
    sample: int = 0  # which of the input row's --n samples (its noise key: sampling.row_key(seed, id, sample))


@dataclass
class TokenLogprob:
    """One completion token's log-probability under the target, and the target's top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # [N] (token id, logprob), most probable first

    @classmethod
    def from_record(cls, record: dict) -> "TokenLogprob":
        """From its ``dataclasses.asdict`` form as stored in a table (``top`` as (id, logprob) structs)."""
        return cls(record["token_id"], record["logprob"],
                   [(t["token_id"], t["logprob"]) if isinstance(t, dict) else tuple(t) for t in record["top"]])


@dataclass
class RowResult:
    """A finished row, emitted by the engine as soon as it is done."""

    row: int
    id: str
    token_ids: list[int]  # completion tokens, the stop token (EOS) included when hit
    finish_reason: str  # stop | length | stop_string | error
    error: str | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] when the request asked for them


@dataclass
class WidthChosen:
    """``--batch-size auto``: the batch width a run measured and chose, before its first row."""

    width: int  # the rows a step runs at most
    rates: dict[int, float]  # tokens per second of a plain step, by width (empty: nothing to measure)
    stopped: str  # why no wider width was measured
    remembered: bool = False  # the width this machine measured before for the same model and job shape


@dataclass
class PolicyTrace:
    """What the policy (``control``) expected and chose for one round: its trace, kept out of the step's facts so
    that a statistic is never read from the decision it checks. Zeros and "" under a fixed k and for prefills."""

    expected_tokens: float = 0.0  # scalar: the committed tokens the policy expected of the round (before stops)
    expected_ms: float = 0.0  # scalar: the policy's modelled cost of the round (0: not modelled, fixed k)
    plain_ms: float = 0.0  # scalar: the policy's modelled cost of a plain step (k = 0) of the same group
    arm: str = ""  # auto's arm for the round: "plain" (plain steps and forced runs) or "spec"; "" for a fixed k
    window_tokens_per_s: float = 0.0  # scalar: auto: the rate of the window the round closed (prefills out; 0: none)


@dataclass
class StepStats:
    """One step: one group through one round (or one AR step, or an admission's prefill).

    The fields are the step's facts: what ran and what it committed, as measured. The policy's
    trace (what it expected and chose) is a record of its own, ``trace``. The statistics file
    has one column per fact, then one per trace field (``record`` / ``from_record``).
    """

    bucket: int  # the length bucket of the group's first row
    step: int  # 1, 2, ... over the job (prefills included)
    group_kind: str  # same_length | realigned | prefill | ar (from the grouping's decision)
    batch_size: int  # rows in the group: G
    k: int  # the round's speculation length (0: a plain step)
    accepted: list[int]  # [G] drafts accepted and kept this round
    tokens_emitted: int  # tokens committed this round over all rows (after stop cuts)
    pad_before: int  # padding columns in the group's rectangle before the round
    pad_after: int  # ... and after commit/realignment
    kv_moved: int  # KV entries (token x layer, both models) copied by realignment
    kv_gathered: int  # KV entries copied to assemble the group from the pool (a prefill: its samples' prompt KV)
    draft_ms: float  # drafting (the draft model's forwards, its catch-up included; model-free lookups)
    verify_ms: float  # the target's forward over [last committed, drafts] (a prefill's whole time)
    realign_ms: float  # moving the group's rows into one rectangle when that realigned them
    gather_ms: float  # moving a group's rows into one slot range without realigning them (assembly)
    total_ms: float  # the whole round, its preparation included
    drafter: str = ""  # who drafted: "model", model-free drafters' names ("ngram", "suffix"), "" for k = 0
    drafted: int = 0  # draft tokens verified this round over all rows (rows may draft fewer than k)
    # prefill steps: prompt tokens the target computed (a shared prefix's new columns once, then each row's own
    # tokens), and prompt tokens whose KV a row took instead, from a shared prefix (``prefix``) or from another
    # sample of its input row (--n); 0 for rounds
    prompt_prefilled: int = 0
    prompt_reused: int = 0
    trace: PolicyTrace = field(default_factory=PolicyTrace)  # the policy's trace of the round

    def record(self) -> dict:
        """One flat row of the statistics file: the facts, then the trace's fields."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}
        return {**row, **asdict(self.trace)}

    @classmethod
    def from_record(cls, row: dict) -> "StepStats":
        """From a flat row (``record``); trace fields a row lacks keep their defaults."""
        trace = {f.name: row[f.name] for f in fields(PolicyTrace) if f.name in row}
        facts = {f.name: row[f.name] for f in fields(cls) if f.name in row and f.name != "trace"}
        return cls(**facts, trace=PolicyTrace(**trace))
