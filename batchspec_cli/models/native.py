"""batchspec's CPU kernels (attention, and a Llama layer's elementwise steps: ``layers``), built once on the user's
machine.

On a CPU, every decode step and verify attends a few query tokens per row to the whole cache. SDPA's flash
kernel does that at about 4 GB/s of cache read on one core (its small per-block products and their
reductions), well below what the core can stream. ``attention_cpu.cpp`` scores each key column once for all
the queries that share its KV head, in float32 whatever the cache's dtype, and sums the values in column order:
2.1-3.3x SDPA's folded kernel for one layer, the same error against float64 (``benchmarks/attention_kernels.py``).
It also keeps a row's output independent of the rows and padding beside it, and a verify's query computes
what a one-token step at its position would. Where the CPU has AVX512-BF16, a bfloat16 prefill's causal attention
runs batchspec's own kernel too (``causal``): bfloat16 pairs dotted into float32 by the CPU's dot-product
instruction, tiles of key columns with a running softmax, the probabilities rounded to bfloat16 for the product with
the values (as SDPA's CPU flash kernel does, which runs far below this core's bfloat16 speed). Where it has AVX-512,
a float32 prefill's the same in float32 (SDPA's flash kernel ran it at a third of the core's float32 products). On a
CPU with AVX2 and FMA but no AVX-512 the attention kernels and SiLU run in 8-lane registers, each lane computed as the
AVX-512 build computes it (without them a decode step's attention ran 2-4x slower than SDPA there: plain C++).

No kept library ships such a kernel for this PyTorch (vLLM's and IPEX's pin their own), so it is built here
with PyTorch's own extension builder (a C++ compiler and ninja; ``-march=native``) into the tool's cache
directory, keyed by the source, this CPU's flags and the PyTorch and Python versions; 10-20 s, once. Where
it cannot be built (no compiler, an unsupported platform) ``load`` says why and attention stays on SDPA.
``attach`` gives a model's attention layers the kernel (``attention._attend`` calls it) and its Llama decoder layers
batchspec's forward (``layers``, on ``layers_cpu.cpp``'s operators from the same build); ``detach`` undoes both.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from . import kernels, layers, widths

SOURCE = Path(__file__).with_name("attention_cpu.cpp")
SOURCES = (SOURCE, SOURCE.with_name("layers_cpu.cpp"), SOURCE.with_name("linear_cpu.cpp"))  # one library
HEADERS = (SOURCE.with_name("native_cpu.h"),)
# no contraction into fused multiply-adds: layers_cpu.cpp rounds every product as transformers does
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
MAX_QUERY = 16  # longer queries (a prefill, a long catch-up) keep SDPA: its blocked products pay there
DTYPES = (torch.float32, torch.bfloat16)
ATTRIBUTE = "batchspec_attend"  # set on a model's attention layers by ``attach``
STALE_LOCK_S = 600.0  # a builder's lock older than this was left by a killed build (one takes 10-20 s here)


class Built:
    """The outcome of building the kernel in this process: the function, or why there is none."""

    def __init__(self, module=None, error: str | None = None, seconds: float = 0.0, built_now: bool = False,
                 key: str = ""):
        self.attend = module.attend if module is not None else None  # short queries, float32 and bfloat16
        # a row's causal prefill: bfloat16 where the CPU has AVX512-BF16, float32 where it has AVX-512 or AVX2 and FMA
        # (the build's -march=native)
        self.causal_dtypes = tuple(dtype for dtype, built in (
            (torch.bfloat16, module is not None and module.has_causal()),
            (torch.float32, module is not None and module.has_causal_float())) if built)
        self.causal = module.causal if self.causal_dtypes else None
        self.ops = module  # every operator, the layers' elementwise ones too (``layers``)
        # the bfloat16 linear kernel, where the CPU has AVX512-BF16 (kernels.use_native runs it)
        self.linear = module is not None and module.has_linear()
        # the weight dtypes the linear kernels take: float32 where the CPU has AVX-512 or AVX2, bfloat16 as ``linear``
        self.linear_dtypes = tuple(dtype for dtype, built in (
            (torch.bfloat16, self.linear), (torch.float32, module is not None and module.has_linear_float())) if built)
        self.error, self.seconds, self.built_now = error, seconds, built_now
        self.key = key  # the build's key (source, CPU, versions)
        self._told = False

    def __deepcopy__(self, memo):
        return self  # the process's one build, shared (a copied model's attention layers keep it)

    def news(self) -> list[str]:
        """For the user, once per process: that the kernel was built now (a pause of its seconds), or why not."""
        if self._told:
            return []
        self._told = True
        if self.attend is None:
            return [f"batchspec's CPU kernels could not be built ({self.error}): attention runs on SDPA and the layers "
                    f"on transformers' modules"]
        if not self.built_now:
            return []
        return [f"built batchspec's CPU kernels for this machine in {self.seconds:.0f} s (once)"]


_built: Built | None = None
_lock = threading.Lock()


def _key() -> str:
    """What the built library depends on: the sources, the flags, this CPU (-march=native) and the versions it
    links; and where the sources are, since PyTorch's builder rebuilds a directory whose sources moved (two
    installs taking turns would each rebuild, 20 s, at every run)."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    digest.update(str(SOURCE.parent.resolve()).encode())
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    flags = widths.cpuinfo("flags", "Features") or platform.processor()  # x86's flags, ARM's features
    for part in (flags, platform.machine(), torch.__version__, sys.version):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _ninja_on_path():
    """Let PyTorch's builder find the ``ninja`` the ``ninja`` package installed, even outside an activated venv."""
    try:
        import ninja

        extra = getattr(ninja, "BIN_DIR", None)
    except ImportError:
        extra = None
    before = os.environ.get("PATH", "")
    if extra:
        os.environ["PATH"] = extra + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before


