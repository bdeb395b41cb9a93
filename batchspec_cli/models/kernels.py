"""CPU kernels: linear layers with oneDNN-prepacked weights (inference only; ``--kernels auto`` uses them on a CPU
in float32 and bfloat16 when the memory allows, see ``assembly.use_kernels``).

On a CPU, a forward of a few new tokens (a verify of k + 1 tokens, a short catch-up) runs
its linear layers as small-M matrix products, which MKL's general path does far less
efficiently than the one-token matrix-vector product: on 2 cores, 6 rows cost about twice
one row although the weights stream once either way. oneDNN with its weights reordered
once into its blocked layout ("prepacked") keeps the cost of M = 1..8 rows nearly flat;
at M = 1 it is no faster than MKL's matrix-vector path (a fixed per-call overhead).

``prepack(model, min_rows)`` therefore swaps every float32 or bfloat16 CPU ``nn.Linear`` for a
``PackedLinear`` that runs oneDNN for inputs of ``min_rows`` to ``MAX_ROWS`` rows (tokens x
batch) and the stock dense path outside that. Nothing global is patched; ``unpack`` undoes it.

bfloat16: on a CPU with AMX the packed path runs AMX tiles; the stock bfloat16 ``F.linear``
runs far below it for small products (SmolLM2's 576 x 1536 layer, one thread: 1-16 rows
1.7-2.1x faster packed, 32-128 rows 1.3-2.3x; from ~512 rows the stock path is as fast or
faster), so a bfloat16 layer packs from one row up to ``MAX_ROWS_BF16``.

Memory per input size: oneDNN builds (JIT-compiles) a kernel for every distinct input size it sees
and keeps it in two caches (ideep's and oneDNN's own, 1,024 entries each), at about 0.25 MB per
kernel, even for a 16-wide layer. An unbounded range of sizes (a prefill of rows x prompt length)
would fill both caches as a job runs, and the C heap would grow with the rows. ``MAX_ROWS`` bounds the
sizes to ``MAX_ROWS - min_rows + 1`` per layer shape; above it oneDNN is no faster than MKL (docs/history.md,
"Figures once kept in the code"). That still allows 63 kernels per layer shape (about 0.6 MB each at SmolLM2's
shapes): ``bound_caches`` caps both caches at ``CACHE_ENTRIES`` for the process (more than a round's
working set, a few sizes per layer shape), so what they hold no longer depends on the job. oneDNN
reads the caps when the process first uses it: ``bound_caches`` must run before ``prepack``, and
keeps a value the user set.

Which kernel pays from how many rows is the machine's: oneDNN's packed path was flat over 1-8 rows on the
AMD and AMX hosts measured, but on an AVX-512 Xeon without bfloat16 units MKL ran 1-3 rows faster (a verify of
3 tokens at batch 1 took 112-123 ms packed against 90-95 stock) and oneDNN only 4 rows and more.
``measure_min_rows`` times both on the model's own weights, streamed as a forward streams them, and
``set_min_rows`` applies the fewest rows from which packed is never slower (``--kernels auto``; the job
remembers it per machine and model, ``job.assembly.tune_kernels``).

batchspec's own bfloat16 kernel (``models/linear_cpu.cpp``, built by ``native`` on a CPU with AVX512-BF16): oneDNN's
packed path streamed a batch-1 step's weights at about half this CPU's memory bandwidth (11-14 of 22-25 GB/s at 1-8
rows), and ran below the core's bfloat16 peak at 16-1,024 rows. ``use_native`` runs a bfloat16 ``PackedLinear`` on it
for inputs of up to the rows ``measure_native_rows`` found it no slower than the kernel that ran them before (every
size on a CPU without AMX, where it was 1.6-2.2x oneDNN's at 1-8 rows and 1.04-1.11x from 64 rows; on a CPU with AMX
tiles oneDNN's wide products should stay faster, and the measurement keeps them). Each of its outputs is one float32
sum in a fixed order, so a row's outputs do not depend on the rows beside it.

batchspec's float32 kernel (the same file, built on any CPU with AVX-512, or AVX2 and FMA): on a Xeon without bfloat16
units, where a job runs float32, MKL and oneDNN ran 4-16 rows at 1.2-1.4x its time (a decode step streams the weights
once at whatever rows); on a Zen 3 core with AVX2 alone, oneDNN 1.5-1.7x and MKL 1.9-2.3x. It runs the span of sizes
``measure_native_rows`` found it no slower (``native_rows_from``: MKL's one-row product may stream as fast, and
oneDNN's wide products run at the float32 roof), below and above which the layer keeps the kernels it had. Each
output is one float32 sum over k in blocks of 64, so again a row's outputs do not depend on the rows beside it.

``--dtype mixed`` (``to_mixed``): bfloat16 weights and matmul inputs, float32 sums and activations. Its linears are
``MixedLinear`` layers, which oneDNN never packs: batchspec's kernel runs them at every size (float32 in, rounded to
bfloat16 as read, float32 out) where it is built; else transformers' float32 product of the rounded numbers.

Numerics: oneDNN and MKL sum in different orders, so logits differ from the stock kernels
by float32 rounding (~1e-6 relative). A given input size always takes the same kernel, so
runs are deterministic; but like the stock kernels (whose one-row and many-row paths also
differ), a verify forward and a one-token forward of the same token may round differently.

Memory: the packed copy is held next to the dense weight (which stays a ``Parameter``:
state dicts, tied embeddings and ``model.parameters()`` are unchanged), so each packed
layer's weight memory doubles. The packed copy is made once: re-``prepack`` after changing
weights in place.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import os
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

# One row: MKL's matrix-vector path is as fast; from two rows on oneDNN is much faster (benchmarks/verify_cost.py;
# docs/history.md, "Figures once kept in the code").
DEFAULT_MIN_ROWS = 2
# Larger inputs run MKL: as fast there, and oneDNN's per-size kernels stay bounded (see the module docstring).
MAX_ROWS = 64
MAX_ROWS_BF16 = 256  # bfloat16: oneDNN's AMX path is faster from 1 row to a few hundred (module docstring)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
CACHE_ENTRIES = 128  # per cache (ideep's and oneDNN's): at most ~75 MB of kernels for the process
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


def available() -> bool:
    """Whether this PyTorch build has the oneDNN operators ``PackedLinear`` runs on."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state-dict keys) with a oneDNN-prepacked copy of its weight.

    Inputs of ``min_rows`` to ``MAX_ROWS`` rows (all leading dimensions together; bfloat16: 1 to
    ``MAX_ROWS_BF16``) run oneDNN on the packed weight; others run ``F.linear`` on the dense weight.
    """

    def __init__(self, linear: nn.Linear, min_rows: int = DEFAULT_MIN_ROWS):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared, not copied: tied weights stay tied
        self.bias = linear.bias
        self.min_rows = min_rows
        bf16 = linear.weight.dtype == torch.bfloat16
        self.first, self.last = (1 if bf16 else min_rows) * self.in_features, \
            (MAX_ROWS_BF16 if bf16 else MAX_ROWS) * self.in_features  # [first, last] input elements run packed
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        # batchspec's kernel (``use_native``): its ops, its layout of the weight, the fewest and the most input elements
        # it runs (-1: none)
        self.native_ops, self.native, self.native_first, self.native_last = None, None, 0, -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.numel()
        if self.native_first <= size <= self.native_last and x.dtype == self.native.dtype:  # not a model moved since
            return self.native_ops.linear(x, self.native, self.out_features)
        if self.packed is None or not self.first <= size <= self.last:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this layer's parameters."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def __deepcopy__(self, memo):
        # The packed tensor has no storage to copy: copy the dense layer and pack it again.
        return PackedLinear(copy.deepcopy(self.to_linear(), memo), self.min_rows)

    def extra_repr(self) -> str:
        native = f", native_rows={self.native_first // self.in_features}-{self.native_last // self.in_features}" \
            if self.native is not None else ""
        return f"{super().extra_repr()}, min_rows={self.min_rows}{native}"


def set_min_rows(model: nn.Module, min_rows: int) -> None:
    """Run every ``PackedLinear`` of ``model``, whatever its dtype, packed from ``min_rows`` rows (in place)."""
    if min_rows < 1:
        raise ValueError(f"min_rows must be at least 1, got {min_rows}")
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            layer.min_rows, layer.first = min_rows, min_rows * layer.in_features


def nativeable(layer: nn.Module, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> bool:
    """Whether batchspec's linear kernel, built for the weight dtypes ``dtypes``, can run ``layer``: a ``PackedLinear``
    of one of them without bias (bfloat16: with an even number of input features)."""
    return (isinstance(layer, PackedLinear) and layer.weight.dtype in dtypes and layer.bias is None
            and (layer.weight.dtype != torch.bfloat16 or layer.in_features % 2 == 0))


def use_native(layers: list[nn.Module], ops, rows: int, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
               first: int = 1) -> None:
    """Run the ``nativeable`` of ``layers`` on batchspec's kernel (``ops``: ``torch.ops.batchspec``, built with
    ``linear_cpu.cpp`` for the weight dtypes ``dtypes``) for inputs of ``first`` to ``rows`` rows (``EVERY_ROWS``: all
    from ``first``); ``rows`` 0 gives them back to oneDNN. Where the kernel takes every size oneDNN did, oneDNN's copy
    of the weight is freed (the memory stays what packing took). A ``MixedLinear`` takes the kernel at every size
    whatever ``rows`` (0: its reference product again)."""
    for layer in layers:
        if isinstance(layer, MixedLinear):  # its only bfloat16 kernel: every size
            if rows <= 0:
                drop_native(layer)
            elif layer.native is None and layer.in_features % 2 == 0:
                with torch.no_grad():
                    layer.native_ops, layer.native = ops, ops.pack_linear(layer.weight.detach())
            continue
        if not nativeable(layer, dtypes):
            continue
        if rows <= 0:
            drop_native(layer)
            continue
        if layer.native is None:
            with torch.no_grad():
                layer.native = ops.pack_linear(layer.weight.detach())
        layer.native_ops = ops
        layer.native_first = first * layer.in_features
        layer.native_last = EVERY_ROWS * layer.in_features if rows >= EVERY_ROWS else rows * layer.in_features
        if layer.native_first <= layer.first and layer.native_last >= layer.last:
            layer.packed = None


MIXED = "batchspec_mixed"  # set on a model ``to_mixed`` converted


class MixedLinear(nn.Linear):
    """A linear layer of ``--dtype mixed``: a bfloat16 weight, float32 out; the input float32, rounded to bfloat16
    (nearest even), or bfloat16 already; the products summed in float32: on batchspec's kernel where ``use_native``
    gave it one (each output one float32 sum in a fixed order, whatever the rows beside it), else as transformers'
    float32 product of the same rounded numbers (the reference ``batchspec verify`` decodes with)."""

    def __init__(self, weight: torch.Tensor):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None
        self.native_ops, self.native = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype in (torch.float32, torch.bfloat16) \
                and self.weight.dtype == torch.bfloat16:  # bfloat16 x: already rounded (layers: norms, SiLU, attention)
            return self.native_ops.linear(x, self.native, self.out_features, torch.float32)
        if x.dtype == torch.bfloat16:
            x = x.float()
        return F.linear(x.to(torch.bfloat16).to(x.dtype), self.weight.to(x.dtype))

    def __deepcopy__(self, memo):
        return MixedLinear(copy.deepcopy(self.weight, memo))  # without the kernel's copy (verify's float64 model)


def to_mixed(model: nn.Module) -> nn.Module:
    """``--dtype mixed`` on a float32 CPU model, in place: bfloat16 weights and matmul inputs, float32 sums, outputs
    and residual stream. Every ``nn.Linear`` without bias and with an even number of input features becomes a
    ``MixedLinear`` (its weight rounded to bfloat16 at nearest even; a tied output head gets a copy of its own), and
    the input embeddings are rounded to bfloat16 values in place (a lookup is no product: they stay float32 tensors).
    Norms, rotary, the residual stream and the logits stay float32; batchspec's Llama layer (``layers``) rounds the
    attention's inputs to bfloat16 too, so its KV cache holds bfloat16. Returns ``model``."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Embedding) and module.weight.dtype == torch.float32:
                module.weight.copy_(module.weight.to(torch.bfloat16))
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if (type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.bias is None
                        and child.weight.device.type == "cpu" and child.in_features % 2 == 0):
                    setattr(parent, name, MixedLinear(child.weight))
    setattr(model, MIXED, True)
    return model


