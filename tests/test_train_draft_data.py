"""The draft-training script's data bookkeeping: nothing answered twice, validation never trained on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_draft  # noqa: E402


def record(prompt, answer):
    """A record as `generate_batch` stores it (ids as int32 tensors)."""
    n = len(answer)
    return {"prompt_ids": torch.tensor(prompt, dtype=torch.int32), "answer_ids": torch.tensor(answer, dtype=torch.int32),
            "top_ids": torch.zeros((n, 2), dtype=torch.int32), "top_lp": torch.zeros((n, 2), dtype=torch.float16),
            "sampled": False}


def test_prompts_an_earlier_run_answered_are_not_answered_again():
    old = [record([5, 6, 7], [8]), record([9], [10, 11])]
    todo = [[5, 6, 7], [5, 6], [9], [12, 13]]
    assert train_draft.unanswered(todo, old) == [[5, 6], [12, 13]]


def test_shards_split_the_prompts_without_overlap_or_loss():
    items = [[i] for i in range(11)]
    parts = [train_draft.shard(items, f"{k}/3") for k in range(3)]
    assert sorted(sum(parts, [])) == items
    assert train_draft.shard(items, "0/1") == items
    for bad in ("3/3", "x", "1"):
        with pytest.raises(SystemExit):
            train_draft.shard(items, bad)


def test_repeats_are_dropped_and_no_training_answer_shares_a_validation_prompt():
    recs = [record([1, i], [i, i + 1]) for i in range(40)]
    recs.append(record([1, 3], [3, 4]))        # exact repeat of an earlier answer: dropped
    recs.append(record([1, 5], [7, 7, 7]))     # another (sampled) answer to prompt [1, 5]: kept
    recs += [record([2, i], [i]) for i in range(3)] + [record([1, 39], [0])]  # validation tail
    unique, train, val = train_draft.split_validation(recs)
    assert len(unique) == len(recs) - 1
    assert len(val) == 4                       # a tenth of the unique answers
    val_prompts = {tuple(r["prompt_ids"].tolist()) for r in val}
    assert (1, 39) in val_prompts
    assert all(tuple(r["prompt_ids"].tolist()) not in val_prompts for r in train)
    assert len(train) == len(unique) - len(val) - 1   # the earlier answer to [1, 39] left training
    keys = [(tuple(r["prompt_ids"].tolist()), tuple(r["answer_ids"].tolist())) for r in train + val]
    assert len(keys) == len(set(keys))


def test_batched_answers_are_each_prompts_own_greedy_decode(monkeypatch):
    """`generate_batch` (left-padded batch, rows finishing at different steps) stores for every greedy row
    exactly the per-prompt greedy answer, its top-k ids ranked from it, and log-probs that sum below 0."""
    import types
    from collections import Counter

    from conftest import greedy_reference, make_tiny_llama

    model = make_tiny_llama(61, seed=5, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 61, (int(n),), generator=g).tolist() for n in (3, 11, 7, 1, 9, 5)]
    # A random model seldom says its EOS: make "end" the token its greedy answers say most often.
    EOS_ID = Counter(t for p in prompts for t in greedy_reference(model, p, 20, [])).most_common(1)[0][0]
    monkeypatch.setattr(train_draft, "EOS_ID", EOS_ID)
    refs = [greedy_reference(model, p, 20, [EOS_ID]) for p in prompts]
    assert len({len(r) for r in refs}) > 3, "rows must finish at different steps for this test to bite"
    args = types.SimpleNamespace(max_new_tokens=20, topk=4, temperature=0.7)
    sampled = [False, True, False, False, True, False]
    recs = train_draft.generate_batch(model, prompts, sampled, args, torch.Generator().manual_seed(0))
    for rec, prompt, ref, samp in zip(recs, prompts, refs, sampled):
        assert rec["prompt_ids"].tolist() == prompt and rec["sampled"] == samp
        n = len(rec["answer_ids"])
        assert rec["top_ids"].shape == (n, 4) and rec["top_lp"].shape == (n, 4)
        assert bool((rec["top_lp"].float().exp().sum(-1) <= 1.001).all())
        if not samp:
            assert rec["answer_ids"].tolist() == ref
            assert rec["top_ids"][:, 0].tolist() == ref
        else:  # a sampled row stops at EOS or the limit, and its top-k still ranks the target's argmax first
            assert n == 20 or rec["answer_ids"][-1] == EOS_ID
            assert EOS_ID not in rec["answer_ids"][:-1].tolist()


def test_the_moving_average_is_scored_in_place_of_the_live_weights_and_kept_when_validation_prefers_it():
    """`score_ema` evaluates the averaged weights, puts the live ones back, and returns the average as the
    checkpoint to keep only when its validation agreement is at least the best so far."""
    from conftest import greedy_reference, make_tiny_llama

    teacher = make_tiny_llama(61, seed=1)
    live = make_tiny_llama(61, seed=2)
    live.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight)  # shared, as in a shared draft
    g = torch.Generator().manual_seed(3)
    recs = []
    for n in (4, 9, 6):
        prompt = torch.randint(3, 61, (n,), generator=g).tolist()
        answer = greedy_reference(teacher, prompt, 12, [])
        rec = record(prompt, answer)
        rec["top_ids"][:, 0] = torch.tensor(answer)
        recs.append(rec)
    ex = train_draft.build_examples(recs)
    ev = {"weight": live.lm_head.weight}
    live_before = train_draft.trained_state(live)
    ema = train_draft.trained_state(teacher)           # an "average" that agrees with the teacher everywhere
    assert train_draft.evaluate(live, ex, **ev)[0] < 0.5
    evals = []
    best = train_draft.score_ema(live, ema, ex, ex, ev, 7, (0.4, 3, live_before, "live"), evals, 0.0)
    assert best[0] == 1.0 and best[1] == 7 and best[3] == "ema"
    assert all(torch.equal(best[2][k], ema[k]) for k in ema)
    assert evals[-1][2:] == (1.0, 1.0, "ema")
    after = train_draft.trained_state(live)
    assert all(torch.equal(after[k], live_before[k]) for k in after), "the live weights must be restored"
    kept = train_draft.score_ema(live, ema, ex, ex, ev, 8, (1.01, 3, live_before, "live"), [], 0.0)
    assert kept[1] == 3 and kept[3] == "live"


def test_draws_keep_every_kind_at_its_share_where_distinct_prompts_drift_to_arithmetic():
    """`draw_prompts` repeats prompts rather than run out of a kind; `build_prompts` stays distinct and fixed."""
    import hashlib

    from draft_prompts import build_prompts, draw_prompts

    def arithmetic_share(prompts):
        marks = ("How many", "How much", "average speed", "area and perimeter", "percentage of the class",
                 "how long would it take", "Solve for x", "multiplied by")
        return sum(any(m in p for m in marks) for p in prompts) / len(prompts)

    draws = draw_prompts(16000, seed=11)
    assert draws == draw_prompts(16000, seed=11) and draws != draw_prompts(16000, seed=12)
    assert len(set(draws)) < len(draws)                      # repeats allowed
    assert 0.10 < arithmetic_share(draws) < 0.16             # two kinds of sixteen
    distinct = build_prompts(16000)
    assert len(set(distinct)) == 16000 and arithmetic_share(distinct) > 0.35
    # the held-out and earlier rounds' prompts depend on this list: it must not change
    assert hashlib.sha256("\n".join(build_prompts(3000)).encode()).hexdigest().startswith("177700026de9")
