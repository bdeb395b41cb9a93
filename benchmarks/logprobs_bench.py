"""What `--logprobs N` costs: the same job with and without log-probabilities, side by side in one process.

    python benchmarks/logprobs_bench.py --prompts 12 --logprobs 5 --modes auto ar --threads 1

For every mode the engine decodes the same Spec-Bench prompts (``turns[0]``, chat template,
bucketed as ``batchspec generate`` does) without log-probabilities (A) and with them for
every row (B), in palindrome blocks A B B A, after one warm-up run of each. Each block
gives a ratio: B's tokens/s over A's (both runs of each arm pooled), so that a drift of
the machine's speed within a block cancels; the table reports the median ratio, its
spread over blocks (min..max) and the cost (1 - ratio). The script also checks that B's
completions equal A's token for token, and that B's log-probabilities equal those of one
plain forward of the target over each prompt and its completion alone (the largest
difference over every token and its top N is reported; the check fails above
``--tolerance``). Absolute times on a shared machine are noise: quote the ratios.

Whole runs are noisy on a shared machine (and ``auto`` chooses its k from measured times),
so the script also times the log-probability work alone against the forward it rides on:
per repeat, one bare target forward of n tokens per row (n = 1: a plain step; n = k+1: a
verify) on a KV cache of the job's mean context, then ``Recorder.device_values`` on its
logits with the host read-back (``tolist`` + ``unpack``), back to back; the median of the
per-repeat ratios is the share a round pays for log-probabilities.

A table for people, then one JSON line for machines (last).
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

from transformers import DynamicCache  # noqa: E402

from batchspec_cli.engine import drafters  # noqa: E402
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle  # noqa: E402
from batchspec_cli.engine.events import Request, RowResult  # noqa: E402
from batchspec_cli.engine.logprobs import Recorder  # noqa: E402
from batchspec_cli.io.prompts import render_prompt  # noqa: E402
from batchspec_cli.models import loading as models  # noqa: E402
from batchspec_cli.models.attention import attention_inputs  # noqa: E402
from bench import SPEC_BENCH, requests, spec_bench_prompts  # noqa: E402


def run(target, draft, eos, reqs: list[Request], mode: str, k: int, batch_size: int, top: int | None,
        logprobs_mode: str) -> tuple[dict[int, RowResult], float]:
    """One engine run over the requests (every row asking for ``top`` alternatives, or none); (results, wall s)."""
    names = [] if mode == "ar" else (["suffix"] if mode == "auto" else [])
    engine = Engine(target, draft if mode != "ar" else None, eos,
                    EngineConfig(mode=mode, k=k, batch_size=batch_size, window=4 * batch_size,
                                 logprobs_mode=logprobs_mode), lookups=drafters.make(names))
    for r in reqs:
        r.logprobs = top
    started = time.perf_counter()
    results = {e.row: e for e in engine.run(reqs) if isinstance(e, RowResult)}
    return results, time.perf_counter() - started


@torch.no_grad()
def largest_difference(model, prompt_ids: list[list[int]], results: dict[int, RowResult]) -> tuple[float, int]:
    """(max |engine - plain forward| over every token's logprob and its top N by rank, tokens checked)."""
    worst, tokens = 0.0, 0
    for row, ids in enumerate(prompt_ids):
        r = results[row]
        completion = r.token_ids
        logits = model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : len(ids) - 1 + len(completion)]
        ref = torch.log_softmax(logits.double(), -1)
        for j, entry in enumerate(r.logprobs):
            values = ref[j].topk(len(entry.top)).values.tolist() if entry.top else []
            worst = max(worst, abs(entry.logprob - float(ref[j, completion[j]])),
                        *(abs(v - e) for (_, v), e in zip(entry.top, values)))
            tokens += 1
    return worst, tokens


