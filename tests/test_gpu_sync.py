"""One decode round syncs the host at most once (its commit's ``tolist``), in every mode, constrained rows too.

The engine runs as a generator: after the first prefill's StepStats the next event is the
StepStats of exactly one round (``Engine._round``); prompts fit one admission, so nothing but
that round runs during the pull. On a GPU the pull runs under
``torch.cuda.set_sync_debug_mode("warn")``, which warns on every synchronizing CUDA operation
("error" would raise on the one allowed sync too); skipped without CUDA. On the CPU, where
nothing synchronizes, the same pull counts the engine's own reads of a tensor's values on the
host (``tolist``, ``item``, ``bool``, ``int``, ``float``, ``numpy``, ``cpu``, called from
engine.py): on a GPU each would be a sync.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

from batchspec_cli.engine import constraints, drafters
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, Sampling, StepStats
from conftest import make_tiny_llama, perturbed_copy
from test_structured import EOS, LLT, PADDED_VOCAB, TOKENIZER  # a byte-level tokenizer llguidance reads

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BATCH = 4
SYNC_WARNING = "synchronizing"  # "called a synchronizing CUDA operation"
ENGINE_FILE = str(Path(sys.modules[Engine.__module__].__file__))
HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy", "cpu")


def tiny_models(device: str):
    target = make_tiny_llama(len(TOKENIZER) + PADDED_VOCAB, seed=0, dtype=torch.float32)
    draft = perturbed_copy(target, scale=0.02, seed=1)
    return target.to(device), draft.to(device)


@pytest.fixture(scope="module")
def models():
    return tiny_models("cuda")


@pytest.fixture(scope="module")
def cpu_models():
    return tiny_models("cpu")


def a_constraint() -> constraints.Constraint:
    """A forced run (the grammar drafts it), then a word and digits to choose."""
    return constraints.regex("answer: (yes|no|maybe) [0-9]{1,6}")


def engine_for(target, draft, mode: str, logprobs: str | None, lookups: tuple[str, ...] = ()) -> Engine:
    guide = constraints.Guide(lambda: LLT, target.config.vocab_size)
    return Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [EOS],
                  EngineConfig(mode=mode, k=3, batch_size=BATCH, window=4 * BATCH, logprobs_mode=logprobs or "raw"),
                  lookups=drafters.make(list(lookups)), guide=guide)


def requests_for(settings: Sampling, logprobs: str | None, constrained: str) -> list[Request]:
    """One bucket, one admission; ``constrained``: "" none, "all" every row, "some" every other row."""
    prompts = [[5 + i, 17, 33 + i, 40, 8 + 2 * i, 61] for i in range(BATCH)]
    return [Request(row=i, id=f"row-{i}", prompt_ids=p, max_new_tokens=16, sampling=settings,
                    logprobs=[5, None, 0, 20][i % 4] if logprobs else None,  # some rows ask, some do not
                    constraint=a_constraint() if constrained == "all" or (constrained == "some" and i % 2) else None)
            for i, p in enumerate(prompts)]


@contextlib.contextmanager
def cuda_syncs(found: list[str]):
    """Every synchronizing CUDA operation meanwhile, into ``found``."""
    torch.cuda.synchronize()  # nothing of the admission still in flight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    found += [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]


@contextlib.contextmanager
def engine_host_reads(found: list[str]):
    """Every read of a tensor's values on the host made by engine.py meanwhile, into ``found`` (on the CPU)."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, real):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename == ENGINE_FILE:
                found.append(f"{name} in Engine.{caller.f_code.co_name} (line {caller.f_lineno})")
            return real(self, *args, **kwargs)
        return read

    for name, real in originals.items():
        setattr(torch.Tensor, name, counted(name, real))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)


def syncs_in_first_round(engine: Engine, requests: list[Request], watch) -> tuple[int, StepStats, list[str]]:
    events = engine.run(requests)
    for event in events:  # up to the first prefill's stats (admission and calibration may sync freely)
        if isinstance(event, StepStats) and event.group_kind == "prefill":
            break
    else:
        pytest.fail("no prefill")
    found: list[str] = []
    with watch(found):
        event = next(events)  # exactly one round
    for _ in events:  # finish the run (outside the check)
        pass
    return len(found), event, found


@needs_cuda
@pytest.mark.parametrize("mode", ["ar", "eqspec", "exspec", "auto"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("logprobs", [None, "raw", "processed"])
def test_one_round_syncs_at_most_once(models, mode, sampled, logprobs):
    settings = Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=7) if sampled else Sampling()
    count, event, messages = syncs_in_first_round(engine_for(*models, mode, logprobs),
                                                  requests_for(settings, logprobs, ""), cuda_syncs)
    assert isinstance(event, StepStats) and event.group_kind != "prefill", event
    assert count <= 1, f"{mode}: {count} synchronizing operations in one round (k={event.k}): {messages}"


CONSTRAINED = [("exspec", ()), ("exspec", ("grammar", "suffix")), ("eqspec", ("grammar",)), ("auto", ("grammar",))]


@needs_cuda
@pytest.mark.parametrize("mode,lookups", CONSTRAINED)
@pytest.mark.parametrize("constrained", ["all", "some"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_constrained_round_syncs_at_most_once(models, mode, lookups, constrained, sampled):
    """The grammar walks host lists: a model-free drafter's drafts come with their host copy, and a draft model's
    stay on the device (a constrained row takes none of them)."""
    settings = Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=7) if sampled else Sampling()
    count, event, messages = syncs_in_first_round(engine_for(*models, mode, "processed", lookups),
                                                  requests_for(settings, "processed", constrained), cuda_syncs)
    assert isinstance(event, StepStats) and event.group_kind != "prefill", event
    assert count <= 1, f"{mode}: {count} synchronizing operations in one round (k={event.k}): {messages}"


@pytest.mark.parametrize("mode,lookups", [("ar", ()), *CONSTRAINED])
@pytest.mark.parametrize("constrained", ["", "all", "some"])
def test_one_round_reads_the_device_once_on_the_cpu_too(cpu_models, mode, lookups, constrained):
    """The same round on the CPU: the engine reads a tensor's values on the host once (the commit's ``tolist``),
    whichever drafter drafts and whether rows are constrained or not; speculative rounds are checked too."""
    counts, ks = [], []
    for sampled in (False, True):
        settings = Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=7) if sampled else Sampling()
        count, event, reads = syncs_in_first_round(engine_for(*cpu_models, mode, "processed", lookups),
                                                   requests_for(settings, "processed", constrained), engine_host_reads)
        assert isinstance(event, StepStats) and event.group_kind != "prefill", event
        assert count == 1 and "_commit" in reads[0], f"{mode}: {reads} in one round (k={event.k})"
        ks.append(event.k)
    if mode in ("exspec", "eqspec") and (lookups or constrained != "all"):
        assert any(ks), "a speculative round was checked"
