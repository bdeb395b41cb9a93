"""Where the pooled engine's time goes when it does not speculate: ``ar`` against ``pool0`` side by side.

    python benchmarks/pool_cost.py --batch-sizes 8 16 --prompts 16 --max-new-tokens 64 --threads 1
    python benchmarks/pool_cost.py --batch-sizes 16 --runs ar pool0 "pool0[grow]" "pool0[grow25]"

``pool0`` is the pooled engine (``auto``'s pool, grouping and admission) with no drafter, so every
round is a plain step. The runs (``--runs``, default ar and pool0) go forward then backward in one
process on the same bucketed Spec-Bench prompts and must give the same tokens; ``pool0[variant]``
runs the pool with another memory mechanism (``VARIANTS``) for comparison. Pieces of the engine
are timed by wrapping them for the run: KV buffer allocation (``_allocate``) and growth
(``_resize``, inside forwards and moves), realignment moves, group selection and planning,
prefills, and the target's forwards (prefills and growths inside them included); "other" is
the wall time outside forwards, moves and grouping (commit, bookkeeping, Python). CPU time
(``process_time``) is reported beside wall time: on a shared machine it is the steadier ratio.
KV bytes are read from the caches after the run (they never shrink: the peak).
A table for people, one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import SPEC_BENCH, requests, spec_bench_prompts  # noqa: E402
from batchspec_cli.engine import align, pool  # noqa: E402
from batchspec_cli.engine import core as engine_module  # noqa: E402
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle  # noqa: E402
from batchspec_cli.engine.events import StepStats  # noqa: E402
from batchspec_cli.io.prompts import render_prompt  # noqa: E402
from batchspec_cli.job.assembly import use_kernels  # noqa: E402
from batchspec_cli.models import loading as models  # noqa: E402
from batchspec_cli.models.attention import use_folded_sdpa  # noqa: E402
from batchspec_cli.policy import grouping  # noqa: E402

TIMED = [(align.SlotCache, "_resize"), (align.SlotCache, "_allocate"), (pool.SlotPool, "move"),
         (grouping.Pool, "select"), (grouping.StaticBatch, "select"), (grouping.Pool, "plan"),
         (grouping.StaticBatch, "plan"), (Engine, "_prefill")]


VARIANTS = {
    "reserve": "columns reserved at admission (prompt + max_new_tokens + k + 1), 1.5x growth, live slots copied",
    "grow": "no reservation: buffers grow inside forwards by 1.5x, live slots copied",
    "grow25": "no reservation, growth by 25 % (the old factor), live slots copied",
    "window4": "as shipped, but a window of 4 x batch (the pool's default with a drafter) instead of one batch",
}


def patch_variant(variant: str) -> list:
    """Monkeypatches that turn the shipped pool into a variant; returns (owner, name, original) to restore."""
    saved = [(pool.SlotPool, "reserve", pool.SlotPool.reserve), (align.SlotCache, "growth", align.SlotCache.growth)]
    if variant in ("grow", "grow25"):
        real = pool.SlotPool.reserve
        pool.SlotPool.reserve = lambda self, slots, columns, rows=0: real(self, slots, 0, rows)  # the slots only
    if variant == "grow25":
        align.SlotCache.growth = 0.25
    return saved


def timed_run(target, eos, reqs, mode: str, batch: int, window: int | None = None) -> dict:
    spent = defaultdict(float)
    counts = defaultdict(int)
    variant = mode.partition("[")[2].rstrip("]") or "reserve"
    originals = patch_variant(variant)
    for owner, name in TIMED:
        real = getattr(owner, name)
        originals.append((owner, name, real))

        def wrapper(*a, _real=real, _name=name, **kw):
            began = time.perf_counter()
            counts[_name] += 1
            try:
                return _real(*a, **kw)
            finally:
                spent[_name] += time.perf_counter() - began
        setattr(owner, name, wrapper)
    pools = []  # the run's slot pool (a run's state is its own), for its KV bytes after the run
    real_pool = engine_module.SlotPool
    engine_module.SlotPool = lambda *a, **kw: pools.append(real_pool(*a, **kw)) or pools[-1]
    originals.append((engine_module, "SlotPool", real_pool))
    forward = target.model.forward

    def timed_forward(*a, **kw):
        began = time.perf_counter()
        try:
            return forward(*a, **kw)
        finally:
            spent["forward"] += time.perf_counter() - began
    target.model.forward = timed_forward
    engine = Engine(target, None, eos, EngineConfig(mode="ar" if mode == "ar" else "auto", batch_size=batch,
                                                    window=window))
    if variant == "window4":  # what the pool does with a drafter: every row of 4 batches admitted and prefilled
        engine.strategy = grouping.Pool(4 * batch, batch, engine.cfg.min_group, engine.cfg.trim)
    try:
        started, cpu = time.perf_counter(), time.process_time()
        tokens, steps, rounds = {}, 0, 0
        for event in engine.run(reqs):
            if isinstance(event, StepStats):
                steps += 1
                rounds += event.group_kind != "prefill"
            else:
                tokens[event.row] = event.token_ids
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        for owner, name, real in originals:
            setattr(owner, name, real)
        del target.model.forward
    caches = [c for c in (pools[-1].table.target, pools[-1].table.draft) if c is not None]
    kv_bytes = sum(t.numel() * t.element_size() for c in caches for t in c.keys + c.values)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "rounds": rounds, "kv_bytes": kv_bytes,
            "resizes": counts["_resize"], **dict(spent)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--window-factor", type=float, default=None,
                        help="pool0's window in batches (default: the engine's)")
    parser.add_argument("--kernels", choices=["auto", "stock", "packed"], default="auto",
                        help="the CLI's --kernels (auto: oneDNN-prepacked linears on a CPU)")
    parser.add_argument("--runs", nargs="+", default=["ar", "pool0"],
                        help=f"ar, pool0 and pool0[variant] with variants {', '.join(VARIANTS)} (run forward, then "
                             "backward)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tgt = models.load_model(None, "auto", "auto", quiet=True)
    kernels_run, _ = use_kernels(args.kernels, tgt, None)
    use_folded_sdpa(tgt.model)  # as the engine runs it
    print("kernels:", kernels_run, flush=True)
    target = ModelHandle(tgt.model, models.cache_kwarg(tgt.model))
    eos = models.eos_ids(tgt.model, tgt.tokenizer)
    prompt_ids = [render_prompt(tgt.tokenizer, p, True, None) for p in spec_bench_prompts(SPEC_BENCH, args.prompts)]
    reqs = requests(prompt_ids, args.max_new_tokens)
    timed_run(target, eos, reqs[:2], "pool0", 2)  # warm-up
    keys = ["forward", "_prefill", "_resize", "move", "select", "plan"]
    print(f"{'run':15} {'batch':>5} {'wall s':>7} {'cpu s':>7} {'vs ar':>6} {'cpu vs ar':>9} {'rounds':>6} "
          f"{'KV MB':>7} "
          f"{'resizes':>7} " + " ".join(f"{k:>9}" for k in keys) + f" {'other':>7}")
    out = []
    for batch in args.batch_sizes:
        runs = defaultdict(list)
        for mode in args.runs + args.runs[::-1]:  # palindrome: drift cancels to first order
            window = max(1, round(args.window_factor * batch)) if args.window_factor and mode != "ar" else None
            runs[mode].append(timed_run(target, eos, reqs, mode, batch, window))
        ref = runs["ar"][0]["tokens"]
        ar = {k: sum(r[k] for r in runs["ar"]) for k in ("wall_s", "cpu_s")}
        for mode, rs in runs.items():
            assert all(r["tokens"] == ref for r in rs), f"batch {batch}: {mode} differs from ar"
            mean = ["wall_s", "cpu_s", "rounds", "kv_bytes", "resizes"] + keys
            row = {"mode": mode, "batch": batch, **{k: sum(r.get(k, 0.0) for r in rs) / len(rs) for k in mean}}
            row["other"] = row["wall_s"] - row["forward"] - row["move"] - row["select"] - row["plan"]
            row["ratio"] = ar["wall_s"] / sum(r["wall_s"] for r in rs)  # throughput over ar's, same tokens
            row["cpu_ratio"] = ar["cpu_s"] / sum(r["cpu_s"] for r in rs)
            row["ratio_runs"] = [a["wall_s"] / r["wall_s"] for a, r in zip(runs["ar"][::-1], rs)]
            out.append(row)
            print(f"{mode:15} {batch:>5} {row['wall_s']:>7.2f} {row['cpu_s']:>7.2f} {row['ratio']:>6.3f} "
                  f"{row['cpu_ratio']:>9.3f} {row['rounds']:>6.0f} {row['kv_bytes'] / 2**20:>7.1f} "
                  f"{row['resizes']:>7.0f} "
                  + " ".join(f"{row[k]:>9.2f}" for k in keys) + f" {row['other']:>7.2f}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
