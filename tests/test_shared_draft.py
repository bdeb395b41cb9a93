"""Shared-embedding drafts: the format the default draft ships in, its loader and its head."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult
from batchspec_cli.models import loading as models
from conftest import greedy_reference, make_tokenizer, make_tiny_llama, perturbed_copy

torch.set_num_threads(1)


def write_shared_draft(target, tokenizer, out, head_ids, layers=1, noise=0.01):
    """A draft made of the target's first layers (perturbed), saved in the shared-embedding format."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    draft = LlamaForCausalLM(config).to(target.dtype)
    draft.model.layers = copy.deepcopy(target.model.layers[:layers])
    draft.model.norm = copy.deepcopy(target.model.norm)
    draft = perturbed_copy(draft, noise, seed=9)
    out.mkdir()
    models.save_shared_draft(draft, head_ids, target, tokenizer, out, target_name="tiny")
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return make_tiny_llama(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)


def loaded(model, tokenizer):
    return models.LoadedModel(model=model, tokenizer=tokenizer, name="tiny-target", source="")


def test_head_scores_its_tokens_and_rules_out_the_rest(target, tokenizer, tmp_path):
    head_ids = torch.arange(0, len(tokenizer), 2)
    path = write_shared_draft(target, tokenizer, tmp_path / "draft", head_ids)
    draft = models.load_draft(str(path), loaded(target, tokenizer)).model
    assert draft.model.embed_tokens is target.get_input_embeddings()  # shared, not stored
    assert draft.dtype == target.dtype and not any(p.requires_grad for p in draft.parameters())
    ids = torch.tensor([[5, 17, 33, 8]])
    with torch.no_grad():
        hidden = draft.model(input_ids=ids).last_hidden_state
        logits = draft(input_ids=ids).logits
    expected = hidden @ target.get_output_embeddings().weight[head_ids].T
    assert torch.allclose(logits[..., head_ids], expected)
    outside = torch.ones(len(tokenizer), dtype=torch.bool)
    outside[head_ids] = False
    assert (logits[..., outside] == torch.finfo(logits.dtype).min).all()
    assert (path / "model.safetensors").stat().st_size < 2 * sum(p.numel() for p in draft.model.layers.parameters()) + 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_kernels_pack_the_head_and_it_scores_the_same(target, tokenizer, tmp_path, dtype):
    """``kernels.prepack`` packs the head's product like the draft's other linears (the stock bfloat16 product
    re-laid its weight out at every call); the packed head scores its tokens as the dense product does, to the
    dtype's rounding, and still rules the rest out."""
    from batchspec_cli.models import kernels

    if not kernels.packs(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weight here (no oneDNN, or bfloat16 on a CPU without AVX-512)")
    head_ids = torch.arange(1, len(tokenizer), 3)
    path = write_shared_draft(target, tokenizer, tmp_path / "draft", head_ids)
    draft = models.load_draft(str(path), loaded(copy.deepcopy(target).to(dtype), tokenizer)).model
    hidden = torch.randn(2, 3, target.config.hidden_size).to(dtype)
    with torch.no_grad():
        dense = hidden.float() @ draft.lm_head.weight.float().T
        kernels.prepack(draft, min_rows=1)
        assert isinstance(draft.lm_head.rows, kernels.PackedLinear)
        packed = draft.lm_head(hidden)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(packed[..., head_ids].float(), dense, rtol=tolerance, atol=tolerance * dense.abs().max())
    outside = torch.ones(len(tokenizer), dtype=torch.bool)
    outside[head_ids] = False
    assert (packed[..., outside] == torch.finfo(dtype).min).all()


def test_every_weight_of_a_loaded_draft_is_the_file_s_or_the_target_s(target, tokenizer, tmp_path):
    """The loader builds the draft without a random init (every weight is loaded or borrowed): none is left as it was
    allocated, and its buffers (rotary frequencies) are those of a model built the usual way."""
    from safetensors.torch import load_file

    path = write_shared_draft(target, tokenizer, tmp_path / "draft", torch.arange(0, len(tokenizer), 3), layers=2)
    draft = models.load_draft(str(path), loaded(target, tokenizer)).model
    saved = load_file(str(path / "model.safetensors"))
    for name, param in draft.named_parameters():
        if name.startswith("model.embed_tokens."):
            assert param is target.get_input_embeddings().weight
        elif name.startswith("lm_head."):
            assert torch.equal(param, target.get_output_embeddings().weight[saved["head_ids"].long()])
        else:
            assert torch.equal(param, saved[name].to(param.dtype)), name
    usual = dict(LlamaForCausalLM(draft.config).named_buffers())
    buffers = {name: b for name, b in draft.named_buffers() if name in usual}
    assert buffers and all(torch.equal(b, usual[name].to(b.dtype)) for name, b in buffers.items())


def test_refused_for_a_target_with_other_embeddings(target, tokenizer, tmp_path):
    path = write_shared_draft(target, tokenizer, tmp_path / "draft", torch.arange(40))
    other = make_tiny_llama(len(tokenizer), seed=5)
    with pytest.raises(models.ModelError, match="borrows the embeddings"):
        models.load_draft(str(path), loaded(other, tokenizer))


@pytest.mark.parametrize("mode,batch_size", [("exspec", 3), ("eqspec", 4), ("exspec", 8)])
def test_engine_with_a_shared_draft_equals_greedy(target, tokenizer, tmp_path, mode, batch_size):
    import random

    rng = random.Random(2)
    prompts = [[rng.randrange(4, len(tokenizer)) for _ in range(rng.randint(1, 12))] for _ in range(12)]
    eos = [tokenizer.eos_token_id]
    refs = [greedy_reference(target, p, 12, eos) for p in prompts]
    # A head that lacks some tokens the target picks: those positions must be rejected, never emitted wrongly.
    head_ids = torch.tensor(sorted({t for r in refs for t in r[::2]} | set(range(0, len(tokenizer), 3))))
    assert any(t not in set(head_ids.tolist()) for r in refs for t in r)
    path = write_shared_draft(target, tokenizer, tmp_path / "draft", head_ids)
    draft = models.load_draft(str(path), loaded(target, tokenizer)).model
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), eos,
                    EngineConfig(mode=mode, k=3, batch_size=batch_size, window=2 * batch_size))
    results = {e.row: e for e in engine.run(Request(row=i, id=str(i), prompt_ids=p, max_new_tokens=12)
                                            for i, p in enumerate(prompts)) if isinstance(e, RowResult)}
    assert [results[i].token_ids for i in range(len(prompts))] == refs
    assert sum(r.accepted_tokens for r in results.values()) > 0


def test_refused_when_the_job_opens_without_reading_its_weights(target, tokenizer, tmp_path):
    """``check_draft`` (what opening a job runs; the weights load at first use) refuses what ``load_draft`` would."""
    path = write_shared_draft(target, tokenizer, tmp_path / "draft", torch.arange(40))
    assert models.check_draft(str(path), loaded(target, tokenizer))[1] == path.resolve()
    (path / "model.safetensors").unlink()  # not read to vet the draft
    with pytest.raises(models.ModelError, match="borrows the embeddings"):
        models.check_draft(str(path), loaded(make_tiny_llama(len(tokenizer), seed=5), tokenizer))
