"""batchspec's own forward for a Llama decoder layer on a CPU: fused linears and one pass per elementwise step.

transformers' ``LlamaDecoderLayer`` runs, per layer and forward, three linears for q, k and v, two for gate and up,
and some twenty elementwise operations (RMSNorm alone converts, squares, averages, scales and converts back), each a
pass over the activations and a Python call. On a CPU that is a tenth of a prefill and more of a decode step of a
small model. ``attach`` gives a Llama layer a forward that computes the same thing with

- q | k | v and gate | up as one linear each (their weights concatenated once; the separate layers' weights become
  views of the joint one, so no weight is held twice),
- ``layers_cpu.cpp``'s kernels for RMSNorm (and the residual sum before the second one), rotary embedding and
  SiLU(gate) * up, each rounding to the model's dtype where transformers rounds,
- the attention, the KV cache and the masks exactly as transformers' attention layer calls them (the model's
  attention implementation: batchspec's kernels, SDPA, a packed prefill).

Where the numbers can differ from transformers' own layer: the fused linears may sum in another order than the
separate ones, RMSNorm's sum of squares is taken in 16 lanes, and exp is the kernels' own polynomial; so a float32 row
matches the stock layer to float32 rounding, a bfloat16 row to bfloat16 rounding (the audits' units). A row's
numbers never depend on the rows beside it. Only layers whose classes are transformers' Llama classes with a SiLU MLP
and no q/k/v or gate/up bias take it (``fusable``); a model in training mode, one moved to another dtype or device
and a deep copy run the stock forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

from . import kernels

ATTRIBUTE = "batchspec_layer"  # a fused layer's Fused, set by ``attach``


class Fused:
    """What a fused layer's forward needs besides the layer: the kernels and the two joint linears. Not a module:
    the model's modules and state dict stay as they were."""

    def __init__(self, ops, qkv: nn.Linear, gate_up: nn.Linear, packed: dict[str, int]):
        self.ops, self.qkv, self.gate_up = ops, qkv, gate_up
        self.packed = packed  # the separate linears that ran packed before, and from how many rows (``detach``)

    def __deepcopy__(self, memo):
        return None  # a copied model (verify's float64 copy, say) runs transformers' forward on its own weights


def fusable(layer: nn.Module) -> bool:
    """A transformers Llama decoder layer on a CPU in float32 or bfloat16, SiLU MLP, no q/k/v or gate/up bias."""
    if type(layer) is not llama.LlamaDecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not llama.LlamaAttention or type(mlp) is not llama.LlamaMLP \
            or type(layer.input_layernorm) is not llama.LlamaRMSNorm \
            or type(layer.post_attention_layernorm) is not llama.LlamaRMSNorm \
            or type(mlp.act_fn) not in (SiLUActivation, nn.SiLU):
        return False
    joined = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
    weight = attn.q_proj.weight
    config = attn.config
    dim, heads, kv_heads = attn.head_dim, config.num_attention_heads, config.num_key_value_heads
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and all(isinstance(m, nn.Linear) and m.bias is None and m.weight.dtype == weight.dtype
                    and m.weight.device == weight.device for m in joined)
            and layer.input_layernorm.weight.dtype == layer.post_attention_layernorm.weight.dtype
            == (torch.float32 if isinstance(attn.q_proj, kernels.MixedLinear) else weight.dtype)
            and attn.q_proj.out_features == heads * dim and attn.k_proj.out_features == kv_heads * dim
            and attn.v_proj.out_features == kv_heads * dim and dim % 2 == 0)


def _joint(parent_layers: list[tuple[nn.Module, str]]) -> nn.Linear:
    """One linear over the concatenated weights of ``parent_layers`` (parent, name); each separate layer's weight
    becomes a view of the joint weight."""
    separate = [getattr(parent, name) for parent, name in parent_layers]
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in separate])
    joint = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    joint.weight = nn.Parameter(weight, requires_grad=False)
    start = 0
    for m in separate:
        rows = m.out_features
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        start += rows
    return joint


