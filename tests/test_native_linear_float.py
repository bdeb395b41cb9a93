"""batchspec's float32 linear kernel (models/linear_cpu.cpp, any CPU with AVX-512, or AVX2 and FMA) and the rows it
runs (kernels.native_rows_from, kernels.use_native): its products against float64 ones within the error bound of its
blocked sum, each output the documented blocked sum bit for bit, a row's outputs the same whatever rows run beside
it, the shapes a model has, the range of sizes it takes from MKL and oneDNN, and a float32 model on it against the
stock model."""

import pytest
import torch
from torch import nn

from batchspec_cli.models import kernels, native
from conftest import assert_rows_independent, logits_on_native_kernel, make_tiny_llama

BUILT = native.load()
needs_kernel = pytest.mark.skipif(torch.float32 not in BUILT.linear_dtypes,
                                  reason="the float32 linear kernel needs AVX-512 or AVX2 and a build: "
                                         f"{BUILT.error or 'this CPU has neither'}")
OPS = BUILT.ops
UNIT = 2.0**-24  # float32's unit roundoff


def random(shape, seed, scale=1.0):
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def product(x, weight):
    return OPS.linear(x, OPS.pack_linear(weight), weight.shape[0])


def test_the_rows_it_runs_span_the_sizes_where_it_was_never_slower():
    before = {1: 10.0, 4: 10.0, 16: 20.0, 64: 50.0, 256: 100.0, 1024: 400.0}
    rule = kernels.native_rows_from
    assert rule(before, {1: 5.0, 4: 6.0, 16: 15.0, 64: 45.0, 256: 90.0, 1024: 380.0}) == (1, kernels.EVERY_ROWS)
    assert rule(before, {1: 5.0, 4: 6.0, 16: 15.0, 64: 45.0, 256: 90.0, 1024: 420.0}) == (1, 256)
    assert rule(before, {1: 5.0, 4: 6.0, 16: 25.0, 64: 45.0, 256: 90.0, 1024: 380.0}) == (1, 4)  # AMX's wide tiles
    # MKL's one-row product streams faster on some CPUs: it keeps one row, the kernel runs from 4
    assert rule(before, {1: 11.0, 4: 6.0, 16: 15.0, 64: 45.0, 256: 90.0, 1024: 380.0}) == (4, kernels.EVERY_ROWS)
    assert rule(before, {1: 11.0, 4: 6.0, 16: 15.0, 64: 55.0, 256: 90.0, 1024: 380.0}) == (4, 16)
    assert rule(before, {1: 11.0, 4: 11.0, 16: 21.0, 64: 55.0, 256: 101.0, 1024: 401.0}) == (0, 0)


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (70, 1536), (1, 3), (130, 64), (64, 200)])
def test_the_product_is_the_float64_product_within_its_sums_error_bound(out_features, in_features):
    x, weight = random((11, in_features), 1), random((out_features, in_features), 2, 0.05)
    got = product(x, weight)
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    # blocks of 64 terms summed apart, then the blocks in order: (64 + k / 64 + 1) roundings at most
    bound = (64 + in_features / 64 + 1) * UNIT * magnitude
    assert ((got.double() - exact).abs() <= bound).all()
    stock = nn.functional.linear(x, weight).double()
    assert (got.double() - exact).abs().max() <= 4 * (stock - exact).abs().max() + 1e-12  # as close as PyTorch's


def fused_multiply_add(a, b, c):
    """float32 a * b + c rounded once, to nearest even (a fused multiply-add): a * b is exact in float64, the sum's
    float64 rounding error is found exactly (two-sum) and decides the one case where float64 rounding could mislead
    the float32 one, a sum exactly halfway between two float32 numbers."""
    product, addend = a.double() * b.double(), c.double()
    total = product + addend
    back = total - product
    error = (product - (total - back)) + (addend - back)
    rounded = total.float()
    inf = torch.tensor(float("inf"))
    low = torch.where(rounded.double() <= total, rounded, torch.nextafter(rounded, -inf))
    high = torch.nextafter(low, inf)
    halfway = (low.double() + high.double()) / 2 == total
    rounded = torch.where(halfway & (error > 0), high, rounded)
    return torch.where(halfway & (error < 0), low, rounded)


