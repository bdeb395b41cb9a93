"""On a GPU, one decode round syncs the host at most once (its commit's ``tolist``), in every mode.

Skipped without CUDA. The engine runs as a generator: after the first prefill's StepStats
the next event is the StepStats of exactly one round (``Engine._round``); that pull runs
under ``torch.cuda.set_sync_debug_mode("warn")``, which warns on every synchronizing CUDA
operation. ("error" would raise on the one allowed sync too.) Prompts fit one admission,
so nothing but that round runs during the pull.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from batchspec_cli.engine import Engine, EngineConfig, ModelHandle
from batchspec_cli.events import Request, Sampling, StepStats
from conftest import TINY_VOCAB_SIZE, make_tiny_llama, perturbed_copy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BATCH = 4
SYNC_WARNING = "synchronizing"  # "called a synchronizing CUDA operation"


@pytest.fixture(scope="module")
def models():
    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0, dtype=torch.float32)
    draft = perturbed_copy(target, scale=0.02, seed=1)
    return target.cuda(), draft.cuda()


def syncs_in_first_round(target, draft, mode: str, settings: Sampling,
                         logprobs: str | None = None) -> tuple[int, StepStats, list[str]]:
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [1],
                    EngineConfig(mode=mode, k=3, batch_size=BATCH, window=4 * BATCH, logprobs_mode=logprobs or "raw"))
    prompts = [[5 + i, 17, 33 + i, 40, 8 + 2 * i, 61] for i in range(BATCH)]  # one bucket, one admission
    requests = [Request(row=i, id=f"row-{i}", prompt_ids=p, max_new_tokens=16, sampling=settings,
                        logprobs=[5, None, 0, 20][i % 4] if logprobs else None)  # some rows ask, some do not
                for i, p in enumerate(prompts)]
    events = engine.run(requests)
    for event in events:  # up to the first prefill's stats (admission and calibration may sync freely)
        if isinstance(event, StepStats) and event.group_kind == "prefill":
            break
    else:
        pytest.fail("no prefill")
    torch.cuda.synchronize()  # nothing of the admission still in flight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            event = next(events)  # exactly one round
        finally:
            torch.cuda.set_sync_debug_mode(0)
    messages = [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]
    for _ in events:  # finish the run (outside the check)
        pass
    return len(messages), event, messages


@pytest.mark.parametrize("mode", ["ar", "eqspec", "exspec", "auto"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("logprobs", [None, "raw", "processed"])
def test_one_round_syncs_at_most_once(models, mode, sampled, logprobs):
    settings = Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=7) if sampled else Sampling()
    count, event, messages = syncs_in_first_round(*models, mode, settings, logprobs)
    assert isinstance(event, StepStats) and event.group_kind != "prefill", event
    assert count <= 1, f"{mode}: {count} synchronizing operations in one round (k={event.k}): {messages}"
