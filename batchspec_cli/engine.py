"""The decoding engine: AR baseline, EQSPEC and EXSPEC over one slot pool.

``Engine.run(requests)`` is a generator of events: a ``RowResult`` as soon as a row is
done and a ``StepStats`` for every step. Modes differ only in how a step's *group* is
chosen and what happens after the round:

- ``ar``: the group is every live row; one target token per step (a round with k = 0).
- ``eqspec``: the group is every live row of a static batch; after every round the rows
  are realigned into one left-padded rectangle (unpad -> append -> repad) and finished
  rows leave (their slots are compacted away).
- ``exspec``: a pool of ``window`` slots; each step runs the largest group of rows with the
  same padded length (no realignment); when that group is smaller than
  ``min_group`` x the batch (by default: than a full batch), it is topped up with the rows
  closest in length, which are realigned to it (the EQSPEC fallback, for those rows only).
  New prompts are admitted into free slots as rows finish, one bucket per prefill. A group
  whose rows all carry much padding (its longest row has left) is trimmed to its longest
  content in the same move: attention reads every padded column of every row in every
  later round, a move copies the content once.

One round (``_round``): 1. draft k tokens with the draft's persistent cache,
2. verify them in one target forward, 3. accept, 4. commit (stops, bookkeeping) and
realign if the mode asks for it. Exactly one host sync per round.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from . import sampling
from .align import Layout, SlotCache, group_forward, is_run, realign, selection, use_folded_sdpa
from .events import Request, RowResult, StepStats

StopChecker = Callable[[list[int], int], int | None]
"""(completion token ids so far, number of tokens added this round) -> cut length or None."""

_RUNNING, _STOP, _LENGTH, _STOP_STRING = 0, 1, 2, 3
_REASONS = {_STOP: "stop", _LENGTH: "length", _STOP_STRING: "stop_string"}
_TRIM_MIN, _TRIM_FRACTION = 16, 8  # trim shared padding of at least max(16, end / 8) columns


@dataclass
class EngineConfig:
    mode: str = "exspec"  # ar | eqspec | exspec
    k: int = 5  # draft tokens per round
    batch_size: int = 8
    window: int = 32  # exspec pool size
    # exspec: a same-length group smaller than this x batch is topped up by realigned rows. 1.0 (always a full
    # batch): on CPU a forward of fewer rows costs nearly as much, so fewer, fuller steps win (README).
    min_group: float = 1.0
    trim: bool = True  # exspec: a group's padding it no longer needs is dropped in its move (see _target_end)
    pad_id: int = 0


@dataclass
class ModelHandle:
    model: torch.nn.Module
    cache_kwarg: str  # "cache" or "past_key_values"


def _contiguous_first(free: list[int], n: int) -> list[int]:
    """n free slots, one contiguous run when there is one (the admitted group then reads views)."""
    for i in range(len(free) - n + 1):
        if free[i + n - 1] - free[i] == n - 1:
            return free[i : i + n]
    return free[:n]


class Engine:
    def __init__(self, target: ModelHandle, draft: ModelHandle | None, eos_ids: list[int], cfg: EngineConfig,
                 stop_checker: StopChecker | None = None):
        if cfg.mode not in ("ar", "eqspec", "exspec"):
            raise ValueError(f"unknown mode {cfg.mode!r}")
        if cfg.mode != "ar" and draft is None:
            raise ValueError(f"mode {cfg.mode} needs a draft model")
        self.target, self.draft, self.cfg = target, draft, cfg
        for handle in (target, draft):  # multi-token forwards with a mask then copy no K/V
            if handle is not None:
                use_folded_sdpa(handle.model)
        self.k = 0 if cfg.mode == "ar" else cfg.k
        self.device = next(target.model.parameters()).device
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.stop_checker = stop_checker
        self.context = int(getattr(target.model.config, "max_position_embeddings", 0) or 0) or None
        self.vocab = target.model.get_output_embeddings().weight.shape[0]
        self.n_slots = cfg.window if cfg.mode == "exspec" else cfg.batch_size
        self.step_no = 0

    # ------------------------------------------------------------------ public
    def run(self, requests: Iterable[Request]) -> Iterator[RowResult | StepStats]:
        stream = iter(requests)
        self._reset()
        while True:
            yield from self._admit_from(stream)
            if not self.live:
                if self.exhausted:
                    return
                continue
            slots, kind = self._select()
            try:
                yield from self._round(slots, kind)
            except torch.OutOfMemoryError:
                yield from self._out_of_memory(slots)

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        n, cap, dev = self.n_slots, 64, self.device
        self.layout = Layout.empty(n, cap, dev)
        self.tcache = SlotCache(n, cap)
        self.dcache = SlotCache(n, cap) if self.draft is not None and self.k > 0 else None
        zeros = torch.zeros(n, dtype=torch.long, device=dev)
        self.gen, self.max_new = zeros.clone(), zeros.clone()
        self.drafted, self.accepted, self.rounds = zeros.clone(), zeros.clone(), zeros.clone()
        self.keys = zeros.clone()
        self.temperature = torch.zeros(n, dtype=torch.float64, device=dev)
        self.top_k = zeros.clone()
        self.top_p = torch.ones(n, dtype=torch.float64, device=dev)
        self.rows: list[Request | None] = [None] * n
        self.end_host = [0] * n  # mirrors of layout.end / layout.pad, updated at the round's sync
        self.pad_host = [0] * n
        self.last_run = [0] * n
        self.texts: list[list[int] | None] = [None] * n  # completion ids, kept only with stop strings
        self.live: list[int] = []
        self.step_no = 0
        self.max_group = self.cfg.batch_size  # halved on out-of-memory
        self.exhausted = False
        self.pending: Request | None = None  # read from the stream, waiting for the next admission

    def _caches(self) -> list[tuple[SlotCache, int]]:
        caches = [(self.tcache, 1)]
        if self.dcache is not None:
            caches.append((self.dcache, 2))
        return caches

    def _check(self, req: Request) -> str | None:
        if not req.prompt_ids:
            return "empty prompt after tokenization"
        if self.context is not None and len(req.prompt_ids) >= self.context:
            return f"prompt has {len(req.prompt_ids)} tokens; the model's context is {self.context}"
        return None

    # ------------------------------------------------------------------ admission
    def _admit_from(self, stream: Iterator[Request]) -> Iterator[RowResult | StepStats]:
        """Admit new prompts into free slots, in chunks of at most a batch.

        exspec admits a whole batch at a time (admitted rows form one same-length group);
        ar and eqspec refill their batch as soon as a quarter of it is free, placing the new
        rows at the batch's common padded length (continuous batching).
        """
        free = [s for s in range(self.n_slots) if self.rows[s] is None]
        chunk_min = self.cfg.batch_size if self.cfg.mode == "exspec" else max(1, self.cfg.batch_size // 4)
        if self.live and len(free) < min(chunk_min, self.n_slots):
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
                    yield RowResult(req.row, req.id, [], "error", error=error, prompt_tokens=len(req.prompt_ids))
                    continue
                if chunk and req.bucket != chunk[0].bucket:  # one prefill pads to one bucket's length, not the next
                    self.pending = req
                    break
                chunk.append(req)
            if chunk:
                taken = _contiguous_first(free, len(chunk))
                yield from self._admit(chunk, taken)
                free = [s for s in free if s not in taken]

    def _admit(self, chunk: list[Request], slots: list[int]) -> Iterator[StepStats]:
        """Place prompts in free slots, left-padded to one padded length, and prefill both caches."""
        started = time.perf_counter()
        end = max(2, max(max(r.pad_to, len(r.prompt_ids)) for r in chunk))
        moved, realign_s = 0, 0.0
        if self.cfg.mode != "exspec" and self.live:  # join the running batch at its common padded length
            batch_end = self.end_host[self.live[0]]
            if end > batch_end:
                moved = self._realign_group(list(self.live), end, compact=False)
                self._sync()
                realign_s = time.perf_counter() - started
            end = max(end, batch_end)
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.layout.place(idx, [r.prompt_ids for r in chunk], end, self.cfg.pad_id)
        for slot, req in zip(slots, chunk):
            self.rows[slot] = req
            self.end_host[slot], self.pad_host[slot] = end, end - len(req.prompt_ids)
            self.last_run[slot] = self.step_no
            self.texts[slot] = [] if self.stop_checker else None
        limit = [r.max_new_tokens if self.context is None else min(r.max_new_tokens, self.context - len(r.prompt_ids))
                 for r in chunk]
        self.max_new[idx] = torch.tensor(limit, device=self.device)
        for t in (self.gen, self.drafted, self.accepted, self.rounds):
            t[idx] = 0
        self.keys[idx] = torch.tensor([sampling.row_key(r.sampling.seed, r.id) for r in chunk], device=self.device)
        self.temperature[idx] = torch.tensor([r.sampling.temperature for r in chunk], dtype=torch.float64,
                                             device=self.device)
        self.top_k[idx] = torch.tensor([r.sampling.top_k for r in chunk], device=self.device)
        self.top_p[idx] = torch.tensor([r.sampling.top_p for r in chunk], dtype=torch.float64, device=self.device)
        self.live = sorted(self.live + slots)

        self._prefill(slots, end)
        self._sync()
        ms = (time.perf_counter() - started) * 1e3
        self.tcache.gathered = 0
        if self.dcache is not None:
            self.dcache.gathered = 0
        yield StepStats(bucket=chunk[0].bucket, step=self._next_step(), group_kind="prefill", batch_size=len(chunk),
                        k=0, accepted=[], tokens_emitted=0, pad_before=sum(self.pad_host[s] for s in slots),
                        pad_after=sum(self.pad_host[s] for s in slots), kv_moved=moved, kv_gathered=0, draft_ms=0.0,
                        verify_ms=ms - realign_s * 1e3, realign_ms=realign_s * 1e3, gather_ms=0.0, total_ms=ms)

    @torch.no_grad()
    def _prefill(self, slots: list[int], end: int) -> None:
        """Fill both caches for new rows; on out-of-memory, prefill the halves one after the other."""
        sel = selection(slots, self.device)
        pad = self.layout.pad[sel]
        try:
            for handle, cache, lag in ((self.target, self.tcache, 1), (self.draft, self.dcache, 2)):
                if cache is None or end - lag <= 0:
                    continue
                group_forward(handle.model, cache, handle.cache_kwarg, sel, self.layout.tokens[sel, : end - lag],
                              pad, 0, logits_to_keep=1)
        except torch.OutOfMemoryError:
            if len(slots) == 1:
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(slots) // 2
            self._prefill(slots[:half], end)
            self._prefill(slots[half:], end)

    def _next_step(self) -> int:
        self.step_no += 1
        return self.step_no

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ grouping
    def _select(self) -> tuple[list[int], str]:
        """Choose the next group (sorted slots) and its kind.

        exspec: the *core* is the largest group of rows with one padded length (the one
        cheapest to bring into one slot range among equals), or the longest-waiting row's
        group when a row starves. A core of at least ``min_group`` x the batch runs alone
        (``same_length``: no realignment needed; its padding may still be trimmed, see
        ``_target_end``); a smaller one is topped up with the rows closest
        to it in length (``realigned``: ``_round`` realigns the group to ``_target_end``,
        normally the core's length, so only the added rows move).
        """
        if self.cfg.mode != "exspec":
            return self.live[: self.max_group], ("ar" if self.cfg.mode == "ar" else "same_length")
        size = min(self.max_group, len(self.live))
        oldest = min(self.live, key=lambda s: self.last_run[s])
        starving = self.step_no - self.last_run[oldest] > 2 * max(1, self.n_slots // self.cfg.batch_size)
        if starving:
            end = self.end_host[oldest]
            core = [oldest] + [s for s in self.live if self.end_host[s] == end and s != oldest][: size - 1]
        else:
            by_end = Counter(self.end_host[s] for s in self.live)
            best_n = min(size, max(by_end.values()))
            candidates = [[s for s in self.live if self.end_host[s] == e][:size]
                          for e, n in sorted(by_end.items()) if min(n, size) == best_n]
            core = min(candidates, key=self._assembly_cost)
        if len(core) >= max(1, math.ceil(self.cfg.min_group * size)):
            return sorted(core), "same_length"
        end, members = self.end_host[core[0]], set(core)
        # Fillers: rows whose content fits the core's length first (only they move), nearest length first.
        rest = sorted((s for s in self.live if s not in members),
                      key=lambda s: (self.end_host[s] - self.pad_host[s] > end, abs(self.end_host[s] - end), s))
        return sorted(core + rest[: size - len(core)]), "realigned"

    def _out_of_memory(self, slots: list[int]) -> Iterator[RowResult]:
        """A step ran out of memory: halve the group size and retry; a single row that still fails errors out.

        No rollback is needed: a forward writes KV only past each row's committed length
        (``end``), and ``end`` advances only at commit, after every forward succeeded. The
        half-written entries are overwritten by the retry.
        """
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(slots) > 1:
            self.max_group = max(1, len(slots) // 2)
            return
        slot = slots[0]
        req = self.rows[slot]
        self.rows[slot], self.texts[slot] = None, None
        self.live.remove(slot)
        yield RowResult(req.row, req.id, [], "error", error="out of memory even for this row alone",
                        prompt_tokens=len(req.prompt_ids))

    # ------------------------------------------------------------------ one round
    def _round(self, slots: list[int], kind: str) -> Iterator[RowResult | StepStats]:
        started = time.perf_counter()
        k, dev = self.k, self.device
        pad_before = sum(self.pad_host[s] for s in slots)
        moved, realign_s, assembled, assemble_s = 0, 0.0, 0, 0.0
        if self.cfg.mode == "exspec":
            # A mixed group is brought to one padded length (the fallback), a same-length one
            # loses padding it no longer needs; either way it becomes one contiguous slot range.
            new_end = self._target_end(slots)
            if new_end is not None or not is_run(slots):
                t = time.perf_counter()
                slots, n = self._assemble(slots, new_end)
                self._sync()
                if new_end is None:  # same length, scattered over the pool: moved together once
                    assembled, assemble_s = n, time.perf_counter() - t
                else:
                    moved, realign_s = n, time.perf_counter() - t
        T = self.end_host[slots[0]]
        sel = selection(slots, dev)
        idx = torch.tensor(slots, dtype=torch.long, device=dev)
        pad = self.layout.pad[sel]
        self.layout.grow(T + k + 2)
        for cache, _ in self._caches():
            cache.gathered, cache.gather_s = 0, 0.0
        greedy = all(self.rows[s].sampling.greedy for s in slots)
        bucket = self.rows[slots[0]].bucket
        gen = self.gen[sel]  # [G] completion position of the first token decided this round

        with torch.no_grad():
            # 1. Draft: re-feed the last two committed tokens, then propose k tokens one at a time.
            t0 = time.perf_counter()
            drafts, q = self._draft(sel, idx, pad, T, gen, greedy) if k else (None, None)
            self._sync()
            # 2. Verify: one target forward over [last committed, d_1..d_k].
            t1 = time.perf_counter()
            inputs = self.layout.tokens[sel, T - 1 : T]
            if k:
                inputs = torch.cat([inputs, drafts], dim=1)  # [G, k+1]
            logits = group_forward(self.target.model, self.tcache, self.target.cache_kwarg, sel, inputs, pad, T - 1)
            logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
            # 3. Accept: longest accepted prefix plus the correction or bonus token.
            n_acc, nxt = self._accept(drafts, q, logits, idx, gen, greedy)
            self._sync()
            t2 = time.perf_counter()
            # 4. Commit: write the block, apply stops, advance the rows.
            block = nxt[:, None] if not k else torch.cat([drafts, torch.zeros_like(nxt)[:, None]], dim=1)
            block = block.scatter(1, n_acc[:, None], nxt[:, None])  # [G, k+1]
            self.layout.tokens[sel, T : T + k + 1] = block
            emitted, kept, code = self._stops(block, n_acc, sel)
            self.layout.end[sel] += emitted
            host = torch.stack([emitted, kept, code]).tolist()  # the round's one host sync
            block_host = block.tolist() if self.stop_checker else None

        emitted_h, kept_h, code_h = host
        finished = []
        for i, s in enumerate(slots):
            self.end_host[s] += emitted_h[i]  # before any stop-string cut: the layout's end on the device
            self.last_run[s] = self.step_no + 1
            if block_host is not None:
                ids = self.texts[s]
                ids.extend(block_host[i][: emitted_h[i]])
                cut = self.stop_checker(ids, emitted_h[i])
                if cut is not None:  # the stop string ends within this round's tokens: drop what follows it
                    emitted_h[i] -= len(ids) - cut
                    kept_now = min(kept_h[i], emitted_h[i])
                    self.accepted[s] -= kept_h[i] - kept_now
                    kept_h[i] = kept_now
                    del ids[cut:]
                    code_h[i] = _STOP_STRING
            if code_h[i] != _RUNNING:
                finished.append((i, s, _REASONS[code_h[i]]))

        results = [self._finish(s, reason) for _, s, reason in finished]
        t3 = time.perf_counter()
        if self.live and (self.cfg.mode == "eqspec" or (self.cfg.mode == "ar" and finished)):
            moved += self._realign_group(list(self.live), None, compact=True)
        self._sync()
        realign_s += time.perf_counter() - t3
        gathered = assembled + sum(c.gathered for c, _ in self._caches())
        gather_s = assemble_s + sum(c.gather_s for c, _ in self._caches())
        total = time.perf_counter() - started
        live_in_group = self.live if self.cfg.mode != "exspec" else [s for s in slots if self.rows[s] is not None]
        yield StepStats(
            bucket=bucket,
            step=self._next_step(), group_kind=kind, batch_size=len(slots), k=k,
            accepted=kept_h, tokens_emitted=sum(emitted_h), pad_before=pad_before,
            pad_after=sum(self.pad_host[s] for s in live_in_group), kv_moved=moved, kv_gathered=gathered,
            draft_ms=(t1 - t0) * 1e3, verify_ms=(t2 - t1) * 1e3, realign_ms=realign_s * 1e3,
            gather_ms=gather_s * 1e3, total_ms=total * 1e3)
        yield from results

    def _draft(self, sel, idx, pad, T: int, gen: torch.Tensor, greedy: bool):
        """Propose k tokens per row. Returns drafts [G, k] and, when sampling, q [G, k, V]."""
        model, cache, kwarg = self.draft.model, self.dcache, self.draft.cache_kwarg
        inputs, start = self.layout.tokens[sel, T - 2 : T], T - 2
        drafts, probs = [], []
        for j in range(self.k):
            logits = group_forward(model, cache, kwarg, sel, inputs, pad, start, logits_to_keep=1)[:, -1]
            logits = self._to_target_vocab(logits)  # [G, V]
            if greedy:
                token = logits.argmax(-1)
            else:
                q = sampling.warp_probs(logits[:, None], self.temperature[idx], self.top_k[idx], self.top_p[idx])[:, 0]
                u = sampling.keyed_uniform(self.keys[idx], (gen + j)[:, None], sampling.STREAM_DRAFT)[:, 0]
                token = sampling.sample_from(q, u)
                probs.append(q)
            drafts.append(token)
            inputs, start = token[:, None], T + j
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None)

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Slice or pad draft logits [G, Vd] to the target's vocabulary size."""
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        extra = self.vocab - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.vocab]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=torch.finfo(logits.dtype).min)
        return logits

    def _accept(self, drafts, q, logits, idx, gen, greedy: bool):
        """Accepted counts [G] and the correction/bonus token [G]."""
        k = self.k
        if greedy:
            argmax = logits.argmax(-1)  # [G, k+1]
            if not k:
                return torch.zeros_like(argmax[:, 0]), argmax[:, 0]
            return sampling.greedy_accept(drafts, argmax)
        p = sampling.warp_probs(logits, self.temperature[idx], self.top_k[idx], self.top_p[idx])  # [G, k+1, V]
        positions = gen[:, None] + torch.arange(k + 1, device=self.device)[None, :]  # [G, k+1]
        u_target = sampling.keyed_uniform(self.keys[idx], positions, sampling.STREAM_TARGET)
        if not k:
            return torch.zeros_like(gen), sampling.sample_from(p[:, 0], u_target[:, 0])
        u_accept = sampling.keyed_uniform(self.keys[idx], positions[:, :k], sampling.STREAM_ACCEPT)
        return sampling.speculative_accept(drafts, q, p, u_accept, u_target)

    def _stops(self, block: torch.Tensor, n_acc: torch.Tensor, sel):
        """Tokens kept per row (after EOS / max_new_tokens), drafts kept, finish code; updates counters."""
        k = self.k
        cols = torch.arange(k + 1, device=self.device)[None, :]
        is_eos = torch.isin(block, self.eos) & (cols <= n_acc[:, None])
        first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(n_acc, k + 1))
        remaining = self.max_new[sel] - self.gen[sel]
        emitted = torch.minimum(torch.minimum(n_acc + 1, first_eos + 1), remaining)  # [G]
        kept = torch.minimum(n_acc, emitted)
        code = torch.where(first_eos + 1 <= emitted, _STOP, torch.where(emitted >= remaining, _LENGTH, _RUNNING))
        self.gen[sel] += emitted
        self.drafted[sel] += k
        self.accepted[sel] += kept
        self.rounds[sel] += 1
        return emitted, kept, code

    def _finish(self, slot: int, reason: str) -> RowResult:
        req = self.rows[slot]
        if self.texts[slot] is not None:
            ids = list(self.texts[slot])
        else:
            end, n = self.end_host[slot], int(self.gen[slot])
            ids = self.layout.tokens[slot, end - n : end].tolist()
        counters = torch.stack([self.drafted[slot], self.accepted[slot], self.rounds[slot]]).tolist()
        self.rows[slot] = None
        self.texts[slot] = None
        self.live.remove(slot)
        return RowResult(req.row, req.id, ids, reason, drafted_tokens=counters[0], accepted_tokens=counters[1],
                         rounds=counters[2], prompt_tokens=len(req.prompt_ids))

    # ------------------------------------------------------------------ realignment
    @torch.no_grad()
    def _realign_group(self, slots: list[int], new_end: int | None, compact: bool) -> int:
        """Give ``slots`` one padded length; ``new_end=None`` trims to the longest content.

        With ``compact`` the rows are also moved to slots 0..n-1 (finished rows leave the
        batch). Only rows whose slot or shift changes are touched.
        """
        if new_end is None:
            new_end = max(self.end_host[s] - self.pad_host[s] for s in slots)
        dst = list(range(len(slots))) if compact else list(slots)
        return self._move([(s, d, new_end) for s, d in zip(slots, dst)])

    def _target_end(self, slots: list[int]) -> int | None:
        """The padded length an exspec group runs at, or None to keep the one its rows share.

        Any end at or past the group's longest content is reachable (rows shift left into
        their padding or right). Of those, the end most rows already have (fewest moved),
        unless it leaves at least max(16, end / 8) pad columns in every row: then the
        longest content. A pad column costs every later round an attention read per row
        and layer (target and draft); a move copies a row's content once.
        """
        floor = max(2, max(self.end_host[s] - self.pad_host[s] for s in slots))  # the draft re-reads 2 columns
        ends = Counter(self.end_host[s] for s in slots if self.end_host[s] >= floor)
        end = max(ends.items(), key=lambda item: (item[1], -item[0]))[0] if ends else floor
        if self.cfg.trim and end - floor >= max(_TRIM_MIN, end // _TRIM_FRACTION):
            end = floor
        if len(ends) == 1 and ends[end] == len(slots):
            return None  # every row already ends there
        return end

    def _window_for(self, slots: list[int]) -> tuple[int, int]:
        """(first slot, KV columns moved) of the contiguous range that takes ``slots`` most cheaply.

        Moving the group into [a, a+G) moves every member outside the range and every other
        live row inside it (it trades places with a member); each costs its content length
        (``realign`` copies content only), so a long row stays put when a short one can move.
        """
        size, members = len(slots), set(slots)
        content = [self.end_host[s] - self.pad_host[s] if self.rows[s] is not None else 0
                   for s in range(self.n_slots)]
        # cost(a) = (members' content outside) + (other rows' content inside), from running sums over the slots
        weight = [-content[s] if s in members else content[s] for s in range(self.n_slots)]
        cost = sum(content[s] for s in slots) + sum(weight[:size])
        best = (0, cost)
        for a in range(1, self.n_slots - size + 1):
            cost += weight[a + size - 1] - weight[a - 1]
            if cost < best[1]:
                best = (a, cost)
        return best

    def _assembly_cost(self, slots: list[int]) -> int:
        return 0 if is_run(slots) else self._window_for(slots)[1]

    @torch.no_grad()
    def _assemble(self, slots: list[int], new_end: int | None) -> tuple[list[int], int]:
        """Make an exspec group one contiguous slot range (views, no per-forward gathers).

        With ``new_end`` the rows are also realigned to that padded length in the same
        move (the mixed-length fallback). Returns the group's new slots and KV entries moved.
        """
        a, _ = self._window_for(slots)
        target = range(a, a + len(slots))
        incoming = [s for s in slots if s not in target]
        opening = [d for d in target if d not in slots]  # as many as incoming
        plan = [(s, s, new_end) for s in slots if s in target] + [(s, d, new_end) for s, d in zip(incoming, opening)]
        if new_end is None:
            plan = [(s, d, self.end_host[s]) for s, d, _ in plan]
        # A live row in an opening slot trades places with the member that comes in.
        plan += [(d, s, self.end_host[d]) for s, d in zip(incoming, opening) if self.rows[d] is not None]
        return list(target), self._move(plan)

    def _move(self, plan: list[tuple[int, int, int]]) -> int:
        """Move rows (src slot, dst slot, new padded length) in one realign call, bookkeeping with them."""
        moving = [(s, d, e) for s, d, e in plan if s != d or self.end_host[s] != e]
        if not moving:
            return 0
        src_t = torch.tensor([s for s, _, _ in moving], dtype=torch.long, device=self.device)
        dst_t = torch.tensor([d for _, d, _ in moving], dtype=torch.long, device=self.device)
        ends = torch.tensor([e for _, _, e in moving], dtype=torch.long, device=self.device)
        moved = realign(self.layout, self._caches(), src_t, dst_t, ends)
        # Move the per-slot bookkeeping with the rows (host lists first, from a snapshot).
        snapshot = {s: (self.rows[s], self.end_host[s], self.pad_host[s], self.last_run[s], self.texts[s])
                    for s, _, _ in moving}
        for t in (self.gen, self.max_new, self.drafted, self.accepted, self.rounds, self.keys, self.temperature,
                  self.top_k, self.top_p):
            t[dst_t] = t[src_t]
        destinations = {d for _, d, _ in moving}
        for s, _, _ in moving:
            if s not in destinations:
                self.rows[s], self.texts[s] = None, None
        for s, d, e in moving:
            row, end, pad, last, texts = snapshot[s]
            self.rows[d], self.end_host[d], self.pad_host[d] = row, e, pad + e - end
            self.last_run[d], self.texts[d] = last, texts
        self.live = sorted(s for s in range(self.n_slots) if self.rows[s] is not None)
        return moved