def blocked_sum(x, weight):
    """The order the kernel documents for each output, on any CPU: k in blocks of 64, each block one chain of fused
    multiply-adds from zero, k upwards, the blocks' sums added to the total in order."""
    total = torch.zeros(x.shape[0], weight.shape[0])
    for first in range(0, x.shape[1], 64):
        block = torch.zeros_like(total)
        for j in range(first, min(x.shape[1], first + 64)):
            block = fused_multiply_add(x[:, j, None], weight[None, :, j], block)
        total = total + block
    return total


def test_the_reference_fused_multiply_add_rounds_once():
    from fractions import Fraction

    a, b, c = random((2000,), 21), random((2000,), 22), random((2000,), 23, 1e-3)
    a[0], b[0], c[0] = 1 + 2.0**-12, 1 + 2.0**-12, -(1 + 2.0**-11)  # a * b + c = 2^-24: only a fused one keeps it
    a[1:4], b[1:4] = 1 + 2.0**-12, 1 + 2.0**-12  # a * b = 1 + 2^-11 + 2^-24: halfway between two float32 numbers
    c[1:4] = torch.tensor([2.0**-60, -(2.0**-60), 0.0])  # a hair above it, below it, on it (float64 rounds to half)
    got = fused_multiply_add(a, b, c)
    for i in range(len(a)):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        near = torch.tensor(float(exact)).float()
        candidates = [torch.nextafter(near, torch.tensor(d)).item() for d in (-1e30, 1e30)] + [near.item()]
        best = min(abs(Fraction(v) - exact) for v in candidates)
        assert abs(Fraction(got[i].item()) - exact) == best, i
    assert got[0].item() == 2.0**-24
    assert got[1:4].tolist() == [1 + 2.0**-11 + 2.0**-23, 1 + 2.0**-11, 1 + 2.0**-11]  # the tie: to even


@needs_kernel
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 70, 200), (7, 130, 64), (13, 16, 129), (50, 20, 70)])
def test_each_output_is_the_documented_blocked_sum_bit_for_bit(rows, out_features, in_features):
    # the same bits on every CPU the kernel is built for: 16-lane and 8-lane builds sum each output in this order
    x, weight = random((rows, in_features), 24), random((out_features, in_features), 25, 0.05)
    assert torch.equal(product(x, weight), blocked_sum(x, weight))


@needs_kernel
def test_a_rows_outputs_do_not_depend_on_the_rows_or_threads_beside_it():
    assert_rows_independent(OPS, random((200, 576), 3, 0.05), random((37, 576), 4))


@needs_kernel
def test_every_shape_a_forward_passes():
    weight = random((96, 63), 5)
    packed = OPS.pack_linear(weight)
    x = random((2, 3, 63), 6)
    assert torch.equal(OPS.linear(x, packed, 96), OPS.linear(x.reshape(6, 63), packed, 96).view(2, 3, 96))
    strided = random((63, 6), 7).t()  # not contiguous
    assert torch.equal(OPS.linear(strided, packed, 96), OPS.linear(strided.contiguous(), packed, 96))
    assert OPS.linear(random((0, 63), 8), packed, 96).shape == (0, 96)
    with pytest.raises(RuntimeError):
        OPS.linear(random((2, 62), 9), packed, 96)  # another input width
    with pytest.raises(RuntimeError):
        OPS.linear(x.to(torch.bfloat16), packed, 96)  # a float32 weight takes float32 only
    with pytest.raises(RuntimeError):
        OPS.linear(x, packed, 96, torch.bfloat16)


def packed_layer(out_features=192, in_features=128, seed=11, min_rows=4):
    linear = nn.Linear(in_features, out_features, bias=False).requires_grad_(False)
    linear.weight.copy_(random((out_features, in_features), seed, 0.05))
    return kernels.PackedLinear(linear, min_rows=min_rows)


