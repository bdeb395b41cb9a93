"""Log-probabilities through the engine equal those of a per-prompt plain decode (float64).

The reference is Hugging Face alone, one prompt at a time, no padding: the greedy rows'
tokens are ``generate(do_sample=False)``'s, and every row's values come from one plain
forward over prompt + completion (teacher forcing), warped for ``processed`` by Hugging
Face's own logits warpers. None of the engine's code is used for the reference.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from batchspec_cli.engine import drafters
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult, Sampling
from conftest import TINY_VOCAB_SIZE, greedy_reference, make_tiny_llama, perturbed_copy, scheduled

torch.set_num_threads(1)
MAX_NEW = 13  # lands inside a round for most k
SAMPLED = Sampling(temperature=0.8, top_k=30, top_p=0.9, seed=5)
TOP_P_ONLY = Sampling(temperature=1.3, top_p=0.7, seed=9)
TOL = 1e-10  # float64: equal up to rounding


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(TINY_VOCAB_SIZE, seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, scale=0.01, seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    base = [[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(rng.randint(1, 20))] for _ in range(10)]
    return base + [p * 3 for p in base[:4]]  # self-repeating rows: the model-free drafters find drafts


@pytest.fixture(scope="module")
def eos_ids(target, prompts):
    """The real EOS plus the target's most frequent greedy token, so rows stop mid-round."""
    counts = Counter(t for p in prompts for t in greedy_reference(target, p, MAX_NEW, [])[1:])
    return [1, counts.most_common(1)[0][0]]


def row_settings(i: int) -> tuple[Sampling, int | None]:
    """Row i's sampling and logprobs request: greedy and sampled rows, N in {None, 0, 3, 20}."""
    sampling = [Sampling(), SAMPLED, Sampling(), TOP_P_ONLY][i % 4]
    return sampling, [3, 0, 20, None, 5][i % 5]


def run(target, draft, prompts, eos_ids, *, mode, k=4, batch_size=4, lookups=(), logprobs_mode="raw",
        stop_checker=None, window=None):
    # auto starts in its PLAIN arm, and a short job may never leave it: an injected arm schedule makes it speculate
    policy = scheduled(k, 7) if mode == "auto" else None
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache") if draft is not None else None,
                    list(eos_ids), EngineConfig(mode=mode, k=k, batch_size=batch_size, window=window or 4 * batch_size,
                                                logprobs_mode=logprobs_mode),
                    stop_checker=stop_checker, lookups=drafters.make(list(lookups)), policy=policy)
    requests = []
    for i, p in enumerate(prompts):
        sampling, top = row_settings(i)
        requests.append(Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=MAX_NEW, sampling=sampling,
                                logprobs=top))
    results = {e.row: e for e in engine.run(requests) if isinstance(e, RowResult)}
    assert sorted(results) == list(range(len(prompts)))
    return results


def warpers(settings: Sampling) -> LogitsProcessorList:
    out = LogitsProcessorList([TemperatureLogitsWarper(settings.temperature)])
    if settings.top_k:
        out.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1:
        out.append(TopPLogitsWarper(settings.top_p))
    return out


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], completion: list[int], settings: Sampling, mode: str,
                       eos_ids: list[int]) -> torch.Tensor:
    """[len(completion), V] log-probabilities of a plain per-prompt decode at each completion position."""
    if settings.greedy:  # the tokens are Hugging Face's own greedy decode's
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=len(completion), eos_token_id=eos_ids, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == completion, "greedy tokens differ from generate's"
    # The values from one plain forward over the completion's tokens (generate's output_logits are float32).
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    if mode == "processed" and not settings.greedy:
        context = torch.tensor([prompt + completion])
        logits = torch.cat([warpers(settings)(context[:, : len(prompt) + j], logits[j : j + 1].clone())
                            for j in range(len(completion))], 0)
    return torch.log_softmax(logits.to(torch.float64), -1)


def assert_logprobs_match(target, prompts, results, eos_ids, mode="raw"):
    checked = 0
    for i, prompt in enumerate(prompts):
        settings, top = row_settings(i)
        result = results[i]
        if top is None:
            assert result.logprobs is None
            continue
        assert len(result.logprobs) == len(result.token_ids) > 0, i
        ref = reference_logprobs(target, prompt, result.token_ids, settings, mode, eos_ids)
        for j, (entry, token) in enumerate(zip(result.logprobs, result.token_ids)):
            assert entry.token_id == token
            assert abs(entry.logprob - float(ref[j, token])) < TOL, (i, j)
            values, ids = ref[j].topk(top)
            expected = [(int(t), float(v)) for t, v in zip(ids, values) if v > -math.inf]
            assert [t for t, _ in entry.top] == [t for t, _ in expected], (i, j)
            assert all(abs(v - e) < TOL for (_, v), (_, e) in zip(entry.top, expected)), (i, j)
            assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))
            checked += 1
    assert checked


