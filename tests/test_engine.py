"""Oracle tests of the engine: every mode == per-prompt greedy decoding, exactly (float64)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult, StepStats
from conftest import (TINY_VOCAB_SIZE, greedy_reference, make_tiny_llama, perturbed_copy, run_engine_rows,
                      scheduled)

torch.set_num_threads(1)
MAX_NEW = 13  # not a multiple of k + 1 for most k: max_new_tokens lands inside a round


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(TINY_VOCAB_SIZE, seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    return {
        "self": target,  # everything accepted
        "random": make_tiny_llama(TINY_VOCAB_SIZE, seed=7, layers=1),  # almost nothing accepted
        "perturbed": perturbed_copy(target, scale=0.01, seed=1),  # mixed: the hard case
    }


def ragged_prompts(n: int, seed: int, lo: int = 1, hi: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(20, seed=3)


@pytest.fixture(scope="module")
def eos_ids(target, prompts):
    """EOS set: the real EOS id plus the token the target emits most, so rows stop mid-round."""
    counts = Counter(t for p in prompts for t in greedy_reference(target, p, MAX_NEW, [])[1:])
    return [1, counts.most_common(1)[0][0]]


@pytest.fixture(scope="module")
def references(target, prompts, eos_ids):
    return [greedy_reference(target, p, MAX_NEW, eos_ids) for p in prompts]


def run_engine(target, draft, prompts, eos_ids, *, mode, k=4, batch_size=4, window=None, max_new=MAX_NEW,
               pad_to=None, buckets=None, min_group=None, trim=True, policy=None):
    """Run the engine; ``max_new`` is one limit for every row or a list of per-row limits."""
    cfg = EngineConfig(mode=mode, k=k, batch_size=batch_size, window=window or 4 * batch_size, trim=trim)
    if min_group is not None:
        cfg.min_group = min_group
    return run_engine_rows(target, draft, prompts, cfg, max_new=max_new, eos=eos_ids, pad_to=pad_to, buckets=buckets,
                           policy=policy)


def assert_equal_to_reference(results, references):
    for row, ref in enumerate(references):
        assert results[row].token_ids == ref, f"row {row} differs from per-prompt greedy decoding"


def assert_stats_consistent(results, stats):
    spec = [s for s in stats if s.group_kind != "prefill"]
    assert sum(sum(s.accepted) for s in spec) == sum(r.accepted_tokens for r in results.values())
    assert sum(s.tokens_emitted for s in spec) == sum(len(r.token_ids) for r in results.values())
    assert sum(s.batch_size for s in spec) == sum(r.rounds for r in results.values())
    for s in spec:
        assert len(s.accepted) == s.batch_size and all(0 <= a <= s.k for a in s.accepted)


def test_ar_equals_greedy(target, prompts, eos_ids, references):
    for batch_size in (1, 3, 16):
        results, stats = run_engine(target, None, prompts, eos_ids, mode="ar", batch_size=batch_size)
        assert_equal_to_reference(results, references)
        assert_stats_consistent(results, stats)
    reasons = Counter(r.finish_reason for r in results.values())
    assert reasons["stop"] and reasons["length"], reasons


# A covering subset of (mode, batch size, k, draft): every batch size 1..16 and k 1..8 appear.
MATRIX = [
    ("eqspec", 1, 1, "perturbed"), ("eqspec", 2, 8, "random"), ("eqspec", 3, 2, "self"), ("eqspec", 4, 5, "perturbed"),
    ("eqspec", 5, 3, "random"), ("eqspec", 6, 7, "perturbed"), ("eqspec", 7, 4, "self"), ("eqspec", 8, 6, "perturbed"),
    ("eqspec", 11, 3, "perturbed"), ("eqspec", 16, 8, "perturbed"), ("eqspec", 13, 1, "random"),
    ("exspec", 1, 3, "perturbed"), ("exspec", 2, 5, "self"), ("exspec", 4, 2, "perturbed"), ("exspec", 8, 4, "random"),
    ("exspec", 9, 6, "perturbed"), ("exspec", 10, 7, "self"), ("exspec", 12, 8, "perturbed"),
    ("exspec", 14, 1, "perturbed"), ("exspec", 15, 5, "random"), ("exspec", 16, 3, "perturbed"),
]
# exspec's default tops every short group up to a full batch; these run same-length groups of at least half a batch alone
HALF_GROUPS = [("exspec", 3, 4, "perturbed"), ("exspec", 8, 2, "perturbed"), ("exspec", 16, 5, "random")]


@pytest.mark.parametrize("mode,batch_size,k,draft_name,min_group",
                         [m + (None,) for m in MATRIX] + [m + (0.5,) for m in HALF_GROUPS])
def test_speculative_equals_greedy(target, drafts, prompts, eos_ids, references, mode, batch_size, k, draft_name,
                                   min_group):
    window = {1: 3, 4: 8, 8: 12}.get(batch_size)  # several pool sizes, including tight ones
    results, stats = run_engine(target, drafts[draft_name], prompts, eos_ids, mode=mode, k=k, batch_size=batch_size,
                                window=window, min_group=min_group)
    assert_equal_to_reference(results, references)
    assert_stats_consistent(results, stats)


def test_draft_equal_to_target_accepts_everything(target, prompts):
    k = 3
    results, stats = run_engine(target, target, prompts, [], mode="eqspec", k=k, batch_size=8, max_new=3 * (k + 1))
    for r in results.values():  # no EOS, max_new a multiple of k+1: every round accepts all k
        assert r.rounds == 3 and r.accepted_tokens == 3 * k and len(r.token_ids) == 3 * (k + 1)
    assert all(a == k for s in stats if s.group_kind != "prefill" for a in s.accepted)


def test_random_draft_accepts_almost_nothing(target, drafts, prompts, eos_ids):
    results, _ = run_engine(target, drafts["random"], prompts, eos_ids, mode="eqspec", k=4, batch_size=8)
    drafted = sum(r.drafted_tokens for r in results.values())
    assert sum(r.accepted_tokens for r in results.values()) < 0.25 * drafted


def test_perturbed_draft_gives_mixed_acceptance_within_a_round(target, drafts, prompts, eos_ids):
    _, stats = run_engine(target, drafts["perturbed"], prompts, eos_ids, mode="eqspec", k=4, batch_size=8)
    mixed = [s for s in stats if s.group_kind != "prefill" and len(set(s.accepted)) > 1]
    assert len(mixed) >= 3, "rows should accept different counts in the same round"
    # EQSPEC really moved KV to realign those rows.
    assert any(s.kv_moved > 0 for s in mixed)


def test_exspec_groups_same_length_rows_without_moving_kv(target, drafts, eos_ids):
    """A realistic run: bucketed prompts padded to the bucket's longest share a padded length."""
    prompts = ragged_prompts(40, seed=11, lo=8, hi=14)
    refs = [greedy_reference(target, p, MAX_NEW, eos_ids) for p in prompts]
    results, stats = run_engine(target, drafts["perturbed"], prompts, eos_ids, mode="exspec", k=3, batch_size=4,
                                window=16, pad_to=[14] * len(prompts), min_group=0.5)
    assert_equal_to_reference(results, refs)
    same = [s for s in stats if s.group_kind == "same_length"]
    assert same and all(s.kv_moved == 0 for s in same)  # same-length groups are never realigned
    # Some of them need no KV copied at all: the group already sits in one slot range.
    untouched = [s for s in same if s.kv_gathered == 0]
    assert len(untouched) >= 3
    assert len(same) > len([s for s in stats if s.group_kind == "realigned"]), "grouping should mostly hit"
    assert_stats_consistent(results, stats)