@needs_kernel
def test_a_packed_layer_runs_the_kernel_over_its_span_and_the_kernels_it_had_outside():
    layer = packed_layer()
    x = random((9, 128), 12)
    onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], "")
    kernels.use_native([layer], OPS, 6, (torch.float32,), first=4)
    assert layer.packed is not None  # oneDNN still runs 7-64 rows
    assert torch.equal(layer(x[:1]), nn.functional.linear(x[:1], layer.weight))  # below the span: MKL, as before
    for rows in (4, 6):
        assert torch.equal(layer(x[:rows]), product(x[:rows], layer.weight))
    assert torch.equal(layer(x), onednn)
    kernels.use_native([layer], OPS, kernels.EVERY_ROWS, (torch.float32,), first=4)
    assert layer.packed is None  # every size oneDNN ran is the kernel's: its copy is freed
    big = random((300, 128), 13)
    assert torch.equal(layer(big), product(big, layer.weight))
    kernels.drop_native(layer)
    assert layer.native is None and torch.equal(layer(x), onednn)
    kernels.use_native([layer], OPS, 8)  # built for bfloat16 only: a float32 layer keeps its kernels
    assert layer.native is None
    kernels.use_native([layer], OPS, kernels.EVERY_ROWS, (torch.float32,))
    moved = layer.to(torch.float64)  # a model moved to another dtype: the kernel's copy stays behind, unused
    assert torch.equal(moved(x.double()), nn.functional.linear(x.double(), moved.weight))


def tiny_float():
    return make_tiny_llama(300, seed=11, dtype=torch.float32, layers=3, hidden=128, heads=4, kv_heads=2)


@needs_kernel
def test_a_float32_model_on_the_kernel_computes_the_stock_models_logits_and_a_row_is_the_same_in_any_batch():
    model = tiny_float()
    ids = torch.randint(3, 300, (4, 13), generator=torch.Generator().manual_seed(1))
    # the kernel's layout is held beside oneDNN's where it takes only some sizes: --kernels auto counts both
    assert kernels.packable_bytes(model, (torch.float32,)) == 2 * kernels.packable_bytes(model) > 0
    stock, together, alone = logits_on_native_kernel(model, ids, kernels.EVERY_ROWS)
    assert torch.equal(together, alone)
    assert (together - stock).abs().max() <= 1e-4 * stock.abs().max()  # float32 rounding, not another model
    assert torch.equal(together.argmax(-1), stock.argmax(-1))


@needs_kernel
def test_the_measurement_times_both_kernels_on_a_float32_models_layers():
    layers_ = [packed_layer(seed=s) for s in range(3)]
    (first, last), timings = kernels.measure_native_rows(layers_, OPS, sizes=(1, 4, 300), dtypes=(torch.float32,))
    assert set(timings) == {"before", "native"} and set(timings["native"]) == {1, 4, 300}
    assert all(ms > 0 for kind in timings.values() for ms in kind.values())
    assert first in (0, 1, 4, 300) and last in (0, 1, 4, 300, kernels.EVERY_ROWS) and first <= last
    assert all(layer.native is None for layer in layers_)  # measuring changes nothing
    assert kernels.measure_native_rows(layers_, OPS, sizes=(1, 4)) == ((0, 0), {})  # bfloat16 asked: none here


@needs_kernel
def test_a_span_measured_with_fewer_attempts_is_measured_again_then_remembered(tmp_path, monkeypatch):
    """A span remembered from a measurement of fewer timed attempts than ``NATIVE_REPEATS`` (one attempt, before
    2026-12-08: a neighbour's burst could decide it for good) is measured again, once; the new one is remembered."""
    from batchspec_cli.job import assembly
    from batchspec_cli.models import loading, widths

    model = tiny_float()
    kernels.prepack(model)
    native.attach(model)
    loaded = loading.LoadedModel(model=model, tokenizer=None, name="tiny", source="")
    memory = widths.MachineMemory(tmp_path / "widths.json", {"machine": "test"})
    spans = iter([(4, 16), (1, 64)])
    measured = []
    monkeypatch.setattr(kernels, "measure_native_rows",
                        lambda layers_, ops, repeats, **_: measured.append(repeats) or (next(spans), {}))
    monkeypatch.setattr(kernels, "NATIVE_REPEATS", 1)
    assert assembly.tune_native(loaded, memory) == (4, 16)
    monkeypatch.setattr(kernels, "NATIVE_REPEATS", 3)
    assert assembly.tune_native(loaded, memory) == (1, 64) and measured == [1, 3]  # timed as often as the key says
    assert assembly.tune_native(loaded, memory) == (1, 64) and measured == [1, 3]
