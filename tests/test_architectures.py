"""The architecture matrix: tiny random float64 models of each supported family, every mode against per-prompt
HF decoding (``model.generate(do_sample=False)``, one prompt at a time, no padding), prompts longer than every
sliding window and attention chunk; sampled rows identical under ``ar`` and speculating ``auto``."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import transformers as tf

from batchspec_cli.engine import drafters
from batchspec_cli.engine.core import EngineConfig
from batchspec_cli.engine.events import Sampling
from batchspec_cli.models import loading as models
from conftest import perturbed_copy, run_engine_rows, scheduled

torch.set_num_threads(1)
VOCAB, WINDOW, MAX_NEW = 64, 8, 10
SAMPLED = Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=5)


def _sizes(**kw) -> dict:
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                 initializer_range=0.2, tie_word_embeddings=False)
    return sizes | kw


# family -> (config, model class); each has a window or chunk of WINDOW tokens (Mistral: 16) where it has one
FAMILIES = {
    "llama": lambda: (tf.LlamaConfig(**_sizes()), tf.LlamaForCausalLM),
    "qwen2": lambda: (tf.Qwen2Config(**_sizes()), tf.Qwen2ForCausalLM),
    "gpt2": lambda: (tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=2,
                                   eos_token_id=1, initializer_range=0.2), tf.GPT2LMHeadModel),
    "gemma2": lambda: (tf.Gemma2Config(**_sizes(head_dim=8, sliding_window=WINDOW, num_hidden_layers=3)),
                       tf.Gemma2ForCausalLM),  # eager attention, soft-capping
    "gemma3": lambda: (tf.Gemma3TextConfig(**_sizes(head_dim=8, sliding_window=WINDOW, num_hidden_layers=3,
                                                    layer_types=["sliding_attention"] * 2 + ["full_attention"])),
                       tf.Gemma3ForCausalLM),
    "gpt_oss": lambda: (tf.GptOssConfig(**_sizes(head_dim=8, sliding_window=WINDOW, num_local_experts=4,
                                                 num_experts_per_tok=2)), tf.GptOssForCausalLM),  # sinks, MoE
    "qwen2_sliding": lambda: (tf.Qwen2Config(**_sizes(use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=1)), tf.Qwen2ForCausalLM),
    "mistral_window16": lambda: (tf.MistralConfig(**_sizes(sliding_window=16)), tf.MistralForCausalLM),
    "phi3_window": lambda: (tf.Phi3Config(**_sizes(sliding_window=WINDOW)), tf.Phi3ForCausalLM),
    "llama4_chunked": lambda: (tf.Llama4TextConfig(**_sizes(head_dim=8, attention_chunk_size=WINDOW,
                                                            num_local_experts=2, num_experts_per_tok=1,
                                                            interleave_moe_layer_step=1, intermediate_size_mlp=64,
                                                            no_rope_layer_interval=2)),  # chunked, then full
                               tf.Llama4ForCausalLM),
    "bloom": lambda: (tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, bos_token_id=2,
                                     eos_token_id=1, pad_token_id=0, initializer_range=0.2), tf.BloomForCausalLM),
    "falcon_alibi": lambda: (tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, alibi=True, new_decoder_architecture=False,
                                             multi_query=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                                             initializer_range=0.2),
                             tf.FalconForCausalLM),
    "mpt": lambda: (tf.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=256,
                                 bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.2),
                    tf.MptForCausalLM),  # ALiBi, no position ids
    "deepseek_v3": lambda: (tf.DeepseekV3Config(**_sizes(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                                                         n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                                         topk_group=1, first_k_dense_replace=1,
                                                         moe_intermediate_size=32)),
                            tf.DeepseekV3ForCausalLM),  # MLA: keys 16 wide, values 12
}


def build(family: str) -> torch.nn.Module:
    config, cls = FAMILIES[family]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = cls(config).to(torch.float64).eval()
    model.requires_grad_(False)
    models.check_supported(model, name=family)
    models.plain_experts(model)  # as load_model does: grouped-mm experts have no float64 kernel
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    return model


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (3, 11, 40, 23, 17, 33)]  # most past the window


@torch.no_grad()
def hf_reference(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[1], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(model, draft, mode: str, *, policy=None, lookups=None, settings=None):
    cfg = EngineConfig(mode=mode, k=3, batch_size=3, window=6)
    results, stats = run_engine_rows(model, draft, prompts(), cfg, max_new=MAX_NEW, eos=(1,), policy=policy,
                                     lookups=drafters.make(lookups) if lookups else None, settings=settings)
    return [results[i].token_ids for i in range(len(results))], stats


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_mode_equals_per_prompt_hf_decoding(family):
    model = build(family)
    draft = perturbed_copy(model, scale=0.01, seed=1)
    references = [hf_reference(model, p) for p in prompts()]
    assert any(len(p) > 16 + MAX_NEW for p in prompts())
    for mode, d, names, policy in [("ar", None, None, None), ("eqspec", draft, None, None),
                                   ("exspec", draft, None, None), ("auto", draft, None, scheduled(3, 2)),
                                   ("exspec", None, ["ngram"], None)]:
        outputs, stats = run(model, d, mode, policy=policy, lookups=names)
        assert outputs == references, f"{family} {mode} {names or ''} differs from per-prompt decoding"
        if mode != "ar":
            assert any(s.k for s in stats if s.group_kind != "prefill"), "it speculated"
    sampled_ar, _ = run(model, None, "ar", settings=SAMPLED)
    sampled_auto, _ = run(model, draft, "auto", policy=scheduled(3, 7), settings=SAMPLED)
    assert sampled_auto == sampled_ar


def test_the_cli_runs_a_saved_sliding_window_model_and_verify_finds_it_exact(tmp_path):
    """Gemma 2 (sliding layers, soft-capping, eager attention) through the real CLI: once refused ("batchspec can
    only realign full-attention KV caches"), now generated with a draft and audited by `verify` (plain generate)."""
    import json

    from typer.testing import CliRunner

    from batchspec_cli.cli import app
    from conftest import make_tokenizer, perturbed_copy as noisy

    tokenizer = make_tokenizer()
    config = tf.Gemma2Config(**_sizes(vocab_size=len(tokenizer), head_dim=8, sliding_window=4, num_hidden_layers=3))
    torch.manual_seed(0)
    model = tf.Gemma2ForCausalLM(config).eval()
    for folder, m in ((tmp_path / "target", model), (tmp_path / "draft", noisy(model, 0.01, 2))):
        m.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a longer prompt than the window", "hi",
                                                                           "the quick brown fox jumps"]))
    out = tmp_path / "out.parquet"
    runner = CliRunner()
    result = runner.invoke(app, ["generate", str(prompts), str(out), "--target", str(tmp_path / "target"), "--draft",
                                 str(tmp_path / "draft"), "--mode", "exspec", "--dtype", "float64", "--quiet",
                                 "--max-new-tokens", "8", "--batch-size", "3"])
    assert result.exit_code == 0, result.output
    audit = runner.invoke(app, ["verify", str(out)])
    assert audit.exit_code == 0 and "checked 3 rows (0 error rows skipped): 3 exact" in audit.output, audit.output


