"""Timing of the model-free drafters (batchspec_cli/policy/lookup.py) on real token ids.

    python benchmarks/lookup_bench.py --rows 16 --k 5 --index-prompts 300

Only timing, never tuning: Spec-Bench ``turns[0]`` prompts are tokenized with the default
model's tokenizer (chat template applied); a row's text is its prompt followed by the
next prompts until it reaches 300-1000 tokens (the length of a prompt plus a completion).
The job index holds ``--index-prompts`` prompts plus half as many completion-like
documents. Measured, after a warm-up: building and extending the per-row structures,
``SuffixIndex.add`` per token, and one round of drafts for the whole batch (``PromptLookup``
alone, the global index alone, and ``SuffixRow`` = local + global), with the rows growing
by a few tokens between rounds as in decoding. The budget: a batch's drafts should cost
under 5 % of a target step (≈ 280 ms at batch 16, ≈ 110 ms at batch 1 on the 2-core CPU).
A table for people, then one JSON line for machines.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchspec_cli.policy.lookup import PromptLookup, SuffixCorpus, SuffixIndex  # noqa: E402

DATA = Path("/work/shared/data/spec_bench_questions.jsonl")
TARGET_STEP_MS = {1: 110.0, 16: 280.0}


def load_prompts(limit: int) -> tuple[list[list[int]], str]:
    """Token ids of Spec-Bench prompts; synthetic Zipf ids if the tokenizer is unavailable."""
    try:
        from batchspec_cli.models.loading import load_tokenizer

        tokenizer, name = load_tokenizer(None, quiet=True)
        rows = [json.loads(line) for line in DATA.read_text().splitlines()[:limit]]
        ids = []
        for row in rows:
            messages = [{"role": "user", "content": row["turns"][0]}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids, name
    except Exception as exc:  # offline box without the cached conversion: still time something
        rng = random.Random(0)
        weights = [1 / (r + 1) for r in range(49152)]
        ids = [rng.choices(range(49152), weights, k=rng.randint(30, 400)) for _ in range(limit)]
        return ids, f"synthetic Zipf ids ({type(exc).__name__})"


def row_texts(prompts: list[list[int]], rows: int, rng: random.Random) -> list[list[int]]:
    texts = []
    for r in range(rows):
        goal = rng.randint(300, 1000)
        text, i = [], r * 7
        while len(text) < goal:
            text += prompts[i % len(prompts)]
            i += 1
        texts.append(text[:goal])
    return texts


def per_token_us(seconds: float, tokens: int) -> float:
    return 1e6 * seconds / max(tokens, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--index-prompts", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    rng = random.Random(0)

    prompts, source = load_prompts(480)
    index_docs = prompts[: args.index_prompts]
    completions = [prompts[(i * 13) % len(prompts)] + prompts[(i * 17 + 1) % len(prompts)] for i in range(args.index_prompts // 2)]
    texts = row_texts(prompts[args.index_prompts :] or prompts, args.rows, rng)
    growth = [prompts[(i * 5 + 3) % len(prompts)] * 4 for i in range(args.rows)]  # tokens the rows "generate"

    # Job index: prompts, then completion-like documents.
    start = time.perf_counter()
    index = SuffixIndex()
    for doc in index_docs:
        index.add(doc)
    for doc in completions:
        index.add(doc)
    add_s = time.perf_counter() - start
    add_tokens = sum(map(len, index_docs)) + sum(map(len, completions))
    drafter = SuffixCorpus(index)

    # Per-row structures over each row's text.
    start = time.perf_counter()
    lookups = [PromptLookup(text) for text in texts]
    lookup_build_s = time.perf_counter() - start
    start = time.perf_counter()
    suffix_rows = [drafter.open(text) for text in texts]  # adds each text to the index too
    row_build_s = time.perf_counter() - start
    text_tokens = sum(map(len, texts))

    def one_round(step: int) -> tuple[float, float, float, float, int]:
        t0 = time.perf_counter()
        ngram = [row.draft(args.k) for row in lookups]
        t1 = time.perf_counter()
        shared = [index.draft(row.text, args.k) for row in suffix_rows]
        t2 = time.perf_counter()
        suffix = [row.draft(args.k) for row in suffix_rows]
        t3 = time.perf_counter()
        for i in range(args.rows):  # commit 1..k+1 tokens per row, as a round would
            n = 1 + (step + i) % (args.k + 1)
            new = growth[i][(step * 3) % 200 : (step * 3) % 200 + n]
            lookups[i].extend(new)
            suffix_rows[i].extend(new)
        t4 = time.perf_counter()
        drafted = sum(len(d.tokens) for d in ngram) + sum(len(d.tokens) for d in suffix)
        del shared
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, drafted

    for step in range(10):  # warm-up
        one_round(step)
    samples = [one_round(step) for step in range(10, 10 + args.rounds)]
    ms = {
        "ngram_propose": statistics.median(s[0] for s in samples) * 1e3,
        "index_propose": statistics.median(s[1] for s in samples) * 1e3,
        "suffix_propose": statistics.median(s[2] for s in samples) * 1e3,
        "extend_both": statistics.median(s[3] for s in samples) * 1e3,
    }
    step_ms = TARGET_STEP_MS[16] if args.rows >= 16 else TARGET_STEP_MS[1]
    rows_out = [
        (f"PromptLookup.propose, batch {args.rows}", ms["ngram_propose"], "ms"),
        (f"SuffixIndex.draft (global only), batch {args.rows}", ms["index_propose"], "ms"),
        (f"SuffixRow.draft (local + global), batch {args.rows}", ms["suffix_propose"], "ms"),
        (f"extend both per round, batch {args.rows}", ms["extend_both"], "ms"),
        ("SuffixIndex.add", per_token_us(add_s, add_tokens), "us/token"),
        ("PromptLookup build", per_token_us(lookup_build_s, text_tokens), "us/token"),
        ("SuffixCorpus.open (global + local)", per_token_us(row_build_s, text_tokens), "us/token"),
    ]
    print(f"tokens: {source}; rows {args.rows}, k {args.k}, texts {min(map(len, texts))}-{max(map(len, texts))} tokens")
    index_bytes = index.nodes * index.NODE_BYTES + index.tokens * index.TOKEN_BYTES  # the class's bound formula
    print(f"index: {len(index)} documents, {index.tokens} tokens, {index.nodes} nodes, ~{index_bytes / 2**20:.0f} MiB")
    print(f"{'what':48} {'median':>10}  unit    share of a {step_ms:.0f} ms target step")
    for name, value, unit in rows_out:
        share = f"{100 * value / step_ms:.2f} %" if unit == "ms" else ""
        print(f"{name:48} {value:10.3f}  {unit:8}{share}")
    drafts_ms = ms["ngram_propose"] + ms["suffix_propose"]
    print(
        json.dumps(
            {
                "bench": "lookup",
                "source": source,
                "rows": args.rows,
                "k": args.k,
                "index_docs": len(index),
                "index_tokens": index.tokens,
                "index_nodes": index.nodes,
                "index_bytes_estimate": index_bytes,
                **{f"{name}_ms": round(value, 4) for name, value in ms.items()},
                "add_us_per_token": round(per_token_us(add_s, add_tokens), 3),
                "lookup_build_us_per_token": round(per_token_us(lookup_build_s, text_tokens), 3),
                "suffix_open_us_per_token": round(per_token_us(row_build_s, text_tokens), 3),
                "target_step_ms": step_ms,
                "suffix_share_of_step": round(ms["suffix_propose"] / step_ms, 5),
                "ngram_share_of_step": round(ms["ngram_propose"] / step_ms, 5),
                "under_5_percent": max(ms["suffix_propose"], ms["ngram_propose"]) < 0.05 * step_ms,
                "mean_drafted_per_row": round(statistics.mean(s[4] for s in samples) / (2 * args.rows), 3),
                "drafts_ms_total": round(drafts_ms, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
