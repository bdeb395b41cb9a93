"""batchspec's own Llama layer forward (models/layers.py, layers_cpu.cpp) against transformers' modules: each
elementwise kernel computes what the module computes (bit for bit in bfloat16, where both round every step to
bfloat16; to float32 rounding in float32), a fused model's logits are the stock model's, a row's numbers do not depend
on the rows beside it, and attach and detach leave the model's parameters as they were."""

import pytest
import torch
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from batchspec_cli.models import kernels, layers, native
from conftest import make_tiny_llama

BUILT = native.load()
pytestmark = pytest.mark.skipif(BUILT.attend is None, reason=f"the kernels could not be built: {BUILT.error}")
OPS = BUILT.ops
FLOAT32_ULPS = 4e-6  # relative: a sum of squares or an exp taken in another order or polynomial


def random(shape, dtype, seed, scale=1.0):
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def same_or_close(got, want):
    if want.dtype == torch.bfloat16:
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {want.numel()} differ"
    else:
        torch.testing.assert_close(got, want, rtol=FLOAT32_ULPS, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 64, 37])  # vector lanes only, and a tail
def test_rms_norm_and_the_residual_sum_before_it_compute_what_llama_rms_norm_does(dtype, width):
    x, residual = random((3, 50, width), dtype, 1, 3.0), random((3, 50, width), dtype, 2)
    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    norm.weight.data = random(width, dtype, 3)
    with torch.no_grad():
        same_or_close(OPS.rms_norm(x, norm.weight, 1e-5), norm(x))
        normed, total = OPS.add_rms_norm(x, residual, norm.weight, 1e-5)
        assert torch.equal(total, residual + x)
        same_or_close(normed, norm(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_mul_computes_what_llamas_mlp_does_between_its_linears(dtype, width):
    gate, up = random((2, 40, width), dtype, 4, 4.0), random((2, 40, width), dtype, 5)
    want = SiLUActivation()(gate) * up
    same_or_close(OPS.silu_mul(torch.cat([gate, up], -1)), want)
    # three times over: through the vector loop (16 or 8 lanes, exp a polynomial within an ulp or two) and the tail
    extremes = torch.tensor([-200.0, -88.5, -87.0, -20.0, -0.0, 0.0, 20.0, 87.0, 100.0, float("inf"),
                             float("-inf")]).repeat(3)
    ones = torch.ones_like(extremes)
    torch.testing.assert_close(OPS.silu_mul(torch.cat([extremes, ones])), SiLUActivation()(extremes) * ones,
                               rtol=2 * torch.finfo(torch.float32).eps, atol=0, equal_nan=True)  # silu(-inf): NaN
    assert OPS.silu_mul(torch.tensor([float("nan"), 1.0])).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [True, False])
def test_rope_computes_what_apply_rotary_pos_emb_does_from_a_fused_qkv_product(dtype, per_row):
    batch, length, heads, kv_heads, dim = 3, 21, 6, 2, 64
    qkv = random((batch, length, (heads + 2 * kv_heads) * dim), dtype, 6)
    cos, sin = random((batch if per_row else 1, length, dim), dtype, 7), random((batch if per_row else 1, length, dim),
                                                                                   dtype, 8)
    q = qkv[..., : heads * dim].view(batch, length, heads, dim).transpose(1, 2)
    k = qkv[..., heads * dim : (heads + kv_heads) * dim].view(batch, length, kv_heads, dim).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = OPS.rope(qkv, cos, sin, heads, kv_heads)
    assert torch.equal(got_q.transpose(1, 2), want_q) and torch.equal(got_k.transpose(1, 2), want_k)


def test_a_float32_input_written_in_bfloat16_is_its_float32_result_rounded_as_torch_rounds_it():
    # --dtype mixed: a norm's, SiLU's or rotary's result rounded as the bfloat16 product reading it would round it
    bf16 = torch.bfloat16
    x, residual, weight = random((3, 50, 576), torch.float32, 1, 3.0), random((3, 50, 576), torch.float32, 2), \
        random(576, torch.float32, 3)
    normed = OPS.rms_norm(x, weight, 1e-5, bf16)
    assert normed.dtype == bf16 and torch.equal(normed, OPS.rms_norm(x, weight, 1e-5).to(bf16))
    normed, total = OPS.add_rms_norm(x, residual, weight, 1e-5, bf16)
    want_normed, want_total = OPS.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(normed, want_normed.to(bf16)) and total.dtype == torch.float32 and torch.equal(total, want_total)
    special = torch.tensor([float("nan"), float("inf"), -1e-40, 3.0e38, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])
    gate_up = torch.cat([torch.cat([random((2, 40, 1533), torch.float32, 4, 4.0), special.expand(2, 40, 6)], -1),
                         random((2, 40, 1539), torch.float32, 5)], -1)  # vector lanes, a tail, halfway cases
    got, want = OPS.silu_mul(gate_up, bf16), OPS.silu_mul(gate_up).to(bf16)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    qkv = random((3, 21, 10 * 64), torch.float32, 6)
    cos, sin = random((3, 21, 64), torch.float32, 7), random((3, 21, 64), torch.float32, 8)
    for got, want in zip(OPS.rope(qkv, cos, sin, 6, 2, bf16), OPS.rope(qkv, cos, sin, 6, 2)):
        assert got.dtype == bf16 and torch.equal(got, want.to(bf16))
    with pytest.raises(RuntimeError):  # bfloat16 in, float32 out is no rounding: refused
        OPS.silu_mul(gate_up.to(bf16), torch.float32)
    with pytest.raises(RuntimeError):
        OPS.rms_norm(x, weight, 1e-5, torch.float16)


def test_the_kernels_refuse_shapes_they_cannot_read():
    with pytest.raises(RuntimeError):
        OPS.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError):
        OPS.rms_norm(torch.randn(8, 4).t(), torch.randn(8), 1e-5)  # not contiguous
    with pytest.raises(RuntimeError):
        OPS.silu_mul(torch.randn(3, 5))  # no gate | up halves
    with pytest.raises(RuntimeError):
        OPS.rope(torch.randn(1, 4, 10 * 8), torch.randn(1, 3, 8), torch.randn(1, 4, 8), 6, 2)
    with pytest.raises(RuntimeError):
        OPS.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), 1e-5)


