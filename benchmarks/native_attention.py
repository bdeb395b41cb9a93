"""batchspec's CPU kernels (models/native.py: attention; models/layers.py: the Llama layer) on a whole job, in one
process.

    python benchmarks/native_attention.py --prompts 64 --max-new-tokens 64 --batch-size 32 --threads 1
    python benchmarks/native_attention.py --arms all no-linear no-causal sdpa   # batchspec's linear, causal kernels

The same engine run (``--mode``, default ``ar``, on the embedded default model in ``--dtype``, packed linears as
``--kernels auto`` runs them) three ways: ``all`` (what ``--kernels auto`` attaches: the attention kernels and the
Llama layer), ``attention`` (the attention kernels, transformers' layer) and ``sdpa`` (neither), in palindrome order
(all, attention, sdpa, sdpa, attention, all), on the same Spec-Bench prompts; or the ``--arms`` named, among them
``no-linear`` (all but batchspec's linear kernel) and ``no-causal`` (all but its causal prefill kernel). Reports prefill and decode seconds from
the engine's step statistics, their ratios to the first arm's, and how many rows equal its (in bfloat16 a near-tie
falls either way; in float32 the kernels round otherwise than SDPA and transformers' RMSNorm, rarely enough to flip
a token). A table for people, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import SPEC_BENCH, requests, spec_bench_prompts  # noqa: E402
from batchspec_cli.models import loading as models  # noqa: E402
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle  # noqa: E402
from batchspec_cli.engine.events import StepStats  # noqa: E402
from batchspec_cli.io.prompts import render_prompt  # noqa: E402
from batchspec_cli.job.assembly import kernel_memory, tune_native, use_kernels  # noqa: E402
from batchspec_cli.models import layers, native  # noqa: E402

ARMS = ("all", "attention", "sdpa")
MORE_ARMS = ("no-linear", "no-causal")  # all but batchspec's linear kernel; all but its causal prefill kernel


def arm(loaded, name: str, memory, causal_dtypes: tuple) -> None:
    """Attach what the arm runs (batchspec's linear kernel over the sizes the job measured for it; its causal kernel
    for ``causal_dtypes``, what the build has)."""
    model = loaded.model
    built = native.load()
    built.causal_dtypes = causal_dtypes if name != "no-causal" else ()
    native.detach(model)
    if name != "sdpa":
        native.attach(model)
        tune_native(loaded, memory)
    if name == "attention":
        for layer in model.modules():
            layers.detach(layer)
    if name == "no-linear":
        native.use_native_rows(model, 0)


def run(target: ModelHandle, eos, reqs, mode: str, batch_size: int) -> dict:
    engine = Engine(target, None, eos, EngineConfig(mode=mode, k=0, batch_size=batch_size))
    tokens, prefill_ms, decode_ms, out = 0, 0.0, 0.0, {}
    began = time.perf_counter()
    for event in engine.run(reqs):
        if isinstance(event, StepStats):
            if event.group_kind == "prefill":
                prefill_ms += event.total_ms
            else:
                decode_ms += event.total_ms
        else:
            out[event.row] = event.token_ids
            tokens += len(event.token_ids)
    return {"wall_s": time.perf_counter() - began, "prefill_s": prefill_ms / 1e3, "decode_s": decode_ms / 1e3,
            "tokens": tokens, "rows": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--mode", default="ar", choices=["ar", "auto"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS + MORE_ARMS,
                        help="the first is the yardstick (default: all attention sdpa)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = models.load_model(None, args.dtype, "cpu", quiet=True)
    memory = kernel_memory(loaded)
    kernels, notes = use_kernels("auto", loaded, tuning=memory)
    built = native.load()
    if built.attend is None:
        sys.exit(f"the kernels could not be built: {built.error}")
    causal_dtypes = built.causal_dtypes
    target = ModelHandle(loaded.model, models.cache_kwarg(loaded.model))
    eos = models.eos_ids(loaded.model, loaded.tokenizer)
    ids = [render_prompt(loaded.tokenizer, p, True, None) for p in spec_bench_prompts(SPEC_BENCH, args.prompts)]
    reqs = requests(ids, args.max_new_tokens)
    run(target, eos, reqs[:2], args.mode, 2)  # warm-up
    arms = tuple(dict.fromkeys(args.arms))
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for name in arms + arms[::-1]:
        arm(loaded, name, memory, causal_dtypes)
        results[name].append(run(target, eos, reqs, args.mode, args.batch_size))
    arm(loaded, "all", memory, causal_dtypes)

    def total(name, key):
        return sum(r[key] for r in results[name])

    base, others = arms[0], arms[1:]
    first = results[base][0]["rows"]
    same = {name: sum(results[name][0]["rows"][i] == first[i] for i in first) for name in others}
    print(f"{args.prompts} Spec-Bench prompts x {args.max_new_tokens} tokens, {args.mode}, batch {args.batch_size}, "
          f"{loaded.model.dtype}, {args.threads} thread(s), kernels {kernels}, causal prefill kernel for "
          f"{', '.join(str(d).removeprefix('torch.') for d in causal_dtypes) or 'no dtype'}; palindrome, seconds "
          f"summed over 2 runs each")
    print(f"| phase | {' | '.join(f'{name} s' for name in arms)} | "
          f"{' | '.join(f'{name} / {base}' for name in others)} |\n|{'---|' * (2 * len(arms))}")
    record = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "mode": args.mode,
              "batch_size": args.batch_size, "dtype": str(loaded.model.dtype).removeprefix("torch."),
              "threads": args.threads, "causal": [str(d).removeprefix("torch.") for d in causal_dtypes],
              "rows_equal_to_first_arm": same, "rows": len(ids)}
    for key in ("prefill_s", "decode_s", "wall_s"):
        values = [total(name, key) for name in arms]
        print(f"| {key[:-2]} | {' | '.join(f'{v:.1f}' for v in values)} | "
              f"{' | '.join(f'{v / values[0]:.2f}x' for v in values[1:])} |")
        record[key] = {name: [r[key] for r in results[name]] for name in arms}
    print(f"rows equal to {base}'s: {', '.join(f'{name} {same[name]}' for name in others)} of {len(ids)}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
