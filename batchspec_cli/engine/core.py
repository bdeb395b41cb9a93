"""The decoding engine: AR baseline, EQSPEC, EXSPEC and ``auto`` over one slot pool.

``Engine.run(requests)`` is a generator of events: a ``RowResult`` as soon as a row is
done and a ``StepStats`` for every step. Modes differ in how a step's *group* is chosen,
how it is brought into one rectangle, and which k it runs:

- ``ar``: the group is every live row; one target token per step (a round with k = 0).
- ``eqspec``: the group is every live row of a static batch, realigned into one
  left-padded rectangle (unpad -> append -> repad) before every round; finished rows
  leave (their slots are compacted away).
- ``exspec``: a pool of ``window`` slots; each step runs the largest group of rows with the
  same padded length (no realignment); when that group is smaller than ``min_group`` x the
  batch (by default: than a full batch), it is topped up with the rows closest in length,
  which are realigned to it (the EQSPEC fallback, for those rows only). New prompts are
  admitted into free slots as rows finish, one bucket per prefill. A group whose rows all
  carry much padding (its longest row has left) is trimmed to its longest content in the
  same move.
- ``auto``: EXSPEC grouping with the k of every round (0 = a plain step) chosen by the
  policy in ``control`` (plain against speculative decoding on measured throughput; inside
  speculation, each round's drafter and k from measured costs and each row's acceptance).

Drafters (``drafters``): the draft model (``ModelDrafter``: its own slot cache, caught up in
one forward when it lags) and model-free ones that propose from host-side indexes, all
behind ``propose(rows, k) -> Proposal``; rows may get fewer than k drafts, or none. The draft
model may come as a function that loads it (``assembly.LazyDraft``): it is called when the
draft is first used, so a job that never speculates never loads it. Tokens
are chosen by the Gumbel-max coupling of ``sampling`` (greedy rows: g = 0), so no choice of
mode, drafter or k changes an output.

Which rows run together and which rows move where is decided by pure functions in
``grouping`` (a ``StaticBatch`` strategy for ``ar``/``eqspec``, a ``Pool`` for
``exspec``/``auto``, each returning a ``MovePlan``); the ``align.SlotTable`` owns every
slot's geometry (pad, end, draft end, liveness) with its tokens and KV caches, and carries
plans out (``SlotTable.move``); ``pool.SlotPool`` moves it and the rows' state as one unit.
Without a drafter the pool holds one batch: rows that never speculate stay in step.

The engine keeps what lives as long as it does: the models, the policy, the model-free drafters
and the kept prefix. A run's state (its requests, slots, draft-model drafter, step counter and
clock since the last round) is one ``RunState``, handed to every admission and round and changed
there. One round: 0. prepare the group (``_prepare``: one rectangle, one slot range), then
(``_round``) choose k, 1. draft, 2. verify in one target forward, 3. accept, 4. commit; then
the policy observes the round's ``RoundReport``, and the round returns its ``RoundOutcome``
(its ``StepStats``, made from the report, and finished rows), which ``run`` yields. Which requests enter the pool,
and when, is ``admission.Admission``'s; where they go and their prefill, ``_admit``'s (rows that share a prompt
prefix take its KV from ``prefix.PrefixStore`` and prefill their own suffixes only). Exactly one host sync per
round (the commit's ``tolist``); step timers are CUDA events on a GPU, read after it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from ..config import DEFAULT, MODES
from ..models.attention import for_run, group_forward, kv_column_bytes, pack_rows, packable, packed_forward
from ..models.widths import WidthMemory
from ..policy.control import (Auto, Calibration, Choice, FixedK, Group, Offer, Policy, RoundReport, choose_width,
                              wider_pays)
from ..policy.grouping import MovePlan, Pool, StaticBatch
from . import drafters as drafting
from . import sampling
from .admission import Admission, error_row
from .align import CacheFull, SlotCache, SlotTable, device_tensor, selection
from .constraints import Guide
from .drafters import ModelDrafter, Proposal, Rows
from .events import NonFiniteLogits, PolicyTrace, Request, RowResult, StepStats, WidthChosen
from .logprobs import Recorder, RoundLogprobs
from .pool import SlotPool
from .prefix import MAX_TOKENS, MIN_TOKENS, PrefixStore, share_groups
from .slots import SlotState
from .stops import StopChecker

_RUNNING, _STOP, _LENGTH, _STOP_STRING, _BROKEN = 0, 1, 2, 3, 4  # _BROKEN: non-finite logits
_REASONS = {_STOP: "stop", _LENGTH: "length", _STOP_STRING: "stop_string"}
_CALIBRATION_CONTEXT = 16  # the draft's bare-forward timings run on a throwaway cache of this many columns


@dataclass
class EngineConfig:
    """The engine's settings; their defaults are the `generate` command's (``config.DEFAULT``)."""

    mode: str = DEFAULT.mode  # auto | ar | eqspec | exspec
    k: int = DEFAULT.k  # draft tokens per round (auto: the most)
    batch_size: int = 8  # rows a step runs at most (auto_width: the widest it may measure); generate's is "auto"
    window: int | None = DEFAULT.window  # pool size of exspec and auto (None: pool_window)
    # exspec: a same-length group smaller than this x batch is topped up by realigned rows. 1.0 (always a full
    # batch): on CPU a forward of fewer rows costs nearly as much, so fewer, fuller steps win (README).
    min_group: float = 1.0
    trim: bool = True  # exspec: a group's padding it no longer needs is dropped in its move (see _target_end)
    pad_id: int = 0
    logprobs_mode: str = DEFAULT.logprobs_mode  # the distribution of the rows' log-probabilities (logprobs.py)
    # --batch-size auto: the run measures plain steps at growing widths (AUTO_WIDTHS, up to batch_size) and keeps the
    # best (control.choose_width), within kv_memory bytes of KV (None: KV_MEMORY_SHARE of the memory free then).
    auto_width: bool = False
    kv_memory: int | None = None
    # ... and a width measured before for the same machine, model and job shape is run again (widths.WidthMemory)
    width_memory: WidthMemory | None = None
    # rows that share a prompt prefix at least this long take its KV instead of computing it (prefix.py); 0: never
    prefix_min: int = MIN_TOKENS
    prefix_max: int = MAX_TOKENS  # the kept prefix's most columns (its memory: one row of each model's KV)


def pool_window(batch_size: int, window: int | None = None) -> int:
    """The pool's size in rows (exspec, auto): ``window`` when given, else 4 x the batch size."""
    return window or 4 * batch_size


@dataclass
class ModelHandle:
    model: torch.nn.Module
    cache_kwarg: str  # "cache" or "past_key_values"


