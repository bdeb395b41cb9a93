"""Model-free drafters through the engine: outputs equal `ar` whatever drafts, and copies accept nearly everything."""

from __future__ import annotations

import random

import pytest
import torch

from batchspec_cli.engine import drafters
from batchspec_cli.engine.core import EngineConfig
from batchspec_cli.engine.events import Sampling
from conftest import TINY_VOCAB_SIZE, greedy_reference, make_tiny_llama, perturbed_copy, run_engine_rows

torch.set_num_threads(1)
MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(TINY_VOCAB_SIZE, seed=0)


def base_prompts() -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(4, 30) for _ in range(rng.randint(2, 20))] for _ in range(10)]


@pytest.fixture(scope="module")
def prompts():
    base = base_prompts()
    return base + [p * 3 for p in base[:4]] + base[:4]  # self-repeating prompts, and exact repeats of earlier rows


def run(target, prompts, *, mode, names, draft=None, batch_size=4, k=4, settings=Sampling(), max_new=MAX_NEW,
        window=None):
    cfg = EngineConfig(mode=mode, k=k, batch_size=batch_size, window=window or 4 * batch_size)
    return run_engine_rows(target, draft, prompts, cfg, settings=settings, max_new=max_new,
                           lookups=drafters.make(names))


CASES = [("exspec", ["ngram"], None, 1, 3), ("auto", ["suffix"], None, 2, 5), ("eqspec", ["ngram", "suffix"], None, 5, 4),
         ("exspec", ["suffix"], "model", 8, 2), ("auto", ["ngram", "suffix"], "model", 16, 6),
         ("exspec", ["ngram", "suffix"], None, 16, 8)]


@pytest.mark.parametrize("mode,names,with_model,batch_size,k", CASES)
def test_outputs_equal_ar_with_every_drafter(target, prompts, mode, names, with_model, batch_size, k):
    model = perturbed_copy(target, scale=0.01, seed=1) if with_model else None
    references = [greedy_reference(target, p, MAX_NEW, [1]) for p in prompts]
    results, stats = run(target, prompts, mode=mode, names=names, draft=model, batch_size=batch_size, k=k)
    assert [results[i].token_ids for i in range(len(prompts))] == references
    rounds = [s for s in stats if s.group_kind != "prefill"]
    used = {name for s in rounds for name in s.drafter.split(",") if name}
    if mode != "auto" and not with_model:  # a fixed k drafts with the model when there is one
        assert used & set(names), "a model-free drafter proposed"
    assert sum(s.drafted for s in rounds) == sum(r.drafted_tokens for r in results.values())
    assert all(len(s.accepted) == s.batch_size and all(a <= s.k for a in s.accepted) for s in rounds)
    sampled = Sampling(temperature=0.9, top_p=0.95, seed=4)
    plain, _ = run(target, prompts, mode="ar", names=[], batch_size=batch_size, settings=sampled)
    spec, _ = run(target, prompts, mode=mode, names=names, draft=model, batch_size=batch_size, k=k, settings=sampled)
    assert {r: e.token_ids for r, e in spec.items()} == {r: e.token_ids for r, e in plain.items()}


def test_a_repeated_prompt_is_drafted_from_the_finished_row_and_accepts_nearly_everything(target):
    """One row at a time: the repeats run after their originals finished, so the job-wide index holds them."""
    prompts = base_prompts() + base_prompts()[:4]
    results, _ = run(target, prompts, mode="exspec", names=["suffix"], batch_size=1, window=1, k=6)
    repeats = range(len(prompts) - 4, len(prompts))
    drafted = sum(results[r].drafted_tokens for r in repeats)
    accepted = sum(results[r].accepted_tokens for r in repeats)
    assert drafted >= 30 and accepted / drafted > 0.9, (accepted, drafted)
    firsts = sum(results[r].accepted_tokens for r in range(4)) / max(1, sum(results[r].drafted_tokens for r in range(4)))
    assert firsts < accepted / drafted


def test_rows_without_a_match_verify_one_token(target):
    """A prompt with no repeated n-gram drafts nothing: its rounds are plain steps beside rows that draft."""
    lone = list(range(4, 20))  # no repeats: ngram has nothing to propose until the completion repeats
    looped = [5, 6, 7, 8] * 4
    results, stats = run(target, [lone, looped], mode="exspec", names=["ngram"], batch_size=2, k=4, max_new=6)
    first = [s for s in stats if s.group_kind != "prefill"][0]
    assert first.drafted == 4 and first.k == 4  # only the looped row drafted
    assert results[1].drafted_tokens >= 4


def test_a_forced_run_is_continued_only_by_a_proposal_that_begins_with_all_of_it():
    """Row 0: suffix begins with the forced run and goes on, so grammar proposes the longer run. Row 1: suffix
    disagrees within the forced run, so the grammar keeps its own. Row 2: nothing forced, nothing changes."""
    grammar = drafters._padded([[7, 8], [7, 8], []], 5, "grammar")
    suffix = drafters._padded([[7, 8, 9, 10], [7, 3, 9, 10], [1, 2]], 5, "suffix")
    ngram = drafters._padded([[7, 8, 9], [], []], 5, "ngram")
    proposals = {"ngram": ngram, "suffix": suffix, "grammar": grammar}
    drafters.continue_forced(proposals)
    assert grammar.lengths == [4, 2, 0] and grammar.tokens[0, :4].tolist() == [7, 8, 9, 10]
    assert grammar.tokens[1, :2].tolist() == [7, 8]
    assert suffix.lengths == [4, 4, 2] and ngram.lengths == [3, 0, 0]  # the others are left as they were
