"""Statistics summaries: acceptance length has one definition, and `batchspec stats` reports auto's arms."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.stats import acceptance_length, summarize, summarize_rows
from batchspec_cli.store.outputs import write_stats
from conftest import round_step as step


STEPS = [step("prefill", 4, 0, [], 0),
         step("same_length", 4, 0, [0] * 4, 4, arm="plain"),  # auto's plain steps: not speculative rounds
         step("same_length", 4, 0, [0] * 4, 4, arm="plain", window_tokens_per_s=40.0),
         step("realigned", 2, 3, [3, 1], 6, arm="spec"),  # 2 row-rounds, 4 accepted drafts: 1 + 4 / 2 = 3
         step("same_length", 2, 2, [0, 2], 4, arm="spec", window_tokens_per_s=50.0)]  # 1 + 2 / 2 = 2


def test_acceptance_length_counts_the_bonus_over_speculative_rounds_only():
    summary = summarize_rows("all", [s.record() for s in STEPS])
    assert summary.acceptance_length == pytest.approx(1 + (4 + 2) / (2 + 2))
    assert summary.acceptance_length == acceptance_length(6, 4)
    assert acceptance_length(0, 0) is None
    plain_only = summarize_rows("plain", [s.record() for s in STEPS[:3]])
    assert plain_only.acceptance_length is None


def test_stats_reports_how_long_each_arm_ran_and_what_its_windows_measured(tmp_path):
    path = tmp_path / "out.stats.parquet"
    write_stats(path, STEPS, {})
    overall = summarize(path)[-1]
    assert overall.arms["plain"].rounds == 2 and overall.arms["plain"].seconds == pytest.approx(0.2)
    assert overall.arms["spec"].windows == [50.0] and overall.arms["plain"].windows == [40.0]
    result = CliRunner().invoke(app, ["stats", str(path)])
    assert result.exit_code == 0, result.output
    assert "auto arm plain: ran 0.2 s in 2 rounds; its windows measured 40.0 tok/s" in result.output
    assert "auto arm spec: ran 0.2 s in 2 rounds; its windows measured 50.0 tok/s" in result.output
    assert "2.50" in result.output  # the acceptance length column


def test_the_policy_trace_gives_the_k_histogram_and_expected_against_realised_gain():
    """Over the steps the policy modelled: expected tokens per modelled ms against tokens per measured ms, each over
    the modelled plain rate (the figures ``bench.py`` reports for auto, from this one definition)."""
    steps = [step("prefill", 2, 0, [], 0, 50.0),
             step("same_length", 2, 0, [0, 0], 2, 10.0, expected_tokens=2.0, expected_ms=10.0, plain_ms=10.0),
             step("same_length", 2, 3, [2, 1], 5, 20.0, expected_tokens=6.0, expected_ms=20.0, plain_ms=10.0),
             step("same_length", 2, 3, [1, 1], 4, 10.0)]  # not modelled: left out of the gains
    summary = summarize_rows("auto", [s.record() for s in steps])
    assert summary.k_histogram == {0: 1, 3: 2}
    plain = 4 / 20.0  # rows per modelled plain ms
    assert summary.expected_gain == pytest.approx((8 / 30.0) / plain)
    assert summary.realised_gain == pytest.approx((7 / 30.0) / plain)