def attach(layer: nn.Module, ops) -> None:
    """Give a ``fusable`` layer batchspec's forward (``ops``: the built kernels, ``torch.ops.batchspec``)."""
    if ATTRIBUTE in layer.__dict__:
        return
    attn, mlp = layer.self_attn, layer.mlp
    packed, mixed = {}, isinstance(attn.q_proj, kernels.MixedLinear)
    for parent, name in ((attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (mlp, "gate_proj"), (mlp, "up_proj")):
        child = getattr(parent, name)
        if isinstance(child, kernels.PackedLinear):  # its packed copy would go unused: the joint layer runs
            setattr(parent, name, child.to_linear())
            packed[f"{'self_attn' if parent is attn else 'mlp'}.{name}"] = child.min_rows
    qkv = _joint([(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj")])
    gate_up = _joint([(mlp, "gate_proj"), (mlp, "up_proj")])
    if mixed:  # bfloat16 weights, float32 in and out (kernels.to_mixed); the separate layers' weights are views
        qkv, gate_up = kernels.MixedLinear(qkv.weight), kernels.MixedLinear(gate_up.weight)
    elif packed:  # packed from the rows the separate layers were (kernels.set_min_rows: measured on this machine)
        rows = min(packed.values())
        qkv, gate_up = kernels.PackedLinear(qkv, rows), kernels.PackedLinear(gate_up, rows)
    setattr(layer, ATTRIBUTE, Fused(ops, qkv, gate_up, packed))
    layer.forward = _forward.__get__(layer)


def detach(layer: nn.Module) -> None:
    """Undo ``attach``: the stock forward, the separate layers packed again where they were (their weights stay
    views of the joint ones: the same numbers)."""
    if ATTRIBUTE not in layer.__dict__:
        return
    fused = layer.__dict__.pop(ATTRIBUTE)
    layer.__dict__.pop("forward", None)
    for path, rows in (fused.packed if fused is not None else {}).items():  # None: a deep copy's (Fused.__deepcopy__)
        parent_name, name = path.split(".")
        parent = getattr(layer, parent_name)
        setattr(parent, name, kernels.PackedLinear(getattr(parent, name), rows))


def _forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.LongTensor | None = None, cache=None, use_cache: bool | None = False,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
    """``LlamaDecoderLayer.forward``, fused (the module docstring)."""
    if "past_key_values" in kwargs:  # the layer's former name for the cache
        cache = kwargs.pop("past_key_values")
    fused: Fused | None = self.__dict__.get(ATTRIBUTE)
    if fused is None or self.training or position_embeddings is None or hidden_states.dim() != 3 \
            or hidden_states.device.type != "cpu" or hidden_states.dtype != self.input_layernorm.weight.dtype \
            or fused.qkv.weight.dtype != self.self_attn.q_proj.weight.dtype \
            or (hidden_states.dtype != fused.qkv.weight.dtype and not isinstance(fused.qkv, kernels.MixedLinear)):
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    ops, attn = fused.ops, self.self_attn
    kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}  # what transformers' layer passes on
    batch, length, _ = hidden_states.shape
    heads, kv_heads, dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    # mixed: what a product or the attention reads next is written in bfloat16, rounded as the reader would round it
    rounded = torch.bfloat16 if isinstance(fused.qkv, kernels.MixedLinear) else None
    residual = hidden_states.contiguous()  # [B, T, hidden]
    normed = ops.rms_norm(residual, self.input_layernorm.weight, self.input_layernorm.variance_epsilon, rounded)
    qkv = fused.qkv(normed)  # [B, T, (heads + 2 kv_heads) dim]: q | k | v
    cos, sin = position_embeddings  # [B or 1, T, dim]
    query, key = ops.rope(qkv, cos.to(qkv.dtype).contiguous(), sin.to(qkv.dtype).contiguous(), heads, kv_heads,
                          rounded)
    query, key = query.transpose(1, 2), key.transpose(1, 2)  # [B, heads, T, dim], [B, kv_heads, T, dim]
    value = qkv[..., (heads + kv_heads) * dim :].view(batch, length, kv_heads, dim).transpose(1, 2)
    if rounded is not None:  # attention takes bfloat16 inputs too; the cache holds them
        value = value.to(rounded)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, llama.eager_attention_forward)
    out, _ = interface(attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    out = attn.o_proj(out.reshape(batch, length, -1).contiguous())  # out: [B, T, heads, dim] -> [B, T, hidden]
    normed, residual = ops.add_rms_norm(out, residual, self.post_attention_layernorm.weight,
                                        self.post_attention_layernorm.variance_epsilon, rounded)
    return residual + self.mlp.down_proj(ops.silu_mul(fused.gate_up(normed), rounded))  # gate | up: [B, T, 2 inter.]
