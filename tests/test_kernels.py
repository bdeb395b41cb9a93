"""kernels.prepack: oneDNN-prepacked linears give the stock model's logits (float32) and its greedy tokens."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult
from batchspec_cli.models import kernels, native
from conftest import TINY_VOCAB_SIZE, greedy_reference, make_tiny_llama, malloc_in_use, perturbed_copy

pytestmark = pytest.mark.skipif(not kernels.available(), reason="this PyTorch has no oneDNN")


def tiny(seed: int = 0) -> torch.nn.Module:
    return make_tiny_llama(TINY_VOCAB_SIZE, seed=seed, dtype=torch.float32)


def packed_copy(model, min_rows: int = 1):
    return kernels.prepack(copy.deepcopy(model), min_rows=min_rows)


def test_prepack_swaps_every_linear_and_keeps_parameters():
    model = tiny()
    names = dict(model.state_dict())
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    packed = packed_copy(model)
    assert kernels.packed_layers(packed) == n_linear > 0
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert packed.state_dict().keys() == names.keys()
    for key, value in packed.state_dict().items():
        assert torch.equal(value, names[key])
    kernels.unpack(packed)
    assert kernels.packed_layers(packed) == 0 and sum(type(m) is torch.nn.Linear for m in packed.modules()) == n_linear


def test_prepack_leaves_other_dtypes_alone():
    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)  # float64
    assert kernels.packed_layers(kernels.prepack(model)) == 0


@pytest.mark.parametrize("min_rows", [1, 2, 4])
@pytest.mark.parametrize("batch,length", [(1, 1), (1, 3), (1, 6), (3, 1), (3, 5)])
@torch.no_grad()
def test_logits_match_the_stock_model(min_rows, batch, length):
    model = tiny()
    packed = packed_copy(model, min_rows)
    ids = torch.randint(4, TINY_VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(length))
    expected, got = model(input_ids=ids).logits, packed(input_ids=ids).logits
    assert torch.allclose(got, expected, rtol=0, atol=1e-5), float((got - expected).abs().max())


@pytest.mark.skipif(not kernels.packs(torch.bfloat16), reason="oneDNN packs no bfloat16 weight on this CPU")
@pytest.mark.parametrize("rows", [1, 3, 8, 40, kernels.MAX_ROWS_BF16 + 1])
@torch.no_grad()
def test_bfloat16_layers_pack_and_round_as_the_stock_bfloat16_product(rows):
    """A bfloat16 layer packs from one row up (AMX where the CPU has it); its output is the float32 product of the
    same bfloat16 numbers, rounded once to bfloat16, as the stock bfloat16 path computes it: within one bfloat16
    unit of the exact product, whichever path ran."""
    linear = torch.nn.Linear(96, 40, bias=True, dtype=torch.bfloat16).requires_grad_(False)
    packed = kernels.PackedLinear(linear)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    exact = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    got = packed(x)
    assert got.dtype == torch.bfloat16
    unit = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=1e-3)  # one bfloat16 unit at each magnitude
    assert bool(((got.double() - exact).abs() <= unit).all())
    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=0, dtype=torch.bfloat16)
    assert kernels.packed_layers(kernels.prepack(model)) == sum(
        isinstance(m, torch.nn.Linear) for m in model.modules()) > 0


def test_whether_bfloat16_packs_is_what_torch_reports_for_this_cpu():
    """oneDNN's bfloat16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only CPU it refuses."""
    if hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported"):
        assert kernels.packs(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert kernels.packs(torch.float32)


@torch.no_grad()
def test_where_onednn_refuses_bfloat16_its_layers_keep_the_stock_product(monkeypatch):
    """A bfloat16 model on a CPU whose oneDNN packs no bfloat16 (``packs`` says so): prepack leaves its layers plain,
    counts no memory for them, and the logits are the stock model's bit for bit (before: the reorder's error ended
    the job)."""
    monkeypatch.setattr(kernels, "packs", lambda dtype: dtype != torch.bfloat16)
    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=0, dtype=torch.bfloat16)
    stock = copy.deepcopy(model)
    assert kernels.packable_bytes(model) == 0
    assert kernels.packed_layers(kernels.prepack(model)) == 0
    ids = torch.randint(4, TINY_VOCAB_SIZE, (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(input_ids=ids).logits, stock(input_ids=ids).logits)


def test_deepcopy_of_a_packed_model_is_packed_and_equal():
    packed = packed_copy(tiny())
    again = copy.deepcopy(packed)
    assert kernels.packed_layers(again) == kernels.packed_layers(packed)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, packed(input_ids=ids).logits)


