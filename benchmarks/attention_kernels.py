"""One layer's attention on this CPU, per kernel: what a prefill and a decode step of SmolLM2's shape cost.

    python benchmarks/attention_kernels.py --threads 1

Shapes: 9 query heads sharing 3 key/value heads of 64 dimensions (SmolLM2-135M), random inputs in ``--dtype``.

- prefill: one row of L tokens attending causally to itself: SDPA's causal flash path (``is_causal``, what a packed
  prefill runs), the same on float32 inputs, and the same with a materialised boolean mask (what a padded prefill
  ran, without its padding);
- decode: 32 rows of one query each against L cached columns with an additive mask (50 columns of padding masked):
  stock SDPA with grouped-query heads (what a one-token forward ran before), the folded kernel itself
  (``attention._attend``: the query heads that share a key/value head as one query of 3 rows, what ``--kernels stock``
  runs), batchspec's own kernel (``models/native.py``, what ``--kernels auto`` runs on a CPU), and scores taken by a
  matmul in the inputs' dtype (faster, but the scores are rounded to that dtype first).

Each time is the best of ``--reps`` calls after one warm-up; ``err`` is the largest difference from float64 SDPA on
the same inputs. A table for people, then one JSON line for machines.
"""

from __future__ import annotations

import argparse
import json
import time

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchspec_cli.models import native  # noqa: E402
from batchspec_cli.models.attention import _attend  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64
REP = HEADS // KV_HEADS


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best * 1e3


def prefill(length: int, dtype: torch.dtype, reps: int) -> dict[str, float]:
    q = torch.randn(1, HEADS, length, DIM, dtype=dtype)
    k, v = torch.randn(1, KV_HEADS, length, DIM, dtype=dtype), torch.randn(1, KV_HEADS, length, DIM, dtype=dtype)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return {
        "causal": best_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), reps),
        "causal float32": best_ms(lambda: F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True).to(dtype), reps),
        "mask": best_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True), reps),
    }


def decode(length: int, rows: int, dtype: torch.dtype, reps: int) -> dict[str, tuple[float, float]]:
    q = torch.randn(rows, HEADS, 1, DIM, dtype=dtype)
    k, v = torch.randn(rows, KV_HEADS, length, DIM, dtype=dtype), torch.randn(rows, KV_HEADS, length, DIM, dtype=dtype)
    mask = torch.zeros(rows, 1, 1, length, dtype=dtype)
    mask[..., :50] = torch.finfo(dtype).min
    folded_q, layer = q.reshape(rows, KV_HEADS, REP, DIM), SimpleNamespace(num_key_value_groups=REP)
    exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(REP, 1),
                                           v.double().repeat_interleave(REP, 1), attn_mask=mask.double())

    def stock():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def folded():  # [rows, 1, heads, dim]
        return _attend(layer, q, k, v, mask, scaling=DIM ** -0.5)[0].transpose(1, 2)

    kernel = native.load().attend

    def own():
        return native.attend(kernel, q, k, v, mask, DIM ** -0.5).transpose(1, 2)

    def matmul_scores():
        scores = (folded_q @ k.transpose(-1, -2)).float() * DIM ** -0.5 + mask
        return scores.softmax(-1).to(dtype) @ v

    out = {}
    kernels = [("stock", stock), ("folded", folded)] + ([("batchspec", own)] if kernel is not None else [])
    for name, fn in kernels + [("matmul scores", matmul_scores)]:
        err = float((fn().reshape(rows, HEADS, 1, DIM).double() - exact).abs().max())
        out[name] = (best_ms(fn, reps), err)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 800, 1500])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    result = {"dtype": args.dtype, "threads": args.threads, "rows": args.rows, "prefill": {}, "decode": {}}
    print(f"one layer, {HEADS} query heads on {KV_HEADS} key/value heads of {DIM}, {args.dtype}, "
          f"{args.threads} thread(s); ms (best of {args.reps})")
    for length in args.lengths:
        times = prefill(length, dtype, args.reps)
        result["prefill"][length] = times
        print(f"prefill, 1 row of {length}: " + ", ".join(f"{n} {t:.2f}" for n, t in times.items()))
    for length in args.lengths:
        times = decode(length, args.rows, dtype, args.reps)
        result["decode"][length] = {n: {"ms": t, "err": e} for n, (t, e) in times.items()}
        print(f"decode, {args.rows} rows of {length} columns: "
              + ", ".join(f"{n} {t:.2f} (err {e:.4f})" for n, (t, e) in times.items()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
