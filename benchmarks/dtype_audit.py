"""Greedy rows in a dtype against per-prompt decoding in that dtype: exact rows, near-ties, and the margins in units.

    python benchmarks/dtype_audit.py                         # bfloat16, 40 Spec-Bench prompts x 48 tokens
    python benchmarks/dtype_audit.py --dtype float32 --prompts 16 --runs "ar -b 8"

Each run is a whole ``batchspec generate`` process on the embedded default model, then ``batchspec verify`` with
``--units 0 --tolerance 0`` (every difference listed, none excused) re-decodes each row alone with plain
``generate`` in the same dtype. Reported per run: rows exactly equal to the per-prompt decode, the rows that
differ, and at each first difference the reference's margin in units of the dtype at the logits' magnitude
(``verify.unit``), with the count within 1, 2, 4 and 8 units: what verify's default ``--units`` should be.
A table for people, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from bench import SPEC_BENCH, spec_bench_prompts  # noqa: E402

RUNS = ["ar -b 4", "eqspec -b 8", "auto"]  # `auto`: the default (no flags but the dtype)


def audit(inp: Path, out: Path, run: str, dtype: str, max_new: int, threads: int) -> dict:
    mode, *flags = run.split()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    base = [sys.executable, "-m", "batchspec_cli"]
    subprocess.run(base + ["generate", str(inp), str(out), "--mode", mode, *flags, "--dtype", dtype, "--max-new-tokens",
                           str(max_new), "--threads", str(threads), "--quiet", "--overwrite", "--restart"],
                   env=env, check=True)
    from batchspec_cli.verify import verify_run

    report = verify_run(out, tolerance=0.0, units=0.0)
    units = sorted(m.units for m in report.mismatches if m.units is not None)
    return {"run": run, "checked": report.checked, "exact": report.exact, "differ": len(report.mismatches),
            "units": [round(u, 2) for u in units], "no_margin": sum(m.units is None for m in report.mismatches),
            **{f"within_{n}": sum(u <= n for u in units) for n in (1, 2, 4, 8)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--runs", nargs="+", default=RUNS)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "prompts.jsonl"
        inp.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                               for i, p in enumerate(spec_bench_prompts(SPEC_BENCH, args.prompts))))
        for run in args.runs:
            rows.append(audit(inp, Path(tmp) / "out.parquet", run, args.dtype, args.max_new_tokens, args.threads))
            r = rows[-1]
            print(f"  {run}: {r['exact']}/{r['checked']} exact; margins in units {r['units']}", file=sys.stderr)
    print(f"{args.prompts} Spec-Bench chat prompts x {args.max_new_tokens} tokens, greedy, {args.dtype}, against "
          f"per-prompt plain generate in {args.dtype}")
    print(f"{'run':<14} {'exact':>7} {'differ':>7} {'<=1 u':>6} {'<=2 u':>6} {'<=4 u':>6} {'<=8 u':>6} {'largest':>8}")
    for r in rows:
        largest = f"{max(r['units']):.2f}" if r["units"] else "-"
        print(f"{r['run']:<14} {r['exact']:>3}/{r['checked']:<3} {r['differ']:>7} {r['within_1']:>6} {r['within_2']:>6} "
              f"{r['within_4']:>6} {r['within_8']:>6} {largest:>8}")
    print(json.dumps({"dtype": args.dtype, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                      "runs": rows, "command": " ".join(sys.argv)}))


if __name__ == "__main__":
    main()
