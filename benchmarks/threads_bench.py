"""Whole-command time of the default thread setting against ``--threads 1``, quiet and beside a busy process.

A shared machine is where torch's default (one OpenMP thread per core, threads spinning at every
barrier) can collapse: a thread spins while its partner is descheduled. This runs the real CLI
as separate processes, in palindrome order over the variants, with and without one competing
busy process (a pure-Python spin loop), and prints the wall time of each and its ratio to
``--threads 1`` in the same condition.

    python benchmarks/threads_bench.py --rows 8 --max-new-tokens 16 --repeats 2

Variants: ``default`` (no --threads; the CLI's default wait policy), ``threads1`` (--threads 1),
``spin`` (no --threads, OMP_WAIT_POLICY=ACTIVE: what the default was before the CLI chose a
passive wait policy). The last line is one JSON object for machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "default": ([], {}),
    "threads1": (["--threads", "1"], {}),
    "spin": ([], {"OMP_WAIT_POLICY": "ACTIVE"}),
}


def run_once(inp: Path, out: Path, extra: list[str], env_extra: dict, args) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(env_extra)
    command = [sys.executable, "-c", "from batchspec_cli.cli import app; app()", "generate", str(inp), str(out),
               "--mode", args.mode, "-n", str(args.max_new_tokens), "-b", str(args.batch_size),
               "--limit", str(args.rows), "--overwrite", "--quiet", *extra]
    began = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, default=ROOT / "sample_data" / "prompts.jsonl")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--mode", default="ar")
    parser.add_argument("--repeats", type=int, default=2, help="palindrome passes (each runs every variant twice)")
    parser.add_argument("--conditions", nargs="+", default=["quiet", "busy"])
    args = parser.parse_args()

    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.parquet"
        run_once(args.input, out, [], {}, args)  # warm-up: the converted model's cache, the page cache
        for condition in args.conditions:
            competitor = None
            if condition == "busy":
                competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                order = list(VARIANTS)
                for _ in range(args.repeats):
                    for name in order + order[::-1]:
                        extra, env_extra = VARIANTS[name]
                        times.setdefault((condition, name), []).append(run_once(args.input, out, extra, env_extra,
                                                                                args))
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()

    print(f"{'condition':<10}{'variant':<10}{'median s':>10}{'min s':>8}{'max s':>8}{'vs threads1':>13}")
    record = {"command": " ".join(sys.argv), "rows": args.rows, "max_new_tokens": args.max_new_tokens,
              "batch_size": args.batch_size, "mode": args.mode, "cpus": os.cpu_count(), "results": {}}
    for condition in args.conditions:
        base = statistics.median(times[(condition, "threads1")])
        for name in VARIANTS:
            values = times[(condition, name)]
            median = statistics.median(values)
            print(f"{condition:<10}{name:<10}{median:>10.2f}{min(values):>8.2f}{max(values):>8.2f}"
                  f"{median / base:>12.2f}x")
            record["results"][f"{condition}/{name}"] = {"seconds": values, "ratio_vs_threads1": median / base}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
