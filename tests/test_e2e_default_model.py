"""End to end on the real embedded default model (SmolLM2-135M-Instruct), through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.models import cache_dir, default_draft_path, load_model

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "prompts.jsonl"
runner = CliRunner()
pytestmark = pytest.mark.slow


def test_default_model_eqspec_and_exspec_equal_ar_and_verify(tmp_path):
    torch.set_num_threads(1)  # 2 threads thrash when the cores are shared
    load_model(None, quiet=True)  # converts and caches the GGUF once
    draft = default_draft_path() or cache_dir() / "smollm2-135m-instruct"  # the target itself until a draft ships
    common = ["--limit", "3", "--max-new-tokens", "16", "--quiet", "--batch-size", "4", "-k", "3"]
    outputs = {}
    for mode in ("ar", "eqspec", "exspec"):
        out = tmp_path / f"{mode}.parquet"
        extra = [] if mode == "ar" else ["--draft", str(draft)]
        result = runner.invoke(app, ["generate", str(SAMPLE), str(out), "--mode", mode, *common, *extra])
        assert result.exit_code == 0, result.output
        outputs[mode] = pq.read_table(out).to_pylist()
    for row_ar, row_eq, row_ex in zip(outputs["ar"], outputs["eqspec"], outputs["exspec"]):
        assert row_ar["completion"].strip(), "a sensible, non-empty completion"
        assert row_eq["completion_token_ids"] == row_ar["completion_token_ids"]
        assert row_ex["completion_token_ids"] == row_ar["completion_token_ids"]
    verified = runner.invoke(app, ["verify", str(tmp_path / "exspec.parquet")])
    assert verified.exit_code == 0, verified.output


def test_default_mode_on_24_sample_prompts_equals_per_prompt_decoding_at_two_batch_sizes(tmp_path):
    """`auto` with the shipped draft and `suffix` (the defaults), 24 prompts x 48 tokens, batch 4 and 16:
    `batchspec verify` re-decodes every row alone with plain `generate` and finds no unexplained mismatch."""
    load_model(None, quiet=True)
    outputs = {}
    for batch_size in (4, 16):
        out = tmp_path / f"b{batch_size}.parquet"
        result = runner.invoke(app, ["generate", str(SAMPLE), str(out), "--limit", "24", "--max-new-tokens", "48",
                                     "--batch-size", str(batch_size), "--quiet"])
        assert result.exit_code == 0, result.output
        outputs[batch_size] = pq.read_table(out).to_pylist()
        verified = runner.invoke(app, ["verify", str(out)])
        assert verified.exit_code == 0 and "24 rows" in verified.output, verified.output
        assert "0 unexplained" in verified.output
    same = sum(a["completion_token_ids"] == b["completion_token_ids"] for a, b in zip(outputs[4], outputs[16]))
    assert same >= 22, f"only {same} of 24 rows agree between batch sizes (float32 near-ties aside)"
    assert sum(len(r["completion_token_ids"]) for r in outputs[4]) > 24 * 20  # real completions, not empty rows
