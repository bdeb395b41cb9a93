"""Shared prompt prefixes (``prefix``): rows that start with the same tokens take that prefix's KV, and every row
is still exactly its per-prompt decoding (float64), in every mode, with every drafter, a constraint and sampling;
the statistics say how many prompt tokens were prefilled and how many reused, and that is what happened."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.engine import constraints, drafters
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult, Sampling
from batchspec_cli.engine.prefix import PrefixStore, common_length, neighbours, share_groups
from batchspec_cli.engine.sampling import gumbel, noise_base, row_key
from batchspec_cli.stats import summarize
from batchspec_cli.store.outputs import write_stats
from conftest import (TINY_VOCAB_SIZE, greedy_reference, make_step, make_tiny_llama, perturbed_copy, run_engine_rows,
                      save_target_and_draft_dirs, scheduled)

torch.set_num_threads(1)
MAX_NEW, MIN = 9, 8
SAMPLED = Sampling(temperature=0.8, seed=3)


# --------------------------------------------------------------------------- finding prefixes (pure functions)


def test_common_length():
    assert common_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_length([1, 2], [1, 2, 3]) == 2
    assert common_length([], [1]) == 0 and common_length([5], [6]) == 0


def test_share_groups_by_first_tokens_longest_common_prefix_and_the_kept_one():
    a, b = list(range(10, 40)), list(range(10, 18)) + list(range(50, 70))  # share their first 8 tokens only
    prompts = [a + [1], a + [2, 3], b + [4], list(range(80, 95)), a[:20] + [5]]
    groups = share_groups(prompts, kept=[], min_tokens=8)
    # rows 0, 1, 2 and 4 start alike; their common prefix is 8 tokens; row 3 shares nothing
    assert [(g.rows, len(g.prefix)) for g in groups] == [([0, 1, 2, 4], 8)]
    groups = share_groups(prompts[:2] + prompts[3:4], kept=[], min_tokens=8)
    assert [(g.rows, g.prefix) for g in groups] == [([0, 1], a)]
    # a lone row shares what it has in common with the kept prefix, and nothing below min_tokens
    assert [(g.rows, g.prefix) for g in share_groups([a + [9]], kept=a[:25] + [0], min_tokens=8)] == [([0], a[:25])]
    assert share_groups([a + [9]], kept=a[:5], min_tokens=8) == []
    assert share_groups([a + [9]], kept=[], min_tokens=8) == []
    # the row's last token is never shared (reach), and max_tokens cuts the prefix
    assert [len(g.prefix) for g in share_groups([a, a], kept=[], min_tokens=8)] == [29]
    assert [len(g.prefix) for g in share_groups([a, a], kept=[], min_tokens=8, max_tokens=12)] == [12]
    assert share_groups([a[:8], a[:8]], kept=[], min_tokens=8) == []  # 7 shareable tokens < 8


def test_neighbours_put_rows_that_share_a_prefix_together():
    a, b = [5] * 10, [3] * 10
    ordered = neighbours([0, 1, 2, 3], [a + [1], b + [2], a + [0], b + [1]])
    assert [row for row, _ in ordered] == [3, 1, 2, 0]


def test_the_store_keeps_the_columns_a_new_prefix_shares():
    store = PrefixStore(max_tokens=6)
    store.hold([1, 2, 3, 4, 5, 6, 7, 8])
    assert store.tokens == [1, 2, 3, 4, 5, 6]
    store.covered["target"] = 6
    store.hold([1, 2, 3])  # a prefix of the kept one: nothing changes
    assert store.tokens == [1, 2, 3, 4, 5, 6] and store.covered["target"] == 6
    store.hold([1, 2, 9, 9])
    assert store.tokens == [1, 2, 9, 9] and store.covered["target"] == 2


# --------------------------------------------------------------------------- the engine against per-prompt decoding


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(TINY_VOCAB_SIZE, seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, scale=0.01, seed=1)


def shared_prompts(seed: int = 0) -> tuple[list[list[int]], list[int], list[int]]:
    """(prompts, pad_to, bucket) in an order that interleaves them: two prefix families that share their first 12
    tokens, rows equal to each other, a row that is a prefix plus one token, rows that share nothing; two buckets."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(n)]  # noqa: E731
    common = tok(12)
    a, b = common + tok(24), common + tok(18)
    rows = [a + tok(rng.randint(1, 7)) for _ in range(7)] + [b + tok(rng.randint(1, 5)) for _ in range(5)]
    rows += [tok(rng.randint(20, 40)) for _ in range(3)] + [a + [7], list(rows[0]), list(rows[0])]
    rng.shuffle(rows)
    buckets = [0 if len(p) <= 37 else 1 for p in rows]
    pad_to = [max(len(q) for q, k in zip(rows, buckets) if k == kind) for kind in buckets]
    order = sorted(range(len(rows)), key=lambda i: buckets[i])  # a bucket at a time, as a job reads them
    return [rows[i] for i in order], [pad_to[i] for i in order], [buckets[i] for i in order]


@pytest.fixture(scope="module")
def prompts():
    return shared_prompts()


