"""--n samples per input row: keys, output-equivalence across modes, and the prompt prefilled once per row."""

from __future__ import annotations

import random

import pytest
import torch

from batchspec_cli.engine import Engine, EngineConfig, ModelHandle
from batchspec_cli.events import Request, RowResult, Sampling, StepStats
from batchspec_cli.sampling import row_key
from conftest import TINY_VOCAB_SIZE, make_tiny_llama, perturbed_copy

torch.set_num_threads(1)

N = 4
SAMPLED = Sampling(temperature=0.8, top_k=0, top_p=1.0, seed=7)


@pytest.fixture(scope="module")
def models():
    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    return target, perturbed_copy(target, scale=0.02, seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(rng.randint(2, 14))] for _ in range(6)]


def sample_requests(prompts, n, settings=SAMPLED, max_new=12):
    """The requests a job makes: sample j of input row i is output row i * n + j, keyed by (seed, id, j)."""
    return [Request(row=i * n + j, id=f"row-{i}", prompt_ids=p, max_new_tokens=max_new, sampling=settings, sample=j)
            for i, p in enumerate(prompts) for j in range(n)]


def run(target, draft, requests, *, mode, batch_size, k=3):
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache") if draft is not None else None, [1],
                    EngineConfig(mode=mode, k=k, batch_size=batch_size))
    events = list(engine.run(requests))
    return {e.row: e.token_ids for e in events if isinstance(e, RowResult)}, \
        [e for e in events if isinstance(e, StepStats)]


def test_sample_zero_key_is_the_rows_key_and_samples_differ():
    assert row_key(3, "x", 0) == row_key(3, "x")
    keys = {row_key(3, "x", j) for j in range(64)} | {row_key(3, f"x{j}", 0) for j in range(64)}
    assert len(keys) == 128  # no (id, sample) pair shares a key with another


def test_samples_equal_across_modes_and_sample_zero_is_the_n1_row(models, prompts):
    target, draft = models
    single, _ = run(target, None, sample_requests(prompts, 1), mode="ar", batch_size=1)
    reference, _ = run(target, None, sample_requests(prompts, N), mode="ar", batch_size=1)
    for i in range(len(prompts)):
        assert reference[i * N] == single[i], i  # adding samples never changes the first
    for mode, batch_size in [("exspec", 8), ("eqspec", 3), ("auto", 8), ("ar", 8)]:
        got, _ = run(target, draft if mode != "ar" else None, sample_requests(prompts, N), mode=mode,
                     batch_size=batch_size)
        assert got == reference, (mode, batch_size)


def test_samples_differ_at_temperature(models, prompts):
    target, _ = models
    got, _ = run(target, None, sample_requests(prompts, N, max_new=16), mode="ar", batch_size=8)
    distinct = [len({tuple(got[i * N + j]) for j in range(N)}) for i in range(len(prompts))]
    # At T = 0.8 over a 100-token vocabulary, 16 tokens: equal samples would be a broken key, not chance.
    assert sum(distinct) >= len(prompts) * (N - 1), distinct


@pytest.mark.parametrize("mode,batch_size,once", [("exspec", 8, True), ("auto", 4, True), ("ar", 4, True),
                                                   ("eqspec", 5, False), ("ar", 3, False)])
def test_prompt_prefilled_once_per_input_row(models, prompts, mode, batch_size, once):
    """A sample admitted while another sample of its row is in flight copies that row's prompt KV. When a batch
    admits whole rows (N divides it) every prompt is prefilled once; otherwise a row whose samples all finished
    before its last one was admitted prefills again (never N times here), and the rows are the same either way."""
    target, draft = models
    got, steps = run(target, draft if mode != "ar" else None, sample_requests(prompts, N), mode=mode,
                     batch_size=batch_size)
    prefills = [s for s in steps if s.group_kind == "prefill"]
    prompt_tokens = sum(len(p) for p in prompts)
    prefilled, reused = sum(s.prefilled_tokens for s in prefills), sum(s.reused_tokens for s in prefills)
    assert prefilled + reused == N * prompt_tokens
    assert prefilled == prompt_tokens if once else prompt_tokens <= prefilled < 2 * prompt_tokens
    assert sum(s.kv_gathered for s in prefills) > 0
    reference, _ = run(target, None, sample_requests(prompts, N), mode="ar", batch_size=1)
    assert got == reference
