"""How far up a wider batch pays: plain-step tokens/s of the target at each width, per dtype and context.

    python benchmarks/width_curve.py                                   # bfloat16 and float32, contexts 300 and 1000
    python benchmarks/width_curve.py --dtypes bfloat16 --widths 1 8 32 128 256 --contexts 600

Each point is what ``--batch-size auto`` measures before a run (``Engine._bare_step``): a one-token forward of the
embedded default target over ``width`` rows with ``context`` cached columns, the engine's kernels and attention
(packed linears where ``--kernels auto`` packs them, the run's attention), the median of ``--repeats`` forwards
after a warm-up. Widths and dtypes alternate within one process so that a drift of the machine falls on all. A table
for people (tokens/s, and the gain over the previous width), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchspec_cli.engine.align import SlotCache  # noqa: E402
from batchspec_cli.job.assembly import use_kernels  # noqa: E402
from batchspec_cli.models import loading as models  # noqa: E402
from batchspec_cli.models.attention import for_run, group_forward  # noqa: E402


@torch.no_grad()
def step_seconds(model, width: int, context: int, repeats: int) -> float:
    cache = SlotCache(width, context + 1)
    tokens = torch.zeros((width, 1), dtype=torch.long)
    pad = torch.zeros(width, dtype=torch.long)
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        group_forward(model, cache, models.cache_kwarg(model), slice(0, width), tokens, pad, context, 1)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = {dtype: models.load_model(None, dtype, "cpu", quiet=True) for dtype in args.dtypes}
    kernels = {dtype: use_kernels("auto", m)[0] for dtype, m in loaded.items()}
    rates: dict[tuple[str, int, int], float] = {}
    with for_run(*(m.model for m in loaded.values())):
        for context in args.contexts:
            for width in args.widths:
                for dtype, m in loaded.items():
                    rates[dtype, context, width] = width / step_seconds(m.model, width, context, args.repeats)
    print(f"plain-step tokens/s by width (one-token forwards, {args.threads} thread(s); x: over the previous width)")
    for dtype in args.dtypes:
        for context in args.contexts:
            cells, previous = [], None
            for width in args.widths:
                rate = rates[dtype, context, width]
                cells.append(f"{width}: {rate:.0f}" + (f" ({rate / previous:.2f}x)" if previous else ""))
                previous = rate
            print(f"{dtype:<9} ({kernels[dtype]}) context {context:>5}  " + "  ".join(cells))
    print(json.dumps({"threads": args.threads, "kernels": kernels, "command": " ".join(sys.argv),
                      "rates": [{"dtype": d, "context": c, "width": w, "tokens_per_s": round(r, 1)}
                                for (d, c, w), r in rates.items()]}))


if __name__ == "__main__":
    main()