def is_mixed(model: nn.Module) -> bool:
    """Whether ``to_mixed`` converted ``model``."""
    return bool(getattr(model, MIXED, False))


def drop_native(layer: PackedLinear | MixedLinear) -> None:
    """Undo ``use_native`` on ``layer``: oneDNN runs it again, its copy of the weight made anew where it was freed (a
    ``MixedLinear``: its reference product)."""
    if isinstance(layer, MixedLinear):
        layer.native_ops, layer.native = None, None
        return
    layer.native_ops, layer.native, layer.native_first, layer.native_last = None, None, 0, -1
    if layer.packed is None:
        with torch.no_grad():
            layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())


NATIVE_ROWS_TIMED = (1, 4, 16, 64, 256, 1024)  # the input sizes ``measure_native_rows`` compares
# Timed attempts per size and kernel, the fastest kept (a neighbour's burst only ever slows one down). One attempt,
# with another batchspec job on the other core, measured the float32 kernel behind oneDNN at 64 rows in 1 of 6
# measurements (0.94x, where the other 5 said 1.06-1.43x) and kept that span for good; three: 1.26-1.36x, 6 of 6
# (AVX2 host, one thread, 2026-12-08; docs/performance.md). It costs about 0.6 s more, once per machine and model.
NATIVE_REPEATS = 3
NATIVE_WIDE_ROWS = 64  # from these rows a product is compute-bound: timed on the first ``NATIVE_WIDE_BYTES`` only
NATIVE_WIDE_BYTES = 16 * 2**20
EVERY_ROWS = 1 << 30  # the kernel runs every size (it was never slower, up to a prefill's 1,024 rows)
DEFAULT_NATIVE_ROWS = 8  # unmeasured (--kernels packed): a product streaming its weights, where it was 1.5-2x oneDNN's


