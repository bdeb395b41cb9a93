"""Sampling through the whole engine: exact target distribution, and per-row determinism."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult, Sampling
from batchspec_cli.models.loading import SubsetHead
from conftest import TINY_VOCAB_SIZE, exact_first_two, make_tiny_llama, perturbed_copy

torch.set_num_threads(1)


def run(target, draft, prompts, settings: Sampling, *, mode, k=3, batch_size=4, window=None, max_new=10, eos=(1,),
        order=None):
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache") if draft is not None else None,
                    list(eos), EngineConfig(mode=mode, k=k, batch_size=batch_size, window=window or 4 * batch_size))
    requests = (Request(row=i, id=f"row-{i}", prompt_ids=prompts[i], max_new_tokens=max_new, sampling=settings)
                for i in (order or range(len(prompts))))
    return {e.row: e for e in engine.run(requests) if isinstance(e, RowResult)}


@pytest.fixture(scope="module")
def models():
    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    return target, perturbed_copy(target, scale=0.02, seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(4)
    return [[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(rng.randint(1, 15))] for _ in range(16)]


SETTINGS = Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=123)


def test_sampled_rows_identical_across_batch_sizes_modes_and_windows(models, prompts):
    target, draft = models
    reference = run(target, draft, prompts, SETTINGS, mode="eqspec", batch_size=1)
    for mode, batch_size, window in [("eqspec", 4, None), ("eqspec", 16, None), ("exspec", 1, 2), ("exspec", 4, 8),
                                     ("exspec", 16, 16), ("exspec", 3, 5)]:
        other = run(target, draft, prompts, SETTINGS, mode=mode, batch_size=batch_size, window=window)
        for row in reference:
            assert other[row].token_ids == reference[row].token_ids, (mode, batch_size, row)
    # Stream order (bucket order) does not matter either: rows are keyed by id, not by arrival.
    reordered = run(target, draft, prompts, SETTINGS, mode="exspec", batch_size=4, order=list(reversed(range(16))))
    assert {r: e.token_ids for r, e in reordered.items()} == {r: e.token_ids for r, e in reference.items()}


def test_same_command_twice_same_output_and_seed_matters(models, prompts):
    target, draft = models
    first = run(target, draft, prompts, SETTINGS, mode="exspec")
    second = run(target, draft, prompts, SETTINGS, mode="exspec")
    assert {r: e.token_ids for r, e in first.items()} == {r: e.token_ids for r, e in second.items()}
    other_seed = run(target, draft, prompts, Sampling(0.9, 20, 0.95, seed=124), mode="exspec")
    assert any(other_seed[r].token_ids != first[r].token_ids for r in first)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_draft_equal_to_target_accepts_everything_when_sampling(models, prompts, temperature):
    target, _ = models
    k = 3
    results = run(target, target, prompts, Sampling(temperature, 0, 1.0, seed=9), mode="eqspec", k=k, batch_size=8,
                  max_new=3 * (k + 1), eos=())
    for r in results.values():
        assert r.rounds == 3 and r.accepted_tokens == 3 * k


def test_greedy_rows_in_a_sampled_batch_stay_greedy(models, prompts):
    """temperature 0 rows are exactly greedy even when other rows of the group sample."""
    target, draft = models
    greedy = run(target, draft, prompts, Sampling(), mode="exspec")
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [1],
                    EngineConfig(mode="exspec", k=3, batch_size=4))
    requests = [Request(row=i, id=f"row-{i}", prompt_ids=p, max_new_tokens=10,
                        sampling=Sampling() if i % 2 else SETTINGS) for i, p in enumerate(prompts)]
    mixed = {e.row: e for e in engine.run(requests) if isinstance(e, RowResult)}
    for row in range(1, len(prompts), 2):
        assert mixed[row].token_ids == greedy[row].token_ids


# ---------------------------------------------------------------------------- statistics

V = 8  # a vocabulary small enough to enumerate


def total_variation(counts: Counter, n: int, exact: dict) -> float:
    return 0.5 * sum(abs(counts.get(key, 0) / n - p) for key, p in exact.items())


@pytest.mark.parametrize("mode", ["exspec", "ar", "exspec-subset-head"])
def test_sampled_distribution_matches_target(mode):
    target = make_tiny_llama(V, seed=2, layers=1, hidden=32, heads=2, kv_heads=1, eos_token_id=[], pad_token_id=0)
    draft = make_tiny_llama(V, seed=3, layers=1, hidden=32, heads=2, kv_heads=1, eos_token_id=[], pad_token_id=0)
    if mode == "exspec-subset-head":  # q is zero outside the draft's head: the residual must supply those tokens
        ids = torch.tensor([0, 2, 3, 6])
        draft.lm_head = SubsetHead(draft.lm_head.weight[ids].clone(), ids, V)
        mode = "exspec"
    prompt = [3, 5, 2]
    settings = Sampling(temperature=1.0, top_k=0, top_p=1.0, seed=5)
    exact = exact_first_two(target, prompt, settings, V)
    with torch.no_grad():  # the draft is far from the target, so rejections and residual samples happen
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1], -1)
        q = torch.softmax(draft(torch.tensor([prompt])).logits[0, -1], -1)
    assert 0.5 * float((p - q).abs().sum()) > 0.3
    n = 2 ** 16 if mode == "exspec" else 2 ** 14
    results = run(target, draft if mode != "ar" else None, [prompt] * n, settings, mode=mode, k=2,
                  batch_size=512, window=1024, max_new=2, eos=())
    counts = Counter(tuple(r.token_ids) for r in results.values())
    bound = 3 * math.sqrt(len(exact)) / math.sqrt(n)
    assert total_variation(counts, n, exact) < bound
    if mode == "exspec":
        drafted = sum(r.drafted_tokens for r in results.values())
        accepted = sum(r.accepted_tokens for r in results.values())
        assert 0.1 < accepted / drafted < 0.9, "both acceptances and rejections must occur"