def shared_prefix_prompts() -> list[list[int]]:
    """Rows that share a prefix longer than every window and chunk (and a pair that shares only part of it)."""
    rng = random.Random(4)
    prefix = [rng.randrange(4, VOCAB) for _ in range(30)]
    own = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (1, 5, 9, 3, 6)]
    return [prefix + o for o in own] + [prefix[:20] + own[1], prefix[:20] + own[2]]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_sharing_a_prefix_equal_per_prompt_hf_decoding(family):
    """Prefix sharing (``prefix``) in every family: sliding-window and chunked layers, ALiBi, MLA, learned positions;
    the prefix's KV is computed alone from position 0 and copied to each row's own content offset."""
    model = build(family)
    draft = perturbed_copy(model, scale=0.01, seed=1)
    rows = shared_prefix_prompts()
    references = [hf_reference(model, p) for p in rows]
    for mode, d, policy in [("ar", None, None), ("exspec", draft, None), ("auto", draft, scheduled(3, 2))]:
        cfg = EngineConfig(mode=mode, k=3, batch_size=3, window=6, prefix_min=8)
        results, stats = run_engine_rows(model, d, rows, cfg, max_new=MAX_NEW, eos=(1,), policy=policy,
                                         pad_to=max(map(len, rows)))
        assert [results[i].token_ids for i in range(len(rows))] == references, f"{family} {mode}"
        assert sum(s.prompt_reused for s in stats) > 0