def native_rows_from(before: dict[int, float], native: dict[int, float]) -> tuple[int, int]:
    """The rows the native kernel runs, (first, last): from the smallest timed size where it was no slower than the
    kernel that ran that size before (oneDNN's packed one over its range, the stock one outside it), up to the largest
    timed size before which it never was slower again (``EVERY_ROWS`` when it never was); (0, 0) when it was slower at
    every size. Sizes below the first keep the kernel they had (MKL's one-row product can stream faster)."""
    sizes = sorted(native)
    first = next((size for size in sizes if native[size] <= before[size]), 0)
    if not first:
        return 0, 0
    last = first
    for size in sizes[sizes.index(first):]:
        if native[size] > before[size]:
            return first, last
        last = size
    return first, EVERY_ROWS


@torch.no_grad()
def measure_native_rows(layers: list[nn.Module], ops, sizes: tuple[int, ...] = NATIVE_ROWS_TIMED,
                        repeats: int = NATIVE_REPEATS,
                        dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> tuple[tuple[int, int], dict]:
    """Time batchspec's kernel (built for ``dtypes``) against the one that runs each size of ``sizes`` rows today
    (oneDNN's packed kernel over the layer's packed range, the stock one outside it) on the ``nativeable`` of
    ``layers`` (one model: one dtype), in order until ``TIMED_BYTES`` of weights (``NATIVE_WIDE_BYTES`` from
    ``NATIVE_WIDE_ROWS`` rows), interleaved, the fastest of ``repeats`` after one untimed pass. Returns
    (``native_rows_from`` the timings, {"before"|"native": {rows: ms}}); ((0, 0), {}) without such layers."""
    timed, streamed = [], 0
    for layer in layers:
        if nativeable(layer, dtypes) and streamed < TIMED_BYTES:
            native = layer.native if layer.native is not None else ops.pack_linear(layer.weight.detach())
            packed = layer.packed if layer.packed is not None else \
                torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
            timed.append((layer, native, packed, streamed < NATIVE_WIDE_BYTES))
            streamed += layer.weight.numel() * layer.weight.element_size()
    if not timed:
        return (0, 0), {}
    inputs = _inputs(sizes, {entry[0].in_features for entry in timed}, timed[0][0].weight.dtype)

    def seconds(rows: int, native: bool) -> float:
        start = time.perf_counter()
        for layer, weight, packed, wide in timed:
            if rows >= NATIVE_WIDE_ROWS and not wide:
                break
            x = inputs[rows, layer.in_features]
            if native:
                ops.linear(x, weight, layer.out_features)
            elif layer.first <= x.numel() <= layer.last:
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            else:
                F.linear(x, layer.weight)
        return time.perf_counter() - start

    before, native = _fastest_ms(sizes, seconds, repeats)
    return native_rows_from(before, native), {"before": before, "native": native}


ROWS_TIMED = (1, 2, 3, 4, 6, 8)  # the input sizes ``measure_min_rows`` compares; above them packed is taken as faster
TIMED_BYTES = 128 * 2**20  # weights one timing streams: more than a CPU's last-level cache, as a forward reads them


def min_rows_from(stock: dict[int, float], packed: dict[int, float]) -> int:
    """The fewest rows from which the packed kernel runs: the smallest timed size from which it was never slower
    than the stock one at any larger timed size; one past the largest when it was slower there."""
    best = max(stock) + 1
    for rows in sorted(stock, reverse=True):
        if packed[rows] > stock[rows]:
            break
        best = rows
    return best


@torch.no_grad()
def measure_min_rows(model: nn.Module, sizes: tuple[int, ...] = ROWS_TIMED, repeats: int = 2) -> tuple[int, dict]:
    """Time the stock and the packed kernel on ``model``'s own packed layers at each input size of ``sizes`` rows,
    in the model's order until ``TIMED_BYTES`` of weights, interleaved, the fastest of ``repeats``. Returns
    (``min_rows_from`` the timings, {"stock"|"packed": {rows: ms}}). A model without packed layers: (1, {})."""
    layers, streamed = [], 0
    for layer in model.modules():
        if isinstance(layer, PackedLinear) and layer.packed is not None and streamed < TIMED_BYTES:
            layers.append(layer)
            streamed += layer.weight.numel() * layer.weight.element_size()
    if not layers:
        return 1, {}
    inputs = _inputs(sizes, {layer.in_features for layer in layers}, layers[0].weight.dtype)

    def seconds(rows: int, packed: bool) -> float:
        start = time.perf_counter()
        for layer in layers:
            x = inputs[rows, layer.in_features]
            if packed:
                torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
            else:
                F.linear(x, layer.weight, layer.bias)
        return time.perf_counter() - start

    stock, packed = _fastest_ms(sizes, seconds, repeats)
    return min_rows_from(stock, packed), {"stock": stock, "packed": packed}


def _inputs(sizes: tuple[int, ...], widths: set[int], dtype: torch.dtype) -> dict[tuple[int, int], torch.Tensor]:
    """A timing's inputs: random rows of each width at each size, the same on every machine."""
    return {(rows, n): torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)).to(dtype)
            for rows in sizes for n in widths}


