"""Summaries of a statistics file (one row per step), per bucket and overall.

- group hit rate: same_length steps / (same_length + realigned) steps. A step is labelled
  by what it did: ``realigned`` when KV was moved to bring its rows to one padded length
  (before the round in exspec/auto, between rounds in eqspec), ``same_length`` otherwise,
  so eqspec and exspec compare honestly (plain ``ar`` steps count in neither);
- mean acceptance length (``acceptance_length``, the one definition the CLI uses too): tokens
  a row commits per speculative round, *counting* the correction or bonus token,
  = 1 + accepted drafts / row-rounds of the rounds with k > 0 (auto's PLAIN rounds that verify a
  grammar's forced runs included). Plain steps (k = 0) are not speculative rounds and do not count;
  a row that got no draft in a speculative round counts as one row-round of 1 token;
- realign+gather share: (realign_ms + gather_ms) / total_ms over every step;
- tokens/s: tokens emitted / summed step time (prefill included);
- prompt reuse: the share of admitted prompt tokens whose KV was copied from another sample of the same input
  row (``--n``) instead of prefilled (reused / (prefilled + reused), over the prefill steps);
- k histogram: decode steps per chosen k (auto chooses it every round; 0 is a plain step);
- expected / realised gain (auto): over the steps whose cost the policy modelled, the
  expected tokens per modelled second, and the tokens emitted per measured second, each
  over the rate of plain steps the policy modelled for the same groups;
- prompt reuse: prompt tokens whose KV a row took from a shared prefix (``prompt_reused``) over those and
  the prompt tokens the target computed (``prompt_prefilled``: a shared prefix's columns once, each row's own);
- arms (auto): per arm (plain, spec) the rounds it ran, their summed step time, and the
  committed tokens per second each of its windows measured (the policy's own figures).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from .errors import InputError
from .store.outputs import stats_path_for

SPEC_KINDS = ("same_length", "realigned")


def acceptance_length(accepted: int, row_rounds: int) -> float | None:
    """1 + accepted drafts / row-rounds of speculative rounds (k > 0): tokens per row per round, bonus counted."""
    return 1 + accepted / row_rounds if row_rounds else None


@dataclass
class ArmSummary:
    rounds: int
    seconds: float  # summed step time of its rounds
    windows: list[float]  # committed tokens per second of each window it closed, in order


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
    k_histogram: dict[int, int] = field(default_factory=dict)  # k -> decode steps
    expected_gain: float | None = None
    realised_gain: float | None = None
    arms: dict[str, ArmSummary] = field(default_factory=dict)  # auto's arms by name
    prompt_prefilled: int = 0  # prompt tokens the target computed at admission
    prompt_reused: int = 0  # prompt tokens whose KV rows took from a shared prefix or a sample

    @property
    def reuse_share(self) -> float | None:
        """Reused prompt tokens over reused and prefilled ones; None without prefills."""
        total = self.prompt_prefilled + self.prompt_reused
        return self.prompt_reused / total if total else None


def summarize_rows(label: str, rows: list[dict]) -> Summary:
    spec = [r for r in rows if r["group_kind"] in SPEC_KINDS]
    same = sum(r["group_kind"] == "same_length" for r in spec)
    speculative = [r for r in rows if r["group_kind"] != "prefill" and r["k"] > 0]
    tokens = sum(r["tokens_emitted"] for r in rows)
    total_ms = sum(r["total_ms"] for r in rows)
    moving_ms = sum(r["realign_ms"] + r["gather_ms"] for r in rows)
    decode = [r for r in rows if r["group_kind"] != "prefill"]
    modelled = [r for r in decode if r.get("expected_ms") and r.get("plain_ms")]
    plain_rate = sum(r["batch_size"] for r in modelled) / sum(r["plain_ms"] for r in modelled) if modelled else 0
    return Summary(
        label=label, steps=len(rows) - sum(r["group_kind"] == "prefill" for r in rows),
        hit_rate=same / len(spec) if spec else None,
        acceptance_length=acceptance_length(sum(sum(r["accepted"]) for r in speculative),
                                            sum(r["batch_size"] for r in speculative)),
        realign_share=moving_ms / total_ms if total_ms else 0.0, tokens=tokens,
        tokens_per_s=tokens / (total_ms / 1e3) if total_ms else 0.0,
        kv_moved=sum(r["kv_moved"] for r in rows), kv_gathered=sum(r["kv_gathered"] for r in rows),
        k_histogram=dict(sorted(Counter(r["k"] for r in decode).items())),
        expected_gain=(sum(r["expected_tokens"] for r in modelled) / sum(r["expected_ms"] for r in modelled)
                       / plain_rate) if modelled else None,
        realised_gain=(sum(r["tokens_emitted"] for r in modelled) / sum(r["total_ms"] for r in modelled)
                       / plain_rate) if modelled else None,
        arms=arms(decode), prompt_prefilled=sum(r.get("prompt_prefilled") or 0 for r in rows),
        prompt_reused=sum(r.get("prompt_reused") or 0 for r in rows))


def arms(decode: list[dict]) -> dict[str, ArmSummary]:
    out: dict[str, ArmSummary] = {}
    for r in decode:
        arm = r.get("arm") or ""
        if arm:
            summary = out.setdefault(arm, ArmSummary(0, 0.0, []))
            summary.rounds += 1
            summary.seconds += r["total_ms"] / 1e3
            if r.get("window_tokens_per_s"):
                summary.windows.append(r["window_tokens_per_s"])
    return out


USED_COLUMNS = ("bucket", "group_kind", "k", "batch_size", "tokens_emitted", "accepted", "total_ms", "realign_ms",
                "gather_ms", "kv_moved", "kv_gathered")  # the StepStats fields every summary reads


def summarize(path: Path) -> list[Summary]:
    """Per-bucket summaries followed by the overall one; InputError for a file that is no statistics file."""
    table = pq.read_table(path)
    missing = [c for c in USED_COLUMNS if c not in table.column_names]
    if missing:
        hint = (f"; it looks like a completions file: its statistics are in {stats_path_for(path)}"
                if "completion_token_ids" in table.column_names else "")
        raise InputError(f"{path}: not a batchspec statistics file (no column {', '.join(map(repr, missing[:3]))}"
                         f"{hint})")
    rows = table.to_pylist()
    buckets = sorted({r["bucket"] for r in rows})
    out = [summarize_rows(f"bucket {b}", [r for r in rows if r["bucket"] == b]) for b in buckets]
    out.append(summarize_rows("overall", rows))
    return out
