"""The same job through batchspec and the tools a user would run instead, as whole processes, one thread each.

    python benchmarks/peers.py                                  # 128 Spec-Bench chat prompts x 64 tokens, 2 rounds
    python benchmarks/peers.py --prompts 64 --max-new-tokens 48 --rounds 3
    python benchmarks/peers.py --vllm-python /path/to/venv/bin/python   # vLLM's CPU build in its own venv

Runs, alternating in rounds (A B C D A B C D ..., so that a drift of the machine's speed falls on all):

- ``default``: ``batchspec generate`` with no flags (dtype, batch size and mode all automatic);
- ``ar-f32-b8``: ``batchspec generate --mode ar --dtype float32 --batch-size 8`` (the default before this round);
- ``hf-bf16-b8``: plain Hugging Face ``generate``, bfloat16, static batches of 8 prompts in input order, left padding;
- ``vllm``: vLLM's CPU build, bfloat16, its defaults, when ``--vllm-python`` names a python that has it (it pins its
  own torch, so it lives in its own venv and is never a dependency of batchspec).

Every run is greedy on the embedded default model (SmolLM2-135M-Instruct, the converted copy batchspec caches), the
prompts through the tokenizer's chat template. Per process it reports wall and CPU seconds (``wait4``), the
start-up (launch to the first generated token's phase: batchspec's ``start`` event, the others' own marks) and the
generation phase with its generated tokens per second. Texts: how many rows equal the default's, for each tool.
A table for people, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import SPEC_BENCH, spec_bench_prompts  # noqa: E402
from scale import whole_process  # noqa: E402

# A peer's script prints one JSON line: {"startup_s", "generate_s", "texts", "tokens"}; argv: model, prompts, max_new
HF_SCRIPT = textwrap.dedent("""
    import json, sys, time
    began = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    model_dir, prompts_path, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompts = [json.loads(line)["prompt"] for line in open(prompts_path)]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in prompts]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    started = time.perf_counter()
    texts, tokens = [], 0
    with torch.no_grad():
        for i in range(0, len(ids), 8):
            batch = ids[i : i + 8]
            width = max(map(len, batch))
            x = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
            mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=pad)
            for row in out[:, width:].tolist():
                ends = [j for j, t in enumerate(row) if t in (eos if isinstance(eos, list) else [eos])]
                row = row[: ends[0] + 1] if ends else row
                tokens += len(row)
                texts.append(tok.decode(row, skip_special_tokens=True))
    print(json.dumps({"startup_s": started - began, "generate_s": time.perf_counter() - started, "texts": texts,
                      "tokens": tokens}))