def _fastest_ms(sizes: tuple[int, ...], seconds, repeats: int) -> tuple[dict[int, float], dict[int, float]]:
    """``seconds(rows, arm)`` for the two arms (False, True) at each size, interleaved (the order turned every
    attempt), the fastest of ``repeats`` after one untimed attempt (it builds oneDNN's kernels for each size).
    Returns the milliseconds of arm False and of arm True, by size."""
    best: dict[tuple[int, bool], float] = {}
    for attempt in range(repeats + 1):
        for rows in sizes:
            for arm in ((False, True) if attempt % 2 else (True, False)):
                took = seconds(rows, arm)
                if attempt:
                    best[rows, arm] = min(took, best.get((rows, arm), took))
    return ({rows: best[rows, False] * 1e3 for rows in sizes}, {rows: best[rows, True] * 1e3 for rows in sizes})


def bound_caches() -> None:
    """Cap oneDNN's two kernel caches for this process at ``CACHE_ENTRIES`` (see the module docstring), unless the
    environment already sets them. Takes effect only before the process's first oneDNN operation."""
    for name in CACHE_VARIABLES:
        os.environ.setdefault(name, str(CACHE_ENTRIES))


HEAP_KEEPS = 1 << 30  # bytes: glibc serves allocations up to this from its heap and keeps up to this much freed there
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc's own settings, read at start-up
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_heap_kept = False