def test_exspec_admission_never_pads_a_row_past_its_bucket(target, drafts, eos_ids):
    """Free slots may take rows of two buckets at once: each bucket is prefilled at its own length."""
    short, long = ragged_prompts(6, seed=21, lo=3, hi=6), ragged_prompts(6, seed=22, lo=30, hi=40)
    prompts, pad_to, buckets = short + long, [6] * 6 + [40] * 6, [0] * 6 + [1] * 6
    refs = [greedy_reference(target, p, MAX_NEW, eos_ids) for p in prompts]
    results, stats = run_engine(target, drafts["perturbed"], prompts, eos_ids, mode="exspec", k=3, batch_size=4,
                                window=8, pad_to=pad_to, buckets=buckets)
    assert_equal_to_reference(results, refs)
    prefills = [s for s in stats if s.group_kind == "prefill"]
    assert [s.bucket for s in prefills] == [0, 0, 1, 1]  # 4 short; 2 short + 2 long split in two; 4 long
    assert sum(s.pad_before for s in prefills) == sum(t - len(p) for p, t in zip(prompts, pad_to))


def test_exspec_streams_requests_lazily(target, drafts, eos_ids):
    """The pool pulls prompts as slots free up; it never holds the whole dataset."""
    prompts = ragged_prompts(48, seed=5)
    pulled = 0

    def requests():
        nonlocal pulled
        for i, p in enumerate(prompts):
            pulled += 1
            yield Request(row=i, id=str(i), prompt_ids=p, max_new_tokens=6)

    engine = Engine(ModelHandle(target, "cache"), ModelHandle(drafts["perturbed"], "cache"), eos_ids,
                    EngineConfig(mode="exspec", k=2, batch_size=4, window=8))
    pulled_at_first_result = None
    done = 0
    for event in engine.run(requests()):
        if isinstance(event, RowResult):
            done += 1
            if pulled_at_first_result is None:
                pulled_at_first_result = pulled
    assert done == len(prompts)
    assert pulled_at_first_result <= 8 + 1


