"""The draft-training script's data bookkeeping: nothing answered twice, validation never trained on."""

from __future__ import annotations

import sys
from pathlib import Path

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