""")

VLLM_SCRIPT = textwrap.dedent("""
    import json, os, sys, time


    def main():  # vLLM starts its engine core in a spawned process: the script needs the __main__ guard
        began = time.perf_counter()
        from vllm import LLM, SamplingParams
        model_dir, prompts_path, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
        # its CPU backend reserves this share of the machine's memory and refuses to start where less is free
        llm = LLM(model=model_dir, dtype="bfloat16", seed=0, gpu_memory_utilization=float(sys.argv[4]))
        tok = llm.get_tokenizer()
        prompts = [json.loads(line)["prompt"] for line in open(prompts_path)]
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in prompts]
        ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
        params = SamplingParams(temperature=0.0, max_tokens=max_new)
        started = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        generate_s = time.perf_counter() - started
        print(json.dumps({"startup_s": started - began, "generate_s": generate_s,
                          "texts": [o.outputs[0].text for o in outs],
                          "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))


    if __name__ == "__main__":
        main()
""")


def batchspec(inp: Path, out: Path, flags: list[str], threads: int, max_new: int) -> dict:
    """One whole ``batchspec generate`` process: its phases from --log-json, its texts from OUT."""
    import pyarrow.parquet as pq

    log = out.with_suffix(".log.jsonl")
    log.unlink(missing_ok=True)
    command = [sys.executable, "-m", "batchspec_cli", "generate", str(inp), str(out), "--max-new-tokens",
               str(max_new), "--threads", str(threads), "--quiet", "--overwrite", "--restart", "--log-json", str(log),
               *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    began = datetime.datetime.now(datetime.timezone.utc)
    code, wall, usage, stderr = whole_process(command, env)
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed: {stderr[-2000:]}")
    events = {e["event"]: e for e in map(json.loads, log.read_text().splitlines())}
    started = datetime.datetime.fromisoformat(events["start"]["time"])
    finished = datetime.datetime.fromisoformat(events["finish"]["time"])
    table = pq.read_table(out, columns=["completion", "completion_tokens"])
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1024,
            "startup_s": (started - began).total_seconds(), "generate_s": (finished - started).total_seconds(),
            "tokens": sum(table.column("completion_tokens").to_pylist()),
            "texts": table.column("completion").to_pylist(),
            "batch_size": events.get("batch_size", {}).get("batch_size"), "dtype": events["start"].get("dtype")}


def peer(python: str, script: str, model: Path, inp: Path, threads: int, max_new: int, *extra: str) -> dict:
    """One whole process of a peer's script."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    cores = sorted(os.sched_getaffinity(0))[:threads]  # vLLM binds its threads itself: to the cores we may use
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    output: list[str] = []
    code, wall, usage, stderr = whole_process([python, f.name, str(model), str(inp), str(max_new), *extra], env,
                                              output)
    stdout = output[0]
    os.unlink(f.name)
    if code != 0 or '{"startup_s"' not in stdout:
        raise SystemExit(f"{python} {script[:40]!r}... failed: {stderr[-3000:]}")
    # its one JSON line: vLLM logs to stdout too, before and after it
    result = json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith('{"startup_s"')))
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1024, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-python", help="a python whose environment has vLLM's CPU build")
    parser.add_argument("--vllm-memory", type=float, default=0.4,
                        help="the share of the machine's memory vLLM may reserve (its own default, 0.92, does not start "
                             "on a machine where other work holds more than 8 %%)")
    parser.add_argument("--skip", nargs="*", default=[], help="runs to leave out (default, ar-f32-b8, hf-bf16-b8)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from batchspec_cli.models import loading as models

    models.load_model(None, dtype="float32", device="cpu", quiet=True)  # converts and caches the GGUF once
    model_dir = models.cache_dir() / models.DEFAULT_CACHE_NAME
    runs = {"default": lambda inp, out: batchspec(inp, out, [], args.threads, args.max_new_tokens),
            "ar-f32-b8": lambda inp, out: batchspec(inp, out, ["--mode", "ar", "--dtype", "float32", "-b", "8"],
                                                    args.threads, args.max_new_tokens),
            "hf-bf16-b8": lambda inp, out: peer(sys.executable, HF_SCRIPT, model_dir, inp, args.threads,
                                                args.max_new_tokens)}
    if args.vllm_python:
        runs["vllm"] = lambda inp, out: peer(args.vllm_python, VLLM_SCRIPT, model_dir, inp, args.threads,
                                             args.max_new_tokens, str(args.vllm_memory))
    runs = {name: run for name, run in runs.items() if name not in args.skip}
    results: dict[str, list[dict]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "prompts.jsonl"
        inp.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                               for i, p in enumerate(spec_bench_prompts(SPEC_BENCH, args.prompts))))
        for _ in range(args.rounds):
            for name, run in runs.items():
                results[name].append(run(inp, Path(tmp) / f"{name}.parquet"))
                r = results[name][-1]
                print(f"  {name}: wall {r['wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s, generation {r['generate_s']:.1f} s "
                      f"({r['tokens'] / r['generate_s']:.0f} tok/s)", file=sys.stderr, flush=True)
    base = results.get("default", [{}])[0].get("texts")
    rows = []
    for name, rs in results.items():
        med = {key: statistics.median(r[key] for r in rs) for key in ("wall_s", "cpu_s", "startup_s", "generate_s")}
        rates = [r["tokens"] / r["generate_s"] for r in rs]
        rows.append({"run": name, **med, "gen_tok_s_min": min(rates), "gen_tok_s_max": max(rates),
                     "peak_mb": max(r["peak_mb"] for r in rs), "tokens": rs[0]["tokens"],
                     "equal_to_default": None if base is None else sum(a == b for a, b in zip(rs[0]["texts"], base)),
                     "batch_size": rs[0].get("batch_size"), "dtype": rs[0].get("dtype")})
    ref = {r["run"]: r for r in rows}.get("default")
    print(f"{args.prompts} Spec-Bench chat prompts x {args.max_new_tokens} new tokens, greedy, {args.threads} thread(s),"
          f" {args.rounds} alternating rounds (medians; generated tok/s min-max)")
    print(f"{'run':<12} {'wall s':>7} {'cpu s':>7} {'start s':>8} {'gen s':>7} {'gen tok/s':>13} {'peak MB':>8} "
          f"{'= default':>9} {'default x':>10}")
    for r in rows:
        speed = f"{r['cpu_s'] / ref['cpu_s']:.2f}" if ref else "-"
        print(f"{r['run']:<12} {r['wall_s']:7.1f} {r['cpu_s']:7.1f} {r['startup_s']:8.1f} {r['generate_s']:7.1f} "
              f"{r['gen_tok_s_min']:6.0f}-{r['gen_tok_s_max']:<6.0f} {r['peak_mb']:8.0f} "
              f"{r['equal_to_default'] if r['equal_to_default'] is not None else '-':>9} {speed:>10}")
    print("(default x: the run's CPU seconds over the default's: above 1, the default is faster)")
    print(json.dumps({"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                      "rounds": args.rounds, "runs": rows, "command": " ".join(sys.argv)}))


if __name__ == "__main__":
    main()
