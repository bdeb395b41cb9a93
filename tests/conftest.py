"""Tiny, deterministic models and tokenizers for everyone's tests.

Import the factories directly (`from conftest import make_tiny_llama, greedy_reference`)
or use the fixtures below. Everything here is built locally in well under a second;
nothing touches a model hub.

- `make_tokenizer`: a character-level tokenizer (printable ASCII + newline) with
  `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3 — pad and EOS deliberately differ here
  (SmolLM2's are equal: tests must never infer masks from ids either way).
- `make_tiny_llama`: a random Llama, float64 by default so that greedy ties are not an issue.
- `perturbed_copy`: a "draft" that agrees with its target often but not always.
- `greedy_reference`: the oracle — plain batch-1 greedy decoding, no padding.
"""

from __future__ import annotations

import dataclasses

import copy
import os
import random
import string
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from batchspec_cli.engine.events import PolicyTrace, StepStats
from batchspec_cli.models.loading import cache_kwarg
from batchspec_cli.policy.control import PLAIN, SPEC, Arms, Auto, Choice, FixedK, Goodput

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
TINY_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARS)  # 100
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def pytest_configure(config: pytest.Config) -> None:
    # Slow tests run by default (CI runs everything); `-m "not slow"` leaves them out by hand.
    config.addinivalue_line("markers", "slow: end-to-end tests on the real default model")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): a worker a core, at most 4 (each holds a model or two and their kernels)."""
    return max(1, min(4, _cores()))


# the longest files (one core, 2026-12-07: about 450, 200 and 110 s of the suite's 1,470) start first, so that the
# workers finish together (`--dist loadfile --no-loadscope-reorder` hands out the files in the order collected;
# without it xdist orders them by their number of tests)
FIRST = ("test_e2e_default_model.py", "test_ray.py", "test_scale.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # a worker: its share of the cores (tests that need more set them)
    torch.set_num_threads(max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# --------------------------------------------------------------------------- factories


def make_tokenizer(tmp_dir: Path | None = None, shuffle_seed: int | None = None) -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII + newline, 100 tokens.

    `shuffle_seed` permutes the ids of the characters (special tokens keep theirs): a
    tokenizer with the same tokens but a different vocabulary, for mismatch tests.
    """
    chars = list(CHARS)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(chars)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one char, one id
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )
    if tmp_dir is not None:
        tokenizer.save_pretrained(tmp_dir)
    return tokenizer


