"""batchspec's bfloat16 linear kernel (models/linear_cpu.cpp) and where it runs (kernels.use_native,
assembly.tune_native): its products against float64 ones rounded to bfloat16, a row's outputs the same whatever rows
and threads run beside it, every shape a model has (outputs not a multiple of 64, leading dims, no rows), the sizes it
takes from oneDNN, and a model running on it against the stock model."""

import json

import pytest
import torch
from torch import nn

from batchspec_cli.models import kernels, native, widths
from conftest import assert_rows_independent, logits_on_native_kernel, make_tiny_llama

BUILT = native.load()
pytestmark = pytest.mark.skipif(not BUILT.linear, reason="the linear kernel needs AVX512-BF16 and a build: "
                                                         f"{BUILT.error or 'this CPU has no AVX512-BF16'}")
OPS = BUILT.ops


def random(shape, seed, scale=1.0):
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(torch.bfloat16)


def product(x, weight):
    return OPS.linear(x, OPS.pack_linear(weight), weight.shape[0])


def bfloat16_ulps(got, want_float64):
    """How many bfloat16 steps apart ``got`` is from the float64 value, measured at the value's magnitude."""
    want = want_float64.to(torch.bfloat16).double()
    step = torch.where(want == 0, torch.tensor(2.0**-133, dtype=torch.float64),
                       torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 8))
    return ((got.double() - want) / step).abs()


@pytest.mark.parametrize("out_features,in_features", [(576, 576), (70, 1536), (1, 2), (130, 64)])
def test_the_product_is_the_float64_product_rounded_to_bfloat16(out_features, in_features):
    x, weight = random((11, in_features), 1), random((out_features, in_features), 2, 0.05)
    got = product(x, weight)
    exact = x.double() @ weight.double().T
    ulps = bfloat16_ulps(got, exact)
    # summed in float32, rounded once: the float64 value's rounding, or the step beside it where the float32 sum
    # lies within its rounding error of the halfway point
    assert ulps.max() <= 1 and (ulps == 0).float().mean() >= 0.98
    stock = nn.functional.linear(x, weight)
    assert bfloat16_ulps(stock, exact).max() <= 1  # the yardstick holds for PyTorch's own product too


def test_a_rows_outputs_do_not_depend_on_the_rows_or_threads_beside_it():
    assert_rows_independent(OPS, random((200, 576), 3, 0.05), random((37, 576), 4))


def test_every_shape_a_forward_passes():
    weight = random((96, 64), 5)
    packed = OPS.pack_linear(weight)
    x = random((2, 3, 64), 6)
    assert torch.equal(OPS.linear(x, packed, 96), OPS.linear(x.reshape(6, 64), packed, 96).view(2, 3, 96))
    strided = random((64, 6), 7).t()  # not contiguous
    assert torch.equal(OPS.linear(strided, packed, 96), OPS.linear(strided.contiguous(), packed, 96))
    assert OPS.linear(random((0, 64), 8), packed, 96).shape == (0, 96)
    with pytest.raises(RuntimeError):
        OPS.linear(random((2, 62), 9), packed, 96)  # another input width
    with pytest.raises(RuntimeError):
        OPS.linear(x.half(), packed, 96)  # float32 is --dtype mixed's (tests/test_mixed.py); float16 none
    with pytest.raises(RuntimeError):
        OPS.pack_linear(random((4, 7), 10))  # an odd input width has no pairs


def packed_layer(out_features=192, in_features=128, seed=11):
    linear = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(random((out_features, in_features), seed, 0.05))
    return kernels.PackedLinear(linear, min_rows=1)


