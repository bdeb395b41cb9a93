"""batchspec's CPU kernels (models/native.py: attention; models/layers.py: the Llama layer) on a whole job, in one
process.

    python benchmarks/native_attention.py --prompts 64 --max-new-tokens 64 --batch-size 32 --threads 1

The same engine run (``--mode``, default ``ar``, on the embedded default model in ``--dtype``, packed linears as
``--kernels auto`` runs them) three ways: ``all`` (what ``--kernels auto`` attaches: the attention kernels and the
Llama layer), ``attention`` (the attention kernels, transformers' layer) and ``sdpa`` (neither), in palindrome order
(all, attention, sdpa, sdpa, attention, all), on the same Spec-Bench prompts. Reports prefill and decode seconds from
the engine's step statistics, their ratios to ``all``, and how many rows equal ``all``'s (in bfloat16 a near-tie
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
from batchspec_cli.job.assembly import use_kernels  # noqa: E402
from batchspec_cli.models import layers, native  # noqa: E402

ARMS = ("all", "attention", "sdpa")


def arm(model, name: str) -> None:
    """Attach what the arm runs."""
    native.detach(model)
    if name != "sdpa":
        native.attach(model)
    if name == "attention":
        for layer in model.modules():
            layers.detach(layer)


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = models.load_model(None, args.dtype, "cpu", quiet=True)
    kernels, notes = use_kernels("auto", loaded)
    built = native.load()
    if built.attend is None:
        sys.exit(f"the kernels could not be built: {built.error}")
    target = ModelHandle(loaded.model, models.cache_kwarg(loaded.model))
    eos = models.eos_ids(loaded.model, loaded.tokenizer)
    ids = [render_prompt(loaded.tokenizer, p, True, None) for p in spec_bench_prompts(SPEC_BENCH, args.prompts)]
    reqs = requests(ids, args.max_new_tokens)
    run(target, eos, reqs[:2], args.mode, 2)  # warm-up
    results: dict[str, list[dict]] = {name: [] for name in ARMS}
    for name in ARMS + ARMS[::-1]:
        arm(loaded.model, name)
        results[name].append(run(target, eos, reqs, args.mode, args.batch_size))
    native.attach(loaded.model)

    def total(name, key):
        return sum(r[key] for r in results[name])

    first = results["all"][0]["rows"]
    same = {name: sum(results[name][0]["rows"][i] == first[i] for i in first) for name in ARMS[1:]}
    print(f"{args.prompts} Spec-Bench prompts x {args.max_new_tokens} tokens, {args.mode}, batch {args.batch_size}, "
          f"{loaded.model.dtype}, {args.threads} thread(s), kernels {kernels}, causal prefill kernel "
          f"{'yes' if built.causal else 'no'}; palindrome, seconds summed over 2 runs each")
    print("| phase | all s | attention s | SDPA s | attention / all | SDPA / all |\n|---|---|---|---|---|---|")
    record = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "mode": args.mode,
              "batch_size": args.batch_size, "dtype": str(loaded.model.dtype).removeprefix("torch."),
              "threads": args.threads, "causal": built.causal is not None, "rows_equal_to_all": same,
              "rows": len(ids)}
    for key in ("prefill_s", "decode_s", "wall_s"):
        a, b, c = (total(name, key) for name in ARMS)
        print(f"| {key[:-2]} | {a:.1f} | {b:.1f} | {c:.1f} | {b / a:.2f}x | {c / a:.2f}x |")
        record[key] = {name: [r[key] for r in results[name]] for name in ARMS}
    print(f"rows equal to all's: attention {same['attention']}, sdpa {same['sdpa']} of {len(ids)}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