def make_tiny_llama(
    vocab_size: int,
    seed: int,
    dtype: torch.dtype = torch.float64,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    eos_token_id: int | list[int] = EOS_ID,
    pad_token_id: int = PAD_ID,
) -> LlamaForCausalLM:
    """A random Llama, eval mode, no grad. Same seed -> same weights (initialised in float32, then cast)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        initializer_range=0.2,  # wide logits: greedy near-ties are rare
        bos_token_id=BOS_ID,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.requires_grad_(False)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model


def perturbed_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A deep copy with N(0, scale^2) noise added to every parameter (a draft close to its target)."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            param.add_((noise * scale).to(param.dtype))
    return draft


def save_tiny_model_dir(tmp_dir: Path, seed: int, **kw) -> Path:
    """A float32 tiny Llama + `make_tokenizer` saved as a checkpoint directory `load_model` accepts."""
    tmp_dir = Path(tmp_dir)
    tokenizer = make_tokenizer()
    kw.setdefault("eos_token_id", tokenizer.eos_token_id)
    kw.setdefault("pad_token_id", tokenizer.pad_token_id)
    kw["dtype"] = torch.float32
    model = make_tiny_llama(len(tokenizer), seed, **kw)
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    return tmp_dir


def save_target_and_draft_dirs(root: Path, noise: float = 0.01) -> tuple[Path, Path]:
    """A saved tiny target and a perturbed copy of it as its draft (mixed acceptance)."""
    target = save_tiny_model_dir(root / "target", seed=0)
    draft = save_tiny_model_dir(root / "draft", seed=0)
    model = LlamaForCausalLM.from_pretrained(draft)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * noise)
    model.save_pretrained(draft)
    return target, draft


@torch.no_grad()
def tamper_token(out: Path, row: int, position: int, shift: int) -> None:
    """Change one completion token of a finished Parquet OUT in place (the run's metadata kept): a token the
    reference did not choose, for `batchspec verify` to flag."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    ids = [list(x) for x in table.column("completion_token_ids").to_pylist()]
    ids[row][position] = (ids[row][position] + shift) % 100
    column = table.schema.get_field_index("completion_token_ids")
    tampered = table.set_column(column, "completion_token_ids", pa.array(ids, pa.list_(pa.int32())))
    pq.write_table(tampered.replace_schema_metadata(table.schema.metadata), out)


def assert_rows_independent(ops, weight: torch.Tensor, x: torch.Tensor) -> None:
    """batchspec's linear kernel (``ops``: its build) on ``x`` [37, k]: each row's outputs the same bits whatever rows
    run beside it (1-13 of them, at any offset) and under 2 threads."""
    packed = ops.pack_linear(weight)
    n = weight.shape[0]
    together = ops.linear(x, packed, n)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(ops.linear(x, packed, n), together)
    finally:
        torch.set_num_threads(threads)
    for rows in (1, 2, 5, 6, 7, 13):
        for start in (0, 3, x.shape[0] - rows):
            assert torch.equal(ops.linear(x[start : start + rows], packed, n), together[start : start + rows])


def logits_on_native_kernel(model, ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tiny Llama's logits on ``ids`` [B, T]: (with the stock modules, with batchspec's kernels attached and its
    linear kernel on inputs of up to ``rows`` rows, the same one row at a time). Checks that every linear, the fused
    layers' joint ones among them, ran on the kernel, and that detaching gives every packed layer back to oneDNN."""
    from batchspec_cli.models import kernels, layers, native

    with torch.no_grad():
        stock = model(input_ids=ids).logits
        kernels.prepack(model)
        native.attach(model)
        native.use_native_rows(model, rows)
        linears = native.packed_linears(model)
        fused = model.model.layers[0].__dict__[layers.ATTRIBUTE]
        assert fused.qkv in linears and fused.gate_up in linears
        assert all(layer.native is not None for layer in linears)
        together = model(input_ids=ids).logits
        alone = torch.cat([model(input_ids=ids[i : i + 1]).logits for i in range(ids.shape[0])])
    native.detach(model)
    assert all(layer.native is None and layer.packed is not None
               for layer in model.modules() if isinstance(layer, kernels.PackedLinear))
    return stock, together, alone


def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    """Per-prompt greedy decoding (batch 1, no padding, DynamicCache).

    Returns the completion, including the EOS token when one was produced (it ends the completion).
    """
    device = next(model.parameters()).device
    cache = DynamicCache()
    stop = set(eos_ids)
    inputs = torch.tensor([prompt_ids], device=device)
    completion: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=inputs, use_cache=True, **{cache_kwarg(model): cache}).logits
        token = int(logits[0, -1].argmax())
        completion.append(token)
        if token in stop:
            break
        inputs = torch.tensor([[token]], device=device)
    return completion


def run_engine_rows(target, draft, prompts: list[list[int]], cfg, *, settings=None, max_new: int | list[int] = 13,
                    eos=(1,), policy=None, lookups=None, pad_to=None, buckets=None, logprobs=None):
    """Run the engine over prompts (ids ``r0``, ``r1``...); (results by row, step stats). Every row exactly once.

    ``max_new``, ``pad_to``, ``buckets``: one value for every row or a list of per-row values; ``logprobs``: every
    row's (``Request.logprobs``)."""
    from batchspec_cli.engine.core import Engine, ModelHandle
    from batchspec_cli.engine.events import Request, RowResult, Sampling

    def per_row(value, default):
        return value if isinstance(value, list) else [default if value is None else value] * len(prompts)
    limits, pads, bucket_of = per_row(max_new, 13), per_row(pad_to, 0), per_row(buckets, 0)
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache") if draft is not None else None,
                    list(eos), cfg, policy=policy, lookups=lookups)
    results, stats = {}, []
    for event in engine.run(Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=limits[i],
                                    sampling=settings or Sampling(), pad_to=pads[i], bucket=bucket_of[i],
                                    logprobs=logprobs)
                            for i, p in enumerate(prompts)):
        if isinstance(event, RowResult):
            assert event.row not in results, "a row finished twice"
            results[event.row] = event
        else:
            stats.append(event)
    assert sorted(results) == list(range(len(prompts))), "every row appears exactly once"
    return results, stats


