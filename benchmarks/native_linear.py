"""batchspec's linear kernel (models/linear_cpu.cpp; bfloat16, or float32 with ``--dtype float32``) against oneDNN's
packed kernel and PyTorch's stock product, on every linear of the default target (the fused layers' joint ones, as a
forward runs them), in one process.

    python benchmarks/native_linear.py --rows 1 2 4 8 16 32 64 256 1024 --threads 1
    python benchmarks/native_linear.py --dtype float32 --rows 1 2 4 8 16 32 64 256 --repeats 5

For each input size (rows), the three kernels run over all the layers in turn, in palindrome order (stock, onednn,
native, native, onednn, stock) for ``--repeats`` rounds; the time is the median. Reports ms for the whole model's
linears, the weight bytes streamed per second, GFLOP/s and the ratios to the native kernel, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchspec_cli.models import kernels, native  # noqa: E402
from batchspec_cli.models import loading as models  # noqa: E402

KERNELS = ("stock", "onednn", "native")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 1024])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the weights' and inputs' dtype: the bfloat16 kernel, or the float32 one")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    built = native.load()
    dtype = getattr(torch, args.dtype)
    if dtype not in built.linear_dtypes:
        sys.exit(f"the {args.dtype} linear kernel is not built here: {built.error or 'not for this CPU'}")
    kernels.bound_caches()
    model = models.load_model(None, args.dtype, "cpu", quiet=True).model
    kernels.prepack(model, min_rows=1)
    native.attach(model)
    layers = [layer for layer in native.packed_linears(model) if kernels.nativeable(layer, (dtype,))]
    weights = {id(layer): (layer.packed if layer.packed is not None
                           else torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach()),
                           layer.native if layer.native is not None else built.ops.pack_linear(layer.weight.detach()))
               for layer in layers}
    total_bytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)

    def seconds(kernel: str, inputs: dict) -> float:
        start = time.perf_counter()
        for layer in layers:
            x = inputs[layer.in_features]
            onednn, packed = weights[id(layer)]
            if kernel == "stock":
                F.linear(x, layer.weight)
            elif kernel == "onednn":
                torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
            else:
                built.ops.linear(x, packed, layer.out_features)
        return time.perf_counter() - start

    rows_out = []
    print(f"{len(layers)} linears, {total_bytes / 2**20:.0f} MiB of {args.dtype} weights, {args.threads} thread(s)")
    print(f"{'rows':>6} " + " ".join(f"{k + ' ms':>11} {k + ' GB/s':>12}" for k in KERNELS) + "   native GFLOP/s  "
          "stock/native onednn/native")
    with torch.no_grad():
        for rows in args.rows:
            generator = torch.Generator().manual_seed(rows)
            inputs = {n: torch.randn(rows, n, generator=generator).to(dtype)
                      for n in {layer.in_features for layer in layers}}
            for kernel in KERNELS:
                seconds(kernel, inputs)  # oneDNN builds its kernel for this size; every weight read once
            took = {kernel: [] for kernel in KERNELS}
            for _ in range(args.repeats):
                for kernel in KERNELS + KERNELS[::-1]:
                    took[kernel].append(seconds(kernel, inputs))
            ms = {kernel: statistics.median(times) * 1e3 for kernel, times in took.items()}
            flops = 2 * rows * sum(layer.weight.numel() for layer in layers)
            row = {"rows": rows, "ms": ms, "gb_per_s": {k: total_bytes / v / 1e6 for k, v in ms.items()},
                   "native_gflops": flops / ms["native"] / 1e6,
                   "stock_over_native": ms["stock"] / ms["native"], "onednn_over_native": ms["onednn"] / ms["native"]}
            rows_out.append(row)
            ratios = f"{row['stock_over_native']:>12.2f} {row['onednn_over_native']:>13.2f}"
            print(f"{rows:>6} " + " ".join(f"{ms[k]:>11.1f} {row['gb_per_s'][k]:>12.1f}" for k in KERNELS)
                  + f"   {row['native_gflops']:>14.0f}  {ratios}")
    print(json.dumps({"benchmark": "native_linear", "dtype": args.dtype, "threads": args.threads, "layers": len(layers),
                      "weight_mib": total_bytes / 2**20, "rows": rows_out, "command": " ".join(sys.argv)}))


if __name__ == "__main__":
    main()