@contextlib.contextmanager
def _quiet_builder():
    """PyTorch's builder logs its warnings (a compiler it does not know, for one) to its own logger: the library
    stays silent, and a failed build reaches the user as one note (``Built.news``)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


def _why(exc: Exception) -> str:
    """One line for the user from a failed build: the compiler's or the shell's complaint, not the command lines."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    told = [line for line in lines if len(line) < 300 and not line.startswith("FAILED")
            and any(word in line.lower() for word in ("error", "not found", "no such file"))]
    return (told or lines[-1:] or [type(exc).__name__])[0][:160]


def _clear_stale_lock(lock: Path) -> None:
    """Wait while another process builds here; remove the builder's lock once it is older than any build takes.

    PyTorch's builder takes a lock file in the build directory and waits, without end, while one exists: a process
    killed while building (SIGKILL, a machine's crash) would leave every later run waiting on it.
    """
    while True:
        try:
            age = time.time() - lock.lstat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.2)


def _build() -> Built:
    if platform.system() != "Linux":
        return Built(error=f"built on Linux only (this is {platform.system()})")
    missing = [path.name for path in (*SOURCES, *HEADERS) if not path.is_file()]
    if missing:
        return Built(error=f"its source {missing[0]} is missing from the installed package")
    from torch.utils import cpp_extension

    from .loading import cache_dir  # loading imports attention, which imports this module

    root = cache_dir()
    key = _key()
    where = root / "kernels" / key
    if where.is_symlink() or where.parent.is_symlink():  # the tool builds into its own directories only
        return Built(error=f"{where} runs through a symlink")
    began = time.perf_counter()
    fresh = not any(where.glob("*.so"))
    try:
        where.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(where / "lock")
        with _ninja_on_path(), _quiet_builder(), warnings.catch_warnings(), \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            cpp_extension.load(
                name=f"batchspec_attention_{key}", sources=[str(path) for path in SOURCES],
                build_directory=str(where), extra_include_paths=[str(SOURCE.parent)],
                extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False)
        module = torch.ops.batchspec
    except Exception as exc:  # no compiler, no ninja, a compile error: attention stays on SDPA
        return Built(error=_why(exc))
    return Built(module, seconds=time.perf_counter() - began, built_now=fresh, key=key)


def load() -> Built:
    """The kernel, built (or loaded from the cache directory) the first time it is asked for in this process."""
    global _built
    with _lock:
        if _built is None:
            _built = _build()
        return _built


def _attention_layers(model: torch.nn.Module):
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "head_dim")]


