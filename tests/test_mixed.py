"""``--dtype mixed``: bfloat16 weights and matmul inputs, float32 sums, outputs and residual stream (kernels.to_mixed,
kernels.MixedLinear, the float32 path of models/linear_cpu.cpp). Products against float64 ones of the rounded numbers,
a model on the kernel against its reference products (transformers' float32 arithmetic on the same numbers), a row's
tokens and log-probabilities the same at every batch and mode (shared prefixes, padding, speculation, sampling), and
where ``--dtype auto`` chooses it. The real model through the CLI and ``verify``: tests/test_e2e_default_model.py."""

from pathlib import Path

import pytest
import torch
from torch import nn

from batchspec_cli.models import kernels, layers, loading, native
from conftest import make_tiny_llama

BUILT = native.load()
needs_kernel = pytest.mark.skipif(not BUILT.linear, reason="the linear kernel needs AVX512-BF16 and a build: "
                                                           f"{BUILT.error or 'this CPU has no AVX512-BF16'}")


def rounded(t):
    return t.to(torch.bfloat16).double()


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (70, 1536), (1, 2), (130, 64)])
def test_the_float32_product_sums_the_rounded_numbers_in_float32(out_features, in_features):
    g = torch.Generator().manual_seed(out_features)
    x, weight = torch.randn(11, in_features, generator=g), 0.05 * torch.randn(out_features, in_features, generator=g)
    got = BUILT.ops.linear(x, BUILT.ops.pack_linear(weight.to(torch.bfloat16)), out_features)
    assert got.dtype == torch.float32 and got.shape == (11, out_features)
    exact = rounded(x) @ rounded(weight).T  # each product of two bfloat16 numbers is exact in float32
    bound = (rounded(x).abs() @ rounded(weight).abs().T) * in_features * 2.0**-24  # float32 summation's error
    assert ((got.double() - exact).abs() <= bound).all()
    # not the unrounded product: the input really is rounded
    assert not torch.equal(got, torch.nn.functional.linear(x, weight))
    alone = torch.cat([BUILT.ops.linear(x[i : i + 1], BUILT.ops.pack_linear(weight.to(torch.bfloat16)), out_features)
                       for i in range(11)])
    assert torch.equal(alone, got)


@needs_kernel
def test_a_bfloat16_input_gives_the_float32_sums_of_the_same_numbers_when_asked():
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(13, 576, generator=g).to(torch.bfloat16), 0.05 * torch.randn(70, 576, generator=g)
    packed = BUILT.ops.pack_linear(weight.to(torch.bfloat16))
    got = BUILT.ops.linear(x, packed, 70, torch.float32)
    assert got.dtype == torch.float32
    exact = x.double() @ rounded(weight).T
    bound = (x.double().abs() @ rounded(weight).abs().T) * 576 * 2.0**-24
    assert ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(got, BUILT.ops.linear(x.float(), packed, 70))  # what a float32 x of these values gives
    assert BUILT.ops.linear(x, packed, 70).dtype == torch.bfloat16  # unasked: x's dtype, as before
    with pytest.raises(RuntimeError):
        BUILT.ops.linear(x.float(), packed, 70, torch.bfloat16)  # a float32 x gives float32 sums only


def test_a_mixed_layer_without_the_kernel_computes_the_reference_product():
    g = torch.Generator().manual_seed(3)
    linear = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g))
    mixed = kernels.MixedLinear(linear.weight)
    x = torch.randn(5, 64, generator=g)
    got = mixed(x)
    assert mixed.weight.dtype == torch.bfloat16 and got.dtype == torch.float32
    assert torch.allclose(got.double(), rounded(x) @ rounded(linear.weight).T, rtol=1e-5, atol=1e-5)
    assert mixed(x.double()).dtype == torch.float64  # verify's float64 copy
    assert torch.equal(mixed(x.to(torch.bfloat16)), mixed(x.to(torch.bfloat16).float()))  # a rounded input as is


def tiny_mixed():
    return kernels.to_mixed(make_tiny_llama(300, seed=11, dtype=torch.float32, layers=3, hidden=128, heads=4,
                                            kv_heads=2))


def test_to_mixed_rounds_the_weights_and_keeps_the_rest_float32():
    model = make_tiny_llama(300, seed=11, dtype=torch.float32, layers=3, hidden=128, heads=4, kv_heads=2)
    embedding = model.get_input_embeddings().weight.detach().clone()
    kernels.to_mixed(model)
    assert kernels.is_mixed(model) and loading.dtype_name(model) == "mixed"
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, kernels.MixedLinear) and m.weight.dtype == torch.bfloat16 for m in linears)
    kept = model.get_input_embeddings().weight
    assert kept.dtype == torch.float32 and torch.equal(kept, embedding.to(torch.bfloat16).float())
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.dtype == torch.float32