@pytest.fixture(scope="module")
def references(target, prompts):
    return [greedy_reference(target, p, MAX_NEW, [1]) for p in prompts[0]]


def run(target, draft, prompts, mode, *, k=3, batch=4, prefix_min=MIN, policy=None, lookups=None, settings=None,
        window=None):
    cfg = EngineConfig(mode=mode, k=k, batch_size=batch, window=window, prefix_min=prefix_min)
    rows, pad_to, buckets = prompts
    results, stats = run_engine_rows(target, draft, rows, cfg, max_new=MAX_NEW, eos=(1,), policy=policy,
                                     lookups=lookups, pad_to=pad_to, buckets=buckets, settings=settings)
    return [results[i].token_ids for i in range(len(rows))], stats


def reused(stats) -> int:
    return sum(s.prompt_reused for s in stats)


@pytest.mark.parametrize("mode,batch,k,with_draft,names,policy_seed", [
    ("ar", 1, 0, False, None, None), ("ar", 3, 0, False, None, None), ("eqspec", 4, 3, True, None, None),
    ("exspec", 4, 2, True, None, None), ("exspec", 5, 4, False, ["ngram"], None), ("exspec", 3, 3, True,
                                                                                   ["suffix"], None),
    ("auto", 4, 3, True, None, 1), ("auto", 6, 4, True, ["ngram"], 2), ("auto", 8, 3, True, None, None)])
def test_rows_sharing_prefixes_equal_per_prompt_decoding(target, draft, prompts, references, mode, batch, k,
                                                         with_draft, names, policy_seed):
    """The draft's prefix too: ``scheduled`` prefills it eagerly at admission or lazily at its first catch-up."""
    policy = scheduled(k, policy_seed) if policy_seed is not None else None
    outputs, stats = run(target, draft if with_draft else None, prompts, mode, k=k or 3, batch=batch, policy=policy,
                         lookups=drafters.make(names) if names else None)
    assert outputs == references
    assert reused(stats) > 0, "prefixes were shared"
    if mode != "ar" and policy_seed is not None:
        assert any(s.k for s in stats if s.group_kind != "prefill"), "it speculated"


def test_sharing_does_not_change_a_row_and_reuses_what_it_says(target, draft, prompts, references):
    """The target's forwards take fewer prompt columns by at least what the statistics say was reused (less the
    padding a group's forward covers), and without sharing nothing is reused and every prompt token prefilled."""
    fed = []
    hook = target.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"].numel()),
                                            with_kwargs=True)
    try:
        plain, plain_stats = run(target, draft, prompts, "exspec", prefix_min=0)
        plain_fed, fed[:] = sum(fed), []
        shared, shared_stats = run(target, draft, prompts, "exspec")
        shared_fed = sum(fed)
    finally:
        hook.remove()
    assert plain == shared == references
    lengths = sum(len(p) for p in prompts[0])
    assert reused(plain_stats) == 0 and sum(s.prompt_prefilled for s in plain_stats) == lengths
    assert all(s.prompt_prefilled == s.prompt_reused == 0 for s in shared_stats if s.group_kind != "prefill")
    saved = plain_fed - shared_fed
    pads = sum(s.pad_before for s in shared_stats if s.group_kind == "prefill")
    computed = sum(s.prompt_prefilled for s in shared_stats) + reused(shared_stats) - lengths  # the prefixes, once
    assert computed > 0 and reused(shared_stats) > computed
    assert saved >= reused(shared_stats) - computed - pads > 0


@torch.no_grad()
def sampled_reference(model, prompt: list[int], settings: Sampling, row_id: str) -> list[int]:
    """One prompt alone: plain forwards, temperature, the row's keyed Gumbel noise, argmax."""
    ids, out = list(prompt), []
    vocab = model.config.vocab_size
    for position in range(MAX_NEW):
        logits = model(torch.tensor([ids])).logits[0, -1].to(torch.float64)
        logp = torch.softmax(logits / settings.temperature, -1).log()
        base = noise_base(torch.tensor([row_key(settings.seed, row_id)]), torch.tensor([[position]]))[0, 0]
        token = int((logp + gumbel(base, torch.arange(vocab))).argmax())
        out.append(token)
        if token == 1:
            break
        ids.append(token)
    return out


def test_sampled_rows_sharing_prefixes_equal_per_prompt_sampling(target, draft, prompts):
    expected = [sampled_reference(target, p, SAMPLED, f"r{i}") for i, p in enumerate(prompts[0])]
    for mode, d, policy in [("ar", None, None), ("exspec", draft, None), ("auto", draft, scheduled(3, 4))]:
        outputs, stats = run(target, d, prompts, mode, settings=SAMPLED, policy=policy)
        assert outputs == expected, mode
        assert reused(stats) > 0