class Clock:
    """Marks within a round: host clocks on the CPU, CUDA events on a GPU (read after the round's sync)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, a: str, b: str) -> float:
        if a not in self.marks or b not in self.marks:
            return 0.0
        if self.cuda:
            return self.marks[a].elapsed_time(self.marks[b]) / 1e3
        return self.marks[b] - self.marks[a]


@dataclass
class Committed:
    """What each row of a round committed, on the host (read at the round's one sync)."""

    emitted: list[int]  # [G] tokens committed: accepted drafts + the correction or bonus, cut at EOS / limit / stop
    kept: list[int]  # [G] drafts accepted and kept
    codes: list[int]  # [G] _RUNNING, _STOP, _LENGTH or _STOP_STRING
    blocks: list[list[int]]  # [G, k+1] the round's tokens (accepted drafts, then the target's); first emitted count
    logprobs: RoundLogprobs | None = None  # the log-probabilities of the rows that asked (logprobs.Recorder)


@dataclass
class Prepared:
    """A group brought into one rectangle (``Engine._prepare``), for its round."""

    plan: MovePlan  # the grouping's decision; plan.slots: [G] the group's slots after the move
    moved: int  # KV entries copied for rows whose padded length changed (realignment)
    gathered: int  # KV entries copied for rows that only changed slot (assembly)
    pad_before: int  # the group's padding before the move
    bucket: int  # the first row's length bucket
    started: float  # perf_counter when the round began (its prepare included)
    clock: Clock  # the round's marks, "prepare" and "prepared" set


@dataclass
class SinceRound:
    """What happened since the last round ended: the next round's report counts it (the policy's wall clock)."""

    ended: float  # perf_counter when the last round ended (or the run started)
    draft_prefill_s: float = 0.0  # draft prefills at admission since then (within the next round's elapsed_s)
    admit_s: float = 0.0  # the target's admission prefills since then (within the next round's elapsed_s)


@dataclass
class RoundOutcome:
    """What one round did: its step's statistics and the rows it finished."""

    stats: StepStats
    finished: list[RowResult]


@dataclass
class RunState:
    """One run's state: handed to every admission and round, changed there, dropped when the run ends.

    What lives as long as the engine (models, kernels, the policy, the model-free drafters, the kept prefix) is the
    engine's; this is what one run (``Engine.run``) owns."""

    admission: Admission  # the run's requests, read as free slots ask for them
    pool: SlotPool  # the slots: their geometry (``table``) and the rows' state (``state``)
    logprobs: Recorder  # the rows that asked for log-probabilities
    models: contextlib.ExitStack  # the run's model settings (``for_run``), entered for the draft at its first use
    max_group: int  # rows a step runs at most: the batch, halved on out-of-memory
    since: SinceRound  # what happened since the last round (the policy's clock)
    drafter: ModelDrafter | None = None  # the draft model's drafter on the run's draft cache, built at its first use
    step: int = 0  # the last step's number (prefills included): ``next_step`` alone moves it

    @property
    def table(self) -> SlotTable:
        return self.pool.table

    @property
    def state(self) -> SlotState:
        return self.pool.state

    def next_step(self) -> int:
        """The number of a step that has happened (an admission's prefill, or a round that committed)."""
        self.step += 1
        return self.step


class DraftModel:
    """The engine's draft model: given loaded, or a function that loads it (``assembly.LazyDraft``), called at its
    first use (``handle``); once loaded it stays for the engine's life."""

    def __init__(self, draft: ModelHandle | Callable[[], ModelHandle]):
        self.loaded: ModelHandle | None = None if callable(draft) else draft
        self._load = draft if callable(draft) else None

    def handle(self) -> ModelHandle:
        if self.loaded is None:
            self.loaded = self._load()
        return self.loaded


def step_stats(report: RoundReport, prepared: Prepared, step: int, kind: str, pad_after: int,
               window: float | None) -> StepStats:
    """A round's step statistics, from its ``RoundReport`` and what preparing its group did. ``kind``: the
    grouping's label; ``pad_after``: the padding of the group's rows still live; ``window``: the rate of the
    window the round closed (``Policy.observe``)."""
    choice, realigned = report.choice, prepared.plan.realigns
    return StepStats(
        bucket=prepared.bucket, step=step, group_kind=kind, batch_size=report.group, k=choice.k,
        accepted=report.accepted, tokens_emitted=report.tokens, pad_before=prepared.pad_before, pad_after=pad_after,
        kv_moved=prepared.moved, kv_gathered=prepared.gathered, draft_ms=report.draft_s * 1e3,
        verify_ms=report.verify_s * 1e3, realign_ms=(report.prepare_s if realigned else 0.0) * 1e3,
        gather_ms=(0.0 if realigned else report.prepare_s) * 1e3, total_ms=report.total_s * 1e3,
        drafter=drafting.label(report.drafters), drafted=sum(report.drafted),
        trace=PolicyTrace(expected_tokens=choice.expected_tokens, expected_ms=choice.expected_s * 1e3,
                          plain_ms=choice.plain_s * 1e3, arm=choice.arm, window_tokens_per_s=window or 0.0))


AUTO_WIDTHS = (8, 16, 32, 64, 128, 256)  # --batch-size auto measures these widths, narrowest first
KV_MEMORY_SHARE = 0.25  # --batch-size auto: the rows' KV may take this share of the memory free when the run starts
PREFILL_TOKENS = 4096  # columns x rows of one prefill forward: a wide batch of long prompts is not one giant forward


def prefill_chunks(slots: list[int], columns: int, most: int = PREFILL_TOKENS) -> Iterator[tuple[list[int], int, int]]:
    """The forwards that prefill ``columns`` columns of ``slots``: (rows, first column, end column), each at most
    ``most`` tokens (rows x columns). Rows go in groups of ``most // columns``; a row longer than ``most`` alone, in
    column chunks, each chunk attending to the columns cached before it (as a decode step does)."""
    if columns <= 0:
        return
    rows_per = max(1, most // columns)
    step = columns if rows_per > 1 else min(columns, most)
    for i in range(0, len(slots), rows_per):
        for start in range(0, columns, step):
            yield slots[i : i + rows_per], start, min(columns, start + step)


def _by_start(slots: list[int], starts: dict[int, int]) -> list[tuple[int, list[int]]]:
    """(start column, the slots that start there), by start column."""
    groups: dict[int, list[int]] = {}
    for s in slots:
        groups.setdefault(starts[s], []).append(s)
    return sorted(groups.items())


def _contiguous_first(free: list[int], n: int) -> list[int]:
    """n free slots, one contiguous run when there is one (the admitted group then reads views)."""
    for i in range(len(free) - n + 1):
        if free[i + n - 1] - free[i] == n - 1:
            return free[i : i + n]
    return free[:n]


class Engine:
    def __init__(self, target: ModelHandle, draft: ModelHandle | Callable[[], ModelHandle] | None, eos_ids: list[int],
                 cfg: EngineConfig, stop_checker: StopChecker | None = None,
                 lookups: list[drafting.Drafter] | None = None, policy: Policy | None = None,
                 guide: Guide | None = None):
        """``draft``: the draft model, or a function that loads it, called when the draft is first used (auto:
        at its first speculative trial; eqspec and exspec: at their first admission). ``guide``: the constrained
        rows' matchers (``constraints.Guide``)."""
        if cfg.mode not in MODES:
            raise ValueError(f"unknown mode {cfg.mode!r}")
        plain = cfg.mode == "ar"
        self.draft = None if plain or draft is None else DraftModel(draft)
        drafts = self.draft is not None
        self.lookups = [] if plain else list(lookups or [])
        if cfg.mode in ("eqspec", "exspec") and not drafts and not self.lookups:
            raise ValueError(f"mode {cfg.mode} needs a drafter")
        self.target, self.cfg = target, cfg
        self.max_k = 0 if plain or (not drafts and not self.lookups) else cfg.k
        self._set_width(cfg.batch_size)
        self.width_rates: dict[int, float] | None = None  # --batch-size auto: tokens/s by width, once measured
        self.device = next(target.model.parameters()).device
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.eos_set = set(eos_ids)
        self.stop_checker = stop_checker
        self.context = int(getattr(target.model.config, "max_position_embeddings", 0) or 0) or None
        self.vocab = target.model.get_output_embeddings().weight.shape[0]
        # The constrained rows' matchers (constraints.py); without a tokenizer a constrained row is an error row.
        self.guide = guide if guide is not None else Guide(None, self.vocab)
        for drafter in self.lookups:
            if hasattr(drafter, "bind"):
                drafter.bind(self.guide)
        self.has_draft = drafts and self.max_k > 0  # a draft model, loaded or not yet
        # The policy and its measurements outlive a run (a distributed worker runs one per block).
        if policy is None:
            policy = Auto(self.max_k) if cfg.mode == "auto" and self.max_k else FixedK(self.max_k)
        self.policy: Policy = policy
        # The last shared prompt prefix's KV (both models): it outlives a run, so the next run's rows reuse it too.
        self.prefixes = PrefixStore(cfg.prefix_max)

    # ------------------------------------------------------------------ public
    def run(self, requests: Iterable[Request]) -> Iterator[RowResult | StepStats]:
        """Decode every request; the models run the folded GQA attention and a contiguous output head
        (``attention.for_run``) for the run only.
        Requests with a length (a list, the job's rows) tell ``auto`` how much work is ahead. With
        ``auto_width`` the first run measures the batch width first (``WidthChosen``). The run's state is one
        ``RunState``, handed to every admission and round."""
        admission = Admission(requests, self.batch_size)
        with contextlib.ExitStack() as models:
            models.enter_context(for_run(*(h.model for h in self._loaded())))
            if self.cfg.auto_width and self.width_rates is None:
                yield self._measure_width(admission)
            admission.batch_size = self.batch_size
            yield from self._decode(self._start(admission, models))

    def _decode(self, run: RunState) -> Iterator[RowResult | StepStats]:
        """Admit, choose a group, prepare it and run its round, until every request is done."""
        while True:
            yield from self._admit_from(run)
            if not run.table.live:
                if run.admission.exhausted:
                    return
                continue
            group = self.strategy.select(run.pool.view(), run.max_group, run.step)
            try:
                prepared = self._prepare(run, group)
                group = prepared.plan.slots
                outcome = self._round(run, prepared)
            except torch.OutOfMemoryError as exc:
                yield from self._out_of_memory(run, group, exc)
                continue
            yield outcome.stats
            yield from outcome.finished

    def preload(self, saved: Iterable[tuple[list[int], list[int] | None]]) -> None:
        """Teach the model-free drafters the rows an interrupted run of the job saved: (prompt, completion or
        None), in run order, as the drafters of an uninterrupted run had learnt them."""
        for prompt, completion in saved:
            for drafter in self.lookups:
                drafter.preload(prompt, completion)

    # ------------------------------------------------------------------ state
    def _start(self, admission: Admission, models: contextlib.ExitStack) -> RunState:
        """A run's fresh state: empty slots, nothing drafted, no step yet (the guide's matchers are the run's)."""
        self.guide.clear()
        return RunState(admission, SlotPool(self.strategy.n_slots, self.device, with_draft=self.has_draft),
                        Recorder(self.cfg.logprobs_mode, self.device), models, max_group=self.batch_size,
                        since=SinceRound(time.perf_counter()))

    def _set_width(self, width: int) -> None:
        """The batch: at most ``width`` rows a step, and the slots that holds (a pool of ``window`` rows)."""
        cfg = self.cfg
        self.batch_size = width
        # Without a drafter the pool can never speculate: rows in step need no grouping, so it holds one batch.
        window = pool_window(width, cfg.window) if self.max_k else width
        self.strategy = (Pool(window, width, cfg.min_group, cfg.trim)
                         if cfg.mode in ("exspec", "auto") else StaticBatch(width))

    # ------------------------------------------------------------------ the batch width (--batch-size auto)
    @torch.no_grad()
    def _measure_width(self, admission: Admission) -> WidthChosen:
        """Time plain steps at growing widths on the job's typical context and keep the best (``control``).

        Each width runs bare one-token forwards of the target over a throwaway cache of that many rows and the
        context of the job's median row (or, where the job does not know it, its first row) plus half the first
        row's token limit (the timing does not depend on the cache's values; a decode step's rows each read their
        own columns, ``attention.column_spans``, so the median row's context is what a step costs on average).
        Widths stop at the job's rows, at the KV memory budget (the rows, or the pool's window where the engine can
        speculate, at the job's longest row's full length, or the first row's where that is not known) and at the
        first width that does not pay.
        """
        first = admission.peek()
        rows = admission.total if admission.total is not None else self.cfg.batch_size
        widths = [w for w in AUTO_WIDTHS if w <= self.cfg.batch_size]
        widths = [w for w in widths if w < rows] + [w for w in widths if w >= rows][:1]
        if first is None or len(widths) <= 1:
            self.width_rates = {}
            self._set_width(widths[0] if widths else self.cfg.batch_size)
            return WidthChosen(self.batch_size, {}, "the job has no more rows than the narrowest width")
        first_length = max(first.pad_to or 0, len(first.prompt_ids))
        context = (admission.typical or first_length) + first.max_new_tokens // 2
        longest = (admission.longest or first_length) + first.max_new_tokens + self.max_k + 1
        budget = self._kv_budget()
        row_bytes = (pool_window(1, None) if self.max_k else 1) * longest * kv_column_bytes(self.target.model)

        def fits(width: int) -> bool:  # its rows (the pool's window where it can speculate) at the longest length
            return not budget or width * row_bytes <= budget

        memory = self.cfg.width_memory
        job = {"mode": self.cfg.mode, "k": self.max_k, "draft": self.has_draft, "widths": widths,
               "context": 1 << max(0, context - 1).bit_length()}  # the context's power of two
        remembered = memory.recall(job) if memory is not None else None
        if remembered is not None and fits(remembered[0]):
            self.width_rates = remembered[1]
            self._set_width(remembered[0])
            return WidthChosen(self.batch_size, remembered[1], "measured before on this machine", remembered=True)
        rates, stopped = {}, "a wider batch did not pay"
        for width in widths:
            try:
                seconds = self._bare_step(width, context)
            except torch.OutOfMemoryError:
                self._empty_cache()
                stopped = "out of memory"
                break
            rates[width] = width / seconds
            wider = next((w for w in widths if w > width), None)
            if wider is None:
                stopped = "the widest width" if width < rows else "the job's rows"
                break
            if not fits(wider):
                stopped = f"the KV memory budget ({budget / 2**30:.1f} GiB)"
                break
            if not wider_pays(rates):
                break
        self.width_rates = rates
        self._set_width(choose_width(rates))
        if memory is not None:
            memory.remember(job, self.batch_size, rates)
        return WidthChosen(self.batch_size, rates, stopped)

    def _first_reservation(self, run: RunState, columns: int, limit: int) -> tuple[int, int]:
        """(columns, slots) to reserve at a run's first admission. When the job's longest padded prompt and its row
        count are known and the slots its rows will fill, at that length, fit the KV budget: exactly that (one
        allocation; no growth that copies every slot as longer buckets arrive). The slots are the pool's where the
        policy fills the pool, else one batch's (auto's PLAIN arm: a SPEC that wins later grows them). Else an
        eighth more columns than the first rows need (each bucket is at most about 10 % longer than the one
        before), slots as they come."""
        longest, total = run.admission.longest, run.admission.total
        if longest is not None and total is not None:
            reach = max(columns, longest + limit + self.max_k + 1)
            slots = min(self.strategy.n_slots if self.policy.wants_pool() else self.batch_size, total)
            column = sum(kv_column_bytes(h.model) for h in self._loaded())
            if slots * reach * column <= self._kv_budget():
                return reach, slots
        return columns + columns // 8, 0

    def _joining_end(self, run: RunState, end: int, limit: int) -> int:
        """The padded length rows admitted now take: where the live rows run as one batch (``ar``, ``eqspec``,
        auto's plain arm) and share one padded length that the new prompts fit in, with room in the KV buffers for
        the new rows' tokens, that length, so that the next round runs every row there and no row's KV moves
        (``grouping.target_end`` keeps the end most rows have); else ``end``, the chunk's own. A row's numbers do not
        depend on its padding."""
        table = run.table
        if not table.live or not table.target.n_layers \
                or (self.policy.wants_pool() and not isinstance(self.strategy, StaticBatch)):
            return end
        shared = {table.end[s] for s in table.live}
        if len(shared) != 1:
            return end
        joined = shared.pop()
        fits = end <= joined and joined + limit + self.max_k + 1 <= table.target.capacity
        return joined if fits else end

    def _loaded(self) -> list[ModelHandle]:
        """The target, and the draft model when it is loaded."""
        draft = self.draft.loaded if self.draft is not None else None
        return [self.target] + ([draft] if draft is not None else [])

    def _kv_budget(self) -> int:
        """The bytes the rows' KV may take: ``kv_memory``, else ``KV_MEMORY_SHARE`` of the memory free now (0:
        unknown)."""
        return self.cfg.kv_memory or int(KV_MEMORY_SHARE * (self._free_memory() or 0))

    def _bare_step(self, width: int, context: int) -> float:
        """Seconds of a one-token target forward of ``width`` rows at ``context``."""
        cache = SlotCache(width, context + 1)
        tokens = torch.full((width, 1), self.cfg.pad_id, dtype=torch.long, device=self.device)
        pad = torch.zeros(width, dtype=torch.long, device=self.device)
        times = []
        for _ in range(3):  # the first allocates the cache and builds the kernels of this size
            self._sync()
            began = time.perf_counter()
            group_forward(self.target.model, cache, self.target.cache_kwarg, slice(0, width), tokens, pad, context,
                          logits_to_keep=1)
            self._sync()
            times.append(time.perf_counter() - began)
        return min(times[1:])

    def _free_memory(self) -> int | None:
        from ..models.kernels import free_memory

        return free_memory(self.device)

    def _check(self, req: Request) -> str | None:
        if not req.prompt_ids:
            return "empty prompt after tokenization"
        if self.context is not None and len(req.prompt_ids) >= self.context:
            return f"prompt has {len(req.prompt_ids)} tokens; the model's context is {self.context}"
        return self.guide.admit(req.row, req.constraint)  # the row's matcher, or what is wrong with its constraint

    def _limit(self, req: Request) -> int:
        """A row's token limit, worked out once at admission (``SlotState.limit``)."""
        return req.max_new_tokens if self.context is None else min(req.max_new_tokens,
                                                                   self.context - len(req.prompt_ids))

    # ------------------------------------------------------------------ admission
    def _admit_from(self, run: RunState) -> Iterator[RowResult | StepStats]:
        """Admit new prompts into free slots, in chunks of at most a batch.

        The pooled modes admit a whole batch at a time (admitted rows form one same-length
        group); ar and eqspec refill their batch as soon as a quarter of it is free
        (continuous batching): the next round's ``_prepare`` realigns the batch, new rows
        included, into one rectangle. While the policy does not speculate (``wants_pool``
        false: auto's PLAIN arm, or no drafter) the pool, too, holds one batch, and refills
        every slot as soon as it is free: rows that a SPEC trial left out of step finish
        one by one, and waiting for a quarter of the batch would run most rows for more rounds
        than ``ar`` (docs/history.md, "Figures once kept in the code").
        """
        table = run.table
        free = table.free_slots()
        if not self.policy.wants_pool():  # plain steps only (auto's PLAIN arm): one batch in flight, kept full
            free = free[: max(0, self.batch_size - len(table.live))]
        elif table.live and len(free) < min(self.strategy.admit_at, self.strategy.n_slots):
            return
        for chunk in run.admission.chunks(free, lambda slot: not table.is_live(slot), self._check):
            if isinstance(chunk, RowResult):  # a request that cannot run
                yield chunk
            else:
                yield from self._admit(run, *chunk)

    def _admit(self, run: RunState, chunk: list[Request], free: list[int]) -> Iterator[RowResult | StepStats]:
        """Place prompts in free slots, left-padded to one padded length, and prefill the caches."""
        started = time.perf_counter()
        end = max(2, max(max(r.pad_to, len(r.prompt_ids)) for r in chunk))
        slots = _contiguous_first(free, len(chunk))
        limits = [self._limit(r) for r in chunk]
        table = run.table
        end = self._joining_end(run, end, max(limits))
        columns = end + max(limits) + self.max_k + 1
        rows = 0
        if not table.target.n_layers:  # the run's first rows: room for the next buckets
            columns, rows = self._first_reservation(run, columns, max(limits))
        try:  # the KV buffers hold the rows, with room for the longest they can become (no growth while decoding)
            run.pool.reserve(slots, columns, rows)
        except torch.OutOfMemoryError:
            self._empty_cache()
            for req in chunk:
                self.guide.finish(req.row)
                yield error_row(req, "out of memory: no room for this row's KV cache")
            return
        run.admission.admitted(limits)
        keys = [sampling.row_key(r.sampling.seed, r.id, r.sample) for r in chunk]
        run.pool.place(slots, chunk, end, keys, limits, self.cfg.pad_id, run.step)
        run.logprobs.admit(chunk)
        for drafter in self.lookups:
            for req in chunk:
                drafter.admit(req.row, req.prompt_ids)

        prefill_started = time.perf_counter()
        donors = self._donors(run, slots)  # samples of an input row whose prompt KV another slot holds or will
        fresh = [s for s in slots if s not in donors]
        starts, computed, reused = self._share_prefixes(run, [r for s, r in zip(slots, chunk) if s not in donors],
                                                        fresh)
        errors = self._prefill(run, fresh, end, starts) if fresh else []
        lost = [s for s, d in donors.items() if not table.is_live(d)]  # a donor that did not fit was freed
        if lost:
            donors = {s: d for s, d in donors.items() if s not in lost}
            errors += self._prefill(run, lost, end, dict.fromkeys(lost, 0))
            fresh += lost
        copied = self._share_prompts(run, donors, draft=False)
        self._sync()
        run.since.admit_s += time.perf_counter() - prefill_started
        if self.has_draft and self.policy.wants_draft():
            self._prefill_draft(run, [s for s in fresh if table.is_live(s)], end)
            copied += self._share_prompts(run, donors, draft=True)
            lagging = [s for s in donors if table.is_live(s) and table.draft_end[s] < end - 2]
            self._prefill_draft(run, lagging, end)
        self._sync()
        ms = (time.perf_counter() - started) * 1e3
        pads = sum(table.pad[s] for s in slots)
        prompt = {s: len(r.prompt_ids) for s, r in zip(slots, chunk)}
        yield StepStats(bucket=chunk[0].bucket, step=run.next_step(), group_kind="prefill", batch_size=len(chunk),
                        k=0, accepted=[], tokens_emitted=0, pad_before=pads, pad_after=pads, kv_moved=0,
                        kv_gathered=copied, draft_ms=0.0, verify_ms=ms, realign_ms=0.0, gather_ms=0.0, total_ms=ms,
                        prompt_prefilled=computed + sum(prompt[s] for s in fresh) - reused,
                        prompt_reused=reused + sum(prompt[s] for s in donors))
        yield from errors

    def _donors(self, run: RunState, slots: list[int]) -> dict[int, int]:
        """The rows just placed in ``slots`` that need no prefill of their own (the ``--n`` samples of one input
        row): slot -> the slot whose KV of the same prompt they copy, a live row with the same id and prompt ids,
        or the first such row of ``slots`` (prefilled first)."""
        rows, placed = run.state.rows, set(slots)
        holders: dict[str, int] = {}
        for s in run.table.live:
            if s not in placed:
                holders.setdefault(rows[s].id, s)
        donors = {}
        for s in slots:
            holder = holders.setdefault(rows[s].id, s)
            if holder != s and rows[holder].prompt_ids == rows[s].prompt_ids:
                donors[s] = holder
        return donors

    @torch.no_grad()
    def _share_prompts(self, run: RunState, donors: dict[int, int], draft: bool) -> int:
        """Copy the donors' prompt KV (``_donors``) into their samples' slots, the target's or the draft's
        (``SlotTable.share_prompt``); returns the KV entries copied."""
        live = [(d, s) for s, d in donors.items() if run.table.is_live(s)]
        return run.table.share_prompt(live, [len(run.state.rows[s].prompt_ids) for _, s in live], draft)

    @torch.no_grad()
    def _drafter(self, run: RunState) -> ModelDrafter:
        """The run's draft-model drafter on the run's draft cache, built at the run's first use of the draft; the
        model is loaded then if it is not yet (and runs with ``for_run`` for the rest of the run too)."""
        if run.drafter is None:
            loaded = self.draft.loaded is not None
            draft = self.draft.handle()
            if not loaded:  # loaded now, mid-run (a loaded draft entered ``for_run`` with the target)
                run.models.enter_context(for_run(draft.model))
            run.drafter = ModelDrafter(draft.model, draft.cache_kwarg, self.vocab, run.table.draft)
        return run.drafter

    def _share_prefixes(self, run: RunState, chunk: list[Request],
                        slots: list[int]) -> tuple[dict[int, int], int, int]:
        """Give the admitted rows that share a prompt prefix its target KV (``prefix``), computed once.

        Returns (the column each slot's prefill starts at, the prefix columns computed now, the prompt tokens the
        rows took from the prefix). A group's rows start at the first column where each of them has its prefix;
        only the columns before it are copied. Out of memory: nothing is shared (the store is dropped)."""
        starts = dict.fromkeys(slots, 0)
        if self.cfg.prefix_min <= 0:
            return starts, 0, 0
        table, store, prompts = run.table, self.prefixes, [r.prompt_ids for r in chunk]
        computed, reused = 0, 0
        ahead = run.admission.peek()  # the next row: a lone row's prefix is worth computing apart when it shares it
        try:
            for group in share_groups(prompts, store.tokens, self.cfg.prefix_min, self.cfg.prefix_max,
                                      ahead=ahead.prompt_ids if ahead is not None else None):
                store.hold(group.prefix)
                members = [slots[i] for i in group.rows]
                lengths = [min(store.match(prompts[i]), len(prompts[i]) - 1) for i in group.rows]
                computed += store.cover("target", self.target.model, self.target.cache_kwarg, max(lengths),
                                        self.device)
                start = min(table.pad[s] + n for s, n in zip(members, lengths))
                copied = [max(0, start - table.pad[s]) for s in members]
                table.share_prefix(store.caches["target"], False, members, copied)
                reused += sum(copied)
                starts.update(dict.fromkeys(members, start))
        except torch.OutOfMemoryError:
            self._empty_cache()
            store.clear()
            return dict.fromkeys(slots, 0), computed, 0
        return starts, computed, reused

    def _prefill(self, run: RunState, slots: list[int], end: int, starts: dict[int, int]) -> list[RowResult]:
        """Fill the target cache of new rows from their ``starts`` (the columns before them hold a shared prefix):
        one forward per start column; on out-of-memory, prefill the halves one after the other.

        A row that does not fit even alone becomes an error row (its slot is freed).
        """
        try:
            self._fill(self.target.model, run.table.target, self.target.cache_kwarg, run, slots, starts, end - 1)
            return []
        except torch.OutOfMemoryError:
            self._empty_cache()
            if len(slots) == 1:
                return [self._end_row(run, slots[0], "error", "out of memory while prefilling this prompt alone")]
            half = len(slots) // 2
            return self._prefill(run, slots[:half], end, starts) + self._prefill(run, slots[half:], end, starts)

    def _fill(self, model, cache: SlotCache, cache_kwarg: str, run: RunState, slots: list[int],
              starts: dict[int, int], stop: int) -> None:
        """Write ``model``'s KV for ``slots`` from their ``starts`` up to column ``stop``, in forwards of at most
        ``PREFILL_TOKENS`` tokens. Packed where the model allows (``attention.packable``: one sequence of the rows'
        own columns, no padding, each row causal on its own); else each start column's rows as a padded group."""
        table = run.table
        if packable(model, self.device):
            rows = [(s, table.pad[s], max(starts[s], table.pad[s]), stop) for s in slots]
            for pieces in pack_rows(rows, PREFILL_TOKENS):
                packed_forward(model, cache, cache_kwarg, table.layout.tokens, pieces)
            return
        for first, group in _by_start(slots, starts):
            for rows, start, end in prefill_chunks(group, stop - first, PREFILL_TOKENS):
                rows_index = selection(rows, self.device)
                group_forward(model, cache, cache_kwarg, rows_index, table.layout.tokens[rows_index, first + start :
                                                                                          first + end],
                              table.pads(rows), first + start, logits_to_keep=1)

    def _share_draft(self, run: RunState, slots: list[int]) -> None:
        """Rows whose draft cache covers none of their prompt take the kept prefix's draft KV where their prompt
        starts with it (computed once, when first needed): at admission, or at the draft's first catch-up of rows
        admitted while no draft was wanted. Out of memory: nothing is shared (the store is dropped)."""
        table, store, least = run.table, self.prefixes, self.cfg.prefix_min
        if least <= 0 or len(store.tokens) < least:
            return
        members, lengths = [], []
        for s in slots:
            prompt = run.state.rows[s].prompt_ids
            if table.draft_end[s] <= table.pad[s] and len(prompt) - 2 >= least:
                n = min(store.match(prompt), len(prompt) - 2)
                if n >= least:
                    members.append(s)
                    lengths.append(n)
        if not members:
            return
        drafter = self._drafter(run)  # the draft model, loaded on first use
        try:
            store.cover("draft", drafter.model, drafter.cache_kwarg, max(lengths), self.device)
            table.share_prefix(store.caches["draft"], True, members, lengths)
        except torch.OutOfMemoryError:
            self._empty_cache()
            store.clear()

    @torch.no_grad()
    def _prefill_draft(self, run: RunState, slots: list[int], end: int) -> None:
        """Fill the draft cache up to ``end - 2``; on out-of-memory leave it to the first round's catch-up."""
        if not slots or end - 2 <= 0:
            return
        started = time.perf_counter()
        table = run.table
        try:
            self._share_draft(run, slots)
            # rows that got a shared prefix start together at the first column all of them lack; the others at 0
            shared = [s for s in slots if table.draft_end[s] > table.pad[s]]
            first = min((table.draft_end[s] for s in shared), default=0)
            drafter = self._drafter(run)
            self._fill(drafter.model, table.draft, drafter.cache_kwarg, run, slots,
                       {s: first if s in shared else 0 for s in slots}, end - 2)
            self._sync()
        except torch.OutOfMemoryError:
            self._empty_cache()
            return
        finally:
            run.since.draft_prefill_s += time.perf_counter() - started
        table.draft_prefilled(slots, end)

    def _sync(self) -> None:
        """Outside rounds only (admission, calibration)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ calibration (auto)
    @torch.no_grad()
    def _calibrate(self, run: RunState, slots: list[int], rows_index, pad: torch.Tensor, T: int) -> Calibration:
        """Bare forward timings for the policy's speculative options, when it first asks (``wants_seed``).

        The target's verify of 2 and K+1 tokens runs on the group's own cache and context: it
        writes columns from the last committed one on, which every later forward writes again
        before anything reads them. The draft's step and first forwards (1, 2 and K+1 tokens)
        run on a throwaway cache of ``_CALIBRATION_CONTEXT`` columns of the group's text. A
        plain step's cost is what the real rounds measure. These only seed the policy: an
        option's first real round replaces its seed.
        """
        top = self.max_k + 1
        layout = run.table.layout
        layout.grow(T + top)

        def timed(model, cache: SlotCache, kwarg: str, rows, tokens: torch.Tensor, row_pad, start: int) -> float:
            self._sync()
            began = time.perf_counter()
            group_forward(model, cache, kwarg, rows, tokens, row_pad, start, logits_to_keep=1)
            self._sync()
            return time.perf_counter() - began

        last = layout.tokens[rows_index, T - 1 : T]  # [G, 1]
        verify = {w: timed(self.target.model, run.table.target, self.target.cache_kwarg, rows_index, last.repeat(1, w),
                           pad, T - 1) for w in sorted({2, top})}
        for w in range(3, top):  # linear in between
            verify[w] = verify[2] + (verify[top] - verify[2]) * (w - 2) / (top - 2)
        draft = None
        if self.has_draft:
            handle = self._drafter(run)  # loads the draft model at its first calibration
            context, group = min(T, _CALIBRATION_CONTEXT), len(slots)
            # tokens: [G, > context + K+1]
            tokens = layout.tokens[rows_index, T - context : T].repeat(1, 2 + top // context)
            cache, zeros = SlotCache(group, tokens.shape[1]), torch.zeros_like(pad)
            whole = slice(0, group)
            timed(handle.model, cache, handle.cache_kwarg, whole, tokens[:, :context], zeros, 0)  # prefill, warm-up
            draft = {w: timed(handle.model, cache, handle.cache_kwarg, whole, tokens[:, context : context + w], zeros,
                              context) for w in sorted({1, 2, top})}
            for w in range(3, top):
                draft[w] = draft[2] + (draft[top] - draft[2]) * (w - 2) / (top - 2)
        return Calibration(len(slots), T, verify, draft)

    def _out_of_memory(self, run: RunState, slots: list[int], exc: torch.OutOfMemoryError) -> Iterator[RowResult]:
        """A step ran out of memory: halve the group size and retry; a single row that still fails errors out.

        No rollback is needed: forwards write KV only past each row's committed length
        (``end``), which advances only at commit, after every forward succeeded; moves
        (``realign``) and buffer growth (``SlotCache.grow``) allocate everything before
        their first write. When the pool's buffers cannot grow (``CacheFull``) a smaller
        group cannot help: the group's longest row errors out instead.
        """
        self._empty_cache()
        slots = [s for s in slots if run.table.is_live(s)]
        if isinstance(exc, CacheFull):
            longest = max(slots, key=run.table.content)
            yield self._end_row(run, longest, "error", f"out of memory: {exc}")
            return
        if len(slots) > 1:
            run.max_group = max(1, len(slots) // 2)
            return
        yield self._end_row(run, slots[0], "error", "out of memory even for this row alone")

    # ------------------------------------------------------------------ one round
    def _prepare(self, run: RunState, slots: list[int]) -> Prepared:
        """0. Prepare: the selected group in one rectangle in one slot range (the round's clock starts here)."""
        started, clock = time.perf_counter(), Clock(self.device)
        pad_before = sum(run.table.pad[s] for s in slots)
        bucket = run.state.rows[slots[0]].bucket
        clock.mark("prepare")
        plan = self.strategy.plan(run.pool.view(), slots)
        moved, gathered = run.pool.move(plan)  # KV entries copied to realign and to assemble
        clock.mark("prepared")
        return Prepared(plan, moved, gathered, pad_before, bucket, started, clock)

    def _round(self, run: RunState, prepared: Prepared) -> RoundOutcome:
        """One round over a prepared group: k, draft, verify, accept, commit; what happened, as a ``RoundOutcome``.

        The round changes the run it is handed (its rows, its step, its clock since the last round) and the
        policy's measurements, and nothing of the engine's own."""
        plan, clock, started, state, table = prepared.plan, prepared.clock, prepared.started, run.state, run.table
        slots = plan.slots
        # 0. (prepared) The policy's k and the drafts' noise.
        T = table.end[slots[0]]
        rows_index = selection(slots, self.device)
        pad = table.pads(slots)  # [G]
        if self.policy.wants_seed():  # once, when speculation is first tried: not part of any round's own cost
            self.policy.seed(self._calibrate(run, slots, rows_index, pad, T))
            clock.mark("calibrated")
        proposals = self._lookup_proposals(run, slots, self.policy.proposing(tuple(d.name for d in self.lookups)))
        choice = self._choose(run, slots, proposals)
        k = choice.k
        noise = self._noise(run, slots, rows_index, k)
        table.layout.grow(T + k + 2)
        with torch.no_grad():
            # 1. Draft: up to k tokens per row (the draft model first catches up on what it has not seen).
            clock.mark("draft")
            draft, drafters = self._draft(run, slots, rows_index, pad, T, choice, proposals, noise)
            masks = self._constrain(run, slots, draft, k)  # cuts the drafts grammars refuse; None: no row constrained
            # 2. Verify: one target forward over [last committed, d_1..d_k].
            clock.mark("verify")
            inputs = table.layout.tokens[rows_index, T - 1 : T]
            if k:
                inputs = torch.cat([inputs, draft.tokens], dim=1)  # [G, k+1]
            logits = group_forward(self.target.model, table.target, self.target.cache_kwarg, rows_index, inputs,
                                   pad, T - 1)
            # 3. Accept: the longest prefix of drafts equal to the target's own tokens, plus its next token.
            masked = logits if masks is None else logits.masked_fill(~masks, float("-inf"))  # [G, k+1, V]
            target_tokens = self._choose_tokens(run, masked, rows_index, noise, 0)  # [G, k+1]
            logprobs = run.logprobs.device_values([state.rows[s] for s in slots],
                                                  masked if self.cfg.logprobs_mode == "processed" else logits,
                                                  target_tokens, state.temperature[rows_index],
                                                  state.top_k[rows_index], state.top_p[rows_index])
            if k:
                lengths = None if choice.source == "model" and masks is None \
                    else device_tensor(draft.lengths, self.device)
                n_acc, nxt = sampling.coupled_accept(draft.tokens, lengths, target_tokens)
            else:
                n_acc, nxt = torch.zeros_like(target_tokens[:, 0]), target_tokens[:, 0]
            clock.mark("accepted")
            # 4. Commit: write the block, apply stops, advance the rows.
            finite = torch.isfinite(logits.amax(-1)).all(-1)  # [G] no NaN, no +inf, not all -inf
            committed = self._commit(run, slots, rows_index, T, k, draft, n_acc, nxt, finite,
                                     logprobs)  # the round's one sync
        step = run.next_step()  # the round has committed (or is broken, which ends the run)
        if _BROKEN in committed.codes:
            broken = [state.rows[s].id for s, code in zip(slots, committed.codes) if code == _BROKEN]
            raise NonFiniteLogits(f"the target model gave non-finite logits (NaN or inf) for row {broken[0]!r}"
                                  f"{f' and {len(broken) - 1} more' if len(broken) > 1 else ''} at step "
                                  f"{step} ({self.target.model.dtype}); nothing of that round was kept")
        rows = [state.rows[s].row for s in slots]
        committed, results = self._bookkeep(run, slots, draft, committed)
        ended = time.perf_counter()
        prepare_s = clock.seconds("prepare", "prepared")
        calibrate_s = clock.seconds("prepared", "calibrated")
        report = RoundReport(
            choice=choice, context=T, rows=rows, drafted=draft.lengths, drafters=drafters,
            accepted=committed.kept, emitted=committed.emitted, finished=[r.row for r in results], fed=draft.fed,
            seconds=ended - started - prepare_s - calibrate_s, prepare_s=prepare_s, calibrate_s=calibrate_s,
            elapsed_s=ended - run.since.ended, draft_prefill_s=run.since.draft_prefill_s,
            admit_s=run.since.admit_s, tokens_left=run.admission.tokens_left(sum(state.tokens_left(table.live))),
            draft_s=clock.seconds("draft", "verify"), verify_s=clock.seconds("verify", "accepted"))
        run.since = SinceRound(ended)
        window = self.policy.observe(report)
        pad_after = sum(table.pad[s] for s in slots if table.is_live(s))
        return RoundOutcome(step_stats(report, prepared, step, self._kind(plan), pad_after, window), results)

    def _kind(self, plan: MovePlan) -> str:
        """The step's label, from the grouping decision (``kv_moved`` is counted apart, from what was copied)."""
        if self.cfg.mode == "ar":
            return "ar"
        return "realigned" if plan.realigns else "same_length"

    def _lookup_proposals(self, run: RunState, slots: list[int], names: tuple[str, ...]) -> dict[str, Proposal]:
        """The named model-free drafters' proposals for the group (K columns), cut where a row's limit is reached."""
        if not names or not self.max_k:
            return {}
        state = run.state
        rows = Rows([state.rows[s].row for s in slots])
        room = [max(0, min(self.max_k, left - 1)) for left in state.tokens_left(slots)]  # the target's token: 1
        proposals = {}
        for drafter in (d for d in self.lookups if d.name in names):  # no draft past the end
            proposal = drafter.propose(rows, self.max_k)
            proposal.lengths = [min(n, r) for n, r in zip(proposal.lengths, room)]
            proposals[drafter.name] = proposal
        drafting.continue_forced(proposals)  # a grammar's forced run, continued where another drafter agrees
        return proposals

    def _choose(self, run: RunState, slots: list[int], proposals: dict[str, Proposal]) -> Choice:
        """The policy's k for this round and who drafts: "model", "lookup" (the model-free drafters) or ""."""
        state, table = run.state, run.table
        rows = [state.rows[s].row for s in slots]
        remaining = sum(state.tokens_left(slots)) / len(slots)
        sources = {name: Offer(p.lengths) for name, p in proposals.items() if any(p.lengths)}
        if self.has_draft and not all(row in self.guide.matchers for row in rows):  # see _constrain
            sources["model"] = Offer(None, table.end[slots[0]] - table.draft_reach(slots))
        choice = self.policy.choose(Group(rows, table.end[slots[0]], remaining), sources)
        if not choice.k:
            choice.source = ""
        return choice

    def _noise(self, run: RunState, slots: list[int], rows_index, k: int):
        """(noise seeds [G, k+1], sampled flags, filter flags) for the round's positions; None when all greedy."""
        state = run.state
        rows = [state.rows[s] for s in slots]
        sampled = [not r.sampling.greedy for r in rows]
        if not any(sampled):
            return None
        filters = (any(r.sampling.top_k > 0 for r in rows if not r.sampling.greedy),
                   any(r.sampling.top_p < 1.0 for r in rows if not r.sampling.greedy))
        positions = state.gen[rows_index][:, None] + torch.arange(k + 1, device=self.device)[None, :]
        return sampling.noise_base(state.keys[rows_index], positions), sampled, filters

    def _choose_tokens(self, run: RunState, logits: torch.Tensor, rows_index, noise, first: int) -> torch.Tensor:
        """Coupled tokens for logits [G, n, V] at the round's positions first..first+n-1: [G, n]."""
        logits = sampling.up_cast(logits)
        if noise is None:
            return logits.argmax(-1)
        base, sampled, filters = noise
        state = run.state
        return sampling.gumbel_tokens(logits, state.temperature[rows_index], state.top_k[rows_index],
                                      state.top_p[rows_index], base[:, first : first + logits.shape[1]], sampled,
                                      filters)

    def _draft(self, run: RunState, slots, rows_index, pad, T: int, choice: Choice, proposals: dict[str, Proposal],
               noise) -> tuple[Proposal, list[str]]:
        """The round's drafts and [G] who drafted each row ("" none)."""
        k = choice.k
        if not k:
            return Proposal(None, [0] * len(slots), ""), [""] * len(slots)
        if choice.source == "model":
            self._share_draft(run, slots)  # rows admitted while no draft was wanted: their shared prefix, no catch-up
            table = run.table
            rows = Rows([run.state.rows[s].row for s in slots], rows_index, table.layout.tokens[rows_index, :T],
                        pad, table.draft_reach(slots),
                        lambda logits, j: self._choose_tokens(run, logits, rows_index, noise, j))
            return self._drafter(run).propose(rows, k), ["model"] * len(slots)
        merged = drafting.merge(proposals, choice.drafters, k, self.device)
        return merged, [name if n else "" for name, n in zip(choice.drafters, merged.lengths)]

    def _constrain(self, run: RunState, slots: list[int], draft: Proposal, k: int) -> torch.Tensor | None:
        """The constrained rows' masks [G, k+1, V] (bool, on the device) for the verify positions; None when no
        row of the group is constrained (no cost). Drafts are cut at the first token a row's grammar refuses
        (``draft.lengths``), and the masks are those of the row's committed prefix plus its drafts before each
        position (``constraints.Guide.walk``).

        The grammar walks host lists only, so a constrained round still syncs once (its commit): model-free
        drafts come with their host copy (``Proposal.host``); a draft model's stay on the device, so a
        constrained row takes none of them (the model drafts only for a group with a free row, ``_choose``:
        on constrained jobs its drafts were chosen and accepted rarely, docs/history.md)."""
        if not self.guide.matchers:  # no constrained row in flight: nothing to do
            return None
        rows = [run.state.rows[s].row for s in slots]
        if not self.guide.any(rows):
            return None
        if not k:
            drafts = [[]] * len(slots)
        elif draft.host is not None:
            drafts = draft.host
        else:  # the model's: a free row's are only counted by the walk, a constrained row's are dropped unread
            drafts = [[] if row in self.guide.matchers else [0] * n for row, n in zip(rows, draft.lengths)]
        draft.lengths, masks = self.guide.walk(rows, drafts, self.eos_set, k + 1)
        return masks.to(self.device, non_blocking=True)

    def _commit(self, run: RunState, slots: list[int], rows_index, T: int, k: int, draft: Proposal,
                n_acc: torch.Tensor, nxt: torch.Tensor, finite: torch.Tensor,
                logprobs: torch.Tensor | None = None) -> Committed:
        """Write the round's block and advance the rows; returns what each row committed, on the host.

        finite: [G] whether the row's logits were all usable; if any row's were not, nothing is
        written and every row's code is returned as it is, a broken row's as ``_BROKEN``.

        ``logprobs``: [G, n] int64 columns of the rows' log-probabilities (``logprobs.Recorder``), carried
        to the host in the same copy.

        Tokens kept stop at the first EOS of the set among the committed ones and at the
        row's limit. Everything is computed before the first write.
        """
        block = nxt[:, None] if not k else torch.cat([draft.tokens, torch.zeros_like(nxt)[:, None]], dim=1)
        block = block.scatter(1, n_acc[:, None], nxt[:, None])  # [G, k+1]
        cols = torch.arange(k + 1, device=self.device)[None, :]
        is_eos = torch.isin(block, self.eos) & (cols <= n_acc[:, None])
        first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(n_acc, k + 1))
        remaining = device_tensor(run.state.tokens_left(slots), self.device)  # [G]
        emitted = torch.minimum(torch.minimum(n_acc + 1, first_eos + 1), remaining)  # [G]
        kept = torch.minimum(n_acc, emitted)
        code = torch.where(first_eos + 1 <= emitted, _STOP, torch.where(emitted >= remaining, _LENGTH, _RUNNING))
        code = torch.where(finite, code, _BROKEN)
        extra = [] if logprobs is None else [logprobs]
        on_host = torch.cat([torch.stack([emitted, kept, code], 1), block, *extra], 1).tolist()  # [G, 3 + k+1 + n]
        if any(r[2] == _BROKEN for r in on_host):
            return Committed([], [], [r[2] for r in on_host], [])
        run.table.layout.tokens[rows_index, T : T + k + 1] = block
        run.state.gen[rows_index] += emitted
        columns = (list(column) for column in zip(*((r[0], r[1], r[2], r[3 : 4 + k]) for r in on_host)))
        return Committed(*columns, Recorder.unpack(on_host, 4 + k, k + 1))

    def _bookkeep(self, run: RunState, slots: list[int], draft: Proposal,
                  committed: Committed) -> tuple[Committed, list[RowResult]]:
        """Host side of the commit: mirrors, completions, stop strings, finished rows (at the run's step).

        Returns what the rows committed after stop-string cuts, and the rows that finished."""
        state, finished = run.state, []
        emitted, kept, codes = list(committed.emitted), list(committed.kept), list(committed.codes)
        for i, slot in enumerate(slots):
            block = committed.blocks[i]
            run.pool.commit(slot, emitted[i], draft.source == "model", run.step)
            row = state.rows[slot].row
            ids = state.ids[slot]
            ids.extend(block[: emitted[i]])
            for drafter in self.lookups:
                drafter.extend(row, block[: emitted[i]])
            self.guide.extend(row, block[: emitted[i]])
            if self.stop_checker is not None:
                cut = self.stop_checker(ids, emitted[i], state.rows[slot].stop)
                if cut is not None:  # the stop string ends within this round's tokens: drop what follows it
                    emitted[i] -= len(ids) - cut
                    kept[i] = min(kept[i], emitted[i])
                    del ids[cut:]
                    codes[i] = _STOP_STRING
            run.logprobs.record(row, committed.logprobs, i, block[: emitted[i]])
            state.drafted[slot] += draft.lengths[i]
            state.accepted[slot] += kept[i]
            state.rounds[slot] += 1
            if codes[i] != _RUNNING:
                finished.append(self._end_row(run, slot, _REASONS[codes[i]]))
        return Committed(emitted, kept, codes, committed.blocks, committed.logprobs), finished

    def _end_row(self, run: RunState, slot: int, reason: str, error: str | None = None) -> RowResult:
        """A row leaves the pool, finished (``reason``) or as an error row (``"error"``: no tokens kept)."""
        state = run.state
        req = state.rows[slot]
        if error is None:
            result = RowResult(req.row, req.id, list(state.ids[slot]), reason, drafted_tokens=state.drafted[slot],
                               accepted_tokens=state.accepted[slot], rounds=state.rounds[slot],
                               prompt_tokens=len(req.prompt_ids), logprobs=run.logprobs.pop(req.row))
        else:
            run.logprobs.pop(req.row)
            result = error_row(req, error)
        run.pool.free(slot)
        self.guide.finish(req.row)
        for drafter in self.lookups:
            drafter.finish(req.row, result.token_ids)
        return result