@needs_kernel
def test_a_mixed_model_on_the_kernel_computes_the_reference_logits_and_a_row_is_the_same_in_any_batch():
    model = tiny_mixed()
    ids = torch.randint(3, 300, (4, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(input_ids=ids).logits  # MixedLinear's reference products: transformers' float32 matmul
        assert kernels.packable_bytes(model) > 0  # what the kernel's copies will take
        kernels.prepack(model)
        native.attach(model)
        linears = native.packed_linears(model)
        fused = model.model.layers[0].__dict__[layers.ATTRIBUTE]
        assert fused.qkv in linears and isinstance(fused.qkv, kernels.MixedLinear)
        assert all(isinstance(m, kernels.MixedLinear) and m.native is not None for m in linears)
        assert not any(isinstance(m, kernels.PackedLinear) for m in model.modules())
        together = model(input_ids=ids).logits
        alone = torch.cat([model(input_ids=ids[i : i + 1]).logits for i in range(4)])
    assert torch.equal(together, alone)
    # float32 sums in another order, and attention's inputs rounded to bfloat16 (the reference's are not)
    scale = reference.abs().max().item()
    assert (together - reference).abs().max() <= 0.05 * scale
    assert (together.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    native.detach(model)
    assert all(m.native is None for m in model.modules() if isinstance(m, kernels.MixedLinear))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, reference, atol=1e-5, rtol=1e-5)


def test_mixed_is_a_cpu_recipe():
    assert loading.choose_dtype("mixed", torch.device("cpu"), torch.bfloat16)[0] == torch.float32
    with pytest.raises(loading.ModelError, match="CPU"):
        loading.choose_dtype("mixed", torch.device("cuda", 0), torch.bfloat16)
    with pytest.raises(loading.ModelError, match="mixed"):
        loading.choose_dtype("mixd", torch.device("cpu"), None)


def mixed_on_kernel(model):
    kernels.to_mixed(model)
    kernels.prepack(model)
    native.attach(model)
    return model


@needs_kernel
@pytest.mark.parametrize("mode,batch,temperature", [("ar", 4, 0.0), ("exspec", 3, 0.0), ("auto", 8, 0.0),
                                                     ("exspec", 4, 0.8)])
def test_a_mixed_row_is_the_same_at_any_batch_in_any_mode(mode, batch, temperature):
    """Rows sharing a prompt prefix (its KV computed once, then each row's prefill from a column that depends on the
    rows beside it), prompts of many lengths (padding, packed prefills): each row's tokens at batch 1 alone, and their
    log-probabilities to the bit, equal those at another batch and mode, greedy and sampled (the sampling rule's
    noise is the row's own)."""
    from batchspec_cli.engine.core import EngineConfig
    from batchspec_cli.engine.events import Sampling

    from conftest import run_engine_rows

    torch.manual_seed(0)
    target = mixed_on_kernel(make_tiny_llama(300, seed=5, dtype=torch.float32, layers=2, hidden=256, heads=4,
                                             kv_heads=2))
    draft = mixed_on_kernel(make_tiny_llama(300, seed=6, dtype=torch.float32, layers=1, hidden=256, heads=4,
                                            kv_heads=2))
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 300, (120,), generator=g).tolist()  # rows share 16 to 120 of its tokens, or none
    prompts = [shared[:cut] + torch.randint(3, 300, (3 + 9 * i,), generator=g).tolist()
               for i, cut in enumerate((0, 16, 120, 24, 80, 0, 32, 120, 20))]
    settings = Sampling(temperature=temperature, seed=3)
    alone, _ = run_engine_rows(target, None, prompts, EngineConfig(mode="ar", batch_size=1, prefix_min=8),
                               settings=settings, max_new=12, logprobs=2)
    other, _ = run_engine_rows(target, draft, prompts, EngineConfig(mode=mode, k=3, batch_size=batch,
                                                                     prefix_min=8),
                               settings=settings, max_new=12, logprobs=2)
    for i in range(len(prompts)):
        assert other[i].token_ids == alone[i].token_ids, f"row {i}"
        assert other[i].logprobs == alone[i].logprobs, f"row {i}"  # the logits themselves, to the bit


def test_auto_runs_mixed_where_batchspecs_kernel_is_the_cpus_bfloat16_product(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert loading.prefers_mixed(cpu, kernel=True)
    assert not loading.prefers_mixed(cpu, kernel=False)  # not built, or --kernels stock: bfloat16
    assert not loading.prefers_mixed(cuda, kernel=True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # oneDNN's tiles: bfloat16
    assert not loading.prefers_mixed(cpu, kernel=True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)  # no bfloat16 units: float32
    assert not loading.prefers_mixed(cpu, kernel=True)


def test_a_job_asks_for_the_kernel_only_where_auto_may_choose_mixed():
    from batchspec_cli.config import GenerateConfig
    from batchspec_cli.job import assembly

    def job(**settings):
        return GenerateConfig(input=Path("in.jsonl"), output=Path("out.parquet"), **settings)

    assert not assembly.mixed_kernel(job(dtype="bfloat16"))
    assert not assembly.mixed_kernel(job(kernels="stock"))
    assert assembly.mixed_kernel(job(device="cpu")) == BUILT.linear


def test_the_default_loads_mixed_where_it_is_preferred(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(loading, "prefers_mixed", lambda device, kernel: kernel)
    loaded = loading.load_model(str(tiny_model_dir), device="cpu", mixed_kernel=True)
    assert loading.dtype_name(loaded.model) == "mixed" and loaded.dtype_reason == loading.AUTO_MIXED
    plain = loading.load_model(str(tiny_model_dir), device="cpu", mixed_kernel=False)
    assert loading.dtype_name(plain.model) != "mixed"
