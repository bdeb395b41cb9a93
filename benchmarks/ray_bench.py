"""`generate --ray` against one process: rows per second, Ray's fixed start-up cost, equal output.

Runs the real CLI twice in fresh processes on the same Spec-Bench prompts (prompt =
``turns[0]``): once in one process with ``--threads T``, once with ``--ray --ray-workers W
--threads T`` on a new local Ray. Each run writes ``--log-json``; the timings come from it:

- ``ray_start_s``: connecting to / starting Ray (the ``ray`` event);
- ``pool_ready_s``: from the job's start to the first finished block, less that block's
  own engine time: the actors' start (a process, imports, loading the models);
- ``job_s``: the job's elapsed time (``finish`` event), the pool's start included;
- rows/s end to end = rows / (ray_start_s + job_s); steady = rows / (job_s - pool_ready_s).

Prints a table, then one JSON line. The machine's load is part of every number: run it on
a quiet machine, or report that it was shared.

    python benchmarks/ray_bench.py --prompts 64 --max-new-tokens 64 --mode ar --workers 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench_questions.jsonl"


def write_prompts(path: Path, source: Path, n: int) -> None:
    rows = [json.loads(line) for line in source.read_text().splitlines()[:n]]
    path.write_text("".join(json.dumps({"id": str(r["question_id"]), "prompt": r["turns"][0]}) + "\n"
                            for r in rows))


def run(inp: Path, out: Path, flags: list[str]) -> tuple[float, list[dict]]:
    log = out.with_suffix(".log.jsonl")
    command = [sys.executable, "-c", "from batchspec_cli.cli import app; app()", "generate", str(inp), str(out),
               "--quiet", "--overwrite", "--log-json", str(log), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": flags[flags.index("--threads") + 1]}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 3):
        raise SystemExit(f"generate failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return wall, [json.loads(line) for line in log.read_text().splitlines()]


def timings(events: list[dict]) -> dict:
    by = {e["event"]: e for e in events}
    start = _t(by["start"])
    blocks = [e for e in events if e["event"] == "block_done"]
    pool_ready = (_t(blocks[0]) - start - blocks[0]["seconds"]) if blocks else 0.0
    return {"ray_start_s": by["ray"]["startup_s"] if "ray" in by else 0.0, "job_s": by["finish"]["elapsed_s"],
            "pool_ready_s": pool_ready, "rows": by["finish"]["rows"], "tokens": by["finish"]["completion_tokens"],
            "blocks": len(blocks), "workers_seen": len({b["worker"] for b in blocks})}


def _t(event: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(event["time"]).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mode", default="ar")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", type=Path, default=SPEC_BENCH)
    parser.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inp = tmp / "prompts.jsonl"
        write_prompts(inp, args.data, args.prompts)
        flags = ["--mode", args.mode, "--max-new-tokens", str(args.max_new_tokens), "--batch-size",
                 str(args.batch_size), "--threads", str(args.threads)]
        if args.target:
            flags += ["--target", args.target]
        results = {}
        for name, extra in (("single", []), ("ray", ["--ray", "--ray-address", "local", "--ray-workers",
                                                     str(args.workers)])):
            wall, events = run(inp, tmp / f"{name}.parquet", flags + extra)
            results[name] = {**timings(events), "wall_s": wall}
        a = pq.read_table(tmp / "single.parquet").column("completion_token_ids").to_pylist()
        b = pq.read_table(tmp / "ray.parquet").column("completion_token_ids").to_pylist()
        identical = sum(x == y for x, y in zip(a, b))

    single, ray = results["single"], results["ray"]
    rows = single["rows"]
    single_rps = rows / single["job_s"]
    ray_e2e_rps = rows / (ray["ray_start_s"] + ray["job_s"])
    ray_steady_rps = rows / max(1e-9, ray["job_s"] - ray["pool_ready_s"])
    fixed = ray["ray_start_s"] + ray["pool_ready_s"]
    print(f"{rows} Spec-Bench prompts, --mode {args.mode}, --max-new-tokens {args.max_new_tokens}, "
          f"--batch-size {args.batch_size}; {args.workers} workers x {args.threads} threads vs 1 process x "
          f"{args.threads} threads")
    print(f"{'run':<8}{'job s':>9}{'ray start s':>13}{'pool ready s':>14}{'rows/s e2e':>12}{'rows/s steady':>15}"
          f"{'process wall s':>16}")
    print(f"{'single':<8}{single['job_s']:>9.1f}{'-':>13}{'-':>14}{single_rps:>12.3f}{single_rps:>15.3f}"
          f"{single['wall_s']:>16.1f}")
    print(f"{'ray':<8}{ray['job_s']:>9.1f}{ray['ray_start_s']:>13.1f}{ray['pool_ready_s']:>14.1f}"
          f"{ray_e2e_rps:>12.3f}{ray_steady_rps:>15.3f}{ray['wall_s']:>16.1f}")
    print(f"speed-up: {ray_e2e_rps / single_rps:.2f}x end to end, {ray_steady_rps / single_rps:.2f}x steady; "
          f"fixed start-up {fixed:.1f} s ({fixed / rows:.3f} s per row of this job); identical rows "
          f"{identical}/{rows}")
    print(json.dumps({"bench": "ray", "rows": rows, "mode": args.mode, "max_new_tokens": args.max_new_tokens,
                      "batch_size": args.batch_size, "workers": args.workers, "threads": args.threads,
                      "single": single, "ray": ray, "single_rows_per_s": round(single_rps, 4),
                      "ray_rows_per_s_end_to_end": round(ray_e2e_rps, 4),
                      "ray_rows_per_s_steady": round(ray_steady_rps, 4),
                      "speedup_end_to_end": round(ray_e2e_rps / single_rps, 3),
                      "speedup_steady": round(ray_steady_rps / single_rps, 3), "fixed_startup_s": round(fixed, 2),
                      "identical_rows": identical}))


if __name__ == "__main__":
    main()