def test_prompt_longer_than_context_is_a_row_error(target, eos_ids):
    prompts = [[5] * 600, [6, 7, 8]]  # the tiny model's context is 512
    results, _ = run_engine(target, target, prompts, eos_ids, mode="exspec", k=2, batch_size=2)
    assert results[0].finish_reason == "error" and "context" in results[0].error
    assert results[1].finish_reason in ("stop", "length") and results[1].token_ids


class _OOMOnce(torch.nn.Module):
    """Wraps a decoder layer: raises out-of-memory on its n-th call, after earlier layers wrote their KV."""

    def __init__(self, layer, fail_at: int):
        super().__init__()
        self.layer, self.calls, self.fail_at = layer, 0, fail_at

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("injected")
        return self.layer(*args, **kwargs)


@pytest.mark.parametrize("mode,which", [("eqspec", "target"), ("exspec", "draft"), ("exspec", "target"),
                                        ("ar", "target")])
def test_out_of_memory_mid_forward_halves_the_group_and_loses_nothing(target, drafts, prompts, eos_ids, references,
                                                                      mode, which):
    import copy

    victim = copy.deepcopy(target if which == "target" else drafts["perturbed"])
    victim.model.layers[1] = _OOMOnce(victim.model.layers[1], fail_at=6)  # layer 0 already wrote this step's KV
    models = {"target": victim, "draft": drafts["perturbed"]} if which == "target" else \
        {"target": target, "draft": victim}
    results, stats = run_engine(models["target"], models["draft"] if mode != "ar" else None, prompts, eos_ids,
                                mode=mode, k=3, batch_size=8)
    assert victim.model.layers[1].calls > 6, "the fault was injected"
    assert_equal_to_reference(results, references)
    steps = [s for s in stats if s.group_kind != "prefill"]
    assert max(s.batch_size for s in steps[-5:]) <= 4, "the group was halved after the failure"


def test_stop_checker_cuts_inside_a_round_and_stats_stay_consistent(target, drafts, prompts, eos_ids, references):
    """A stop "string" here: the token pair references[row][2:4], which ends inside the first round (k=4)."""
    def checker(ids, n_new, row_stops=()):
        for cut in range(max(2, len(ids) - n_new + 1), len(ids) + 1):
            if any(ref[2:4] == ids[cut - 2:cut] for ref in references if len(ref) >= 5):
                return cut
        return None

    engine = Engine(ModelHandle(target, "cache"), ModelHandle(drafts["self"], "cache"), eos_ids,
                    EngineConfig(mode="exspec", k=4, batch_size=4), stop_checker=checker)
    events = list(engine.run(Request(row=i, id=str(i), prompt_ids=p, max_new_tokens=MAX_NEW)
                             for i, p in enumerate(prompts)))
    results = {e.row: e for e in events if isinstance(e, RowResult)}
    stats = [e for e in events if isinstance(e, StepStats)]
    cut_rows = [r for r in results.values() if r.finish_reason == "stop_string"]
    assert cut_rows
    for r in cut_rows:
        ref = references[r.row]
        assert r.token_ids == ref[: len(r.token_ids)] and checker(r.token_ids, len(r.token_ids)) == len(r.token_ids)
    assert_stats_consistent(results, stats)