def wants(model: torch.nn.Module) -> bool:
    """Whether the kernel applies to ``model``: a float32 or bfloat16 model on a CPU."""
    weight = next(model.parameters(), None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype in DTYPES


def attach(model: torch.nn.Module) -> bool:
    """Give the attention layers of a model the kernel ``wants`` (``attention._attend`` runs it for queries of up
    to ``MAX_QUERY`` tokens) and its ``layers.fusable`` decoder layers batchspec's forward, building the kernels
    first if need be. Returns whether it did."""
    if not wants(model):
        return False
    built = load()
    if built.attend is None:
        return False
    for layer in _attention_layers(model):
        setattr(layer, ATTRIBUTE, built)
    for layer in model.modules():
        if layers.fusable(layer):
            layers.attach(layer, built.ops)
    if built.linear_dtypes:
        kernels.use_native(packed_linears(model), built.ops, kernels.DEFAULT_NATIVE_ROWS, built.linear_dtypes)
    return True


def packed_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every ``kernels.PackedLinear`` and ``kernels.MixedLinear`` a forward of ``model`` runs: its modules' and its
    fused layers' joint ones."""
    ours = (kernels.PackedLinear, kernels.MixedLinear)
    found = [m for m in model.modules() if isinstance(m, ours)]
    for layer in model.modules():
        fused = layer.__dict__.get(layers.ATTRIBUTE)
        if fused is not None:
            found += [m for m in (fused.qkv, fused.gate_up) if isinstance(m, ours)]
    return found


def on_kernel(model: torch.nn.Module) -> bool:
    """Whether every product of a mixed model (``kernels.to_mixed``) runs on batchspec's kernel (True for others)."""
    return all(layer.native is not None for layer in packed_linears(model) if isinstance(layer, kernels.MixedLinear))


def use_native_rows(model: torch.nn.Module, rows: int, first: int = 1) -> None:
    """Run ``model``'s linears on batchspec's kernel for inputs of ``first`` to ``rows`` rows (``rows`` 0: on the
    kernels they had), where the kernel was built for this CPU and the model's dtype."""
    built = load()
    if built.linear_dtypes:
        kernels.use_native(packed_linears(model), built.ops, rows, built.linear_dtypes, first)


def running(model: torch.nn.Module) -> str:
    """Which attention ``model`` runs: ``sdpa``, or this module's kernels and their build's key (what a measured
    batch width depends on)."""
    built = next((getattr(m, ATTRIBUTE) for m in _attention_layers(model) if hasattr(m, ATTRIBUTE)), None)
    return f"batchspec {built.key}" if built is not None else "sdpa"


def detach(model: torch.nn.Module) -> None:
    """Undo ``attach``."""
    for layer in _attention_layers(model):
        if hasattr(layer, ATTRIBUTE):
            delattr(layer, ATTRIBUTE)
    for layer in packed_linears(model):
        if layer.native is not None:
            kernels.drop_native(layer)
    for layer in model.modules():
        layers.detach(layer)


def _last_dim_dense(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels take any strides but the last (a head's dims must lie side by side)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def causal(built, query, key, value, scaling: float) -> torch.Tensor | None:
    """``built``'s causal kernel (``Built.causal``) on one row's prefill (query ``[1, H, n, D]``, key and value
    ``[1, KV, m, D]``, m >= n, query i seeing keys up to m - n + i); returns ``[n, H, D]``, or None where it does not
    apply (no build, a dtype it was not built for, another head dim: the caller runs SDPA)."""
    dim = query.shape[-1]
    kernel = getattr(built, "causal", None)
    if kernel is None or query.dtype not in built.causal_dtypes or dim not in (64, 128) or query.shape[0] != 1 \
            or key.dtype != query.dtype or value.dtype != query.dtype or query.shape[1] % key.shape[1] \
            or key.shape[-1] != dim or value.shape[-1] != dim or key.shape[2] < query.shape[2]:
        return None
    return kernel(*_last_dim_dense(query, key, value), float(scaling))


def attend(kernel, query, key, value, mask, scaling: float) -> torch.Tensor:
    """``kernel`` (``Built.attend``) on SDPA's inputs (query ``[B, H, q, D]``, key and value ``[B, KV, L, D]``, an
    additive or boolean mask ``[B, 1, q or 1, L]``); returns ``[B, q, H, D]`` (what the attention layers take back)."""
    if mask.dtype != torch.bool and mask.dtype != torch.float32 and not (
            mask.dtype == torch.bfloat16 and query.dtype == torch.bfloat16):
        mask = mask.float()
    mask = mask.expand(query.shape[0], 1, mask.shape[2], key.shape[2])  # a broadcast row: stride 0, as SDPA reads it
    return kernel(*_last_dim_dense(query, key, value), mask, float(scaling))
