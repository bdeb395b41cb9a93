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
