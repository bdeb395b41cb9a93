"""Side-by-side benchmark of ar / eqspec / exspec on Spec-Bench prompts, in one process.

    python benchmarks/bench.py --prompts 24 --batch-sizes 1 4 8 16 --max-new-tokens 128

For every batch size every mode decodes the same prompts (Spec-Bench ``turns[0]`` with the
chat template); the script checks that the completions are identical across modes (and
exits with status 1, naming the batch size, run and rows, when they are not) and reports
tokens/s, the ratio to ``ar`` at the same batch size, the mean acceptance length (tokens
per row per round, *counting* the correction/bonus token), the group hit rate and the
realignment + gather share of step time. By default every batch size runs the modes
forward and then backward (``--order palindrome``) and pools both runs of each mode, so that
a drift of the machine's speed during the sweep does not favour the mode that runs first.

The *ideal* speed-up ``E / (k*c + v)`` uses ``E = (1 - a^(k+1)) / (1 - a)`` with ``a`` the
per-token acceptance solved from the measured accepted drafts per round, and ``c`` / ``v``
the draft step and k+1-token verify forward costs in target-step units, measured by
separate benchmarks of the bare model forwards at that batch size (not the engine's
timers), interleaved so that load from elsewhere cancels in the ratios. A table for
people, then one JSON line for machines; a PNG plot next to the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchspec_cli import models  # noqa: E402
from batchspec_cli.align import attention_inputs, use_folded_sdpa  # noqa: E402
from batchspec_cli.engine import Engine, EngineConfig, ModelHandle  # noqa: E402
from batchspec_cli.events import Request, StepStats  # noqa: E402
from batchspec_cli.io import render_prompt  # noqa: E402
from buckets import plan_buckets  # noqa: E402

SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench_questions.jsonl"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def spec_bench_prompts(path: Path, n: int) -> list[str]:
    """n prompts spread evenly over the six Spec-Bench groups (MT-bench's categories count as one)."""
    groups = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        groups["mt_bench" if row["category"] in MT_BENCH else row["category"]].append(row["turns"][0])
    names = sorted(groups)
    picked = []
    for i in range(n):
        group = groups[names[i % len(names)]]
        picked.append(group[(i // len(names)) * 7 % len(group)])
    return picked


def requests(prompt_ids: list[list[int]], max_new: int) -> list[Request]:
    """Bucketed order and padding, as `batchspec generate` does."""
    ranges = plan_buckets([len(p) for p in prompt_ids], None, min_rows=8)
    out = []
    for b, (lo, hi) in enumerate(ranges):
        rows = sorted((len(p), i) for i, p in enumerate(prompt_ids) if lo <= len(p) <= hi)
        out += [Request(row=i, id=str(i), prompt_ids=prompt_ids[i], max_new_tokens=max_new, bucket=b, pad_to=hi)
                for _, i in rows]
    return out


def run_mode(target, draft, eos, reqs, mode, k, batch_size):
    engine = Engine(target, draft if mode != "ar" else None, eos,
                    EngineConfig(mode=mode, k=k, batch_size=batch_size, window=4 * batch_size))
    results, stats = {}, []
    started = time.perf_counter()
    for event in engine.run(reqs):
        (stats.append if isinstance(event, StepStats) else lambda e: results.__setitem__(e.row, e))(event)
    wall = time.perf_counter() - started
    return results, stats, wall


@torch.no_grad()
def forward_costs(target: ModelHandle, draft: ModelHandle, batch: int, context: int, ks: list[int],
                  repeats: int = 25) -> tuple[float, dict[int, float]]:
    """(c, {k: v}) from bare forwards on a ``context``-token KV cache.

    Each model's cache is filled once; every timed forward is cropped off again. One repeat
    times the target's 1-token step, the draft's 1-token step and the target's (k+1)-token
    verify back to back, so c and v are medians of per-repeat ratios: load from elsewhere that
    drifts over the measurement cancels in the ratio. The forwards get an explicit 4D mask
    without padding, as the engine's forwards do, so they run the same attention kernels
    (``align.use_folded_sdpa``); nothing else of the engine is involved.
    """
    device = target.model.device
    ids = torch.randint(100, 1000, (batch, context), device=device)
    caches = {}
    for name, handle in (("target", target), ("draft", draft)):
        caches[name] = DynamicCache()
        handle.model(input_ids=ids, use_cache=True, **{handle.cache_kwarg: caches[name]})

    def timed(name: str, handle: ModelHandle, new_tokens: int) -> float:
        dtype = next(handle.model.parameters()).dtype
        mask, positions = attention_inputs(torch.zeros(batch, dtype=torch.long, device=device), context,
                                           new_tokens, dtype)
        step = torch.randint(100, 1000, (batch, new_tokens), device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        handle.model(input_ids=step, attention_mask=mask, position_ids=positions, use_cache=True,
                     **{handle.cache_kwarg: caches[name]})
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        caches[name].crop(-new_tokens)  # back to the context (a negative count drops that many tokens)
        return elapsed

    c, v = [], {k: [] for k in ks}
    for repeat in range(repeats + 1):  # the first repeat warms up
        t_step = timed("target", target, 1)
        t_draft = timed("draft", draft, 1)
        t_verify = {k: timed("target", target, k + 1) for k in ks}
        if repeat:
            c.append(t_draft / t_step)
            for k in ks:
                v[k].append(t_verify[k] / t_step)
    return statistics.median(c), {k: statistics.median(x) for k, x in v.items()}


def solve_alpha(mean_accepted: float, k: int) -> float:
    """Per-token acceptance a with a(1 - a^k)/(1 - a) = mean accepted drafts per round."""
    lo, hi = 0.0, 0.999999
    for _ in range(60):
        mid = (lo + hi) / 2
        value = mid * (1 - mid ** k) / (1 - mid)
        lo, hi = (mid, hi) if value < mean_accepted else (lo, mid)
    return (lo + hi) / 2


def run_order(plan: list, order: str) -> list:
    """The runs in the order they execute. ``palindrome`` runs the plan forward, then backward (A B C C B A):
    every mode's mean position is the same, so a drift of the machine's speed during the sweep (measured: the mode
    run third at batch 4 lost 10-15 points of achieved/ideal) cancels to first order instead of favouring one mode."""
    return plan + plan[::-1] if order == "palindrome" else list(plan)


def summarize(runs: list) -> dict:
    """One row from a mode's runs, each ``(results, stats, wall)``: rates are total tokens over total time."""
    run_tokens = [sum(len(r.token_ids) for r in results.values()) for results, _, _ in runs]
    tokens, wall = sum(run_tokens), sum(w for _, _, w in runs)
    stats = [s for _, run_stats, _ in runs for s in run_stats]
    rounds = [s for s in stats if s.group_kind in ("same_length", "realigned", "ar")]
    row_rounds = sum(s.batch_size for s in rounds)
    accepted = sum(sum(s.accepted) for s in rounds)
    spec = [s for s in rounds if s.group_kind != "ar"]
    total_ms = sum(s.total_ms for s in stats)
    decode_ms = sum(s.total_ms for s in stats if s.group_kind != "prefill")
    return {
        "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "runs_tokens_per_s": [n / w for n, (_, _, w) in zip(run_tokens, runs)],
        "decode_tokens_per_s": tokens / (decode_ms / 1e3),
        "acceptance_length": (sum(s.tokens_emitted for s in rounds) / row_rounds) if spec else 1.0,
        "accepted_per_round": accepted / row_rounds if spec else 0.0,
        "hit_rate": (sum(s.group_kind == "same_length" for s in spec) / len(spec)) if spec else None,
        "realign_gather_share": sum(s.realign_ms + s.gather_ms for s in stats) / total_ms if total_ms else 0.0,
        "kv_moved": sum(s.kv_moved for s in stats), "kv_gathered": sum(s.kv_gathered for s in stats),
        "step_ms": {"draft": sum(s.draft_ms for s in stats), "verify": sum(s.verify_ms for s in stats),
                    "realign_gather": sum(s.realign_ms + s.gather_ms for s in stats),
                    "total": total_ms},
    }


def differing_rows(outputs: dict[str, dict[int, list[int]]]) -> tuple[str, dict[str, list[int]]]:
    """(the reference run: ar's first when it ran, else the first; {run: rows whose tokens differ from it})."""
    base = "ar" if "ar" in outputs else next(iter(outputs))
    return base, {name: sorted(row for row in outputs[base] if out.get(row) != outputs[base][row])
                  for name, out in outputs.items()}


def mismatch_report(mismatched: dict[int, dict[str, list[int]]], base: str) -> str | None:
    """None when every run of every batch size gave the reference's tokens; else one line per offending run."""
    lines = [f"batch {batch}: {name} differs from {base} in rows {', '.join(map(str, rows))}"
             for batch, runs in mismatched.items() for name, rows in runs.items() if rows]
    if not lines:
        return None
    return "error: the modes' outputs are not identical (speculative decoding must reproduce the target):\n" + \
        "\n".join(lines)


def plot(rows, path: Path, batch_sizes):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, k in sorted({(r["mode"], r["k"]) for r in rows}):
        mine = [r for r in rows if (r["mode"], r["k"]) == (mode, k)]
        left.plot([r["batch_size"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o",
                  label=mode + (f" k={k}" if k else ""))
    left.set(xlabel="batch size", ylabel="tokens/s", title="throughput", xticks=batch_sizes)
    left.legend()
    labels, draft, verify, realign, other = [], [], [], [], []
    for r in rows:
        if r["mode"] == "ar":
            continue
        labels.append(f"{r['mode'][:2]}{r['k']} b{r['batch_size']}")
        t = r["step_ms"]
        draft.append(t["draft"]), verify.append(t["verify"]), realign.append(t["realign_gather"])
        other.append(max(0.0, t["total"] - t["draft"] - t["verify"] - t["realign_gather"]))
    bottom = [0.0] * len(labels)
    for name, values in (("draft", draft), ("verify", verify), ("realign+gather", realign), ("other", other)):
        right.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set(ylabel="ms (summed over steps)", title="step-time breakdown")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def print_row(r: dict) -> None:
    def fmt(key, spec):
        return format(r[key], spec) if r.get(key) is not None else "-"

    print(f"{r['mode']:8} {r['k']:>2} {r['batch_size']:>5} {r['tokens_per_s']:>8.1f} {fmt('ratio_vs_ar', '6.2f'):>6} "
          f"{fmt('decode_ratio_vs_ar', '6.2f'):>6} {r['acceptance_length']:>7.2f} {fmt('alpha', '6.2f'):>6} "
          f"{fmt('ideal_speedup', '6.2f'):>6} {fmt('achieved_of_ideal', '8.0%'):>8} {fmt('hit_rate', '6.0%'):>6} "
          f"{100 * r['realign_gather_share']:>13.1f}%", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["ar", "eqspec", "exspec"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", "--draft-tokens", type=int, nargs="+", default=[5],
                        help="one or more k; the speculative modes run once per k")
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--order", choices=["palindrome", "given"], default="palindrome",
                        help="palindrome: run the modes forward, then backward, and pool both runs (cancels drift; "
                             "twice the time); given: once each, in the order of --modes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    draft_spec = args.draft or (str(models.default_draft_path()) if args.target is None and
                                models.default_draft_path() else None)
    if draft_spec is None:
        sys.exit("no draft: pass --draft (the default target's shipped draft is missing)")
    tgt = models.load_model(args.target, args.dtype, args.device, quiet=True)
    drf = models.load_draft(draft_spec, tgt, args.dtype, args.device, quiet=True)
    for model in (tgt.model, drf.model):  # as the engine runs them (bare forwards below included)
        use_folded_sdpa(model)
    target = ModelHandle(tgt.model, models.cache_kwarg(tgt.model))
    draft = ModelHandle(drf.model, models.cache_kwarg(drf.model))
    eos = models.eos_ids(tgt.model, tgt.tokenizer)
    prompt_ids = [render_prompt(tgt.tokenizer, p, True, None) for p in spec_bench_prompts(SPEC_BENCH, args.prompts)]
    reqs = requests(prompt_ids, args.max_new_tokens)
    ks = args.draft_tokens
    context = sum(map(len, prompt_ids)) // len(prompt_ids) + args.max_new_tokens // 2

    # Warm up both models once.
    run_mode(target, draft, eos, reqs[:2], "eqspec", ks[0], 2)

    print(f"Spec-Bench, {args.prompts} prompts, max_new_tokens {args.max_new_tokens}, k {' '.join(map(str, ks))}, "
          f"device {tgt.model.device}, threads {torch.get_num_threads()}, order {args.order}; "
          f"acceptance length counts the bonus token; "
          f"'vs ar' is end to end (prefill included), 'decode' excludes prefill and is what 'of ideal' uses",
          flush=True)
    print(f"{'mode':8} {'k':>2} {'batch':>5} {'tok/s':>8} {'vs ar':>6} {'decode':>6} {'acc.len':>7} {'alpha':>6} {'ideal':>6} "
          f"{'of ideal':>8} {'hit':>6} {'realign+gather':>14}", flush=True)
    rows, mismatches, mismatched = [], {}, {}
    plan = [(m, k) for m in args.modes for k in (ks if m != "ar" else [0])]
    for batch_size in args.batch_sizes:
        c, v = forward_costs(target, draft, batch_size, context, ks)
        runs = defaultdict(list)
        for mode, k in run_order(plan, args.order):
            runs[(mode, k)].append(run_mode(target, draft, eos, reqs, mode, k, batch_size))
        outputs, ar = {}, None
        for mode, k in plan:
            for i, (results, _, _) in enumerate(runs[(mode, k)]):
                outputs[f"{mode}" + (f"-k{k}" if k else "") + (f"-run{i + 1}" if i else "")] = {
                    row: r.token_ids for row, r in results.items()}
            row = {"mode": mode, "batch_size": batch_size, "k": k, "order": args.order, **summarize(runs[(mode, k)])}
            if mode != "ar":
                alpha = solve_alpha(row["accepted_per_round"], k)
                expected = (1 - alpha ** (k + 1)) / (1 - alpha)
                row.update(alpha=alpha, c=c, v=v[k], ideal_speedup=expected / (k * c + v[k]))
            ar = row if mode == "ar" else ar
            if ar is not None:
                row["ratio_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"]
                row["decode_ratio_vs_ar"] = row["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
                if "ideal_speedup" in row:  # the ideal models decoding only: compare decode time
                    row["achieved_of_ideal"] = row["decode_ratio_vs_ar"] / row["ideal_speedup"]
            rows.append(row)
            print_row(row)
        base, mismatched[batch_size] = differing_rows(outputs)
        mismatches[batch_size] = {name: len(rows) for name, rows in mismatched[batch_size].items()}

    print(f"rows differing from {base}:", json.dumps(mismatches))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(rows, args.out.with_suffix(".png"), args.batch_sizes)
    record = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "k": ks, "order": args.order,
              "device": str(tgt.model.device), "threads": torch.get_num_threads(), "rows": rows,
              "mismatches_vs_ar": mismatches, "plot": str(png) if png else None}
    failure = mismatch_report(mismatched, base)
    if failure:
        record["mismatched_rows"] = {b: {name: r for name, r in runs.items() if r} for b, runs in mismatched.items()}
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    if failure:
        sys.exit(failure)  # exit status 1, the message on stderr


if __name__ == "__main__":
    main()
