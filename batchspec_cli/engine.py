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
  policy in ``control`` from measured costs and each row's acceptance.

Drafters: a draft model (its own slot cache, caught up in one forward when it lags) and
model-free ``LookupDrafter``s (``drafters``) that propose from host-side indexes; rows may
get fewer than k drafts, or none. Tokens are chosen by the Gumbel-max coupling of
``sampling`` (greedy rows: g = 0), so no choice of mode, drafter or k changes an output.

One round (``_round``): 0. prepare the group (one rectangle, one slot range) and choose k,
1. draft, 2. verify in one target forward, 3. accept, 4. commit. Exactly one host sync
per round (the commit's ``tolist``); step timers are CUDA events on a GPU, read after it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

import torch

from . import sampling
from .align import CacheFull, SlotCache, device_tensor, folded_sdpa, group_forward, selection
from .control import AutoK, Choice, FixedK, Source
from .events import Request, RowResult, StepStats
from .grouping import MovePlan, Pool, StaticBatch
from .pool import SlotPool

StopChecker = Callable[[list[int], int], int | None]
"""(completion token ids so far, number of tokens added this round) -> cut length or None."""

MODES = ("auto", "ar", "eqspec", "exspec")
_RUNNING, _STOP, _LENGTH, _STOP_STRING = 0, 1, 2, 3
_REASONS = {_STOP: "stop", _LENGTH: "length", _STOP_STRING: "stop_string"}
_CALIBRATION_CONTEXT = 64  # auto's start-up timings run on a context of at most this many columns


@dataclass
class EngineConfig:
    mode: str = "auto"  # auto | ar | eqspec | exspec
    k: int = 5  # draft tokens per round (auto: the most)
    batch_size: int = 8
    window: int | None = None  # pool size of exspec and auto (default: pool_window)
    # exspec: a same-length group smaller than this x batch is topped up by realigned rows. 1.0 (always a full
    # batch): on CPU a forward of fewer rows costs nearly as much, so fewer, fuller steps win (README).
    min_group: float = 1.0
    trim: bool = True  # exspec: a group's padding it no longer needs is dropped in its move (see _target_end)
    pad_id: int = 0
    calibrate: bool = True  # auto: time the forwards briefly before the first prefill


def pool_window(batch_size: int, window: int | None = None) -> int:
    """The pool's size in rows (exspec, auto): ``window`` when given, else 4 x the batch size."""
    return window or 4 * batch_size


def up_cast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 (token choice and noise are exact there); others as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


@dataclass
class ModelHandle:
    model: torch.nn.Module
    cache_kwarg: str  # "cache" or "past_key_values"


class LookupDrafter(Protocol):
    """A model-free drafter: host-side indexes over prompts and completions, no forward."""

    name: str

    def admit(self, row: int, prompt: list[int]) -> None: ...

    def extend(self, row: int, tokens: list[int]) -> None: ...

    def finish(self, row: int, completion: list[int]) -> None: ...

    def propose(self, rows: list[int], k: int) -> list[list[int]]: ...


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
class Draft:
    """One round's drafts: tokens [G, k] (filler past each row's length), per-row lengths, who drafted."""

    tokens: torch.Tensor | None  # [G, k] int64
    lengths: list[int]  # [G] real drafts per row (host)
    sources: list[str]  # [G] who drafted each row: "model", a lookup drafter's name, "" for none
    source: str  # the step's label: "model", the lookup drafters' names, "" for k = 0
    fed: int = 0  # tokens the draft model's first forward took (its catch-up)


def _contiguous_first(free: list[int], n: int) -> list[int]:
    """n free slots, one contiguous run when there is one (the admitted group then reads views)."""
    for i in range(len(free) - n + 1):
        if free[i + n - 1] - free[i] == n - 1:
            return free[i : i + n]
    return free[:n]


class Engine:
    def __init__(self, target: ModelHandle, draft: ModelHandle | None, eos_ids: list[int], cfg: EngineConfig,
                 stop_checker: StopChecker | None = None, lookups: list[LookupDrafter] | None = None,
                 policy: FixedK | None = None):
        if cfg.mode not in MODES:
            raise ValueError(f"unknown mode {cfg.mode!r}")
        plain = cfg.mode == "ar"
        self.draft = None if plain else draft
        self.lookups = [] if plain else list(lookups or [])
        if cfg.mode in ("eqspec", "exspec") and self.draft is None and not self.lookups:
            raise ValueError(f"mode {cfg.mode} needs a drafter")
        self.target, self.cfg = target, cfg
        self.max_k = 0 if plain or (self.draft is None and not self.lookups) else cfg.k
        self.strategy = (Pool(pool_window(cfg.batch_size, cfg.window), cfg.batch_size, cfg.min_group, cfg.trim)
                         if cfg.mode in ("exspec", "auto") else StaticBatch(cfg.batch_size))
        self.device = next(target.model.parameters()).device
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.stop_checker = stop_checker
        self.context = int(getattr(target.model.config, "max_position_embeddings", 0) or 0) or None
        self.vocab = target.model.get_output_embeddings().weight.shape[0]
        self.n_slots = self.strategy.n_slots
        self.step_no = 0
        # The policy and its measurements outlive a run (a distributed worker runs one per block).
        if policy is not None:
            self.policy, self.calibrated = policy, True
        else:
            self.policy = AutoK(self.max_k) if cfg.mode == "auto" and self.max_k else FixedK(self.max_k)
            self.calibrated = not (cfg.calibrate and isinstance(self.policy, AutoK))

    # ------------------------------------------------------------------ public
    def run(self, requests: Iterable[Request]) -> Iterator[RowResult | StepStats]:
        """Decode every request; the models run the folded GQA attention (``align.folded_sdpa``) for the run only."""
        stream = iter(requests)
        self._reset()
        with folded_sdpa(*(h.model for h in (self.target, self.draft) if h is not None)):
            while True:
                yield from self._admit_from(stream)
                if not self.pool.live:
                    if self.exhausted:
                        return
                    continue
                slots = self.strategy.select(self.pool.view(), self.max_group, self.step_no)
                self.group = slots
                try:
                    yield from self._round(slots)
                except torch.OutOfMemoryError as exc:
                    yield from self._out_of_memory(self.group, exc)

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        self.pool = SlotPool(self.n_slots, self.device, with_draft=self.draft is not None and self.max_k > 0)
        self.layout, self.state = self.pool.layout, self.pool.state  # the round's own reads (tokens, [slots] tensors)
        self.tcache, self.dcache = self.pool.target, self.pool.draft
        self.step_no = 0
        self.max_group = self.cfg.batch_size  # halved on out-of-memory
        self.exhausted = False
        self.pending: Request | None = None  # read from the stream, waiting for the next admission

    def _check(self, req: Request) -> str | None:
        if not req.prompt_ids:
            return "empty prompt after tokenization"
        if self.context is not None and len(req.prompt_ids) >= self.context:
            return f"prompt has {len(req.prompt_ids)} tokens; the model's context is {self.context}"
        return None

    def _limit(self, req: Request) -> int:
        return req.max_new_tokens if self.context is None else min(req.max_new_tokens,
                                                                   self.context - len(req.prompt_ids))

    # ------------------------------------------------------------------ admission
    def _admit_from(self, stream: Iterator[Request]) -> Iterator[RowResult | StepStats]:
        """Admit new prompts into free slots, in chunks of at most a batch.

        The pooled modes admit a whole batch at a time (admitted rows form one same-length
        group); ar and eqspec refill their batch as soon as a quarter of it is free
        (continuous batching): the next round's ``_prepare`` realigns the batch, new rows
        included, into one rectangle.
        """
        free = self.pool.free_slots()
        if self.pool.live and len(free) < min(self.strategy.admit_at, self.n_slots):
            return
        while free and not self.exhausted:
            chunk = []
            while len(chunk) < min(len(free), self.cfg.batch_size):
                req, self.pending = self.pending or next(stream, None), None
                if req is None:
                    self.exhausted = True
                    break
                error = self._check(req)
                if error:
                    yield self._error_row(req, error)
                    continue
                if chunk and req.bucket != chunk[0].bucket:  # one prefill pads to one bucket's length, not the next
                    self.pending = req
                    break
                chunk.append(req)
            if chunk:
                yield from self._admit(chunk, free)
                free = self.pool.free_slots()

    def _admit(self, chunk: list[Request], free: list[int]) -> Iterator[RowResult | StepStats]:
        """Place prompts in free slots, left-padded to one padded length, and prefill the caches."""
        started = time.perf_counter()
        st = self.state
        end = max(2, max(max(r.pad_to, len(r.prompt_ids)) for r in chunk))
        if not self.calibrated:
            self._calibrate(chunk, end)
        slots = _contiguous_first(free, len(chunk))
        limits = [self._limit(r) for r in chunk]
        try:  # the KV buffers hold the rows, with room for the longest they can become (no growth while decoding)
            self.pool.reserve(slots, end + max(limits) + self.max_k + 1)
        except torch.OutOfMemoryError:
            self._empty_cache()
            for req in chunk:
                yield self._error_row(req, "out of memory: no room for this row's KV cache")
            return
        keys = [sampling.row_key(r.sampling.seed, r.id) for r in chunk]
        self.pool.place(slots, chunk, end, keys, limits, self.cfg.pad_id, self.step_no)
        for drafter in self.lookups:
            for req in chunk:
                drafter.admit(req.row, req.prompt_ids)

        errors = self._prefill(slots, end)
        if self.dcache is not None and self.policy.wants_draft():
            self._prefill_draft([s for s in slots if st.rows[s] is not None], end)
        self._sync()
        ms = (time.perf_counter() - started) * 1e3
        pads = sum(st.pad[s] for s in slots)
        yield StepStats(bucket=chunk[0].bucket, step=self._next_step(), group_kind="prefill", batch_size=len(chunk),
                        k=0, accepted=[], tokens_emitted=0, pad_before=pads, pad_after=pads, kv_moved=0,
                        kv_gathered=0, draft_ms=0.0, verify_ms=ms, realign_ms=0.0, gather_ms=0.0, total_ms=ms)
        yield from errors

    @torch.no_grad()
    def _prefill(self, slots: list[int], end: int) -> list[RowResult]:
        """Fill the target cache of new rows; on out-of-memory, prefill the halves one after the other.

        A row that does not fit even alone becomes an error row (its slot is freed).
        """
        try:
            sel = selection(slots, self.device)
            group_forward(self.target.model, self.tcache, self.target.cache_kwarg, sel,
                          self.layout.tokens[sel, : end - 1], self.pool.pads(slots), 0, logits_to_keep=1)
            return []
        except torch.OutOfMemoryError:
            self._empty_cache()
            if len(slots) == 1:
                return [self._end_row(slots[0], "error", "out of memory while prefilling this prompt alone")]
            half = len(slots) // 2
            return self._prefill(slots[:half], end) + self._prefill(slots[half:], end)

    @torch.no_grad()
    def _prefill_draft(self, slots: list[int], end: int) -> None:
        """Fill the draft cache up to ``end - 2``; on out-of-memory leave it to the first round's catch-up."""
        if not slots or end - 2 <= 0:
            return
        sel = selection(slots, self.device)
        try:
            group_forward(self.draft.model, self.dcache, self.draft.cache_kwarg, sel,
                          self.layout.tokens[sel, : end - 2], self.pool.pads(slots), 0, logits_to_keep=1)
        except torch.OutOfMemoryError:
            self._empty_cache()
            return
        for s in slots:
            self.state.dend[s] = end - 2

    def _next_step(self) -> int:
        self.step_no += 1
        return self.step_no

    def _sync(self) -> None:
        """Outside rounds only (admission, calibration)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ calibration (auto)
    @torch.no_grad()
    def _calibrate(self, chunk: list[Request], end: int) -> None:
        """Time the target's verify and the draft's forwards at the batch size, once, on throwaway caches.

        Verify widths 1, 2 and K+1 are timed (widths between are interpolated), and the
        draft's step and first forwards, once each after a warm-up, on a context of at most
        ``_CALIBRATION_CONTEXT`` columns. These only seed the policy: an option's first real
        round replaces its seed. About ten short forwards, once per engine.
        """
        self.calibrated = True
        group = min(self.cfg.batch_size, self.n_slots)
        context = min(max(2, end), _CALIBRATION_CONTEXT)
        top = self.max_k + 1
        ids = (chunk[0].prompt_ids * (context + top))[: context + top]
        tokens = torch.tensor([ids] * group, device=self.device)  # [G, context + K+1]
        pad = torch.zeros(group, dtype=torch.long, device=self.device)
        sel = slice(0, group)

        def timed(handle: ModelHandle, cache: SlotCache, start: int, width: int, repeats: int = 1) -> float:
            best = math.inf  # the least of a few: a one-off stall elsewhere on the machine must not set the shape
            for _ in range(repeats):
                self._sync()
                began = time.perf_counter()
                group_forward(handle.model, cache, handle.cache_kwarg, sel, tokens[:, start : start + width], pad,
                              start)
                self._sync()
                best = min(best, time.perf_counter() - began)
            return best

        def curve(handle: ModelHandle, widths: list[int]) -> dict[int, float]:
            cache = SlotCache(group, context + top + 8)
            timed(handle, cache, 0, context, 1)  # the prefill, which also warms the kernels up
            measured = {w: timed(handle, cache, context, w) for w in widths}
            known = sorted(measured)
            for w in range(1, top + 1):  # linear in between
                if w not in measured:
                    lo = max(x for x in known if x < w)
                    hi = min(x for x in known if x > w)
                    measured[w] = measured[lo] + (measured[hi] - measured[lo]) * (w - lo) / (hi - lo)
            return measured

        verify = curve(self.target, sorted({1, 2, top}))
        draft = curve(self.draft, sorted({1, 2, top})) if self.draft is not None else None
        self.policy.calibrate(group, verify, draft)

    def _out_of_memory(self, slots: list[int], exc: torch.OutOfMemoryError) -> Iterator[RowResult]:
        """A step ran out of memory: halve the group size and retry; a single row that still fails errors out.

        No rollback is needed: forwards write KV only past each row's committed length
        (``end``), which advances only at commit, after every forward succeeded; moves
        (``realign``) and buffer growth (``SlotCache.grow``) allocate everything before
        their first write. When the pool's buffers cannot grow (``CacheFull``) a smaller
        group cannot help: the group's longest row errors out instead.
        """
        self._empty_cache()
        slots = [s for s in slots if self.state.rows[s] is not None]
        if isinstance(exc, CacheFull):
            longest = max(slots, key=lambda s: self.state.end[s] - self.state.pad[s])
            yield self._end_row(longest, "error", f"out of memory: {exc}")
            return
        if len(slots) > 1:
            self.max_group = max(1, len(slots) // 2)
            return
        yield self._end_row(slots[0], "error", "out of memory even for this row alone")

    # ------------------------------------------------------------------ one round
    def _round(self, slots: list[int]) -> Iterator[RowResult | StepStats]:
        started, clock, st = time.perf_counter(), Clock(self.device), self.state
        pad_before = sum(st.pad[s] for s in slots)
        bucket = st.rows[slots[0]].bucket
        # 0. Prepare: one rectangle in one slot range; then the policy's k and the drafts' noise.
        clock.mark("prepare")
        plan = self.strategy.plan(self.pool.view(), slots)
        moved, gathered = self.pool.move(plan)  # KV entries copied to realign and to assemble
        slots = plan.slots
        self.group = slots
        clock.mark("prepared")
        T, G = st.end[slots[0]], len(slots)
        sel = selection(slots, self.device)
        pad = self.pool.pads(slots)  # [G]
        proposals = self._lookup_proposals(slots)
        choice, source = self._choose(slots, proposals)
        k = choice.k
        noise = self._noise(slots, sel, k)
        self.layout.grow(T + k + 2)
        with torch.no_grad():
            # 1. Draft: up to k tokens per row (the draft model first catches up on what it has not seen).
            clock.mark("draft")
            draft = self._draft(slots, sel, pad, T, k, source, proposals, noise)
            # 2. Verify: one target forward over [last committed, d_1..d_k].
            clock.mark("verify")
            inputs = self.layout.tokens[sel, T - 1 : T]
            if k:
                inputs = torch.cat([inputs, draft.tokens], dim=1)  # [G, k+1]
            logits = group_forward(self.target.model, self.tcache, self.target.cache_kwarg, sel, inputs, pad, T - 1)
            # 3. Accept: the longest prefix of drafts equal to the target's own tokens, plus its next token.
            target_tokens = self._choose_tokens(logits, sel, noise, 0)  # [G, k+1]
            if k:
                lengths = None if source == "model" else device_tensor(draft.lengths, self.device)
                n_acc, nxt = sampling.coupled_accept(draft.tokens, lengths, target_tokens)
            else:
                n_acc, nxt = torch.zeros_like(target_tokens[:, 0]), target_tokens[:, 0]
            clock.mark("accepted")
            # 4. Commit: write the block, apply stops, advance the rows.
            host = self._commit(sel, T, k, draft, n_acc, nxt)  # the round's one host sync
        results = self._bookkeep(slots, T, k, draft, host)
        total = time.perf_counter() - started
        verify_s, draft_s = clock.seconds("verify", "accepted"), clock.seconds("draft", "verify")
        prepare_s = clock.seconds("prepare", "prepared")
        self.policy.observe_round(G, source, k, total - prepare_s, draft.fed, prepare_s)
        live_in_group = [s for s in slots if st.rows[s] is not None]
        yield StepStats(
            bucket=bucket, step=self._next_step(), group_kind=self._kind(plan), batch_size=G, k=k,
            accepted=[row[1] for row in host], tokens_emitted=sum(row[0] for row in host), pad_before=pad_before,
            pad_after=sum(st.pad[s] for s in live_in_group), kv_moved=moved, kv_gathered=gathered,
            draft_ms=draft_s * 1e3, verify_ms=verify_s * 1e3, realign_ms=(prepare_s if moved else 0.0) * 1e3,
            gather_ms=(prepare_s if not moved else 0.0) * 1e3, total_ms=total * 1e3, drafter=draft.source,
            drafted=sum(draft.lengths), expected_tokens=choice.expected_tokens, expected_ms=choice.expected_s * 1e3,
            plain_ms=choice.plain_s * 1e3)
        yield from results

    def _kind(self, plan: MovePlan) -> str:
        """The step's label, from the grouping decision (``kv_moved`` is counted apart, from what was copied)."""
        if self.cfg.mode == "ar":
            return "ar"
        return "realigned" if plan.realigns else "same_length"

    def _lookup_proposals(self, slots: list[int]) -> list[tuple[str, list[int]]] | None:
        """Each row's best model-free draft (drafter name, tokens), by expected accepted tokens."""
        if not self.lookups or not self.max_k:
            return None
        st = self.state
        rows = [st.rows[s].row for s in slots]
        room = [min(self.max_k, self._limit(st.rows[s]) - len(st.ids[s]) - 1) for s in slots]  # no draft past the end
        acceptance = self.policy.acceptance
        best = [("", [])] * len(slots)
        score = [0.0] * len(slots)
        for drafter in self.lookups:
            for i, tokens in enumerate(drafter.propose(rows, self.max_k)):
                tokens = tokens[: max(0, room[i])]
                alpha = acceptance.row((drafter.name, rows[i]))
                value = sum(alpha ** (j + 1) for j in range(len(tokens)))
                if tokens and value > score[i]:
                    best[i], score[i] = (drafter.name, tokens), value
        return best

    def _choose(self, slots: list[int], proposals) -> tuple[Choice, str]:
        """The policy's k for this round and who drafts: "model", "lookup" (the model-free drafters) or ""."""
        st = self.state
        rows = [st.rows[s].row for s in slots]
        remaining = sum(self._limit(st.rows[s]) - len(st.ids[s]) for s in slots) / len(slots)
        sources = {}
        if proposals is not None and any(tokens for _, tokens in proposals):
            sources["lookup"] = Source([(name or "lookup", row) for (name, _), row in zip(proposals, rows)],
                                       [len(tokens) for _, tokens in proposals])
        if self.dcache is not None:
            sources["model"] = Source([("model", row) for row in rows], None,
                                      st.end[slots[0]] - min(st.dend[s] for s in slots))
        choice, source = self.policy.choose(len(slots), sources, remaining)
        return choice, (source if choice.k else "")

    def _noise(self, slots: list[int], sel, k: int):
        """(noise seeds [G, k+1], sampled flags, filter flags) for the round's positions; None when all greedy."""
        rows = [self.state.rows[s] for s in slots]
        sampled = [not r.sampling.greedy for r in rows]
        if not any(sampled):
            return None
        filters = (any(r.sampling.top_k > 0 for r in rows if not r.sampling.greedy),
                   any(r.sampling.top_p < 1.0 for r in rows if not r.sampling.greedy))
        positions = self.state.gen[sel][:, None] + torch.arange(k + 1, device=self.device)[None, :]
        return sampling.noise_base(self.state.keys[sel], positions), sampled, filters

    def _choose_tokens(self, logits: torch.Tensor, sel, noise, first: int) -> torch.Tensor:
        """Coupled tokens for logits [G, n, V] at the round's positions first..first+n-1: [G, n]."""
        logits = up_cast(logits)
        if noise is None:
            return logits.argmax(-1)
        base, sampled, filters = noise
        st = self.state
        return sampling.gumbel_tokens(logits, st.temperature[sel], st.top_k[sel], st.top_p[sel],
                                      base[:, first : first + logits.shape[1]], sampled, filters)

    def _draft(self, slots, sel, pad, T: int, k: int, source: str, proposals, noise) -> Draft:
        if not k:
            return Draft(None, [0] * len(slots), [""] * len(slots), "")
        if source == "model":
            return self._draft_model(slots, sel, pad, T, k, noise)
        names = {name for name, tokens in proposals if tokens}
        lengths = [min(k, len(tokens)) for _, tokens in proposals]
        filled = [tokens[:k] + [self.cfg.pad_id] * (k - len(tokens[:k])) for _, tokens in proposals]
        sources = [name if n else "" for (name, _), n in zip(proposals, lengths)]
        return Draft(device_tensor(filled, self.device), lengths, sources, ",".join(sorted(names)))

    def _draft_model(self, slots, sel, pad, T: int, k: int, noise) -> Draft:
        """k tokens per row from the draft model; its first forward feeds every column it has not seen."""
        model, cache, kwarg = self.draft.model, self.dcache, self.draft.cache_kwarg
        start = max(0, min(min(self.state.dend[s] for s in slots), T - 2))
        inputs, fed = self.layout.tokens[sel, start:T], T - start
        drafts = []
        for j in range(k):
            logits = group_forward(model, cache, kwarg, sel, inputs, pad, start, logits_to_keep=1)[:, -1:]
            token = self._choose_tokens(self._to_target_vocab(logits), sel, noise, j)[:, 0]
            drafts.append(token)
            inputs, start = token[:, None], T + j
        return Draft(torch.stack(drafts, 1), [k] * len(slots), ["model"] * len(slots), "model", fed)

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Slice or pad draft logits [..., Vd] to the target's vocabulary size."""
        logits = up_cast(logits)
        extra = self.vocab - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.vocab]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=torch.finfo(logits.dtype).min)
        return logits

    def _commit(self, sel, T: int, k: int, draft: Draft, n_acc: torch.Tensor, nxt: torch.Tensor) -> list[list[int]]:
        """Write the round's block and advance the rows; returns per row [emitted, kept, code, *block].

        Tokens kept stop at the first EOS of the set among the committed ones and at the
        row's limit. Everything is computed before the first write.
        """
        block = nxt[:, None] if not k else torch.cat([draft.tokens, torch.zeros_like(nxt)[:, None]], dim=1)
        block = block.scatter(1, n_acc[:, None], nxt[:, None])  # [G, k+1]
        cols = torch.arange(k + 1, device=self.device)[None, :]
        is_eos = torch.isin(block, self.eos) & (cols <= n_acc[:, None])
        first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(n_acc, k + 1))
        remaining = self.state.max_new[sel] - self.state.gen[sel]
        emitted = torch.minimum(torch.minimum(n_acc + 1, first_eos + 1), remaining)  # [G]
        kept = torch.minimum(n_acc, emitted)
        code = torch.where(first_eos + 1 <= emitted, _STOP, torch.where(emitted >= remaining, _LENGTH, _RUNNING))
        host = torch.cat([torch.stack([emitted, kept, code], 1), block], 1)  # [G, 3 + k+1]
        self.layout.tokens[sel, T : T + k + 1] = block
        self.state.gen[sel] += emitted
        return host.tolist()

    def _bookkeep(self, slots: list[int], T: int, k: int, draft: Draft,
                  host: list[list[int]]) -> list[RowResult]:
        """Host side of the commit: mirrors, completions, stop strings, acceptance, finished rows."""
        st, finished = self.state, []
        for i, s in enumerate(slots):
            emitted, kept, code, block = host[i][0], host[i][1], host[i][2], host[i][3:]
            self.pool.commit(s, emitted, draft.source == "model", self.step_no + 1)
            row = st.rows[s].row
            ids = st.ids[s]
            ids.extend(block[:emitted])
            for drafter in self.lookups:
                drafter.extend(row, block[:emitted])
            if self.stop_checker is not None:
                cut = self.stop_checker(ids, emitted)
                if cut is not None:  # the stop string ends within this round's tokens: drop what follows it
                    emitted -= len(ids) - cut
                    kept = min(kept, emitted)
                    del ids[cut:]
                    code = _STOP_STRING
            host[i][0], host[i][1] = emitted, kept
            if draft.lengths[i]:
                self.policy.acceptance.observe((draft.sources[i], row), draft.lengths[i], kept)
            st.drafted[s] += draft.lengths[i]
            st.accepted[s] += kept
            st.rounds[s] += 1
            if code != _RUNNING:
                finished.append(self._end_row(s, _REASONS[code]))
        return finished

    def _error_row(self, req: Request, error: str) -> RowResult:
        return RowResult(req.row, req.id, [], "error", error=error, prompt_tokens=len(req.prompt_ids))

    def _end_row(self, slot: int, reason: str, error: str | None = None) -> RowResult:
        """A row leaves the pool, finished (``reason``) or as an error row (``"error"``: no tokens kept)."""
        st = self.state
        req = st.rows[slot]
        if error is None:
            result = RowResult(req.row, req.id, list(st.ids[slot]), reason, drafted_tokens=st.drafted[slot],
                               accepted_tokens=st.accepted[slot], rounds=st.rounds[slot],
                               prompt_tokens=len(req.prompt_ids))
        else:
            result = self._error_row(req, error)
        self.pool.free(slot)
        for drafter in self.lookups:
            drafter.finish(req.row, result.token_ids)
        self.policy.acceptance.forget_row(req.row)
        return result
