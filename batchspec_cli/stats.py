"""Summaries of a statistics file (one row per step), per bucket and overall.

- group hit rate: same_length steps / (same_length + realigned) steps;
- mean acceptance length: tokens emitted per row per round, *counting* the correction or
  bonus token (= 1 + accepted / rounds);
- realign+gather share: (realign_ms + gather_ms) / total_ms over every step;
- tokens/s: tokens emitted / summed step time (prefill included).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

SPEC_KINDS = ("same_length", "realigned")


@dataclass
class Summary:
    label: str
    steps: int
    hit_rate: float | None
    acceptance_length: float | None
    realign_share: float
    tokens: int
    tokens_per_s: float
    kv_moved: int
    kv_gathered: int


def summarize_rows(label: str, rows: list[dict]) -> Summary:
    spec = [r for r in rows if r["group_kind"] in SPEC_KINDS]
    same = sum(r["group_kind"] == "same_length" for r in spec)
    row_rounds = sum(r["batch_size"] for r in rows if r["group_kind"] != "prefill")
    tokens = sum(r["tokens_emitted"] for r in rows)
    total_ms = sum(r["total_ms"] for r in rows)
    moving_ms = sum(r["realign_ms"] + r["gather_ms"] for r in rows)
    return Summary(
        label=label, steps=len(rows) - sum(r["group_kind"] == "prefill" for r in rows),
        hit_rate=same / len(spec) if spec else None,
        acceptance_length=tokens / row_rounds if spec and row_rounds else None,
        realign_share=moving_ms / total_ms if total_ms else 0.0, tokens=tokens,
        tokens_per_s=tokens / (total_ms / 1e3) if total_ms else 0.0,
        kv_moved=sum(r["kv_moved"] for r in rows), kv_gathered=sum(r["kv_gathered"] for r in rows))


def summarize(path: Path) -> list[Summary]:
    """Per-bucket summaries followed by the overall one."""
    rows = pq.read_table(path).to_pylist()
    buckets = sorted({r["bucket"] for r in rows})
    out = [summarize_rows(f"bucket {b}", [r for r in rows if r["bucket"] == b]) for b in buckets]
    out.append(summarize_rows("overall", rows))
    return out