@pytest.mark.parametrize("min_group", [None, 0.5])
def test_exspec_trims_padding_its_longest_row_left_behind(target, drafts, eos_ids, min_group):
    """Short rows padded to a long prompt lose that padding in one move once the long row is done."""
    prompts = [ragged_prompts(1, seed=31, lo=40, hi=40)[0]] + ragged_prompts(3, seed=32, lo=5, hi=8)
    max_new = [1, 12, 12, 12]
    refs = [greedy_reference(target, p, n, eos_ids) for p, n in zip(prompts, max_new)]
    padding = {}
    for trim in (True, False):
        results, stats = run_engine(target, drafts["perturbed"], prompts, eos_ids, mode="exspec", k=2, batch_size=4,
                                    window=8, max_new=max_new, pad_to=[40] * 4, trim=trim, min_group=min_group)
        assert_equal_to_reference(results, refs)
        later = [s for s in stats if s.group_kind != "prefill"][1:]  # every round after the long row finished
        assert later and all(s.batch_size <= 3 for s in later)
        padding[trim] = sum(s.pad_before for s in later)
        if trim:  # the first round without the long row moves its 32+ pad columns away from every short row
            # (what stays is the short rows' own length differences: they are 5-8 tokens long)
            assert later[0].kv_moved > 0 and later[0].pad_after <= later[0].pad_before - 30 * later[0].batch_size
        else:  # untrimmed, the rows keep the long prompt's padding (a fallback realignment moves only the others)
            assert later[0].pad_after >= 32 * later[0].batch_size
    assert padding[True] < padding[False] / 3


# ---------------------------------------------------------------------------- all-or-nothing under out-of-memory


def _fail_calls(real, fail_at: set[int], counter: dict):
    def wrapper(*args, **kwargs):
        counter["n"] += 1
        if counter["n"] in fail_at:
            raise torch.OutOfMemoryError("injected")
        return real(*args, **kwargs)
    return wrapper


def assert_equal_or_error_rows(results, references):
    """Every row is the reference's text or an error row: never wrong text."""
    for row, ref in enumerate(references):
        r = results[row]
        assert r.finish_reason == "error" or r.token_ids == ref, f"row {row} has wrong text"


@pytest.mark.parametrize("mode", ["exspec", "eqspec", "auto"])
def test_out_of_memory_inside_realign_leaves_no_trace(target, drafts, prompts, eos_ids, references, monkeypatch, mode):
    from batchspec_cli.engine import align

    counter = {"n": 0}
    monkeypatch.setattr(align, "_gather", _fail_calls(align._gather, {3, 9, 10}, counter))
    policy = scheduled(3, 5) if mode == "auto" else None  # auto speculates (rows drift apart) under a schedule
    results, stats = run_engine(target, drafts["perturbed"], prompts, eos_ids, mode=mode, k=3, batch_size=6,
                                policy=policy)
    assert counter["n"] > 10, "the faults were injected inside real moves"
    assert_equal_or_error_rows(results, references)  # a failed move changed nothing: the retry is exact
    assert sum(r.finish_reason == "error" for r in results.values()) <= 2  # only a row failing alone gives up


def test_out_of_memory_inside_grow_falls_back_to_the_exact_need(target, drafts, prompts, eos_ids, references,
                                                                monkeypatch):
    from batchspec_cli.engine.align import SlotCache

    counter = {"n": 0}
    monkeypatch.setattr(SlotCache, "_new_buffer", staticmethod(_fail_calls(SlotCache._new_buffer, {3}, counter)))
    results, _ = run_engine(target, drafts["perturbed"], [p * 4 for p in prompts], eos_ids, mode="exspec", k=3,
                            batch_size=4, max_new=MAX_NEW)
    assert counter["n"] > 3
    assert_equal_to_reference(results, [greedy_reference(target, p * 4, MAX_NEW, eos_ids) for p in prompts])


def test_a_cache_that_cannot_grow_errors_out_the_rows_that_need_it(target, drafts, eos_ids, monkeypatch):
    from batchspec_cli.engine.align import SlotCache

    short, long = ragged_prompts(4, seed=41, lo=3, hi=6), ragged_prompts(2, seed=42, lo=70, hi=80)
    prompts = short + long
    references = [greedy_reference(target, p, MAX_NEW, eos_ids) for p in prompts]
    real = SlotCache._new_buffer

    def capped(old, rows, capacity):  # a device that holds 64 columns per slot and not one more
        if capacity > 64:
            raise torch.OutOfMemoryError("injected")
        return real(old, rows, capacity)
    monkeypatch.setattr(SlotCache, "_new_buffer", staticmethod(capped))
    results, _ = run_engine(target, drafts["perturbed"], prompts, eos_ids, mode="exspec", k=3, batch_size=2,
                            buckets=[0, 0, 0, 0, 1, 1])
    assert_equal_or_error_rows(results, references)
    assert all(results[i].token_ids == references[i] for i in range(4)), "rows that fit are unharmed"
    assert all(results[i].finish_reason == "error" and "out of memory" in results[i].error for i in (4, 5))


