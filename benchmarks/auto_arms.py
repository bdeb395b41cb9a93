"""auto against ar, and auto held in its PLAIN arm, side by side in one process (palindrome order).

    python benchmarks/auto_arms.py --prompts 16 --max-new-tokens 64 --batch-sizes 1 4 8 16 --threads 1

Per batch size: ar, auto (the default drafters: the shipped draft model + suffix) and ``auto-plain``
(auto whose arms never leave PLAIN: the pooled engine's cost without speculation) and, when asked,
``auto-spec`` (SPEC from the first round, never re-testing PLAIN) and ``auto-anytime`` (auto whose
SPEC trials ignore the work left: no trial price, no tail rule) run forward then backward over the
same Spec-Bench prompts; outputs must be identical. ``exspec`` is the fixed-k mode with the same drafters
(``-k``). ``--drafters ngram --categories summarization rag`` runs the model-free drafter alone on copy-heavy
prompts. Reports each run's tokens/s over ar's (the mean
of the two passes, and the spread: the ratio of each pass to the ar pass next to it), the time each
arm of auto ran and the rates its windows measured. One JSON line last.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench  # noqa: E402
from batchspec_cli.engine import drafters  # noqa: E402
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle  # noqa: E402
from batchspec_cli.engine.events import StepStats  # noqa: E402
from batchspec_cli.io.prompts import render_prompt  # noqa: E402
from batchspec_cli.job.assembly import use_kernels  # noqa: E402
from batchspec_cli.models import kernels, loading as models  # noqa: E402
from batchspec_cli.models.attention import use_folded_sdpa  # noqa: E402
from batchspec_cli.policy import control  # noqa: E402


class PlainOnly(control.Arms):
    def _decide(self, rate: float) -> None:
        pass


class SpecOnly(PlainOnly):
    """SPEC from the first round on, never re-testing PLAIN: what speculation alone gives."""

    def __init__(self):
        super().__init__()
        self.incumbent = self.arm = control.SPEC
        self.window = control.Window(control.SPEC)


def _use_packed(packed: bool, min_rows: int, *handles) -> None:
    for handle in handles:
        if packed:
            kernels.prepack(handle.model, min_rows)
        else:
            kernels.unpack(handle.model)


def run(target, draft, eos, reqs, name: str, batch: int, k: int, min_rows: int = kernels.DEFAULT_MIN_ROWS,
        drafter_names: tuple[str, ...] = ("model", "suffix")):
    """One run. A name ending in ``+packed`` or ``+stock`` runs on those kernels (the models are switched for the
    run and back after it); a bare name on the kernels ``setup`` chose."""
    name, _, variant = name.partition("+")
    if variant not in ("", "packed", "stock"):
        raise SystemExit(f"unknown run variant {variant!r} (known: packed, stock)")
    was_packed = kernels.packed_layers(target.model) > 0
    if variant and (variant == "packed") != was_packed:
        _use_packed(variant == "packed", min_rows, target, draft)
        try:
            return run(target, draft, eos, reqs, name, batch, k, min_rows, drafter_names)
        finally:
            _use_packed(was_packed, min_rows, target, draft)
    policy = None
    if name in ("auto-plain", "auto-spec", "auto-anytime"):
        policy = control.Auto(k)
        policy.arms = {"auto-plain": PlainOnly, "auto-spec": SpecOnly,
                       "auto-anytime": lambda: control.Arms(share=None)}[name]()
    mode = name if name in ("ar", "exspec") else "auto"
    engine = Engine(target, None if name == "ar" or "model" not in drafter_names else draft, eos,
                    EngineConfig(mode=mode, k=k, batch_size=batch, window=4 * batch),
                    lookups=[] if name == "ar" else drafters.make(list(drafter_names)), policy=policy)
    results, stats = {}, []
    started = time.perf_counter()
    for event in engine.run(reqs):
        if isinstance(event, StepStats):
            stats.append(event)
        else:
            results[event.row] = event.token_ids
    return time.perf_counter() - started, results, stats


def setup(prompts: int, max_new_tokens: int, threads: int, runs: list[str], k: int,
          min_rows: int = kernels.DEFAULT_MIN_ROWS, kernel_choice: str = "auto", categories: list[str] | None = None,
          drafter_names: tuple[str, ...] = ("model", "suffix")):
    """The default target and shipped draft (folded attention, ``--kernels kernel_choice``), their EOS ids and
    ``prompts`` Spec-Bench requests; every run in ``runs`` warmed up once. Returns (target, draft, eos, requests)."""
    torch.set_num_threads(threads)
    tgt = models.load_model(None, "auto", "auto", quiet=True)
    drf = models.load_draft(str(models.default_draft_path()), tgt, "auto", "auto", quiet=True)
    use_kernels(kernel_choice, tgt, drf)
    target = ModelHandle(tgt.model, models.cache_kwarg(tgt.model))
    draft = ModelHandle(drf.model, models.cache_kwarg(drf.model))
    for handle in (target, draft):
        use_folded_sdpa(handle.model)
    eos = models.eos_ids(tgt.model, tgt.tokenizer)
    picked = [p for group, p in bench.spec_bench_groups(bench.SPEC_BENCH, prompts * 6)
              if not categories or group in categories][:prompts]
    texts = [render_prompt(tgt.tokenizer, p, True, None) for p in picked]
    reqs = bench.requests(texts, max_new_tokens)
    warm = [r.__class__(**{**r.__dict__, "max_new_tokens": 8}) for r in reqs[:2]]
    for name in runs:
        run(target, draft, eos, warm, name, 2, k, min_rows, drafter_names)
    return target, draft, eos, reqs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--runs", nargs="+", default=["ar", "auto", "auto-plain"])
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--drafters", nargs="+", default=["model", "suffix"],
                        help="auto's drafters (model: the shipped draft; ngram, suffix: model-free); the CLI's default"
                             " is model and suffix")
    parser.add_argument("--categories", nargs="+", help="take the prompts from these Spec-Bench groups only (e.g."
                        " summarization rag: copy-heavy)")
    parser.add_argument("--kernels", choices=["auto", "stock", "packed"], default="auto",
                        help="the kernels of runs without a +packed / +stock suffix (the CLI's --kernels)")
    parser.add_argument("--min-rows", type=int, default=kernels.DEFAULT_MIN_ROWS,
                        help="runs named NAME+packed: rows from which the oneDNN kernels run")
    args = parser.parse_args()
    names = tuple(args.drafters)
    target, draft, eos, reqs = setup(args.prompts, args.max_new_tokens, args.threads, args.runs, args.k,
                                     args.min_rows, args.kernels, args.categories, names)
    out = []
    for batch in args.batch_sizes:
        order = args.runs + args.runs[::-1]
        times: dict[str, list[float]] = {name: [] for name in args.runs}
        outputs, arms = {}, {}
        for name in order:
            seconds, results, stats = run(target, draft, eos, reqs, name, batch, args.k, args.min_rows, names)
            times[name].append(seconds)
            # Runs on the same kernels must agree exactly in float32; stock against packed differ by float32
            # rounding, and in bfloat16 a verify of k + 1 tokens rounds otherwise than a one-token step (a near-tie
            # falls either way: `batchspec verify` audits those), so there only the rows that differ are reported.
            same = next(n for n in args.runs if n.partition("+")[2] == name.partition("+")[2])
            if outputs.setdefault(name, results) != results or results != outputs.setdefault(same, results):
                if target.model.dtype in (torch.float32, torch.float64):
                    sys.exit(f"batch {batch}: {name} differs from {same}")
            if "auto" in name:
                ran = {}
                for s in stats:
                    if s.trace.arm:
                        ran.setdefault(s.trace.arm, [0.0, 0, []])
                        ran[s.trace.arm][0] += s.total_ms / 1e3
                        ran[s.trace.arm][1] += 1
                        if s.trace.window_tokens_per_s:
                            ran[s.trace.arm][2].append(round(s.trace.window_tokens_per_s, 1))
                arms.setdefault(name, []).append(ran)
        tokens = sum(len(t) for t in outputs[args.runs[0]].values())
        row = {"batch": batch, "tokens": tokens}
        base = outputs[args.runs[0]]
        differ = {n: sum(base[r] != o[r] for r in base) for n, o in outputs.items() if o is not base}
        if any(differ.values()):
            row["rows_differing_from_" + args.runs[0]] = differ
            print(f"batch {batch:2}: rows differing from {args.runs[0]} (other kernels, or bfloat16 near-ties): {differ}", flush=True)
        for name in args.runs:
            passes = [ar / mine for ar, mine in zip(times["ar"], times[name])]
            row[name] = {"seconds": times[name], "ratio_vs_ar": statistics.mean(passes), "passes": passes}
        row["arms"] = arms
        out.append(row)
        cells = [f"{n} {row[n]['ratio_vs_ar']:.3f}x ({' / '.join(f'{p:.3f}' for p in row[n]['passes'])})"
                 for n in args.runs if n != "ar"]
        print(f"batch {batch:2}: " + "  ".join(cells), flush=True)
        for name, passes in arms.items():
            for i, ran in enumerate(passes):
                print(f"          {name} pass {i + 1}: " + "; ".join(
                    f"{arm} {v[0]:.1f} s in {v[1]} rounds, windows {v[2]} tok/s" for arm, v in ran.items()), flush=True)
    print(json.dumps({"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                      "rows": out}))


if __name__ == "__main__":
    main()