@torch.no_grad()
def component_share(target: ModelHandle, batch: int, context: int, n: int, top: int, mode: str,
                    repeats: int = 15) -> float:
    """Median over repeats of (log-probability work) / (target forward of n tokens per row), back to back."""
    device = target.model.device
    cache = DynamicCache()
    target.model(input_ids=torch.randint(100, 1000, (batch, context), device=device), use_cache=True,
                 **{target.cache_kwarg: cache})
    dtype = next(target.model.parameters()).dtype
    mask, positions = attention_inputs(torch.zeros(batch, dtype=torch.long, device=device), context, n, dtype)
    reqs = [Request(row=i, id=str(i), prompt_ids=[1], max_new_tokens=n, logprobs=top) for i in range(batch)]
    zeros = torch.zeros(batch, dtype=torch.float64, device=device)
    shares = []
    for repeat in range(repeats + 1):  # the first warms up
        began = time.perf_counter()
        logits = target.model(input_ids=torch.randint(100, 1000, (batch, n), device=device), attention_mask=mask,
                              position_ids=positions, use_cache=True, **{target.cache_kwarg: cache}).logits
        tokens = logits.argmax(-1)
        host = tokens.tolist()
        forward = time.perf_counter() - began
        cache.crop(-n)
        recorder = Recorder(mode, device)
        recorder.admit(reqs)
        began = time.perf_counter()
        packed = recorder.device_values(reqs, logits, tokens, zeros, zeros.long(), zeros + 1)
        Recorder.unpack(packed.tolist(), 0, n)
        work = time.perf_counter() - began
        if repeat:
            shares.append(work / forward)
    del host
    return statistics.median(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("-k", "--draft-tokens", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["auto", "ar"], choices=["auto", "ar", "eqspec", "exspec"])
    parser.add_argument("--logprobs", type=int, default=5, help="top N alternatives per token (B runs)")
    parser.add_argument("--logprobs-mode", default="raw", choices=["raw", "processed"])
    parser.add_argument("--blocks", type=int, default=3, help="A B B A blocks per mode")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tgt = models.load_model(args.target, "auto", "auto", quiet=True)
    target = ModelHandle(tgt.model, models.cache_kwarg(tgt.model))
    draft = None
    if any(m != "ar" for m in args.modes):
        spec = args.draft or (str(models.default_draft_path()) if args.target is None else None)
        if spec is None:
            sys.exit("no draft: pass --draft")
        drf = models.load_draft(spec, tgt, "auto", "auto", quiet=True)
        draft = ModelHandle(drf.model, models.cache_kwarg(drf.model))
    eos = models.eos_ids(tgt.model, tgt.tokenizer)
    prompt_ids = [render_prompt(tgt.tokenizer, p, True, None) for p in spec_bench_prompts(SPEC_BENCH, args.prompts)]
    reqs = requests(prompt_ids, args.max_new_tokens)

    report = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
              "k": args.draft_tokens, "logprobs": args.logprobs, "logprobs_mode": args.logprobs_mode,
              "threads": args.threads, "blocks": args.blocks, "modes": {}}
    failed = False
    print(f"{'mode':<8} {'ratio B/A':>10} {'min..max':>14} {'cost':>8} {'A tok/s':>9} {'B tok/s':>9} "
          f"{'same tokens':>12} {'max |diff|':>11}")
    for mode in args.modes:
        arms = {"A": None, "B": args.logprobs}
        go = lambda arm: run(target, draft, eos, reqs, mode, args.draft_tokens, args.batch_size,  # noqa: E731
                             arms[arm], args.logprobs_mode)
        go("A"), go("B")  # warm-up (kernels, caches, the draft's and target's first forwards)
        ratios, rates, same, checked = [], {"A": [], "B": []}, True, None
        for _ in range(args.blocks):
            block = {"A": [0, 0.0], "B": [0, 0.0]}  # tokens, seconds
            for arm in "ABBA":
                results, wall = go(arm)
                tokens = sum(len(r.token_ids) for r in results.values())
                block[arm][0] += tokens
                block[arm][1] += wall
                rates[arm].append(tokens / wall)
                if arm == "A":
                    plain = results
                else:
                    with_lp = results
            if any(plain[row].token_ids != with_lp[row].token_ids for row in plain):
                same = False
            checked = with_lp
            ratios.append((block["B"][0] / block["B"][1]) / (block["A"][0] / block["A"][1]))
        worst, n_tokens = largest_difference(tgt.model, prompt_ids, checked)
        median = statistics.median(ratios)
        failed |= not same or worst > args.tolerance
        report["modes"][mode] = {"ratio_median": median, "ratio_min": min(ratios), "ratio_max": max(ratios),
                                 "ratios": ratios, "cost": 1 - median, "same_tokens": same,
                                 "max_abs_diff": worst, "tokens_checked": n_tokens,
                                 "tok_s_a": statistics.median(rates["A"]), "tok_s_b": statistics.median(rates["B"])}
        print(f"{mode:<8} {median:>10.4f} {min(ratios):>6.4f}..{max(ratios):<6.4f} {100 * (1 - median):>7.2f}% "
              f"{statistics.median(rates['A']):>9.1f} {statistics.median(rates['B']):>9.1f} {str(same):>12} "
              f"{worst:>11.2e}", flush=True)
    context = sum(map(len, prompt_ids)) // len(prompt_ids) + args.max_new_tokens // 2
    report["component"] = {"context": context}
    for n in (1, args.draft_tokens + 1):
        share = component_share(target, args.batch_size, context, n, args.logprobs, args.logprobs_mode)
        report["component"][f"share_n{n}"] = share
        print(f"log-probability work / target forward of {n} token(s) x {args.batch_size} rows at context {context}: "
              f"{100 * share:.2f} %")
    print(json.dumps(report))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