def keep_freed_memory() -> bool:
    """Have glibc serve allocations of up to ``HEAP_KEEPS`` bytes from its heap and keep what is freed there, for the
    process, unless the environment sets its own thresholds. Its default maps every allocation above 32 MB afresh and
    unmaps it when freed, so a prefill's large outputs (a 4,096-token product's float32 output over SmolLM2's MLP is
    50 MB) were new pages the OS zero-filled at every forward: a third of that product's time (70.8 against 105.5 ms,
    one thread). The memory a job's peak takes is the same; it is kept for the next forward instead of returned.
    Returns whether it applies (glibc on Linux)."""
    global _heap_kept
    if _heap_kept or any(name in os.environ for name in MALLOC_VARIABLES) or not sys.platform.startswith("linux"):
        return _heap_kept
    try:
        libc = ctypes.CDLL("libc.so.6")
        _heap_kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_KEEPS)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, HEAP_KEEPS))
    except (OSError, AttributeError):  # not glibc
        _heap_kept = False
    return _heap_kept


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a weight of ``dtype`` on this CPU: its bfloat16 reorder refuses a CPU without AVX-512 or
    AVX-NE-CONVERT (an AVX2-only CPU), where bfloat16 layers keep the stock product. Asked of oneDNN itself, once: the
    process's first oneDNN operation, so the caches are capped first (``bound_caches``)."""
    if not available():
        return False
    bound_caches()
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and weight is not None and weight.device.type == "cpu"
            and weight.dtype in PACKED_DTYPES and not weight.requires_grad and packs(weight.dtype))


