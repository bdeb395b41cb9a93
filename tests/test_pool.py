"""The slot pool: what it costs when it does not speculate, and where its KV memory goes (float64 oracles)."""

from __future__ import annotations

import random

import pytest
import torch

from batchspec_cli.engine import align, drafters
from batchspec_cli.engine import core as engine_module
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult, StepStats
from batchspec_cli.policy import control
from conftest import TINY_VOCAB_SIZE, greedy_reference, make_tiny_llama, perturbed_copy, run_engine_rows

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(TINY_VOCAB_SIZE, seed=0)


def prompts_of(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(engine: Engine, prompts, max_new, pad_to=0, buckets=None):
    results, stats = {}, []
    for event in engine.run(Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=max_new, pad_to=pad_to,
                                    bucket=buckets[i] if buckets else 0) for i, p in enumerate(prompts)):
        if isinstance(event, RowResult):
            results[event.row] = event
        else:
            stats.append(event)
    return results, stats


@pytest.fixture
def pools(monkeypatch) -> list:
    """The slot pools the engine's runs make, the newest last (a run's state is the run's: the test keeps them)."""
    made = []
    real = engine_module.SlotPool

    def recorded(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(engine_module, "SlotPool", recorded)
    return made


def watch_growths(monkeypatch, pools: list) -> list[tuple[int, int]]:
    """(slots copied, slots live) of every growth of a KV buffer that holds entries."""
    seen = []
    real = align.SlotCache._resize

    def spy(cache, rows, capacity):
        before = cache.copied_rows
        real(cache, rows, capacity)
        seen.append((cache.copied_rows - before, len(pools[-1].table.live)))
    monkeypatch.setattr(align.SlotCache, "_resize", spy)
    return seen


def test_the_pool_without_speculation_moves_no_kv_and_copies_only_live_slots(target, monkeypatch, pools):
    """Rows that stay in step (k = 0, one bucket, no early stop): no realignment, no assembly, and buffer growths
    (a later, longer bucket) copy the live slots alone, never the whole window."""
    prompts = prompts_of(6, seed=1, lo=4, hi=9) + prompts_of(6, seed=2, lo=60, hi=70)
    buckets = [0] * 6 + [1] * 6
    engine = Engine(ModelHandle(target, "cache"), None, [], EngineConfig(mode="auto", batch_size=3, window=24))
    growths = watch_growths(monkeypatch, pools)
    results, stats = run(engine, prompts, 10, buckets=buckets)
    assert [results[i].token_ids for i in range(12)] == [greedy_reference(target, p, 10, []) for p in prompts]
    rounds = [s for s in stats if s.group_kind != "prefill"]
    assert rounds and all(s.k == 0 for s in rounds)
    assert all(s.kv_moved == 0 and s.kv_gathered == 0 for s in rounds)
    assert growths, "the longer bucket needs wider buffers"
    assert all(copied <= live for copied, live in growths), growths


def test_a_job_that_knows_its_longest_prompt_allocates_its_kv_buffers_once(target, monkeypatch, pools):
    """Requests that say how many they are and their longest padded prompt (``job.Counted``): the first admission
    reserves every slot the job fills at the longest length, so the longer bucket grows nothing; rows stay exact."""
    from batchspec_cli.job.generation import Counted

    prompts = prompts_of(6, seed=1, lo=4, hi=9) + prompts_of(6, seed=2, lo=60, hi=70)
    buckets = [0] * 6 + [1] * 6
    requests = [Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=10, pad_to=9 if i < 6 else 70,
                        bucket=buckets[i]) for i, p in enumerate(prompts)]
    engine = Engine(ModelHandle(target, "cache"), None, [], EngineConfig(mode="auto", batch_size=12))
    growths = watch_growths(monkeypatch, pools)
    results = {e.row: e for e in engine.run(Counted(requests, len(requests), longest=70)) if isinstance(e, RowResult)}
    assert [results[i].token_ids for i in range(12)] == [greedy_reference(target, p, 10, []) for p in prompts]
    cache = pools[-1].table.target
    assert growths == [] and cache.rows == 12 and cache.capacity >= 70 + 10


