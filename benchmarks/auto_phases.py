"""Where a job's time goes, per engine phase and auto arm: ar and auto side by side in one process.

    python benchmarks/auto_phases.py --prompts 16 --batch-size 8 --max-new-tokens 64 --threads 1

Runs the given engines forward then backward (palindrome) over the same Spec-Bench prompts
and, for each run, sums its step statistics: prefill, rounds per arm and per k = 0 / k > 0
(seconds / rounds / tokens), realignment per arm, gathers and draft time, and the KV growths
(``SlotCache._resize``, timed for the run: they happen inside prefills and rounds, so they are
part of those figures, not beside them). The rows are the wall time of the whole run; what the
steps do not cover is printed as "outside".
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import auto_arms  # noqa: E402
from batchspec_cli.engine.align import SlotCache  # noqa: E402


@contextlib.contextmanager
def timed_growths():
    """[seconds, count] of the KV buffers' growths while the block runs (the method is wrapped, then restored)."""
    real, spent = SlotCache._resize, [0.0, 0]

    def resize(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - began
            spent[1] += 1
    SlotCache._resize = resize
    try:
        yield spent
    finally:
        SlotCache._resize = real


def phases(stats) -> dict[str, list]:
    """name -> [seconds, rounds, tokens] summed over a run's steps."""
    out = collections.defaultdict(lambda: [0.0, 0, 0])

    def add(name: str, seconds: float, tokens: int = 0) -> None:
        out[name][0] += seconds
        out[name][1] += 1
        out[name][2] += tokens

    for s in stats:
        if s.group_kind == "prefill":
            add("prefill", s.total_ms / 1e3)
            continue
        add(f"{s.trace.arm or 'ar'} k{'>0' if s.k else '=0'}", s.total_ms / 1e3, s.tokens_emitted)
        if s.realign_ms:
            add(f"realign ({s.trace.arm or 'ar'})", s.realign_ms / 1e3)
        if s.gather_ms:
            add("gather", s.gather_ms / 1e3)
        if s.k and s.draft_ms:
            add("draft", s.draft_ms / 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--runs", nargs="+", default=["ar", "auto"], help="ar, auto, auto-plain, auto-spec")
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    target, draft, eos, reqs = auto_arms.setup(args.prompts, args.max_new_tokens, args.threads, args.runs, args.k)
    print("prompt tokens:", sorted(len(r.prompt_ids) for r in reqs), flush=True)
    first = None
    for name in args.runs + args.runs[::-1]:
        with timed_growths() as growths:
            seconds, results, stats = auto_arms.run(target, draft, eos, reqs, name, args.batch_size, args.k)
        if first is not None and results != first:
            sys.exit(f"{name} differs from {args.runs[0]}")
        first = first or results
        table = phases(stats)
        inside = sum(v[0] for k, v in table.items() if k == "prefill" or " k" in k)
        cells = " ".join(f"{k} {v[0]:.1f}s/{v[1]}r/{v[2]}t" for k, v in sorted(table.items()))
        cells += f" | KV growths {growths[0]:.1f}s/{growths[1]}"
        print(f"{name:10} {seconds:6.1f} s (outside steps {seconds - inside:4.1f} s) | {cells}", flush=True)


if __name__ == "__main__":
    main()
