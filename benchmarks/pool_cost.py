"""Where the pooled engine's time goes when it does not speculate: ``ar`` against ``pool0`` side by side.

    python benchmarks/pool_cost.py --batch-sizes 8 16 --prompts 16 --max-new-tokens 64 --threads 1

``pool0`` is the pooled engine (``auto``'s pool, grouping and admission) with no drafter, so every
round is a plain step. Both run the same bucketed Spec-Bench prompts in one process (ar, pool0,
pool0, ar) and must give the same tokens. The engine's pieces are timed by wrapping them on the
instance's classes for the run: KV buffer allocation (``_allocate``) and growth (``_resize``, inside forwards
and moves), realignment moves, group selection and planning, prefills, and the target's forwards
(prefills and growth inside them included); "other" is the wall time outside forwards, moves and
grouping (commit, bookkeeping, Python). Peak KV buffer bytes are read from the caches after the run.
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
from batchspec_cli import align, grouping, models, pool  # noqa: E402
from batchspec_cli.engine import Engine, EngineConfig, ModelHandle  # noqa: E402
from batchspec_cli.events import StepStats  # noqa: E402
from batchspec_cli.io import render_prompt  # noqa: E402

TIMED = [(align.SlotCache, "_resize"), (align.SlotCache, "_allocate"), (pool, "realign"),
         (grouping.Pool, "select"), (grouping.StaticBatch, "select"), (grouping.Pool, "plan"),
         (grouping.StaticBatch, "plan"), (Engine, "_prefill")]


def timed_run(target, eos, reqs, mode: str, batch: int, window: int | None = None) -> dict:
    spent = defaultdict(float)
    originals = []
    for owner, name in TIMED:
        real = getattr(owner, name)
        originals.append((owner, name, real))

        def wrapper(*a, _real=real, _name=name, **kw):
            began = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                spent[_name] += time.perf_counter() - began
        setattr(owner, name, wrapper)
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
    try:
        started = time.perf_counter()
        tokens, steps, rounds = {}, 0, 0
        for event in engine.run(reqs):
            if isinstance(event, StepStats):
                steps += 1
                rounds += event.group_kind != "prefill"
            else:
                tokens[event.row] = event.token_ids
        wall = time.perf_counter() - started
    finally:
        for owner, name, real in originals:
            setattr(owner, name, real)
        del target.model.forward
    caches = [c for c in _caches(engine) if c is not None]
    kv_bytes = sum(t.numel() * t.element_size() for c in caches for t in c.keys + c.values)
    return {"wall_s": wall, "tokens": tokens, "rounds": rounds, "kv_bytes": kv_bytes, **dict(spent)}


def _caches(engine):
    pool = getattr(engine, "pool", None)
    if pool is not None:
        return [pool.target, pool.draft]
    return [engine.tcache, getattr(engine, "dcache", None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--window-factor", type=float, default=None, help="pool0's window in batches (default: the engine's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tgt = models.load_model(None, "auto", "auto", quiet=True)
    target = ModelHandle(tgt.model, models.cache_kwarg(tgt.model))
    eos = models.eos_ids(tgt.model, tgt.tokenizer)
    prompt_ids = [render_prompt(tgt.tokenizer, p, True, None) for p in spec_bench_prompts(SPEC_BENCH, args.prompts)]
    reqs = requests(prompt_ids, args.max_new_tokens)
    timed_run(target, eos, reqs[:2], "pool0", 2)  # warm-up
    keys = ["forward", "_allocate", "_resize", "realign", "select", "plan", "_prefill"]
    print(f"{'run':8} {'batch':>5} {'wall s':>7} {'rounds':>6} {'KV MB':>7} " + " ".join(f"{k:>9}" for k in keys)
          + f" {'other':>7}")
    out = []
    for batch in args.batch_sizes:
        runs = defaultdict(list)
        for mode in ("ar", "pool0", "pool0", "ar"):
            window = max(1, round(args.window_factor * batch)) if args.window_factor else None
            runs[mode].append(timed_run(target, eos, reqs, mode, batch, window))
        ref = runs["ar"][0]["tokens"]
        for mode, rs in runs.items():
            assert all(r["tokens"] == ref for r in rs), f"batch {batch}: {mode} differs from ar"
            row = {"mode": mode, "batch": batch, **{k: sum(r.get(k, 0.0) for r in rs) / len(rs)
                                                   for k in ["wall_s", "rounds", "kv_bytes"] + keys}}
            row["other"] = row["wall_s"] - row["forward"] - row["realign"] - row["select"] - row["plan"]
            out.append(row)
            print(f"{mode:8} {batch:>5} {row['wall_s']:>7.2f} {row['rounds']:>6.0f} {row['kv_bytes'] / 2**20:>7.1f} "
                  + " ".join(f"{row[k]:>9.2f}" for k in keys) + f" {row['other']:>7.2f}", flush=True)
        print(f"pool0 / ar at batch {batch}: {runs['ar'][0]['wall_s'] / runs['pool0'][0]['wall_s']:.3f}, "
              f"{runs['ar'][1]['wall_s'] / runs['pool0'][1]['wall_s']:.3f} (throughput ratio, both halves)", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