def test_auto_reserves_one_batch_while_it_decodes_plainly_and_its_rows_stay_exact(target, monkeypatch, pools):
    """auto starts in PLAIN, which holds one batch: the first reservation is that batch's slots at the job's longest
    length, not the speculating pool's four batches (which a SPEC that wins grows into)."""
    from batchspec_cli.engine.drafters import make
    from batchspec_cli.engine.pool import SlotPool
    from batchspec_cli.job.generation import Counted

    prompts = prompts_of(12, seed=4, lo=4, hi=30)
    requests = [Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=8, pad_to=len(p)) for i, p in enumerate(prompts)]
    engine = Engine(ModelHandle(target, "cache"), None, [], EngineConfig(mode="auto", batch_size=4),
                    lookups=make(["ngram"]))
    assert engine.strategy.n_slots == 16
    reserved = []
    real = SlotPool.reserve

    def spy(pool, slots, columns, rows=0):
        reserved.append(rows)
        return real(pool, slots, columns, rows)
    monkeypatch.setattr(SlotPool, "reserve", spy)
    results = {e.row: e for e in engine.run(Counted(requests, 12, longest=30)) if isinstance(e, RowResult)}
    assert reserved[0] == 4  # one batch, not min(16, 12)
    assert [results[i].token_ids for i in range(12)] == [greedy_reference(target, p, 8, []) for p in prompts]


def test_kv_buffers_hold_the_rows_there_are_not_the_batch_size(target, pools):
    """Two rows at batch 64 (a window of 256 slots) allocate KV for two slots, reserved for their whole length."""
    prompts = prompts_of(2, seed=3, lo=5, hi=8)
    sizes = {}
    for batch in (2, 64):
        engine = Engine(ModelHandle(target, "cache"), None, [], EngineConfig(mode="auto", batch_size=batch))
        results, stats = run(engine, prompts, 20)
        assert [results[i].token_ids for i in range(2)] == [greedy_reference(target, p, 20, []) for p in prompts]
        cache = pools[-1].table.target
        sizes[batch] = sum(t.numel() for t in cache.keys + cache.values)
        assert cache.rows == 2 and cache.capacity >= max(map(len, prompts)) + 20
    assert sizes[64] == sizes[2]


def test_decoding_never_stops_to_grow_the_buffers(target, monkeypatch):
    """Columns are reserved at admission for what the admitted rows can reach (prompt + max_new_tokens + k + 1)."""
    prompts = prompts_of(8, seed=4, lo=3, hi=30)
    draft = perturbed_copy(target, scale=0.01, seed=1)
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [],
                    EngineConfig(mode="exspec", k=3, batch_size=4, window=8))
    grew_in_round = []
    real = align.SlotCache.grow

    def spy(cache, needed, rows=0):
        if needed > cache.capacity and cache.keys:
            grew_in_round.append(needed)
        return real(cache, needed, rows)
    monkeypatch.setattr(align.SlotCache, "grow", spy)
    results, _ = run(engine, prompts, 40)
    assert [results[i].token_ids for i in range(8)] == [greedy_reference(target, p, 40, []) for p in prompts]
    assert grew_in_round == []


