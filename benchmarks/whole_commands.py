"""`auto` (the default) against `--mode ar` as whole commands, as a user runs them.

    python benchmarks/whole_commands.py                         # batch 1, 4, 8 and 16, 3 pairs each
    python benchmarks/whole_commands.py --batch-sizes 8 --pairs 5 --prompts 16 --max-new-tokens 64

Each run is one ``batchspec generate`` process on the embedded default model (start-up, model
loading, kernel packing and the finish included): ``--mode auto`` and ``--mode ar`` alternate,
A B A B ..., so that a drift in the machine's speed falls on both. Per process it reads the
operating system's accounting (``wait4``): wall seconds, user + system CPU seconds and peak
resident memory. The prompts are ``--prompts`` Spec-Bench first turns spread over its six
groups (as ``bench.py`` picks them). Every run's completions must equal ``ar``'s (exit 1
otherwise). Reported per batch size: the median over the pairs of ar's time / auto's time (above
1: auto is faster), min-max in brackets, for CPU time and for wall time; on a shared machine CPU
time is the steadier figure. A table for people, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import SPEC_BENCH, spec_bench_prompts  # noqa: E402
from scale import whole_process  # noqa: E402


def run(inp: Path, out: Path, mode: str, batch: int, max_new: int, threads: int) -> dict:
    """One whole `generate` process: its wall and CPU seconds, peak memory and completions."""
    command = [sys.executable, "-m", "batchspec_cli", "generate", str(inp), str(out), "--mode", mode,
               "--batch-size", str(batch), "--max-new-tokens", str(max_new), "--threads", str(threads),
               "--quiet", "--overwrite", "--restart"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    code, wall, usage, stderr = whole_process(command, env)
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed: {stderr[-2000:]}")
    import pyarrow.parquet as pq

    tokens = pq.read_table(out, columns=["completion_token_ids"]).column("completion_token_ids").to_pylist()
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1024,
            "tokens": tokens}


def summary(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--pairs", type=int, default=3, help="auto/ar pairs per batch size")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH, help="Spec-Bench's questions (JSONL)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="batchspec-whole-") as tmp:
        inp = Path(tmp) / "in.jsonl"
        inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(spec_bench_prompts(args.questions, args.prompts))))
        for batch in args.batch_sizes:
            runs = {"auto": [], "ar": []}
            for _ in range(args.pairs):
                for mode in ("auto", "ar"):
                    runs[mode].append(run(inp, Path(tmp) / f"{mode}.parquet", mode, batch, args.max_new_tokens,
                                          args.threads))
                    print(f"  b{batch} {mode}: {runs[mode][-1]['wall_s']:.1f} s wall, "
                          f"{runs[mode][-1]['cpu_s']:.1f} s CPU", flush=True)
            reference = runs["ar"][0]["tokens"]
            if any(r["tokens"] != reference for mode in runs for r in runs[mode]):
                raise SystemExit(f"batch {batch}: a run's completions differ from ar's")
            pairs = list(zip(runs["auto"], runs["ar"]))
            rows.append({"batch": batch, "pairs": len(pairs),
                         "cpu": summary([b["cpu_s"] / a["cpu_s"] for a, b in pairs]),
                         "wall": summary([b["wall_s"] / a["wall_s"] for a, b in pairs]),
                         "ar_wall_s": statistics.median(r["wall_s"] for r in runs["ar"]),
                         "peak_mb": {m: round(max(r["peak_mb"] for r in runs[m])) for m in runs}})
    print(f"\n{args.prompts} Spec-Bench prompts x {args.max_new_tokens} tokens, --threads {args.threads}; "
          f"ar's time / auto's (above 1: auto faster), median of {args.pairs} pairs (min-max)")
    print(f"{'batch':>5} {'CPU time':>20} {'wall time':>20} {'ar wall':>8} {'peak MB auto/ar':>16}")
    for r in rows:
        cpu, wall = r["cpu"], r["wall"]
        print(f"{r['batch']:>5} {cpu['median']:>6.2f} ({cpu['min']:.2f}-{cpu['max']:.2f}) "
              f"{wall['median']:>6.2f} ({wall['min']:.2f}-{wall['max']:.2f}) {r['ar_wall_s']:>7.1f}s "
              f"{r['peak_mb']['auto']:>7}/{r['peak_mb']['ar']}")
    print(json.dumps({"benchmark": "whole_commands", "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                      "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