def test_the_kept_prefix_serves_the_next_run(target, prompts, references):
    """An engine keeps the last prefix between runs (a Ray worker runs one per block): the second run's rows reuse
    it without computing it again, and stay exact."""
    rows, pad_to, buckets = prompts
    engine = Engine(ModelHandle(target, "cache"), None, [1], EngineConfig(mode="ar", batch_size=4, prefix_min=MIN))

    def once(indexes):
        events = list(engine.run(Request(row=i, id=f"r{i}", prompt_ids=rows[i], max_new_tokens=MAX_NEW,
                                         pad_to=pad_to[i], bucket=buckets[i]) for i in indexes))
        results = {e.row: e.token_ids for e in events if isinstance(e, RowResult)}
        return results, [e for e in events if not isinstance(e, RowResult)]
    first, _ = once(range(len(rows) - 1))
    last = len(rows) - 1
    kept = engine.prefixes.match(rows[last])
    second, stats = once([last])
    assert {**first, **second} == dict(enumerate(references))
    if kept >= MIN:
        assert stats[0].prompt_reused > 0 and stats[0].prompt_prefilled == len(rows[last]) - stats[0].prompt_reused


# --------------------------------------------------------------------------- a constraint


def test_constrained_rows_sharing_a_prefix_equal_the_constrained_reference():
    from test_structured import EOS, LLT, PADDED_VOCAB, REGEX, TOKENIZER, constrained_reference

    model = make_tiny_llama(len(TOKENIZER) + PADDED_VOCAB, seed=5)
    instruction = TOKENIZER.encode("You extract e-mail addresses from text. Answer with the address only.",
                                   add_special_tokens=False)
    asks = ["Mail bob at", "the list is", "x", "write to us: ", "support?"]
    prompts = [[2] + instruction + TOKENIZER.encode(a, add_special_tokens=False) for a in asks]
    constraint = constraints.regex(REGEX)
    expected = [constrained_reference(model, p, constraint, 20) for p in prompts]
    for mode, k, names in [("ar", 0, []), ("exspec", 3, ["grammar", "ngram"])]:
        engine = Engine(ModelHandle(model, "cache"), None, [EOS],
                        EngineConfig(mode=mode, k=k or 3, batch_size=3, prefix_min=MIN),
                        lookups=drafters.make(names), guide=constraints.Guide(lambda: LLT, model.config.vocab_size))
        events = list(engine.run([Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=20, constraint=constraint,
                                          pad_to=max(map(len, prompts))) for i, p in enumerate(prompts)]))
        results = {e.row: e.token_ids for e in events if isinstance(e, RowResult)}
        assert [results[i] for i in range(len(prompts))] == expected, mode
        assert sum(getattr(e, "prompt_reused", 0) for e in events) > 0


# --------------------------------------------------------------------------- statistics and the CLI


def test_stats_prints_the_reuse_share(tmp_path):
    path = tmp_path / "out.stats.parquet"
    steps = [make_step(group_kind="prefill", batch_size=4, prompt_prefilled=300, prompt_reused=900),
             make_step(group_kind="same_length", batch_size=4, tokens_emitted=4, total_ms=10.0)]
    write_stats(path, steps, {})
    overall = summarize(path)[-1]
    assert (overall.prompt_prefilled, overall.prompt_reused, overall.reuse_share) == (300, 900, 0.75)
    result = CliRunner().invoke(app, ["stats", str(path)])
    assert result.exit_code == 0, result.output
    assert "300 prefilled, 900 reused (shared prefixes, --n samples): reuse share 75.0 %" in result.output


def test_generate_shares_a_system_prompt_and_verify_finds_every_row_exact(tmp_path):
    """A job of chat rows with one long system prompt through the CLI: rows equal per-prompt decoding (``verify``),
    and the statistics file's prefill records reuse most of the prompt."""
    target, draft = save_target_and_draft_dirs(tmp_path / "models")
    system = "You are a careful assistant. Answer in one short line, lower case, no punctuation at all. " * 2
    asks = ["hi", "what is two plus two", "name a colour", "say yes", "count to three", "why", "a", "bye now"]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": [{"role": "system", "content": system},
                                                                {"role": "user", "content": a}]}) + "\n"
                           for i, a in enumerate(asks)))
    out = tmp_path / "out.parquet"
    runner = CliRunner()
    result = runner.invoke(app, ["generate", str(inp), str(out), "--target", str(target), "--draft", str(draft),
                                 "--max-new-tokens", "10", "--batch-size", "3", "--quiet", "--dtype", "float64"])
    assert result.exit_code == 0, result.output
    stats = pq.read_table(tmp_path / "out.stats.parquet").to_pylist()
    share = sum(s["prompt_reused"] for s in stats) / sum(s["prompt_reused"] + s["prompt_prefilled"] for s in stats)
    assert share > 0.5
    verified = runner.invoke(app, ["verify", str(out)])
    assert verified.exit_code == 0 and "8 exact (100.0 %)" in verified.output, verified.output
    summary = runner.invoke(app, ["stats", str(tmp_path / "out.stats.parquet")])
    assert summary.exit_code == 0 and "reused (shared prefixes" in summary.output


def test_a_lone_row_shares_with_the_next_row_to_come():
    a = list(range(10, 40))
    assert [(g.rows, g.prefix) for g in share_groups([a + [1]], kept=[], min_tokens=8, ahead=a + [2, 3])] \
        == [([0], a)]
    assert share_groups([a + [1]], kept=[], min_tokens=8, ahead=[5] + a) == []