def test_a_step_label_comes_from_the_grouping_decision_not_from_the_kv_count(target, monkeypatch):
    """A KV counter that reports nothing must not turn realigned steps into same_length ones.

    The label is the grouping's decision; ``kv_moved`` is what ``realign`` copied. With the counter
    broken, steps still say ``realigned`` and the consistency check between the two catches it."""
    prompts = prompts_of(12, seed=5, lo=3, hi=20)
    draft = perturbed_copy(target, scale=0.01, seed=1)
    cfg = EngineConfig(mode="exspec", k=3, batch_size=4, window=8)

    def consistent(stats) -> bool:
        rounds = [s for s in stats if s.group_kind in ("same_length", "realigned")]
        return (all(s.kv_moved == 0 for s in rounds if s.group_kind == "same_length")
                and all(s.kv_moved > 0 for s in rounds if s.group_kind == "realigned"))

    _, stats = run_engine_rows(target, draft, prompts, cfg, eos=[])
    assert any(s.group_kind == "realigned" for s in stats) and consistent(stats)
    real = align.SlotTable.realign
    monkeypatch.setattr(align.SlotTable, "realign", lambda *args: [0] * len(real(*args)))  # moves, counts nothing
    results, stats = run_engine_rows(target, draft, prompts, cfg, eos=[])
    assert [results[i].token_ids for i in range(12)] == [greedy_reference(target, p, 13, []) for p in prompts]
    assert any(s.group_kind == "realigned" for s in stats)
    assert not consistent(stats)


class _PlainOnly(control.Arms):
    """Arms that never leave PLAIN (auto on a machine where speculation never pays)."""

    def _decide(self, rate: float) -> None:
        pass


class _SpecTrial(_PlainOnly):
    """Arms stuck in a SPEC trial: SPEC runs, PLAIN stays the incumbent."""

    def __init__(self):
        super().__init__()
        self.arm = control.SPEC
        self.window = control.Window(control.SPEC)


class _SpecWins(_SpecTrial):
    """A SPEC trial that wins after ``after`` rounds: SPEC holds from then on."""

    def __init__(self, after: int):
        super().__init__()
        self.left = after

    def record(self, tokens, seconds, tokens_left=None, admit_s=0.0, worth=None, once_s=0.0):
        self.left -= 1
        if self.left == 0:
            self.incumbent = control.SPEC
        return super().record(tokens, seconds, tokens_left, admit_s, worth)


class _Speculating(control.Goodput):
    """SPEC's ruler replaced by one that drafts k with the model every round."""

    def choose(self, group, sources):
        return control.Choice(self.k, "model") if "model" in sources else control.Choice(0)


class _PlainSteps(control.Goodput):
    """SPEC's ruler replaced by one that picks a plain step every round (speculation never pays)."""

    def choose(self, group, sources):
        return control.Choice(0)


def test_auto_holds_one_batch_while_it_does_not_speculate(target, pools):
    """auto with a drafter keeps a window of 4 x batch for speculation to group, but while its PLAIN arm runs it
    admits one batch, as ar does: rows in step, no realignment of rows admitted apart, KV for one batch."""
    draft = perturbed_copy(target, scale=0.05, seed=1)
    prompts = prompts_of(14, seed=4, lo=4, hi=30)
    references = [greedy_reference(target, p, 12, []) for p in prompts]  # per prompt, once
    policy = control.Auto(3)
    policy.arms = _PlainOnly()
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [],
                    EngineConfig(mode="auto", k=3, batch_size=4, window=16), lookups=drafters.make(["suffix"]),
                    policy=policy)
    results, stats = run(engine, prompts, 12)
    assert [results[i].token_ids for i in range(14)] == references
    assert all(s.k == 0 for s in stats if s.group_kind != "prefill")
    assert pools[-1].table.target.rows <= 4, "slots beyond one batch were filled"
    assert pools[-1].table.draft is None or not pools[-1].table.draft.keys, "the draft never ran, so no draft KV"
    # A SPEC trial (PLAIN still the incumbent) speculates on the batch in flight; SPEC as the incumbent fills.
    policy = control.Auto(3)
    policy.arms = _SpecTrial()
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [],
                    EngineConfig(mode="auto", k=3, batch_size=4, window=16), policy=policy)
    results, stats = run(engine, prompts, 12)
    assert [results[i].token_ids for i in range(14)] == references
    assert all(s.trace.arm == control.SPEC for s in stats if s.group_kind != "prefill")  # (k is SPEC's own choice)
    assert pools[-1].table.target.rows <= 4, "a SPEC trial filled slots beyond one batch"
    # SPEC as the incumbent fills the window while its rounds speculate, and holds one batch while its ruler picks
    # plain steps (the rows stay in step: extra rows would only grow the KV).
    for spec, fills in ((_Speculating(3), True), (_PlainSteps(3), False)):
        policy = control.Auto(3)
        policy.arms, policy.spec = _SpecWins(after=8), spec
        engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [],
                        EngineConfig(mode="auto", k=3, batch_size=4, window=16), policy=policy)
        results, stats = run(engine, prompts, 12)
        assert [results[i].token_ids for i in range(14)] == references
        assert all((s.k > 0) == fills for s in stats if s.group_kind != "prefill")
        assert (pools[-1].table.target.rows > 4) == fills, "SPEC fills the window only while it speculates"
    # A policy that speculates fills the window.
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [],
                    EngineConfig(mode="exspec", k=3, batch_size=4, window=16))
    results, _ = run(engine, prompts, 12)
    assert [results[i].token_ids for i in range(14)] == references
    assert pools[-1].table.target.rows > 4