def test_a_packed_layer_runs_the_kernel_for_the_sizes_it_was_given_and_onednn_above():
    layer = packed_layer()
    x = random((9, 128), 12)
    onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], "")
    kernels.use_native([layer], OPS, 4)
    assert layer.packed is not None  # oneDNN still runs 5-256 rows
    for rows in (1, 4):
        assert torch.equal(layer(x[:rows]), product(x[:rows], layer.weight))
    assert torch.equal(layer(x), onednn)
    kernels.use_native([layer], OPS, kernels.MAX_ROWS_BF16)
    assert layer.packed is None  # every size oneDNN ran is the kernel's: its copy is freed
    assert torch.equal(layer(x), product(x, layer.weight))
    big = random((kernels.MAX_ROWS_BF16 + 1, 128), 13)
    assert torch.equal(layer(big), nn.functional.linear(big, layer.weight))  # above: the stock product, as before
    kernels.use_native([layer], OPS, kernels.EVERY_ROWS)
    assert torch.equal(layer(big), product(big, layer.weight))  # a prefill's too, where it was never slower
    kernels.drop_native(layer)
    assert layer.native is None and torch.equal(layer(x), onednn)
    kernels.use_native([layer], OPS, kernels.MAX_ROWS_BF16)
    moved = layer.to(torch.float64)  # a model moved to another dtype: its packed copies stay behind, unused
    assert torch.equal(moved(x.double()), nn.functional.linear(x.double(), moved.weight))


def test_only_bias_free_bfloat16_layers_with_pairs_take_the_kernel():
    with_bias = nn.Linear(64, 32).to(torch.bfloat16).requires_grad_(False)
    odd = nn.Linear(63, 32, bias=False).to(torch.bfloat16).requires_grad_(False)
    wide = nn.Linear(64, 32, bias=False).requires_grad_(False)  # float32
    taken = [kernels.PackedLinear(m) for m in (with_bias, odd, wide)]
    kernels.use_native(taken, OPS, 8)
    assert all(layer.native is None and layer.packed is not None for layer in taken)




def test_the_measurement_times_both_kernels_on_the_models_layers():
    layers_ = [packed_layer(seed=s) for s in range(3)]
    (first, last), timings = kernels.measure_native_rows(layers_, OPS, sizes=(1, 4, 300))
    assert set(timings) == {"before", "native"} and set(timings["native"]) == {1, 4, 300}
    assert all(ms > 0 for kind in timings.values() for ms in kind.values())
    assert first in (0, 1, 4, 300) and last in (0, 1, 4, kernels.EVERY_ROWS) and first <= last
    assert all(layer.native is None for layer in layers_)  # measuring changes nothing


def tiny_bf16():
    return make_tiny_llama(300, seed=11, dtype=torch.bfloat16, layers=3, hidden=128, heads=4, kv_heads=2)


def test_a_model_on_the_kernel_computes_the_stock_models_logits_and_a_row_is_the_same_in_any_batch():
    model = tiny_bf16()
    ids = torch.randint(3, 300, (4, 13), generator=torch.Generator().manual_seed(1))
    stock, together, alone = logits_on_native_kernel(model, ids, kernels.MAX_ROWS_BF16)
    assert torch.equal(together, alone)
    scale = stock.abs().max().item()
    assert (together.float() - stock.float()).abs().max() <= 0.05 * scale
    assert (together.argmax(-1) == stock.argmax(-1)).float().mean() >= 0.9


def test_the_job_measures_once_per_machine_and_model_and_remembers(tmp_path, monkeypatch):
    from batchspec_cli.job import assembly
    from batchspec_cli.models import loading

    model = tiny_bf16()
    kernels.prepack(model)
    native.attach(model)
    loaded = loading.LoadedModel(model=model, tokenizer=None, name="tiny", source="")
    memory = widths.MachineMemory(tmp_path / "widths.json", {"machine": "test"})
    measured = []
    monkeypatch.setattr(kernels, "measure_native_rows",
                        lambda layers_, ops, **_: measured.append(1) or ((4, 16), {"before": {}, "native": {}}))
    assert assembly.tune_native(loaded, memory) == (4, 16)
    assert assembly.tune_native(loaded, memory) == (4, 16) and len(measured) == 1
    assert all(layer.native_first == 4 * layer.in_features and layer.native_last == 16 * layer.in_features
               for layer in native.packed_linears(model))
    saved = json.loads((tmp_path / "widths.json").read_text())
    assert [entry["native_rows"] for entry in saved.values()] == [[4, 16]]
