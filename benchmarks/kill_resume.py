"""A large job SIGKILLed three times (the third time while it writes OUT), then rerun: every row exactly once, in
input order, equal to an uninterrupted run of the same job.

Uses ``scale.py``'s tiny random Llama (the real tokenizer) and prompts, and the real CLI in subprocesses
(``--mode ar --batch-size 32 --max-new-tokens 8 --threads 1``). The first two kills land when about a third and
two thirds of the rows are saved (counted from the checkpoint parts' names), the third once the finish has begun
writing (``job.json`` says ``finishing`` and OUT's temporary file or ``merge/`` exists). Prints one JSON line.

    python benchmarks/kill_resume.py --rows 100000
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402

from batchspec_cli.config import DEFAULT  # noqa: E402
from batchspec_cli.job.generation import work_dir_for  # noqa: E402

CHECKPOINT_ROWS = DEFAULT.checkpoint_rows  # the default --checkpoint-rows: a part holds at most this many rows


def command(inp: Path, out: Path, model: Path) -> list[str]:
    return [sys.executable, "-m", "batchspec_cli", "generate", str(inp), str(out), "--target", str(model), "--quiet",
            "--mode", "ar", "--batch-size", "32", "--max-new-tokens", "8", "--threads", "1"]


def parts(out: Path) -> int:
    directory = work_dir_for(out) / "parts"
    return len(list(directory.glob("part-*.rows.parquet"))) if directory.exists() else 0


def finishing(out: Path) -> bool:
    work = work_dir_for(out)
    try:
        job = json.loads((work / "job.json").read_text())
    except (OSError, ValueError):
        return False
    temps = [t for t in out.parent.glob(f".{out.name}*") if t.is_file() and t.stat().st_size > 0]
    return bool(job.get("finishing")) and (bool(temps) or any((work / "merge").glob("*")))


def run_until(cmd: list[str], ready) -> float:
    """Start the CLI and SIGKILL it once ``ready()``; returns the seconds it ran."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while not ready():
        if proc.poll() is not None:
            raise SystemExit(f"the run ended (exit {proc.returncode}) before its kill: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchspec-kills-") as tmp:
        root = Path(tmp)
        model = scale.tiny_model(root / "model")
        inp, reference, out = root / "prompts.jsonl", root / "reference.parquet", root / "out.parquet"
        scale.write_prompts(inp, args.rows)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        subprocess.run(command(inp, reference, model), env=env, check=True, stdout=subprocess.DEVNULL)
        uninterrupted = time.perf_counter() - start
        total_parts = args.rows / CHECKPOINT_ROWS
        killed = [run_until(command(inp, out, model), lambda: parts(out) >= total_parts / 3),
                  run_until(command(inp, out, model), lambda: parts(out) >= 2 * total_parts / 3),
                  run_until(command(inp, out, model), lambda: finishing(out))]
        start = time.perf_counter()
        subprocess.run(command(inp, out, model), env=env, check=True, stdout=subprocess.DEVNULL)
        rerun = time.perf_counter() - start
        got, expected = pq.read_table(out), pq.read_table(reference)
        ids = got.column("id").to_pylist()
        same = {name: got.column(name).equals(expected.column(name)) for name in
                ("id", "prompt", "completion", "completion_token_ids", "finish_reason", "prompt_tokens", "error")}
        result = {"rows": args.rows, "out_rows": got.num_rows, "every_row_once_in_order": ids == [f"r{i}" for i in
                                                                                                range(args.rows)],
                  "equal_to_uninterrupted": same, "work_dir_left": work_dir_for(out).exists(),
                  "uninterrupted_s": round(uninterrupted, 1), "killed_after_s": [round(k, 1) for k in killed],
                  "rerun_s": round(rerun, 1)}
        print(json.dumps(result))
        if not (result["every_row_once_in_order"] and all(same.values()) and not result["work_dir_left"]):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
