"""The benchmark's bookkeeping: the palindrome order is fair to every mode, and pooled runs count all their tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench  # noqa: E402
from batchspec_cli.events import StepStats  # noqa: E402


def step(kind, rows, accepted, emitted, total_ms):
    return StepStats(bucket=0, step=0, group_kind=kind, batch_size=rows, k=5, accepted=accepted,
                     tokens_emitted=emitted, pad_before=0, pad_after=0, kv_moved=0, kv_gathered=0, draft_ms=0.0,
                     verify_ms=total_ms, realign_ms=0.0, gather_ms=0.0, total_ms=total_ms)


def test_palindrome_gives_every_mode_the_same_mean_position():
    plan = [("ar", 0), ("eqspec", 5), ("exspec", 5)]
    order = bench.run_order(plan, "palindrome")
    assert sorted(order) == sorted(plan * 2)
    means = {m: sum(i for i, x in enumerate(order) if x == m) / 2 for m in plan}
    assert len(set(means.values())) == 1
    assert bench.run_order(plan, "given") == plan


def test_pooled_runs_are_total_tokens_over_total_time():
    def run(tokens, wall, accepted):
        results = {0: SimpleNamespace(token_ids=list(range(tokens)))}
        stats = [step("prefill", 1, [0], 0, 100.0), step("same_length", 1, [accepted], accepted + 1, 400.0)]
        return results, stats, wall

    row = bench.summarize([run(6, 2.0, 2), run(6, 4.0, 4)])
    assert row["tokens"] == 12 and row["wall_s"] == 6.0
    assert row["tokens_per_s"] == 2.0  # not the mean of 3 and 1.5 tok/s
    assert row["runs_tokens_per_s"] == [3.0, 1.5]
    assert row["decode_tokens_per_s"] == 12 / 0.8
    assert row["accepted_per_round"] == 3.0 and row["acceptance_length"] == 4.0
    assert row["step_ms"]["total"] == 1000.0 and row["step_ms"]["verify"] == 1000.0


def run_bench(tmp_path, monkeypatch, corrupt: str | None):
    """bench.main() on tiny saved models and six Spec-Bench-like questions; `corrupt` alters one row of that mode."""
    from conftest import save_target_and_draft_dirs

    target, draft = save_target_and_draft_dirs(tmp_path / "models")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"category": c, "turns": [f"Question about {c}?"]}) + "\n"
                                 for c in ("writing", "translation", "summarization", "qa", "math_reasoning", "rag")))
    monkeypatch.setattr(bench, "SPEC_BENCH", questions)
    real_run_mode = bench.run_mode

    def run_mode(target_, draft_, eos, reqs, mode, k, batch_size):
        results, stats, wall = real_run_mode(target_, draft_, eos, reqs, mode, k, batch_size)
        if mode == corrupt:
            results[4].token_ids[-1] += 1
        return results, stats, wall

    monkeypatch.setattr(bench, "run_mode", run_mode)
    monkeypatch.setattr(bench, "forward_costs", lambda *args: (0.2, {5: 1.5}))  # random ids beyond a tiny vocabulary
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench.py", "--prompts", "6", "--batch-sizes", "2", "--max-new-tokens", "3",
                                      "--target", str(target), "--draft", str(draft), "--dtype", "float64",
                                      "--order", "given", "--out", str(out)])
    bench.main()
    return json.loads(out.read_text())


def test_bench_passes_when_every_mode_gives_the_same_rows(tmp_path, monkeypatch):
    record = run_bench(tmp_path, monkeypatch, corrupt=None)
    assert record["mismatches_vs_ar"] == {"2": {"ar": 0, "eqspec-k5": 0, "exspec-k5": 0}}


def test_bench_fails_and_names_the_rows_when_a_mode_differs(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        run_bench(tmp_path, monkeypatch, corrupt="exspec")
    message = str(exit_info.value.code)
    assert exit_info.value.code not in (0, None) and "batch 2: exspec-k5 differs from ar in rows 4" in message
    assert "eqspec" not in message
    record = json.loads((tmp_path / "bench.json").read_text())  # the results are written all the same
    assert record["mismatched_rows"] == {"2": {"exspec-k5": [4]}}