def test_out_of_memory_inside_prefill(target, drafts, prompts, eos_ids, references):
    """A prefill that fails half way (layer 0 wrote its KV) is retried in halves; outputs stay exact."""
    import copy

    victim = copy.deepcopy(target)
    victim.model.layers[1] = _OOMOnce(victim.model.layers[1], fail_at=1)  # the very first forward: a prefill
    results, stats = run_engine(victim, drafts["perturbed"], prompts, eos_ids, mode="exspec", k=3, batch_size=8)
    assert victim.model.layers[1].calls > 1
    assert_equal_to_reference(results, references)
    first = [s for s in stats if s.group_kind == "prefill"][0]
    assert first.batch_size == 8


def test_a_prompt_that_does_not_fit_alone_is_an_error_row(target, drafts, prompts, eos_ids, references):
    import copy

    class AlwaysFails(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, hidden, *args, **kwargs):
            if hidden.shape[1] > 20:  # only long prefills run out of memory
                raise torch.OutOfMemoryError("injected")
            return self.layer(hidden, *args, **kwargs)

    victim = copy.deepcopy(target)
    victim.model.layers[0] = AlwaysFails(victim.model.layers[0])
    long = ragged_prompts(1, seed=51, lo=30, hi=30)[0]
    results, _ = run_engine(victim, drafts["perturbed"], prompts[:3] + [long], eos_ids, mode="exspec", k=3,
                            batch_size=4, buckets=[0, 0, 0, 1])
    assert results[3].finish_reason == "error" and "prefill" in results[3].error
    assert [results[i].token_ids for i in range(3)] == references[:3]


# ---------------------------------------------------------------------------- grouping under the shipped policy


def test_exspec_default_policy_runs_same_length_groups_without_moving_kv(target, drafts, eos_ids):
    """min_group 1.0 (the default): on a mixed-length job, whole same-length groups do occur and move nothing."""
    prompts = ragged_prompts(32, seed=61, lo=3, hi=40)
    lengths = [len(p) for p in prompts]
    order = sorted(range(32), key=lambda i: lengths[i])
    buckets = [0] * 32
    pad_to = [0] * 32
    for b in range(4):  # four length buckets of 8, padded to their longest as `generate` does
        members = order[8 * b : 8 * (b + 1)]
        for i in members:
            buckets[i], pad_to[i] = b, max(lengths[j] for j in members)
    prompts, buckets, pad_to = ([x[i] for i in order] for x in (prompts, buckets, pad_to))
    references = [greedy_reference(target, p, MAX_NEW, eos_ids) for p in prompts]
    results, stats = run_engine(target, drafts["self"], prompts, eos_ids, mode="exspec", k=3, batch_size=4,
                                window=16, pad_to=pad_to, buckets=buckets)
    assert_equal_to_reference(results, references)
    rounds = [s for s in stats if s.group_kind != "prefill"]
    same = [s for s in rounds if s.group_kind == "same_length"]
    assert all(s.kv_moved == 0 for s in same) and all(s.kv_moved > 0 for s in rounds if s.group_kind == "realigned")
    hit = len(same) / len(rounds)
    assert hit > 0.3, hit  # a draft that accepts everything keeps rows in step: groups stay whole
    assert any(s.batch_size == 4 and s.kv_moved == 0 for s in same)