PROMPTS = [[5, 17, 40, 8], [60, 61, 62, 63, 64, 65, 66, 9], [33], [70, 12, 12, 90, 4, 44]]


@pytest.mark.parametrize("min_rows", [1, 2, 4])
def test_greedy_decoding_is_identical(min_rows):
    model = tiny()
    packed = packed_copy(model, min_rows)
    for prompt in PROMPTS:
        assert greedy_reference(packed, prompt, 20, []) == greedy_reference(model, prompt, 20, [])


@pytest.mark.parametrize("mode", ["eqspec", "exspec"])
def test_speculative_decoding_with_packed_models_equals_ar(mode):
    """The engine on packed target and draft (verify forwards of k + 1 tokens) == packed greedy == stock greedy."""
    model = tiny()
    target = packed_copy(model, min_rows=kernels.DEFAULT_MIN_ROWS)
    draft = kernels.prepack(perturbed_copy(model, scale=0.01, seed=1))
    references = [greedy_reference(model, p, 13, [1]) for p in PROMPTS]
    assert references == [greedy_reference(target, p, 13, [1]) for p in PROMPTS]
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [1],
                    EngineConfig(mode=mode, k=4, batch_size=2, window=8))
    requests = [Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=13, pad_to=0, bucket=0)
                for i, p in enumerate(PROMPTS)]
    results = {e.row: e.token_ids for e in engine.run(requests) if isinstance(e, RowResult)}
    assert [results[i] for i in range(len(PROMPTS))] == references


class _Loaded:
    def __init__(self, model):
        self.model = model


def test_auto_kernels_pack_float32_cpu_models_when_the_memory_allows(monkeypatch):
    """--kernels auto: packed for float32 on a CPU, stock (and a note) when the copies would not fit in half the
    free memory, stock without a note for other dtypes; --kernels packed forces them; stock leaves the model alone."""
    from batchspec_cli.job.assembly import use_kernels

    weights = sum(m.weight.numel() * 4 for m in tiny().modules() if type(m) is torch.nn.Linear)
    assert kernels.packable_bytes(tiny()) == weights > 0
    assert kernels.packable_bytes(packed_copy(tiny())) == 0  # already packed: nothing more to add
    free = kernels.memory_available()
    assert free is None or free > 0

    built = native.load()
    built.news()  # the build's note comes once a process: whichever test packs first shows it
    copies = 2 if torch.float32 in built.linear_dtypes else 1  # batchspec's float32 kernel's layout beside oneDNN's
    monkeypatch.setattr(kernels, "memory_available", lambda: 2 * copies * weights)
    model = tiny()
    assert use_kernels("auto", _Loaded(model), None) == ("packed", [])
    assert kernels.packed_layers(model) > 0
    layers = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    assert layers and all(hasattr(m, native.ATTRIBUTE) == (built.attend is not None) for m in layers)

    monkeypatch.setattr(kernels, "memory_available", lambda: 2 * copies * weights - 1)
    model = tiny()
    ran, notes = use_kernels("auto", _Loaded(model))
    assert ran == "stock" and kernels.packed_layers(model) == 0
    assert len(notes) == 1 and "--kernels packed" in notes[0] and "MiB" in notes[0]
    assert use_kernels("packed", _Loaded(model)) == ("packed", []) and kernels.packed_layers(model) > 0

    model = tiny()
    assert use_kernels("stock", _Loaded(model)) == ("stock", []) and kernels.packed_layers(model) == 0
    assert not any(hasattr(m, native.ATTRIBUTE) for m in model.modules())
    float64 = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    assert use_kernels("auto", _Loaded(float64)) == ("stock", [])
    ran, notes = use_kernels("packed", _Loaded(float64))
    assert ran == "stock" and "float32" in notes[0]


