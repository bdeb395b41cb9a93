"""The engine's own cost per round: wall time minus the time spent inside model forwards.

    python benchmarks/round_overhead.py [--repo PATH ...] [--rows 48] [--max-new-tokens 24] [--repeats 3]

Tiny random models (forwards of well under a millisecond), so what is left is the engine:
selection, realignment bookkeeping, acceptance, commit, host sync and Python. Each ``--repo``
is a checkout of batchspec (default: this one); they run interleaved (A B A B ...) in
subprocesses with the same workload, and the medians are compared. Use it to check that a
change to the round does not make it slower. A table for people, one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, random, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, StepStats

torch.set_num_threads(1)
rows, max_new, mode, k, batch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

def tiny(seed):
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval().requires_grad_(False)

target, draft = tiny(0), tiny(0)
with torch.no_grad():
    for p in draft.parameters():
        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
inside = [0.0]
for model in (target, draft):
    forward = model.forward
    def timed(*a, _f=forward, **kw):
        t = time.perf_counter()
        out = _f(*a, **kw)
        inside[0] += time.perf_counter() - t
        return out
    model.forward = timed
rng = random.Random(0)
prompts = [[rng.randrange(4, 100) for _ in range(rng.randint(4, 40))] for _ in range(rows)]
engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache") if mode != "ar" else None, [],
                EngineConfig(mode=mode, k=k, batch_size=batch, window=4 * batch))
reqs = lambda: [Request(row=i, id=str(i), prompt_ids=p, max_new_tokens=max_new) for i, p in enumerate(prompts)]
for _ in engine.run(reqs()[:batch]):  # warm-up
    pass
inside[0] = 0.0
t = time.perf_counter()
rounds = sum(1 for e in engine.run(reqs()) if isinstance(e, StepStats) and e.group_kind != "prefill")
wall = time.perf_counter() - t
print(json.dumps({"rounds": rounds, "wall_s": wall, "forward_s": inside[0],
                  "overhead_ms_per_round": 1e3 * (wall - inside[0]) / rounds}))
"""


def measure(repo: Path, args, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKER, str(args.rows), str(args.max_new_tokens), mode, str(args.k),
                          str(args.batch_size)], cwd=repo, capture_output=True, text=True,
                         env={"PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if out.returncode:
        sys.exit(f"{repo}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, nargs="+", action="extend", help="checkouts (repeatable)")
    parser.add_argument("--modes", nargs="+", default=["ar", "exspec"])
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.repo = args.repo or [ROOT]
    samples = {(str(r), m): [] for r in args.repo for m in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:
            for repo in args.repo:
                samples[str(repo), mode].append(measure(repo, args, mode))
    print(f"{'checkout':40} {'mode':7} {'rounds':>6} {'overhead ms/round':>18} {'forward share':>13}")
    table = []
    for (repo, mode), runs in samples.items():
        row = {"repo": repo, "mode": mode, "rounds": runs[0]["rounds"],
               "overhead_ms_per_round": statistics.median(r["overhead_ms_per_round"] for r in runs),
               "forward_share": statistics.median(r["forward_s"] / r["wall_s"] for r in runs)}
        table.append(row)
        print(f"{repo[-40:]:40} {mode:7} {row['rounds']:>6} {row['overhead_ms_per_round']:>18.3f} "
              f"{100 * row['forward_share']:>12.1f}%")
    print(json.dumps({"rows": args.rows, "max_new_tokens": args.max_new_tokens, "k": args.k,
                      "batch_size": args.batch_size, "results": table}))


if __name__ == "__main__":
    main()