def prepack(model: nn.Module, min_rows: int = DEFAULT_MIN_ROWS) -> nn.Module:
    """Swap every float32 or bfloat16 CPU ``nn.Linear`` of ``model`` (in place) for a ``PackedLinear``.

    Layers already packed just take the new ``min_rows``; other layers (other dtypes or
    devices, weights that require grad) are left alone, so this is a no-op on a GPU model.
    Returns ``model``. Raises ``RuntimeError`` when this PyTorch has no oneDNN.
    """
    if min_rows < 1:
        raise ValueError(f"min_rows must be at least 1, got {min_rows}")
    if not available():
        raise RuntimeError("this PyTorch build has no oneDNN (mkldnn) linear operators")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                if child.weight.dtype != torch.bfloat16:
                    child.min_rows, child.first = min_rows, min_rows * child.in_features
            elif _packable(child):
                setattr(parent, name, PackedLinear(child, min_rows))
    return model


def unpack(model: nn.Module) -> nn.Module:
    """Undo ``prepack`` in place (plain ``nn.Linear`` layers sharing the same parameters). Returns ``model``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.to_linear())
    return model


def packable_bytes(model: nn.Module, native_dtypes: tuple[torch.dtype, ...] = ()) -> int:
    """The memory ``prepack`` (and ``use_native``, for a mixed model) would add to ``model``: the weight bytes of its
    not yet packed float32 and bfloat16 CPU linears; twice for those of ``native_dtypes``, whose layout for
    batchspec's kernel is held beside oneDNN's where the kernel takes only some sizes."""
    return sum(m.weight.numel() * m.weight.element_size() * (2 if _packable(m) and m.weight.dtype in native_dtypes
                                                             else 1)
               for m in model.modules() if _packable(m) or (isinstance(m, MixedLinear) and m.native is None))


def memory_available() -> int | None:
    """Bytes of memory this machine can still give without swapping (Linux ``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def free_memory(device: torch.device) -> int | None:
    """Bytes ``device`` can still give: a GPU's free memory, else this machine's (``memory_available``)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return memory_available()


def packed_layers(model: nn.Module) -> int:
    """How many ``PackedLinear`` layers ``model`` holds."""
    return sum(isinstance(m, PackedLinear) for m in model.modules())