@pytest.mark.parametrize("joining", [True, False])
def test_a_row_joining_a_running_batch_takes_its_padded_length_and_no_kv_moves(target, monkeypatch, joining):
    """ar refills its batch as rows finish: a short prompt admitted while the batch runs at column 23 is prefilled
    ending there, so no round moves KV; placed at its own length (``joining`` off, as before) it had to move."""
    from batchspec_cli.engine.core import Engine

    if not joining:
        monkeypatch.setattr(Engine, "_joining_end", lambda self, run, end, limit: end)
    prompts = ragged_prompts(4, seed=5, lo=20, hi=20) + ragged_prompts(1, seed=6, lo=6, hi=6)
    max_new = [3, 13, 13, 13, 9]  # row 0 leaves after 3 tokens; row 4 joins the three at 20 + 3 columns, leaves first
    references = [greedy_reference(target, p, n, []) for p, n in zip(prompts, max_new)]
    results, stats = run_engine(target, None, prompts, [], mode="ar", k=0, batch_size=4, max_new=max_new,
                                pad_to=[20, 20, 20, 20, 6], buckets=[0, 0, 0, 0, 1])
    assert_equal_to_reference(results, references)
    prefills = [s for s in stats if s.group_kind == "prefill"]
    assert len(prefills) == 2 and prefills[1].batch_size == 1  # the joining row was admitted alone, mid-run
    moved = sum(s.kv_moved for s in stats if s.group_kind != "prefill")
    assert moved == 0 if joining else moved > 0


def test_prefill_chunks_cover_every_column_of_every_row_within_the_budget():
    from batchspec_cli.engine.core import prefill_chunks

    for n_rows, columns, most in [(5, 3, 7), (3, 20, 7), (1, 1, 4096), (9, 4096, 4096), (4, 5, 20)]:
        chunks = list(prefill_chunks(list(range(n_rows)), columns, most))
        covered = Counter((row, col) for rows, start, stop in chunks for row in rows for col in range(start, stop))
        assert covered == Counter((r, c) for r in range(n_rows) for c in range(columns))  # each exactly once
        assert all(len(rows) * (stop - start) <= max(most, 1) for rows, start, stop in chunks)
        for i, (rows, start, _) in enumerate(chunks):  # a row's columns come in order: each attends to those before
            assert all(stop <= start for earlier, _, stop in chunks[:i] if earlier == rows)


@pytest.mark.parametrize("mode", ["ar", "exspec", "auto"])
def test_prefill_in_chunks_of_rows_and_of_columns_equals_greedy(monkeypatch, target, drafts, prompts, eos_ids,
                                                                references, mode):
    """A budget of 7 tokens a forward, padded groups (the path of models that cannot pack): rows of 24-column
    prompts are prefilled alone, 7 columns at a time."""
    from batchspec_cli.engine import core as engine

    monkeypatch.setattr(engine, "PREFILL_TOKENS", 7)
    monkeypatch.setattr(engine, "packable", lambda model, device: False)
    chunks, real = [], engine.prefill_chunks

    def recorded(*args):
        chunks.extend(real(*args))
        return list(real(*args))

    monkeypatch.setattr(engine, "prefill_chunks", recorded)
    draft = None if mode == "ar" else drafts["perturbed"]
    results, stats = run_engine(target, draft, prompts, eos_ids, mode=mode, batch_size=5, k=3)
    assert_equal_to_reference(results, references)
    assert_stats_consistent(results, stats)
    assert any(start > 0 for _, start, _ in chunks) and all(len(rows) * (stop - start) <= 7 for rows, start, stop in chunks)


@pytest.mark.parametrize("mode", ["ar", "exspec", "auto"])
@pytest.mark.parametrize("most", [7, 4096])
def test_packed_prefill_equals_greedy(monkeypatch, target, drafts, prompts, eos_ids, references, mode, most):
    """Prefills packed into one sequence per forward (no padding, no mask): at 7 tokens a forward a row runs in
    pieces, each later piece attending to the cached columns before it; at 4096 every row of a batch is one
    forward. Both equal per-prompt greedy decoding."""
    from batchspec_cli.engine import core as engine

    monkeypatch.setattr(engine, "PREFILL_TOKENS", most)
    forwards, real = [], engine.pack_rows

    def recorded(rows, budget):
        out = list(real(rows, budget))
        forwards.extend(out)
        return out

    monkeypatch.setattr(engine, "pack_rows", recorded)
    draft = None if mode == "ar" else drafts["perturbed"]
    results, stats = run_engine(target, draft, prompts, eos_ids, mode=mode, batch_size=5, k=3)
    assert_equal_to_reference(results, references)
    assert_stats_consistent(results, stats)
    assert forwards and all(sum(p.end - p.start for p in pieces) <= most for pieces in forwards)
    if most == 7:
        assert any(p.start > p.first for pieces in forwards for p in pieces)  # a later piece of a row
    else:
        assert any(len(pieces) > 1 for pieces in forwards)  # rows packed together
