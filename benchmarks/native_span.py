"""How steady the first run's kernel measurement is: ``kernels.measure_native_rows`` (the rows batchspec's linear
kernel takes from oneDNN and MKL, remembered in ``widths.json`` for good) repeated on the default target, in one
process, for each number of timed attempts asked.

    python benchmarks/native_span.py --attempts 1 3 --trials 6
    python benchmarks/native_span.py --attempts 1 3 --trials 6 --dtype float32    # a CPU without AVX512-BF16

Run it once on a quiet machine and once with a job on the other core (a neighbour, as a user's first run may
have). Per measurement: the span it would remember, its seconds, and per timed size the ratio of the kernel that
ran the size before to batchspec's (above 1: batchspec's is faster). Then, per number of attempts, how many
different spans the trials gave, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchspec_cli.models import kernels, native  # noqa: E402
from batchspec_cli.models import loading as models  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attempts", type=int, nargs="+", default=[1, kernels.NATIVE_REPEATS])
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels.bound_caches()
    model = models.load_model(None, args.dtype, "cpu", quiet=True).model
    kernels.keep_freed_memory()
    kernels.prepack(model)
    built = native.load()
    layers = native.packed_linears(model)
    if not any(kernels.nativeable(layer, built.linear_dtypes) for layer in layers):
        sys.exit(f"batchspec's linear kernel does not run this model's dtype here: {built.error or 'not built for it'}")
    results = {}
    for attempts in args.attempts:
        spans = []
        for trial in range(args.trials):
            started = time.perf_counter()
            span, ms = kernels.measure_native_rows(layers, built.ops, repeats=attempts, dtypes=built.linear_dtypes)
            took = time.perf_counter() - started
            ratios = {rows: round(ms["before"][rows] / ms["native"][rows], 3) for rows in ms["before"]}
            spans.append(list(span))
            print(f"attempts {attempts}  trial {trial}  span {span}  {took:.1f} s  before/native {ratios}", flush=True)
        results[attempts] = spans
    for attempts, spans in results.items():
        print(f"attempts {attempts}: {len({tuple(s) for s in spans})} different spans in {len(spans)} trials")
    print(json.dumps({"dtype": str(model.dtype), "threads": args.threads, "spans": results}))


if __name__ == "__main__":
    main()
