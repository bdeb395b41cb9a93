"""Cost of a multi-token (verify) forward relative to a one-token forward, per kernel variant.

    python benchmarks/verify_cost.py --batch-sizes 1 8 --tokens 1 2 3 4 5 6 \
        --variants plain onednn hybrid --threads 1 2 --reps 7

Every batch size gets a ``SlotCache`` whose rows are prefilled with ``--context`` tokens of
Spec-Bench text (``turns[0]`` of consecutive questions, each row starting elsewhere); then
forwards of T new tokens at column ``--context`` are timed through the engine's own path
(``attention.group_forward``, folded SDPA, explicit 4D mask), overwriting the same columns each
time. ``v(T) = t(T) / t(1)`` of the same variant and thread count; ``vs plain`` divides by
the stock kernels' one-token forward at the same thread count instead.

Variants (see ``batchspec_cli/models/kernels.py``): ``plain`` = stock ``nn.Linear``; ``onednn`` =
every linear on oneDNN-prepacked weights; ``hybrid`` = prepacked for inputs of at least
``--min-rows`` rows (tokens x batch), stock below. Variants and thread counts are
interleaved at the finest grain (for each T, every variant in turn, the order reversed on
every other repetition), and the reported time is the median over repetitions of each
repetition's median of ``--inner`` forwards, so that load from other processes on a shared
machine falls on all variants alike.

Exactness, per variant (at the first thread count): greedy-decode ``--check-tokens``
tokens one token per forward (``ar``), then re-feed them in blocks of ``max(T)`` as a
verifier would; ``verify==ar`` counts the positions whose argmax differs (must be 0 for
speculative greedy output to equal ``ar`` with the same kernels), ``max|dl|`` is the
largest logit difference between the two, and ``vs plain`` the largest logit difference
from the stock kernels' one-token forwards (and their argmax disagreements).

A table for people, then one JSON line for machines.
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

from batchspec_cli.engine.align import SlotCache  # noqa: E402
from batchspec_cli.models import kernels, loading as models  # noqa: E402
from batchspec_cli.models.attention import group_forward, use_folded_sdpa  # noqa: E402

SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench_questions.jsonl"
VARIANTS = ("plain", "onednn", "hybrid")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target model (default: the embedded default)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6], help="T values (1 is always added)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--min-rows", type=int, default=4, help="hybrid: rows from which oneDNN runs")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--inner", type=int, default=5, help="timed forwards per (rep, T, variant)")
    p.add_argument("--check-tokens", type=int, default=48, help="greedy tokens of the exactness check (0: skip)")
    p.add_argument("--questions", type=Path, default=SPEC_BENCH)
    return p.parse_args(argv)


def context_rows(tokenizer, path: Path, rows: int, length: int) -> torch.Tensor:
    """[rows, length] token ids of Spec-Bench text; row r starts at question 7r."""
    questions = [json.loads(line)["turns"][0] for line in path.read_text().splitlines()]
    out = []
    for r in range(rows):
        ids: list[int] = []
        i = 7 * r
        while len(ids) < length:
            ids += tokenizer(questions[i % len(questions)] + "\n\n")["input_ids"]
            i += 1
        out.append(ids[:length])
    return torch.tensor(out)


class Switch:
    """Puts one kernel variant into the model in place: stock and packed layers are built once and swapped."""

    def __init__(self, model, min_rows: int):
        self.model, self.min_rows = model, min_rows
        self.slots = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
                      if type(child) is torch.nn.Linear]
        self.plain = [getattr(parent, name) for parent, name in self.slots]
        kernels.prepack(model)
        self.packed = [getattr(parent, name) for parent, name in self.slots]
        self.set("plain")

    def set(self, variant: str) -> None:
        layers = self.plain if variant == "plain" else self.packed
        for (parent, name), layer in zip(self.slots, layers):
            setattr(parent, name, layer)
        if variant != "plain":
            for layer in self.packed:
                layer.min_rows = 1 if variant == "onednn" else self.min_rows


@torch.no_grad()
def timings(model, kw, ids, context, ts, runs, switch, reps, inner) -> dict:
    """{(variant, threads): {T: seconds}}: medians over reps of the per-rep median of `inner` forwards."""
    batch = ids.shape[0]
    cache = SlotCache(batch, context + max(ts) + 8)
    pad = torch.zeros(batch, dtype=torch.long)
    sel = slice(0, batch)
    switch.set("plain")
    group_forward(model, cache, kw, sel, ids[:, :context], pad, 0)
    samples = {run: {t: [] for t in ts} for run in runs}
    for rep in range(reps):
        order = runs if rep % 2 == 0 else runs[::-1]
        for t in ts:
            new = ids[:, context : context + t]
            for variant, threads in order:
                switch.set(variant)
                torch.set_num_threads(threads)
                group_forward(model, cache, kw, sel, new, pad, context)  # warm this shape and kernel
                times = []
                for _ in range(inner):
                    started = time.perf_counter()
                    group_forward(model, cache, kw, sel, new, pad, context)
                    times.append(time.perf_counter() - started)
                samples[(variant, threads)][t].append(statistics.median(times))
    return {run: {t: statistics.median(v) for t, v in per_t.items()} for run, per_t in samples.items()}


@torch.no_grad()
def exactness(model, kw, ids, context, block, n_tokens, switch, variant, reference=None) -> dict:
    """Greedy ar decode with one-token forwards, then the same tokens re-fed in verify blocks."""
    batch = ids.shape[0]
    switch.set(variant)
    cache = SlotCache(batch, context + n_tokens + block + 8)
    pad = torch.zeros(batch, dtype=torch.long)
    sel = slice(0, batch)
    logits = group_forward(model, cache, kw, sel, ids[:, :context], pad, 0, logits_to_keep=1)[:, -1]
    ar_logits, tokens = [], []
    for step in range(n_tokens):  # ar: logits of position context+step-1 predict token `step`
        ar_logits.append(logits)
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        logits = group_forward(model, cache, kw, sel, token, pad, context + step)[:, -1]
    ar_logits = torch.stack(ar_logits, 1)  # [batch, n, vocab]
    tokens = torch.cat(tokens, 1)  # [batch, n]
    # Verify: feed [last context token, tokens...] in blocks; block logits predict the next token each.
    fed = torch.cat([ids[:, context - 1 : context], tokens[:, :-1]], 1)
    cache2 = SlotCache(batch, context + n_tokens + block + 8)
    group_forward(model, cache2, kw, sel, ids[:, : context - 1], pad, 0, logits_to_keep=1)
    verify_logits = torch.cat([group_forward(model, cache2, kw, sel, fed[:, i : i + block], pad, context - 1 + i)
                               for i in range(0, n_tokens, block)], 1)
    out = {"verify_vs_ar_argmax_diffs": int((verify_logits.argmax(-1) != tokens).sum()),
           "verify_vs_ar_max_abs": float((verify_logits - ar_logits).abs().max()),
           "positions": int(tokens.numel())}
    if reference is not None:
        ref_logits, ref_tokens = reference
        out["ar_vs_plain_max_abs"] = float((ar_logits - ref_logits).abs().max())
        out["ar_vs_plain_token_diffs"] = int((tokens != ref_tokens).sum())
    return out, (ar_logits, tokens)


def main(argv=None) -> int:
    args = parse_args(argv)
    loaded = models.load_model(args.model, "float32", "cpu", quiet=True)
    model, tokenizer = loaded.model, loaded.tokenizer
    use_folded_sdpa(model)
    kw = models.cache_kwarg(model)
    switch = Switch(model, args.min_rows)
    ts = sorted(set([1] + args.tokens))
    runs = [(v, n) for n in args.threads for v in args.variants]
    base_threads = torch.get_num_threads()
    rows = context_rows(tokenizer, args.questions, max(args.batch_sizes), args.context + max(ts) + args.check_tokens)

    results, checks = {}, {}
    for batch in args.batch_sizes:
        ids = rows[:batch]
        results[batch] = timings(model, kw, ids, args.context, ts, runs, switch, args.reps, args.inner)
        if args.check_tokens:
            torch.set_num_threads(args.threads[0])
            checks[batch], reference = {}, None
            for variant in (["plain"] + [v for v in args.variants if v != "plain"]):
                checks[batch][variant], got = exactness(model, kw, ids, args.context, max(ts), args.check_tokens,
                                                        switch, variant, reference)
                reference = reference or got
    switch.set("plain")
    torch.set_num_threads(base_threads)

    for batch in args.batch_sizes:
        print(f"\nbatch {batch}, context {args.context}: t(T) ms | v(T) = t(T)/t(1) same variant | t(T)/t_plain(1)")
        header = f"{'T':>3} " + " ".join(f"{f'{v}@{n}':>26}" for v, n in runs)
        print(header)
        for t in ts:
            cells = []
            for variant, threads in runs:
                sec = results[batch][(variant, threads)][t]
                own = sec / results[batch][(variant, threads)][1]
                plain = results[batch].get(("plain", threads), {}).get(1)
                vs = f"{sec / plain:5.2f}" if plain else "  -  "
                cells.append(f"{1000 * sec:8.1f} {own:6.2f} {vs:>6}   ")
            print(f"{t:>3} " + " ".join(f"{c:>26}" for c in cells))
        for variant, check in checks.get(batch, {}).items():
            extra = (f", ar vs plain max|dl| {check['ar_vs_plain_max_abs']:.1e}, token diffs "
                     f"{check['ar_vs_plain_token_diffs']}") if "ar_vs_plain_max_abs" in check else ""
            print(f"  exactness {variant}@{args.threads[0]}: verify==ar argmax diffs "
                  f"{check['verify_vs_ar_argmax_diffs']}/{check['positions']}, max|dl| "
                  f"{check['verify_vs_ar_max_abs']:.1e}{extra}")
    record = {
        "context": args.context, "min_rows": args.min_rows, "reps": args.reps, "inner": args.inner,
        "torch": torch.__version__,
        "results": {str(b): {f"{v}@{n}": {"ms": {str(t): round(1000 * s, 2) for t, s in per.items()},
                                            "v": {str(t): round(s / per[1], 3) for t, s in per.items()}}
                             for (v, n), per in res.items()} for b, res in results.items()},
        "exactness": {str(b): c for b, c in checks.items()},
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