def tiny(dtype, **config):
    model = make_tiny_llama(300, seed=11, dtype=dtype, layers=3, hidden=128, heads=4, kv_heads=2)
    for name, value in config.items():
        setattr(model.config, name, value)
    return model


def fused_count(model):
    return sum(m.__dict__.get(layers.ATTRIBUTE) is not None for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_model_computes_the_stock_models_logits(dtype):
    model = tiny(dtype)
    ids = torch.randint(3, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        assert native.attach(model) and fused_count(model) == 3
        fused = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert torch.equal(fused, again)
    scale = stock.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(fused, stock, rtol=0, atol=1e-5 * scale)
    else:  # bfloat16: an activation rounded the other way now and then (the audits' units)
        assert (fused.float() - stock.float()).abs().max() <= 0.05 * scale
        assert (fused.argmax(-1) == stock.argmax(-1)).float().mean() >= 0.9


def test_a_rows_numbers_do_not_depend_on_the_rows_beside_it():
    model = tiny(torch.float32)
    native.attach(model)
    ids = torch.randint(3, 300, (4, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        together = model(input_ids=ids).logits
        alone = torch.cat([model(input_ids=ids[i : i + 1]).logits for i in range(4)])
    assert torch.equal(together, alone)


def test_attach_and_detach_keep_the_parameters_and_the_packed_layers():
    model = tiny(torch.float32)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    kernels.prepack(model)
    native.attach(model)
    layer = model.model.layers[0]
    assert not isinstance(layer.self_attn.q_proj, kernels.PackedLinear)  # the joint layer runs packed instead
    assert isinstance(layer.__dict__[layers.ATTRIBUTE].qkv, kernels.PackedLinear)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    native.detach(model)
    assert fused_count(model) == 0 and "forward" not in layer.__dict__
    assert isinstance(layer.self_attn.q_proj, kernels.PackedLinear) and isinstance(layer.mlp.up_proj,
                                                                                   kernels.PackedLinear)
    assert all(torch.equal(model.state_dict()[n], before[n]) for n in before)


@pytest.mark.parametrize("change", [{"attention_bias": True}, {"hidden_act": "gelu"}, {"mlp_bias": True}])
def test_a_layer_the_fused_forward_does_not_cover_keeps_transformers_forward(change):
    from transformers import LlamaForCausalLM

    config = tiny(torch.float32).config
    for name, value in change.items():
        setattr(config, name, value)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    native.attach(model)
    assert fused_count(model) == 0


def test_a_model_in_training_mode_runs_the_stock_forward():
    model = tiny(torch.float32)
    native.attach(model)
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    model.train()
    calls = []
    handle = model.model.layers[0].input_layernorm.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    assert calls  # transformers' RMSNorm module ran: the stock forward


def test_a_copy_or_a_model_moved_to_another_dtype_runs_transformers_forward():
    """verify's float64 copy of a fused model: a deep copy, then ``.to(float64)``, gives transformers' own numbers."""
    import copy

    model = tiny(torch.float32)
    native.attach(model)
    ids = torch.randint(3, 300, (1, 11), generator=torch.Generator().manual_seed(3))
    wide = copy.deepcopy(model).to(torch.float64)
    assert fused_count(wide) == 0
    stock = make_tiny_llama(300, seed=11, dtype=torch.float64, layers=3, hidden=128, heads=4, kv_heads=2)
    with torch.no_grad():
        assert torch.equal(wide(input_ids=ids).logits, stock(input_ids=ids).logits)
        moved = model.to(torch.float64)  # the fused layers' joint weights stay float32: the stock forward runs
        assert torch.equal(moved(input_ids=ids).logits, stock(input_ids=ids).logits)


def test_the_joint_linears_run_packed_from_the_rows_the_separate_ones_did():
    model = tiny(torch.float32)
    kernels.prepack(model)
    kernels.set_min_rows(model, 4)  # what tune_kernels applies from this machine's measurement
    native.attach(model)
    fused = model.model.layers[1].__dict__[layers.ATTRIBUTE]
    assert fused.qkv.min_rows == fused.gate_up.min_rows == 4
    native.detach(model)
    assert model.model.layers[1].self_attn.k_proj.min_rows == 4
