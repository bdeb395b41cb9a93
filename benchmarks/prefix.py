"""A few-shot job whose rows share a long prompt prefix, against the same job with unique prefixes, as whole commands.

    python benchmarks/prefix.py                       # 2 pairs, then `batchspec verify` on the shared job
    python benchmarks/prefix.py --pairs 3 --no-verify

The job (built here, with its own text): 24 support tickets, each a chat whose system message
is the same instruction with worked examples (~1,600 tokens on SmolLM2's tokenizer), then about
32 tokens of the ticket itself; 32 new tokens, the default mode, batch 8, ``--threads 1``. The
*unique* job is the same rows with the shared part made unique per row: one different word at
the start of each row's system message, so no two rows share a prefix and nothing can be reused.

Each run is one ``batchspec generate`` process (start-up, model loading and the finish included);
shared and unique alternate, A B A B, so that a drift in the machine's speed falls on both. Per
process: wall seconds, user + system CPU seconds and peak resident memory (``wait4``). Checked:
every shared run writes the same rows; the statistics file's reuse share; and, unless
``--no-verify``, ``batchspec verify`` re-decodes every row of the shared job one at a time with
plain decoding (its per-prompt reference: exact or a near-tie, nothing unexplained). The unique
job's rows are other prompts, so they are not compared with the shared job's. A table for people,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from scale import whole_process  # noqa: E402

CATEGORIES = ["billing", "login", "shipping", "refund", "bug", "feature request"]
PRODUCTS = ["the mobile app", "the web dashboard", "the desktop client", "the API", "the checkout page",
            "the invoice export", "the team workspace"]
PROBLEMS = {
    "billing": ["I was charged twice for my subscription this month", "my invoice shows the wrong VAT number",
                "the annual plan price changed without notice", "my card was declined but the money left my account",
                "I cannot find where to update the billing address"],
    "login": ["the password reset email never arrives", "two-factor codes are rejected as expired",
              "I get logged out every few minutes", "single sign-on sends me back to the start page",
              "my account is locked after one failed attempt"],
    "shipping": ["the parcel has shown 'in transit' for twelve days", "the courier left my order at the wrong address",
                 "the tracking number does not exist", "only half of my order arrived",
                 "the box arrived crushed and the item is broken"],
    "refund": ["I returned the item three weeks ago and have no refund yet", "the refund went to an expired card",
               "I was refunded less than I paid", "the refund form rejects my order number",
               "I cancelled within the trial and was still charged"],
    "bug": ["exports to CSV cut off after a thousand rows", "the search box freezes when I type an accent",
            "charts show yesterday's data twice", "uploading a PDF larger than 5 MB fails silently",
            "dark mode makes the table headers invisible"],
    "feature request": ["please let us schedule reports weekly", "we would like an audit log of admin changes",
                        "could the calendar sync with Outlook", "add keyboard shortcuts to the editor",
                        "allow more than five members on the basic plan"],
}
PRIORITY = {"billing": "high", "login": "high", "shipping": "medium", "refund": "medium", "bug": "high",
            "feature request": "low"}
NAMES = ["Ana", "Bruno", "Chen", "Dalia", "Emeka", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara"]
UNIQUE_WORDS = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India", "Juliet", "Kilo",
                "Lima", "Mike", "November", "Oscar", "Papa", "Quebec", "Romeo", "Sierra", "Tango", "Uniform",
                "Victor", "Whiskey", "Xray"]


def ticket(i: int) -> tuple[str, str]:
    """(category, ticket text) number i, deterministic."""
    category = CATEGORIES[i % len(CATEGORIES)]
    problems = PROBLEMS[category]
    return category, (f"From {NAMES[i % len(NAMES)]}: about {PRODUCTS[(3 * i + 1) % len(PRODUCTS)]}, "
                      f"{problems[(i // len(CATEGORIES)) % len(problems)]}. Order {40117 + 37 * i}.")


def instruction(examples: int = 26) -> str:
    """The shared system message: the task, the rules and ``examples`` worked examples."""
    rules = (
        "You are the triage assistant of a software company's support desk. Every message you receive is one "
        "customer ticket. Read it carefully and answer with exactly three lines and nothing else:\n"
        "Category: one of billing, login, shipping, refund, bug, feature request.\n"
        "Priority: high, medium or low. Money taken wrongly, an account the customer cannot enter and a product "
        "that loses or corrupts data are high. Late or damaged deliveries and pending refunds are medium. Wishes "
        "and ideas are low.\n"
        "Reply: one short, polite sentence to the customer that names the next step.\n"
        "Do not invent order numbers, amounts or dates. Do not promise a refund before the billing team has "
        "checked the order. If a ticket mentions two problems, classify it by the one that costs the customer "
        "more. Address the customer by name when the ticket gives one.\n\nWorked examples:\n")
    shots = []
    for i in range(examples):
        category, text = ticket(100 + i)
        name = NAMES[(100 + i) % len(NAMES)]
        shots.append(f"Ticket: {text}\nCategory: {category}\nPriority: {PRIORITY[category]}\n"
                     f"Reply: Thanks, {name}; our {category} team will answer today.\n")
    return rules + "\n".join(shots) + "\nNow the ticket."


def jobs(rows: int) -> tuple[list[dict], list[dict]]:
    """(shared job, unique job): chat rows with the same instruction, or the instruction made unique per row."""
    system = instruction()
    shared, unique = [], []
    for i in range(rows):
        _, text = ticket(i)
        shared.append({"id": f"t{i}", "prompt": [{"role": "system", "content": system},
                                                 {"role": "user", "content": text}]})
        unique.append({"id": f"t{i}", "prompt": [{"role": "system", "content": f"{UNIQUE_WORDS[i]} {system}"},
                                                 {"role": "user", "content": text}]})
    return shared, unique


def run(inp: Path, out: Path, args) -> dict:
    """One whole `generate` process: wall and CPU seconds, peak memory, completions and reuse share."""
    command = [sys.executable, "-m", "batchspec_cli", "generate", str(inp), str(out), "--batch-size",
               str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
               "--quiet", "--overwrite", "--restart"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    code, wall, usage, stderr = whole_process(command, env)
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed: {stderr[-2000:]}")
    import pyarrow.parquet as pq

    table = pq.read_table(out, columns=["completion_token_ids", "prompt_tokens"])
    stats = pq.read_table(out.with_name(out.stem + ".stats.parquet"))
    reused = sum(stats.column("prompt_reused").to_pylist()) if "prompt_reused" in stats.column_names else 0
    prefilled = sum(stats.column("prompt_prefilled").to_pylist()) if "prompt_prefilled" in stats.column_names else 0
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1024,
            "tokens": table.column("completion_token_ids").to_pylist(),
            "prompt_tokens": table.column("prompt_tokens").to_pylist(),
            "reuse_share": reused / (reused + prefilled) if reused + prefilled else 0.0}


def verify(out: Path, threads: int) -> str:
    """`batchspec verify` on every row: its one-line verdict (exit 1: an unexplained mismatch)."""
    command = [sys.executable, "-m", "batchspec_cli", "verify", str(out), "--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    line = done.stdout.strip().splitlines()[0] if done.stdout.strip() else done.stderr.strip()[-500:]
    return f"{line} (exit {done.returncode})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="shared/unique pairs")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-verify", action="store_true", help="skip `batchspec verify` of the shared job")
    parser.add_argument("--keep", type=Path, help="write the two jobs' inputs and outputs here")
    args = parser.parse_args()
    shared, unique = jobs(args.rows)
    with tempfile.TemporaryDirectory(prefix="batchspec-prefix-") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        runs = {"shared": [], "unique": []}
        for name, rows in (("shared", shared), ("unique", unique)):
            (where / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for _ in range(args.pairs):
            for name in ("shared", "unique"):
                result = run(where / f"{name}.jsonl", where / f"{name}.parquet", args)
                runs[name].append(result)
                print(f"  {name}: {result['wall_s']:.1f} s wall, {result['cpu_s']:.1f} s CPU, "
                      f"{result['peak_mb']:.0f} MB peak, reuse {100 * result['reuse_share']:.1f} %", flush=True)
        same = all(r["tokens"] == runs["shared"][0]["tokens"] for r in runs["shared"])
        verdict = "not run" if args.no_verify else verify(where / "shared.parquet", args.threads)
        prompt = runs["shared"][0]["prompt_tokens"]
    pairs = list(zip(runs["shared"], runs["unique"]))
    median = lambda key, name: statistics.median(r[key] for r in runs[name])  # noqa: E731
    ratio = {key: statistics.median(u[key] / s[key] for s, u in pairs) for key in ("cpu_s", "wall_s")}
    print(f"\n{args.rows} rows, prompts {min(prompt)}-{max(prompt)} tokens, {args.max_new_tokens} new tokens, "
          f"batch {args.batch_size}, default mode, --threads {args.threads}; median of {args.pairs} pairs")
    print(f"{'job':>8} {'CPU s':>8} {'wall s':>8} {'peak MB':>8} {'reuse':>7}")
    for name in runs:
        print(f"{name:>8} {median('cpu_s', name):>8.1f} {median('wall_s', name):>8.1f} "
              f"{max(r['peak_mb'] for r in runs[name]):>8.0f} {100 * median('reuse_share', name):>6.1f}%")
    print(f"unique / shared: CPU {ratio['cpu_s']:.2f}x, wall {ratio['wall_s']:.2f}x; shared runs equal to each "
          f"other: {same}; shared rows against per-prompt decoding (batchspec verify): {verdict}")
    print(json.dumps({"benchmark": "prefix", "rows": args.rows, "max_new_tokens": args.max_new_tokens,
                      "batch_size": args.batch_size, "threads": args.threads, "pairs": args.pairs,
                      "prompt_tokens": [min(prompt), max(prompt)],
                      "cpu_s": {n: median("cpu_s", n) for n in runs}, "wall_s": {n: median("wall_s", n) for n in runs},
                      "peak_mb": {n: round(max(r["peak_mb"] for r in runs[n])) for n in runs},
                      "reuse_share": {n: median("reuse_share", n) for n in runs}, "ratio": ratio,
                      "shared_runs_equal": same, "verify": verdict}))


if __name__ == "__main__":
    main()
