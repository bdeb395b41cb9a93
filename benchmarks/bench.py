"""Side-by-side benchmark of ar / auto / eqspec / exspec (and plain HF generate) on Spec-Bench prompts, in one process.

    python benchmarks/bench.py --prompts 24 --batch-sizes 1 4 8 16 --max-new-tokens 128
    python benchmarks/bench.py --modes ar auto exspec hf -k 1 2 3 5 --drafters model ngram model+suffix
    python benchmarks/bench.py --modes ar auto exspec --drafters model suffix --by-category

For every batch size every mode decodes the same prompts (Spec-Bench ``turns[0]`` with the
chat template); the script checks that the completions are identical across modes (and
exits with status 1, naming the batch size, run and rows, when they are not) and reports
tokens/s, the ratio to ``ar`` at the same batch size, the acceptance (accepted / drafted
tokens), the mean acceptance length (``stats.acceptance_length``: 1 + accepted drafts per
row-round of the rounds with k > 0, *counting* the correction/bonus token), the group hit
rate and the realignment + gather share of step time. By default every batch size runs the modes forward and then backward (``--order
palindrome``) and pools both runs of each mode, so that a drift of the machine's speed
during the sweep does not favour the mode that runs first.

Runs: ``ar`` once; ``pool0`` once: the pooled engine (``auto``'s pool, admission and
grouping) with no drafter, so every round is a plain step (what the pool itself costs); ``eqspec`` / ``exspec`` once per k of ``-k`` and per drafter
configuration of ``--drafters``; ``auto`` once per drafter configuration with K =
``--max-k`` (default: the largest ``-k``); ``hf`` once: plain Hugging Face
``model.generate`` (greedy, static batches of B prompts in the same bucketed order, left
padding) -- what a user would otherwise run. A drafter configuration is ``model`` (the
draft model), ``ngram``, ``suffix`` or a ``+``-joined combination; rows are labelled
``mode[drafters]`` unless the drafter is the draft model alone. Engine modes must give
``ar``'s tokens exactly; ``hf`` is compared too, but a padded batched HF run may
legitimately differ at float near-ties, so its differing rows are reported apart and do
not fail the run. ``--by-category`` runs every Spec-Bench category (mt_bench,
translation, summarization, qa, math_reasoning, rag) as its own job and reports each.

``auto`` rows also give the histogram of the k the controller chose (decode steps), its
expected and realised gain over a plain step (over the steps it modelled: expected =
sum(expected tokens) / sum(modelled ms), realised = sum(tokens emitted) / sum(step ms),
both divided by the modelled plain rate sum(rows) / sum(modelled plain ms)), and the
controller's overhead: the host time of ``Engine._choose`` (timed by wrapping it here) as
a share of the decode steps' time.

The *ideal* speed-up ``E / (k*c + v)`` (fixed-k rows with the draft model only) uses
``E = (1 - a^(k+1)) / (1 - a)`` with ``a`` the per-token acceptance solved from the
measured accepted drafts per round, and ``c`` / ``v`` the draft step and k+1-token verify
forward costs in target-step units, measured by separate benchmarks of the bare model
forwards at that batch size (not the engine's timers), interleaved so that load from
elsewhere cancels in the ratios. A table for people, then one JSON line for machines; a
PNG plot next to the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import DynamicCache, GenerationConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchspec_cli.engine import drafters  # noqa: E402
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle  # noqa: E402
from batchspec_cli.engine.events import Request, RowResult, StepStats  # noqa: E402
from batchspec_cli.io.prompts import render_prompt  # noqa: E402
from batchspec_cli.job.assembly import use_kernels  # noqa: E402
from batchspec_cli.models import loading as models  # noqa: E402
from batchspec_cli.models.attention import attention_inputs, use_folded_sdpa  # noqa: E402
from batchspec_cli.stats import acceptance_length, summarize_rows  # noqa: E402
from batchspec_cli.store.buckets import plan_buckets  # noqa: E402

SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench_questions.jsonl"  # --questions' default
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
ENGINE_MODES = ("ar", "pool0", "auto", "eqspec", "exspec")
PLAIN = ("ar", "pool0", "hf")  # runs without a drafter, once per batch size
FIXED = ("eqspec", "exspec")
DRAFTER_NAMES = ("model",) + drafters.NAMES


class Run(NamedTuple):
    """One run of one mode: results by row, its StepStats, wall seconds, host seconds in ``Engine._choose``."""

    results: dict
    stats: list
    wall: float
    choose_s: float = 0.0


def spec_bench_groups(path: Path, n: int) -> list[tuple[str, str]]:
    """n (group, prompt) pairs spread evenly over the six Spec-Bench groups (MT-bench's categories count as one)."""
    groups = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        groups["mt_bench" if row["category"] in MT_BENCH else row["category"]].append(row["turns"][0])
    names = sorted(groups)
    picked = []
    for i in range(n):
        name = names[i % len(names)]
        group = groups[name]
        picked.append((name, group[(i // len(names)) * 7 % len(group)]))
    return picked


def spec_bench_prompts(path: Path, n: int) -> list[str]:
    """n prompts spread evenly over the six Spec-Bench groups (MT-bench's categories count as one)."""
    return [prompt for _, prompt in spec_bench_groups(path, n)]


def requests(prompt_ids: list[list[int]], max_new: int) -> list[Request]:
    """Bucketed order and padding, as `batchspec generate` does."""
    ranges = plan_buckets([len(p) for p in prompt_ids], None, min_rows=8)
    out = []
    for b, (lo, hi) in enumerate(ranges):
        rows = sorted((len(p), i) for i, p in enumerate(prompt_ids) if lo <= len(p) <= hi)
        out += [Request(row=i, id=str(i), prompt_ids=prompt_ids[i], max_new_tokens=max_new, bucket=b, pad_to=hi)
                for _, i in rows]
    return out


def parse_drafters(config: str) -> list[str]:
    """``model+suffix`` -> ["model", "suffix"]; unknown names are refused."""
    names = [n for n in config.split("+") if n]
    unknown = [n for n in names if n not in DRAFTER_NAMES]
    if not names or unknown:
        raise ValueError(f"bad drafter configuration {config!r}: use {', '.join(DRAFTER_NAMES)} joined by '+'")
    return names


def label(mode: str, k: int, drafter: str) -> str:
    """A run's name: ``exspec-k3``, ``auto[model+suffix]``, ``exspec[ngram]-k5``, ``ar``, ``hf``."""
    name = mode + (f"[{drafter}]" if drafter and drafter != "model" else "")
    return name + (f"-k{k}" if mode in FIXED else "")


def run_mode(target, draft, eos, reqs, mode, k, batch_size, drafter="model") -> Run:
    """One engine run. ``drafter``: the configuration (``model``, ``ngram``, ``model+suffix``, ...); the model-free
    drafters are built anew for every run (they hold per-job state)."""
    names = parse_drafters(drafter) if mode not in PLAIN else []
    engine = Engine(target, draft if "model" in names else None, eos,
                    EngineConfig(mode="auto" if mode == "pool0" else mode, k=k, batch_size=batch_size),
                    lookups=drafters.make([n for n in names if n != "model"]))
    choose_s = [0.0]
    real_choose = engine._choose

    def timed_choose(*args, **kwargs):  # the controller's host time (the bench's wrapper, on this instance only)
        began = time.perf_counter()
        try:
            return real_choose(*args, **kwargs)
        finally:
            choose_s[0] += time.perf_counter() - began

    engine._choose = timed_choose
    results, stats = {}, []
    started = time.perf_counter()
    for event in engine.run(reqs):
        (stats.append if isinstance(event, StepStats) else lambda e: results.__setitem__(e.row, e))(event)
    wall = time.perf_counter() - started  # the engine's last event follows its round's host sync
    return Run(results, stats, wall, choose_s[0])


@torch.no_grad()
def run_hf(model, pad_id: int, eos: list[int], reqs: list[Request], batch_size: int) -> Run:
    """Plain Hugging Face ``generate``: static batches of ``batch_size`` prompts in the requests' (bucketed) order,
    left padding with an attention mask, greedy; every row is cut after its first EOS (the EOS kept, as the engine
    does)."""
    device = model.device
    config = GenerationConfig(max_new_tokens=reqs[0].max_new_tokens if reqs else 1, do_sample=False,
                              eos_token_id=list(eos), pad_token_id=pad_id, num_beams=1)
    eos_set = set(eos)
    results = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch],
                            device=device)
        config.max_new_tokens = max(r.max_new_tokens for r in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        for r, row in zip(batch, out[:, width:].tolist()):
            row = row[: r.max_new_tokens]
            cut = next((j + 1 for j, t in enumerate(row) if t in eos_set), len(row))
            results[r.row] = RowResult(r.row, r.id, row[:cut], "stop" if cut < len(row) or
                                       (row and row[-1] in eos_set) else "length",
                                       prompt_tokens=len(r.prompt_ids))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return Run(results, [], time.perf_counter() - started)


@torch.no_grad()
def forward_costs(target: ModelHandle, draft: ModelHandle, batch: int, context: int, ks: list[int],
                  repeats: int = 25) -> tuple[float, dict[int, float]]:
    """(c, {k: v}) from bare forwards on a ``context``-token KV cache.

    Each model's cache is filled once; every timed forward is cropped off again. One repeat
    times the target's 1-token step, the draft's 1-token step and the target's (k+1)-token
    verify back to back, so c and v are medians of per-repeat ratios: load from elsewhere that
    drifts over the measurement cancels in the ratio. The forwards get an explicit 4D mask
    without padding, as the engine's forwards do, so they run the same attention kernels
    (``attention.use_folded_sdpa``); nothing else of the engine is involved.
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


def summarize(runs: list[Run]) -> dict:
    """One row from a mode's runs: rates are total tokens over total time (an ``hf`` run has no step stats)."""
    run_tokens = [sum(len(r.token_ids) for r in run.results.values()) for run in runs]
    tokens, wall = sum(run_tokens), sum(run.wall for run in runs)
    stats = [s for run in runs for s in run.stats]
    rounds = [s for s in stats if s.group_kind in ("same_length", "realigned", "ar")]
    row_rounds = sum(s.batch_size for s in rounds)
    accepted = sum(sum(s.accepted) for s in rounds)
    drafted = sum(s.drafted for s in rounds)
    spec = [s for s in rounds if s.group_kind != "ar"]
    total_ms = sum(s.total_ms for s in stats)
    decode_ms = sum(s.total_ms for s in stats if s.group_kind != "prefill")
    row = {
        "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "runs_tokens_per_s": [n / run.wall for n, run in zip(run_tokens, runs)],
        "decode_tokens_per_s": tokens / (decode_ms / 1e3) if decode_ms else None,
        "acceptance_length": acceptance_length(sum(sum(s.accepted) for s in rounds if s.k),
                                               sum(s.batch_size for s in rounds if s.k)),
        "accepted_per_round": accepted / row_rounds if spec else 0.0,
        "drafted": drafted, "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "hit_rate": (sum(s.group_kind == "same_length" for s in spec) / len(spec)) if spec else None,
        "realign_gather_share": sum(s.realign_ms + s.gather_ms for s in stats) / total_ms if total_ms else None,
        "kv_moved": sum(s.kv_moved for s in stats), "kv_gathered": sum(s.kv_gathered for s in stats),
        "step_ms": {"draft": sum(s.draft_ms for s in stats), "verify": sum(s.verify_ms for s in stats),
                    "realign_gather": sum(s.realign_ms + s.gather_ms for s in stats),
                    "total": total_ms},
    }
    if rounds:
        row["drafters"] = dict(Counter(s.drafter or "-" for s in rounds))  # steps per drafter ("-": k = 0)
    return row


def controller(runs: list[Run]) -> dict:
    """``auto``'s choices: k histogram over decode steps, expected vs realised gain over a plain step
    (``stats.summarize_rows``, the one definition), and the controller's overhead."""
    decode = [s for run in runs for s in run.stats if s.group_kind != "prefill"]
    summary = summarize_rows("auto", [s.record() for s in decode])
    modelled = [s for s in decode if s.trace.expected_ms > 0 and s.trace.plain_ms > 0]
    out = {"k_hist": {str(k): n for k, n in summary.k_histogram.items()},
           "expected_gain": summary.expected_gain, "realised_gain": summary.realised_gain,
           "modelled_steps": len(modelled), "choose_ms": 1e3 * sum(run.choose_s for run in runs)}
    decode_ms = sum(s.total_ms for s in decode)
    out["controller_share"] = out["choose_ms"] / decode_ms if decode_ms else None
    return out


def differing_rows(outputs: dict[str, dict[int, list[int]]]) -> tuple[str, dict[str, list[int]]]:
    """(the reference run: ar's first when it ran, else the first; {run: rows whose tokens differ from it})."""
    base = "ar" if "ar" in outputs else next(iter(outputs))
    return base, {name: sorted(row for row in outputs[base] if out.get(row) != outputs[base][row])
                  for name, out in outputs.items()}


def is_hf(name: str) -> bool:
    return name.split("/")[-1].startswith("hf")


def mismatch_report(mismatched: dict[int, dict[str, list[int]]], base: str) -> str | None:
    """None when every engine run of every batch size gave the reference's tokens; else one line per offending run.
    ``hf`` runs are left out (their differences are reported, not failed)."""
    lines = [f"batch {batch}: {name} differs from {base} in rows {', '.join(map(str, rows))}"
             for batch, runs in mismatched.items() for name, rows in runs.items() if rows and not is_hf(name)]
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
    rows = [r for r in rows if r.get("category", "all") == "all"] or rows
    for name in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == name]
        left.plot([r["batch_size"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=name)
    left.set(xlabel="batch size", ylabel="tokens/s", title="throughput", xticks=batch_sizes)
    left.legend(fontsize="small")
    labels, draft, verify, realign, other = [], [], [], [], []
    for r in rows:
        if r["mode"] in ("ar", "hf"):
            continue
        labels.append(f"{r['label']} b{r['batch_size']}")
        t = r["step_ms"]
        draft.append(t["draft"]), verify.append(t["verify"]), realign.append(t["realign_gather"])
        other.append(max(0.0, t["total"] - t["draft"] - t["verify"] - t["realign_gather"]))
    bottom = [0.0] * len(labels)
    for name, values in (("draft", draft), ("verify", verify), ("realign+gather", realign), ("other", other)):
        right.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set(ylabel="ms (summed over steps)", title="step-time breakdown")
    right.tick_params(axis="x", labelrotation=60, labelsize="small")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


HEADER = (f"{'category':14} {'run':22} {'batch':>5} {'tok/s':>8} {'vs ar':>6} {'decode':>6} {'accept':>6} "
          f"{'acc.len':>7} {'alpha':>6} {'ideal':>6} {'of ideal':>8} {'hit':>6} {'realign+gather':>14}")


def print_row(r: dict) -> None:
    def fmt(key, spec, width):
        return format(r[key], spec) if r.get(key) is not None else "-".rjust(width)

    share = r.get("realign_gather_share")
    print(f"{r.get('category', 'all'):14} {r['label']:22} {r['batch_size']:>5} {r['tokens_per_s']:>8.1f} "
          f"{fmt('ratio_vs_ar', '6.2f', 6)} {fmt('decode_ratio_vs_ar', '6.2f', 6)} {fmt('acceptance', '6.0%', 6)} "
          f"{fmt('acceptance_length', '7.2f', 7)} {fmt('alpha', '6.2f', 6)} {fmt('ideal_speedup', '6.2f', 6)} "
          f"{fmt('achieved_of_ideal', '8.0%', 8)} {fmt('hit_rate', '6.0%', 6)} "
          f"{'-' if share is None else format(100 * share, '13.1f') + '%':>14}", flush=True)
    if "controller" in r:
        c = r["controller"]
        gain = (f"expected gain {c['expected_gain']:.2f}, realised {c['realised_gain']:.2f} over "
                f"{c['modelled_steps']} modelled steps" if c["expected_gain"] is not None else "no modelled steps")
        share = "-" if c["controller_share"] is None else f"{100 * c['controller_share']:.2f}%"
        print(f"{'':14}   k histogram {c['k_hist']}; {gain}; controller {c['choose_ms']:.1f} ms = {share} of decode",
              flush=True)


def print_categories(rows: list[dict]) -> None:
    """Per category and run: acceptance (accepted / drafted), tokens per round (incl. bonus), ratio to ar."""
    runs = list(dict.fromkeys(r["label"] for r in rows if r["mode"] not in ("ar",)))
    for batch in dict.fromkeys(r["batch_size"] for r in rows):
        print(f"\nby category, batch {batch}: acceptance / tokens per round (incl. bonus) / tok/s vs ar")
        print(f"{'category':14} " + " ".join(f"{name:>22}" for name in runs))
        for category in dict.fromkeys(r["category"] for r in rows):
            cells = []
            for name in runs:
                r = next((r for r in rows if (r["label"], r["category"], r["batch_size"]) == (name, category, batch)),
                         None)
                if r is None:
                    cells.append(f"{'':>22}")
                    continue
                acc = "-" if r.get("acceptance") is None else f"{r['acceptance']:.0%}"
                length = "-" if r.get("acceptance_length") is None else f"{r['acceptance_length']:.2f}"
                ratio = "-" if r.get("ratio_vs_ar") is None else f"{r['ratio_vs_ar']:.2f}x"
                cells.append(f"{acc + ' / ' + length + ' / ' + ratio:>22}")
            print(f"{category:14} " + " ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["ar", "eqspec", "exspec"],
                        choices=list(ENGINE_MODES) + ["hf"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", "--draft-tokens", type=int, nargs="+", default=[5],
                        help="one or more k; eqspec and exspec run once per k")
    parser.add_argument("--max-k", type=int, default=None, help="auto's largest k (default: the largest -k)")
    parser.add_argument("--drafters", nargs="+", default=["model"],
                        help="drafter configurations: model, ngram, suffix or a '+'-joined combination such as "
                             "model+suffix; every speculative mode runs once per configuration")
    parser.add_argument("--auto-drafters", nargs="+", default=None,
                        help="drafter configurations for auto alone (default: --drafters), e.g. auto with the "
                             "defaults (model+suffix) beside fixed-k runs with the model")
    parser.add_argument("--by-category", action="store_true",
                        help="run every Spec-Bench category's prompts as its own job and report each")
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernels", choices=["auto", "stock", "packed"], default="auto",
                        help="the CLI's --kernels, for every mode (auto: oneDNN-prepacked linears on a CPU)")
    parser.add_argument("--order", choices=["palindrome", "given"], default="palindrome",
                        help="palindrome: run the modes forward, then backward, and pool both runs (cancels drift; "
                             "twice the time); given: once each, in the order of --modes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench.json")
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH,
                        help="Spec-Bench's questions (JSONL: category, turns)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        configs = {config: parse_drafters(config) for config in args.drafters}
        auto_configs = {config: parse_drafters(config) for config in (args.auto_drafters or args.drafters)}
    except ValueError as exc:
        parser.error(str(exc))
    ks = args.draft_tokens
    max_k = args.max_k or max(ks)
    spec_modes = [m for m in args.modes if m in ("auto",) + FIXED]
    needs_model = bool(spec_modes) and any("model" in names for names in {**configs, **auto_configs}.values())

    tgt = models.load_model(args.target, args.dtype, args.device, quiet=True)
    target = ModelHandle(tgt.model, models.cache_kwarg(tgt.model))
    draft = drf = None
    if needs_model:
        draft_spec = args.draft or (str(models.default_draft_path()) if args.target is None and
                                    models.default_draft_path() else None)
        if draft_spec is None:
            sys.exit("no draft: pass --draft (the default target's shipped draft is missing)")
        drf = models.load_draft(draft_spec, tgt, args.dtype, args.device, quiet=True)
        draft = ModelHandle(drf.model, models.cache_kwarg(drf.model))
    kernels_run, _ = use_kernels(args.kernels, tgt, drf)
    for handle in (target, draft):  # as the engine runs them (bare forwards and hf included)
        if handle is not None:
            use_folded_sdpa(handle.model)
    eos = models.eos_ids(tgt.model, tgt.tokenizer)
    pad_id = tgt.tokenizer.pad_token_id if tgt.tokenizer.pad_token_id is not None else eos[0]
    picked = spec_bench_groups(args.questions, args.prompts)
    prompt_ids = [render_prompt(tgt.tokenizer, p, True, None) for _, p in picked]
    if args.by_category:
        jobs = {}
        for (category, _), ids in zip(picked, prompt_ids):
            jobs.setdefault(category, []).append(ids)
        jobs = {category: requests(jobs[category], args.max_new_tokens) for category in sorted(jobs)}
    else:
        jobs = {"all": requests(prompt_ids, args.max_new_tokens)}
    context = sum(map(len, prompt_ids)) // len(prompt_ids) + args.max_new_tokens // 2

    # The runs: (mode, k, drafter configuration); ar and hf once, auto once per configuration at K = max_k.
    plan = []
    for mode in args.modes:
        if mode in PLAIN:
            plan.append((mode, 0, ""))
        elif mode == "auto":
            plan += [(mode, max_k, config) for config in auto_configs]
        else:
            plan += [(mode, k, config) for config in configs for k in ks]
    plan = list(dict.fromkeys(plan))
    ideal_ks = sorted({k for mode, k, config in plan if mode in FIXED and config == "model"})

    # Warm up every model and path once.
    warm = [dataclasses.replace(r, max_new_tokens=min(r.max_new_tokens, 16)) for r in next(iter(jobs.values()))[:2]]
    for mode, k, config in dict.fromkeys((m, min(k, 2), c) for m, k, c in plan):
        if mode == "hf":
            run_hf(tgt.model, pad_id, eos, warm, 2)
        else:
            run_mode(target, draft, eos, warm, mode, k, 2, config)

    print(f"Spec-Bench, {args.prompts} prompts{' by category' if args.by_category else ''}, max_new_tokens "
          f"{args.max_new_tokens}, k {' '.join(map(str, ks))}, auto K {max_k}, drafters {' '.join(configs)}, "
          f"device {tgt.model.device}, dtype {tgt.model.dtype}, threads {torch.get_num_threads()}, "
          f"order {args.order}; 'accept' is accepted / drafted tokens; acceptance length counts the bonus token; "
          f"'vs ar' is end to end (prefill included), 'decode' excludes prefill and is what 'of ideal' uses",
          flush=True)
    print(HEADER, flush=True)
    rows, mismatches, mismatched, base = [], {}, {}, "ar"
    for batch_size in args.batch_sizes:
        c, v = forward_costs(target, draft, batch_size, context, ideal_ks) if ideal_ks else (None, {})
        mismatched[batch_size] = {}
        for category, reqs in jobs.items():
            runs = defaultdict(list)
            for mode, k, config in run_order(plan, args.order):
                if mode == "hf":
                    runs[(mode, k, config)].append(run_hf(tgt.model, pad_id, eos, reqs, batch_size))
                else:
                    runs[(mode, k, config)].append(run_mode(target, draft, eos, reqs, mode, k, batch_size, config))
            outputs, ar = {}, None
            prefix = f"{category}/" if args.by_category else ""
            for mode, k, config in plan:
                name = label(mode, k, config)
                for i, run in enumerate(runs[(mode, k, config)]):
                    outputs[prefix + name + (f"-run{i + 1}" if i else "")] = {
                        row: r.token_ids for row, r in run.results.items()}
                row = {"mode": mode, "label": name, "drafter": config or None, "category": category,
                       "batch_size": batch_size, "k": k, "order": args.order, **summarize(runs[(mode, k, config)])}
                if mode == "auto":
                    row["controller"] = controller(runs[(mode, k, config)])
                if mode in FIXED and config == "model" and row["accepted_per_round"] is not None:
                    alpha = solve_alpha(row["accepted_per_round"], k)
                    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
                    row.update(alpha=alpha, c=c, v=v[k], ideal_speedup=expected / (k * c + v[k]))
                ar = row if mode == "ar" else ar
                if ar is not None:
                    row["ratio_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"]
                    if row["decode_tokens_per_s"] is not None and ar["decode_tokens_per_s"]:
                        row["decode_ratio_vs_ar"] = row["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
                    if "ideal_speedup" in row and "decode_ratio_vs_ar" in row:  # the ideal models decoding only
                        row["achieved_of_ideal"] = row["decode_ratio_vs_ar"] / row["ideal_speedup"]
                rows.append(row)
                print_row(row)
            base, differing = differing_rows({n.removeprefix(prefix): o for n, o in outputs.items()})
            mismatched[batch_size].update({prefix + n: r for n, r in differing.items()})
        mismatches[batch_size] = {name: len(r) for name, r in mismatched[batch_size].items()}
    if args.by_category:
        print_categories(rows)

    engine_counts = {b: {n: m for n, m in runs.items() if not is_hf(n)} for b, runs in mismatches.items()}
    hf_rows = {b: {n: r for n, r in runs.items() if is_hf(n)} for b, runs in mismatched.items()}
    print(f"rows differing from {base}:", json.dumps(engine_counts))
    if any(hf_rows.values()):
        print(f"hf rows differing from {base} (float near-ties of a padded batch are allowed; not a failure):",
              json.dumps({b: {n: len(r) for n, r in runs.items()} for b, runs in hf_rows.items()}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(rows, args.out.with_suffix(".png"), args.batch_sizes)
    record = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "k": ks, "max_k": max_k,
              "drafters": list(configs), "by_category": args.by_category, "order": args.order,
              "device": str(tgt.model.device), "dtype": str(tgt.model.dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "kernels": kernels_run, "rows": rows,
              "mismatches_vs_ar": engine_counts,
              "hf_mismatched_rows": {b: {n: r for n, r in runs.items() if r} for b, runs in hf_rows.items()},
              "plot": str(png) if png else None}
    failure = mismatch_report(mismatched, base)
    if failure:
        record["mismatched_rows"] = {b: {name: r for name, r in runs.items() if r and not is_hf(name)}
                                     for b, runs in mismatched.items()}
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    if failure:
        sys.exit(failure)  # exit status 1, the message on stderr


if __name__ == "__main__":
    main()