@torch.no_grad()
def test_memory_does_not_grow_with_the_number_of_input_sizes():
    """A long job feeds a linear layer hundreds of distinct sizes (prefills of rows x prompt length). oneDNN keeps a
    JIT kernel (~0.25 MB) per size it ran: the packed path takes a bounded range of sizes, so the C heap stays
    flat however many sizes come (unbounded, 300 sizes held ~160 MB)."""
    layer = kernels.PackedLinear(torch.nn.Linear(16, 32).requires_grad_(False))
    sizes = range(1, 400)
    for rows in sizes:  # every size once: the bounded range's kernels are built here
        layer(torch.randn(rows, 16))
    before = malloc_in_use()
    if before is None:
        pytest.skip("needs glibc's mallinfo2")
    for rows in range(400, 700):  # 300 new sizes
        x = torch.randn(rows, 16)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert malloc_in_use() - before < 16 * 2**20


_MANY_SHAPES = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from conftest import malloc_in_use
from batchspec_cli.models import kernels
from batchspec_cli.job.assembly import use_kernels

class Loaded:  # what use_kernels reads of a loaded model
    def __init__(self, model):
        self.model = model

layers = torch.nn.Sequential(*[torch.nn.Linear(16, 8 * (i + 1)) for i in range(10)]).requires_grad_(False)
if {bounded}:
    assert use_kernels("packed", Loaded(layers)) == ("packed", [])
else:  # oneDNN's own caps (the user's setting is kept)
    os.environ.update(dict.fromkeys(kernels.CACHE_VARIABLES, "1024"))
    kernels.prepack(layers)
before = malloc_in_use()
with torch.no_grad():
    for rows in range(kernels.DEFAULT_MIN_ROWS, kernels.MAX_ROWS + 1):
        for layer in layers:
            layer(torch.randn(rows, 16))
print((malloc_in_use() - before) / 2**20)
"""


@pytest.mark.skipif(malloc_in_use() is None, reason="needs glibc's mallinfo2")
def test_the_jobs_kernels_hold_a_bounded_memory_however_many_sizes_run():
    """A job's process (use_kernels) caps oneDNN's kernel caches: 630 layer shape x size pairs, each a ~0.5 MB kernel
    here, hold a fraction of what the same run holds with the caches at oneDNN's own 1,024 entries."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in kernels.CACHE_VARIABLES}

    def grown(bounded: bool) -> float:
        code = _MANY_SHAPES.format(tests=str(Path(__file__).parent), bounded=bounded)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return float(run.stdout.split()[-1])

    unbounded, bounded = grown(False), grown(True)
    if unbounded < 20:
        pytest.skip(f"this oneDNN build keeps little per size ({unbounded:.0f} MB for 630 sizes)")
    # 630 kernels against at most 2 x 128 (here ~320 MB against ~55 MB): whatever a kernel costs on this CPU
    assert bounded < unbounded / 3, (bounded, unbounded)


def test_the_packed_rows_are_the_fewest_from_which_packed_was_never_slower():
    """Invented timings (ms by rows): packed runs from the smallest timed size at and above which it was never
    slower than stock; where it was slower at the largest timed size, from one past it."""
    stock = {1: 10.0, 2: 11.0, 3: 11.0, 4: 17.0, 6: 18.0, 8: 20.0}
    assert kernels.min_rows_from(stock, {1: 14.0, 2: 14.0, 3: 14.0, 4: 14.0, 6: 14.0, 8: 15.0}) == 4  # this Xeon
    assert kernels.min_rows_from(stock, {r: 5.0 for r in stock}) == 1  # an AMX core in bfloat16
    assert kernels.min_rows_from(stock, {1: 14.0, 2: 10.0, 3: 12.0, 4: 14.0, 6: 14.0, 8: 15.0}) == 4  # not 2: 3 lost
    assert kernels.min_rows_from(stock, {**{r: 5.0 for r in stock}, 8: 21.0}) == 9
    assert kernels.min_rows_from(stock, {r: t for r, t in stock.items()}) == 1  # a tie is no loss