def test_a_plain_batch_refills_every_slot_as_soon_as_it_is_free(target, pools):
    """auto in PLAIN holds one batch and keeps it full: rows of different lengths finish one by one, and each freed
    slot takes the next prompt before the next round. Every round until the last prompt is admitted runs the whole
    batch (waiting for a quarter of it to be free ran 7 of 8 rows for a tenth more rounds); outputs equal the
    per-prompt references."""
    draft = perturbed_copy(target, scale=0.05, seed=1)
    prompts = prompts_of(24, seed=6, lo=4, hi=20)
    limits = [3 + (7 * i) % 11 for i in range(len(prompts))]  # rows finish at different rounds
    policy = control.Auto(3)
    policy.arms = _PlainOnly()
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [],
                    EngineConfig(mode="auto", k=3, batch_size=8, window=32), lookups=drafters.make(["suffix"]),
                    policy=policy)
    events = list(engine.run(Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=limits[i])
                             for i, p in enumerate(prompts)))
    results = {e.row: e for e in events if isinstance(e, RowResult)}
    assert [results[i].token_ids for i in range(len(prompts))] == \
        [greedy_reference(target, p, limits[i], []) for i, p in enumerate(prompts)]
    steps = [e for e in events if isinstance(e, StepStats)]
    last_admission = max(i for i, s in enumerate(steps) if s.group_kind == "prefill")
    rounds = [s for s in steps[:last_admission] if s.group_kind != "prefill"]
    assert len(rounds) > 10 and all(s.batch_size == 8 for s in rounds), [s.batch_size for s in rounds]
    assert pools[-1].table.target.rows <= 8


class _CountingSuffix(drafters.SuffixDrafter):
    """The suffix drafter, counting the proposals the engine asks of it."""

    def __init__(self):
        super().__init__()
        self.asked = 0

    def propose(self, rows, k):
        self.asked += 1
        return super().propose(rows, k)


@pytest.mark.parametrize("arms, asks", [(_PlainOnly, False), (_SpecTrial, True)])
def test_plain_rounds_ask_no_drafter_and_index_nothing(target, arms, asks):
    """auto in PLAIN takes no draft, so it asks no model-free drafter for one and builds no row's suffix index
    (measured: 1-2 % of a plain job at batch 8 on short prompts); SPEC's rounds do. Outputs equal the per-prompt
    references either way."""
    draft = perturbed_copy(target, scale=0.05, seed=1)
    prompts = prompts_of(10, seed=8, lo=4, hi=20)
    suffix = _CountingSuffix()
    policy = control.Auto(3)
    policy.arms = arms()
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [],
                    EngineConfig(mode="auto", k=3, batch_size=4, window=16), lookups=[suffix], policy=policy)
    results, _ = run(engine, prompts, 9)
    assert [results[i].token_ids for i in range(len(prompts))] == [greedy_reference(target, p, 9, []) for p in prompts]
    assert (suffix.asked > 0) == asks
    waiting = len(suffix.corpus.pending)  # PLAIN: every prompt and completion still waits; SPEC's drafts read them
    assert (waiting < 2 * len(prompts)) == asks, waiting