CASES = [  # (mode, batch size, k, drafter): a draft model and model-free drafters; batch 1..16, k 1..8
    ("ar", 3, 1, None), ("ar", 16, 1, None),
    ("eqspec", 1, 2, "model"), ("eqspec", 5, 8, "model"), ("eqspec", 4, 3, "ngram"),
    ("exspec", 4, 4, "model"), ("exspec", 8, 6, "ngram,suffix"), ("exspec", 2, 5, "model"),
    ("auto", 4, 5, "model,suffix"), ("auto", 16, 3, "ngram"),
]


@pytest.mark.parametrize("mode,batch_size,k,drafter", CASES)
def test_raw_logprobs_equal_a_plain_per_prompt_decode(target, draft, prompts, eos_ids, mode, batch_size, k, drafter):
    names = (drafter or "").split(",")
    results = run(target, draft if "model" in names else None, prompts, eos_ids, mode=mode, k=k,
                  batch_size=batch_size, lookups=[n for n in names if n in drafters.NAMES])
    assert_logprobs_match(target, prompts, results, eos_ids)
    reasons = Counter(r.finish_reason for r in results.values())
    assert reasons["stop"] and reasons["length"], reasons  # rows ended mid-round by EOS and by the limit
    if mode != "ar":
        assert sum(r.accepted_tokens for r in results.values()), "drafts were accepted"


@pytest.mark.parametrize("mode,drafter", [("exspec", "model"), ("auto", "ngram"), ("ar", None)])
def test_processed_logprobs_equal_hugging_face_warpers(target, draft, prompts, eos_ids, mode, drafter):
    results = run(target, draft if drafter == "model" else None, prompts, eos_ids, mode=mode, k=3,
                  lookups=[drafter] if drafter in drafters.NAMES else [], logprobs_mode="processed")
    assert_logprobs_match(target, prompts, results, eos_ids, mode="processed")
    shortened = [e for r in results.values() if r.logprobs and not row_settings(r.row)[0].greedy
                 for e in r.logprobs if len(e.top) < row_settings(r.row)[1]]
    assert shortened, "top-k / top-p removed some of a row's top N: they are not listed"


def test_logprobs_stop_at_a_stop_string_cut(target, draft, prompts, eos_ids):
    """A stop cut inside a round keeps logprobs for the kept tokens only."""
    counts = Counter(t for p in prompts for t in greedy_reference(target, p, MAX_NEW, [1])[2:])
    stop_token = counts.most_common(1)[0][0]  # the "stop string": this token, after the second

    def checker(ids, n_new, row_stops=()):
        for cut in range(max(3, len(ids) - n_new + 1), len(ids) + 1):
            if ids[cut - 1] == stop_token:
                return cut
        return None

    results = run(target, draft, prompts, [1], mode="exspec", k=5, stop_checker=checker)
    assert any(r.finish_reason == "stop_string" for r in results.values())
    assert_logprobs_match(target, prompts, results, [1])


def test_rows_without_logprobs_are_unchanged(target, draft, prompts, eos_ids):
    """Asking for logprobs changes no token, in any row."""
    with_lp = run(target, draft, prompts, eos_ids, mode="exspec", k=4)
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), list(eos_ids),
                    EngineConfig(mode="exspec", k=4, batch_size=4, window=16))
    requests = [Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=MAX_NEW, sampling=row_settings(i)[0])
                for i, p in enumerate(prompts)]
    without = {e.row: e for e in engine.run(requests) if isinstance(e, RowResult)}
    assert {r: e.token_ids for r, e in with_lp.items()} == {r: e.token_ids for r, e in without.items()}
    assert all(e.logprobs is None for e in without.values())


@pytest.mark.parametrize("vocab", [100, 128 * 5, 128 * 40 + 17, 49152])
def test_top_n_equals_a_topk_over_the_whole_vocabulary(vocab):
    from batchspec_cli.engine.logprobs import top_n

    generator = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, 4, vocab, generator=generator, dtype=torch.float64)
    x[0, 0, 5:] = -math.inf  # a processed distribution with fewer than N tokens left
    x[1, 2, -3:] += 10.0  # the best in the ragged tail
    x[2, 1, 128:131] += 10.0  # several of the best in one chunk
    for n in (0, 1, 5, 20):
        values, ids = top_n(x, n)
        expected = x.topk(n, dim=-1)
        assert torch.equal(values, expected.values)
        finite = values > -math.inf
        assert torch.equal(ids[finite], expected.indices[finite])