def test_a_burst_in_one_attempt_does_not_decide_the_native_rows():
    """Invented kernels: batchspec's 1.25x faster at every size; a neighbour's burst slows the native kernel's first
    timed attempt 3x at every other size. Timed once, the bursts decide (the span ends before 4 rows); the fastest
    of ``NATIVE_REPEATS`` attempts gives every size to the native kernel."""
    sizes = kernels.NATIVE_ROWS_TIMED
    true = {False: 1.25, True: 1.0}  # seconds per row: before, native

    def timings(repeats: int):
        attempts: dict = {}

        def seconds(rows: int, native: bool) -> float:
            n = attempts[rows, native] = attempts.get((rows, native), -1) + 1  # 0: the untimed attempt
            burst = native and n == 1 and sizes.index(rows) % 2 == 1
            return rows * true[native] * (3.0 if burst else 1.0)

        return kernels._fastest_ms(sizes, seconds, repeats)

    before, native = timings(1)
    assert kernels.native_rows_from(before, native) == (1, 1)  # the bursts decided
    before, native = timings(kernels.NATIVE_REPEATS)
    assert before == {r: 1.25e3 * r for r in sizes} and native == {r: 1e3 * r for r in sizes}
    assert kernels.native_rows_from(before, native) == (1, kernels.EVERY_ROWS)


@torch.no_grad()
def test_measured_packed_rows_time_both_kernels_and_apply_to_every_dtype():
    model = packed_copy(tiny())
    rows, timings = kernels.measure_min_rows(model, sizes=(1, 2, 4), repeats=1)
    assert 1 <= rows <= 5 and rows == kernels.min_rows_from(timings["stock"], timings["packed"])
    assert set(timings) == {"stock", "packed"} and all(set(t) == {1, 2, 4} and min(t.values()) > 0
                                                        for t in timings.values())
    assert kernels.measure_min_rows(tiny()) == (1, {})  # nothing packed: nothing to time
    for dtype in (torch.float32, torch.bfloat16) if kernels.packs(torch.bfloat16) else (torch.float32,):
        model = kernels.prepack(make_tiny_llama(TINY_VOCAB_SIZE, seed=0, dtype=dtype))
        kernels.set_min_rows(model, 3)
        layers = [m for m in model.modules() if isinstance(m, kernels.PackedLinear)]
        assert layers and all(m.min_rows == 3 and m.first == 3 * m.in_features for m in layers)
        with pytest.raises(ValueError):
            kernels.set_min_rows(model, 0)


def test_auto_kernels_run_packed_from_the_rows_measured_once_per_machine_and_model(monkeypatch, tmp_path):
    """--kernels auto: the rows are measured on the first job and remembered (the same sizes take the same kernel
    run after run); a damaged entry is measured again; --kernels packed keeps the default rows."""
    from batchspec_cli.job.assembly import tune_kernels, use_kernels
    from batchspec_cli.models.widths import MachineMemory

    measured = []

    def measure(model, sizes=kernels.ROWS_TIMED, repeats=2):
        measured.append(model)
        return 3, {"stock": {1: 1.0}, "packed": {1: 2.0}}

    monkeypatch.setattr(kernels, "measure_min_rows", measure)
    monkeypatch.setattr(kernels, "memory_available", lambda: 2**40)
    memory = MachineMemory(tmp_path / "widths.json", {"machine": "this one"})

    class Named(_Loaded):
        name = "tiny"

    def layer_rows(model):
        return {m.min_rows for m in model.modules() if isinstance(m, kernels.PackedLinear)}

    model = tiny()
    assert use_kernels("auto", Named(model), tuning=memory) == ("packed", [])
    assert len(measured) == 1 and layer_rows(model) == {3}
    again = tiny()
    assert use_kernels("auto", Named(again), tuning=memory) == ("packed", [])
    assert len(measured) == 1 and layer_rows(again) == {3}  # remembered
    job = next(iter(memory._read()))
    memory.put(json.loads(job), {"min_rows": "many"})
    assert tune_kernels(Named(again), memory) == 3 and len(measured) == 2
    forced = tiny()
    assert use_kernels("packed", Named(forced)) == ("packed", [])
    assert len(measured) == 2 and layer_rows(forced) == {kernels.DEFAULT_MIN_ROWS}
