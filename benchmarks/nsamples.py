"""`--n 4` against four copies of each row, as whole commands, as a user runs them.

    python benchmarks/nsamples.py                               # 6 rows x ~600 prompt tokens, 32 new, 2 pairs
    python benchmarks/nsamples.py --rows 8 --pairs 3 --max-new-tokens 64 --words 300

Both jobs write four sampled completions (temperature 0.8) of each of ``--rows`` prompts with the
embedded default model, default mode and batch size, ``--threads 1``: the *n job* reads the rows once
with ``--n 4``; the *copies job* reads each row four times (the first copy keeps the row's id, the
others get ids of their own), as a user without ``--n`` would. The prompts are this script's own
text: a few-shot style instruction per row, distinct from row to row, so that nothing but the
samples of one row shares a prompt. Each run is one ``batchspec generate`` process (start-up, model
loading, the finish included), n and copies alternating, A B A B ..., so that a drift in the
machine's speed falls on both; per process the operating system's accounting (``wait4``) gives
wall and CPU seconds and peak memory. Checked: sample 0 of each row equals the first copy (the
same id, seed and prompt: the row ``--n 1`` writes), and the n job's statistics show every prompt
prefilled once. Reported: the median over the pairs of copies' time / n's time (above 1: --n is
faster), min-max in brackets. A table for people, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from scale import whole_process  # noqa: E402

N = 4
SUBJECTS = ["a lighthouse keeper", "a tired courier", "an old violin", "a city at dawn", "a lost umbrella",
            "a garden in winter", "a train station", "a paper boat", "a bakery at night", "a mountain road"]
WORDS = ("river stone lantern window quiet morning letter harbor candle orchard meadow thunder silver pocket "
         "compass ribbon chimney lantern feather anchor whistle blanket kettle mirror ladder basket").split()


def prompts(rows: int, words: int, seed: int = 0) -> list[list[dict]]:
    """``rows`` chat prompts, each an instruction with its own worked examples (~``words`` words), then a task."""
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        examples = []
        while sum(len(e.split()) for e in examples) < words:
            subject = rng.choice(SUBJECTS)
            examples.append(f"Subject: {subject}. Story: " + " ".join(rng.choice(WORDS) for _ in range(40)) + ".")
        system = (f"Guide {i}: you write very short stories. Keep to one paragraph, plain words, no title. "
                  f"Examples follow.\n" + "\n".join(examples))
        out.append([{"role": "system", "content": system},
                    {"role": "user", "content": f"Subject: {SUBJECTS[i % len(SUBJECTS)]} and row {i}. Story:"}])
    return out


def run(inp: Path, out: Path, extra: list[str], max_new: int) -> dict:
    command = [sys.executable, "-m", "batchspec_cli", "generate", str(inp), str(out), "--temperature", "0.8",
               "--seed", "1", "--max-new-tokens", str(max_new), "--threads", "1", "--quiet", "--overwrite",
               "--restart", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    code, wall, usage, stderr = whole_process(command, env)
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed: {stderr[-2000:]}")
    import pyarrow.parquet as pq

    table = pq.read_table(out, columns=["id", "completion_token_ids", "prompt_tokens"])
    stats = pq.read_table(out.with_name(out.stem + ".stats.parquet")).to_pylist()
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1024,
            "rows": list(zip(table.column("id").to_pylist(), table.column("completion_token_ids").to_pylist())),
            "prompt_tokens": sum(table.column("prompt_tokens").to_pylist()),
            "prefilled": sum(s.get("prompt_prefilled") or 0 for s in stats),
            "reused": sum(s.get("prompt_reused") or 0 for s in stats)}


def summary(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--words", type=int, default=400, help="words of worked examples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    chats = prompts(args.rows, args.words)
    with tempfile.TemporaryDirectory(prefix="batchspec-nsamples-") as tmp:
        tmp = Path(tmp)
        rows_in, copies_in = tmp / "rows.jsonl", tmp / "copies.jsonl"
        rows_in.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(chats)))
        copies_in.write_text("".join(json.dumps({"id": f"r{i}" if c == 0 else f"r{i}-copy{c}", "prompt": p}) + "\n"
                                     for i, p in enumerate(chats) for c in range(N)))
        runs = {"n": [], "copies": []}
        for _ in range(args.pairs):
            for name in ("n", "copies"):
                inp, extra = (rows_in, ["--n", str(N)]) if name == "n" else (copies_in, [])
                runs[name].append(run(inp, tmp / f"{name}.parquet", extra, args.max_new_tokens))
                print(f"  {name}: {runs[name][-1]['wall_s']:.1f} s wall, {runs[name][-1]['cpu_s']:.1f} s CPU",
                      flush=True)
    n_rows, copy_rows = runs["n"][0]["rows"], runs["copies"][0]["rows"]
    if any(r["rows"] != n_rows for r in runs["n"]) or any(r["rows"] != copy_rows for r in runs["copies"]):
        raise SystemExit("a run's completions differ from the same job's first run")
    sample0 = [tokens for j, (_, tokens) in enumerate(n_rows) if j % N == 0]
    first_copies = [tokens for j, (_, tokens) in enumerate(copy_rows) if j % N == 0]
    if sample0 != first_copies:
        raise SystemExit("sample 0 differs from the row --n 1 writes (the first copy)")
    distinct = sum(len({tuple(n_rows[i * N + j][1]) for j in range(N)}) for i in range(args.rows))
    pairs = list(zip(runs["n"], runs["copies"]))
    result = {"benchmark": "nsamples", "rows": args.rows, "n": N, "max_new_tokens": args.max_new_tokens,
              "prompt_tokens_per_row": runs["n"][0]["prompt_tokens"] / (N * args.rows), "pairs": len(pairs),
              "cpu": summary([c["cpu_s"] / n["cpu_s"] for n, c in pairs]),
              "wall": summary([c["wall_s"] / n["wall_s"] for n, c in pairs]),
              "cpu_s": {k: statistics.median(r["cpu_s"] for r in v) for k, v in runs.items()},
              "peak_mb": {k: round(max(r["peak_mb"] for r in v)) for k, v in runs.items()},
              "prefilled": {k: v[0]["prefilled"] for k, v in runs.items()},
              "reused": {k: v[0]["reused"] for k, v in runs.items()},
              "sample0_equal": True, "distinct_samples": distinct}
    cpu, wall = result["cpu"], result["wall"]
    print(f"\n{args.rows} rows x {N} samples (~{result['prompt_tokens_per_row']:.0f} prompt tokens a row), "
          f"{args.max_new_tokens} new tokens, T 0.8, default mode, --threads 1; copies' time / --n's (above 1: --n "
          f"faster), median of {len(pairs)} pairs (min-max)")
    print(f"{'':>8} {'CPU s':>8} {'peak MB':>8} {'prefilled':>10} {'reused':>8}")
    for name in ("copies", "n"):
        print(f"{name:>8} {result['cpu_s'][name]:>8.1f} {result['peak_mb'][name]:>8} "
              f"{result['prefilled'][name]:>10} {result['reused'][name]:>8}")
    print(f"ratio: CPU {cpu['median']:.2f}x ({cpu['min']:.2f}-{cpu['max']:.2f}), wall {wall['median']:.2f}x "
          f"({wall['min']:.2f}-{wall['max']:.2f}); sample 0 = the --n 1 row: yes; distinct samples "
          f"{distinct} of {N * args.rows}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