@torch.no_grad()
def exact_first_two(target, prompt: list[int], settings, vocab: int) -> dict[tuple[int, int], float]:
    """P(first two tokens) of the target under the sampling settings' warping, by enumeration (p > 0 only)."""
    from batchspec_cli.engine.sampling import warp_probs

    def probs(ids):
        logits = target(torch.tensor([ids])).logits[:, -1:]
        one = torch.ones(1, dtype=torch.float64)
        return warp_probs(logits, one * settings.temperature, torch.tensor([settings.top_k]),
                          one * settings.top_p)[0, 0]
    first = probs(prompt)
    return {(a, b): float(first[a] * probs(prompt + [a])[b])
            for a in range(vocab) if first[a] > 0 for b in range(vocab)}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_target() -> LlamaForCausalLM:
    """float64 tiny target (seed 0); do not modify it in a test."""
    return make_tiny_llama(TINY_VOCAB_SIZE, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target) -> LlamaForCausalLM:
    """`tiny_target` plus noise (scale 0.01): ~50 % of teacher-forced greedy tokens agree."""
    return perturbed_copy(tiny_target, scale=0.01, seed=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved tiny target checkpoint (seed 0, float32), loadable with `load_model(str(path))`."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny_target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """A saved tiny draft checkpoint: same tokenizer, one layer, other seed (a draft far from the target)."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=1)


@pytest.fixture
def tiny_prompts(tiny_tokenizer) -> list[list[int]]:
    """Prompts of varied lengths (token ids, no special tokens)."""
    texts = ["Hi", "The quick brown fox", "a", "Hello, world! How are you?", string.ascii_lowercase]
    return [tiny_tokenizer.encode(text, add_special_tokens=False) for text in texts]


# --------------------------------------------------------------------------- injected policies and made-up steps


class RandomK(FixedK):
    """An injected schedule: a random k in 0..max every round, a random choice of eager or lazy draft prefill."""

    def __init__(self, max_k: int, seed: int):
        super().__init__(max_k)
        self.rng = random.Random(seed)

    def wants_draft(self) -> bool:
        return self.rng.random() < 0.5

    def choose(self, group, sources):
        k = self.rng.randint(0, self.k)
        if not k or not sources:
            return Choice(0)
        source = self.rng.choice(sorted({"model" if name == "model" else "lookup" for name in sources}))
        return Choice(k, source, self.rank(group, sources)[0] if source == "lookup" else None)


class ScheduledArms(Arms):
    """An injected arm schedule: a random arm for a random 1-4 rounds at a time (each stretch a 'window'), and a
    random incumbent (SPEC trials on the batch in flight, SPEC as the incumbent on the whole pool)."""

    def __init__(self, seed: int):
        super().__init__()
        self.rng, self.left = random.Random(seed), 0

    def record(self, tokens, seconds, tokens_left=None, admit_s=0.0, worth=None, once_s=0.0):
        self.left -= 1
        if self.left > 0:
            return None
        self.arm, self.left = self.rng.choice([PLAIN, SPEC]), self.rng.randint(1, 4)
        self.incumbent = self.rng.choice([PLAIN, SPEC])
        return tokens / seconds


class RandomSpec(Goodput):
    """SPEC's per-round choice replaced by a random one (it is still seeded and observed like the real one)."""

    def __init__(self, max_k: int, seed: int):
        super().__init__(max_k)
        self.random = RandomK(max_k, seed)

    def choose(self, group, sources):
        return self.random.choose(group, sources)


def scheduled(k: int, seed: int) -> Auto:
    policy = Auto(k)
    policy.arms, policy.spec = ScheduledArms(seed), RandomSpec(k, seed)
    return policy


def make_step(filled: bool = False, **fields) -> StepStats:
    """A step with every field zero or empty but those given, the policy trace's fields included (tests of what
    reads or writes the statistics). ``filled``: every field gets a non-default value by its type instead, so a
    field that a writer drops, or a field added later, shows."""
    by_type = {"int": 1, "float": 0.5, "str": "x", "list[int]": [1]} if filled else \
        {"int": 0, "float": 0.0, "str": "", "list[int]": []}
    record = {f.name: by_type[f.type.replace(" ", "")] for cls in (StepStats, PolicyTrace)
              for f in dataclasses.fields(cls) if f.name != "trace"}
    if not filled:
        record.update(group_kind="same_length", batch_size=1)
    return StepStats.from_record({**record, **fields})


def round_step(kind: str, rows: int, k: int, accepted: list[int], emitted: int, total_ms: float = 100.0,
               **fields) -> StepStats:
    """A step of ``rows`` rows at ``k`` whose time is all verify (tests of the statistics' summaries)."""
    return make_step(group_kind=kind, batch_size=rows, k=k, accepted=accepted, tokens_emitted=emitted,
                     verify_ms=total_ms, total_ms=total_ms, **fields)


def malloc_in_use() -> int | None:
    """Bytes the C heap has handed out (glibc's mallinfo2), or None off glibc."""
    import ctypes
    import ctypes.util

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallinfo2.restype = Mallinfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
