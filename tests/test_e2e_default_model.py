"""End to end on the real embedded default model (SmolLM2-135M-Instruct), through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.models.loading import cache_dir, default_draft_path, load_model

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "prompts.jsonl"
runner = CliRunner()
pytestmark = pytest.mark.slow


def test_default_model_eqspec_and_exspec_equal_ar_and_verify(tmp_path):
    torch.set_num_threads(1)  # 2 threads thrash when the cores are shared
    load_model(None, quiet=True)  # converts and caches the GGUF once
    draft = default_draft_path() or cache_dir() / "smollm2-135m-instruct"  # the target itself until a draft ships
    common = ["--limit", "3", "--max-new-tokens", "16", "--quiet", "--batch-size", "4", "-k", "3", "--dtype", "float32"]
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
    """`auto` with the shipped draft and `suffix` (the defaults), float32, 24 prompts x 48 tokens, batch 4 and 16:
    `batchspec verify` re-decodes every row alone with plain `generate` and finds no unexplained mismatch."""
    load_model(None, quiet=True)
    outputs = {}
    for batch_size in (4, 16):
        out = tmp_path / f"b{batch_size}.parquet"
        result = runner.invoke(app, ["generate", str(SAMPLE), str(out), "--limit", "24", "--max-new-tokens", "48",
                                     "--batch-size", str(batch_size), "--quiet", "--dtype", "float32"])
        assert result.exit_code == 0, result.output
        outputs[batch_size] = pq.read_table(out).to_pylist()
        verified = runner.invoke(app, ["verify", str(out)])
        assert verified.exit_code == 0 and "24 rows" in verified.output, verified.output
        assert "0 unexplained" in verified.output
    same = sum(a["completion_token_ids"] == b["completion_token_ids"] for a, b in zip(outputs[4], outputs[16]))
    assert same >= 22, f"only {same} of 24 rows agree between batch sizes (float32 near-ties aside)"
    assert sum(len(r["completion_token_ids"]) for r in outputs[4]) > 24 * 20  # real completions, not empty rows


def test_bfloat16_passes_its_audit_and_gives_the_same_rows_run_after_run(tmp_path):
    """`--dtype bfloat16` (the default on a CPU with AMX tiles; auto mode, the batch measured), 16 prompts x 32
    tokens, twice: `batchspec verify` finds no unexplained mismatch in the dtype's own units, and both runs wrote the
    same rows."""
    torch.set_num_threads(1)
    load_model(None, quiet=True)
    rows = []
    for run in (1, 2):
        out = tmp_path / f"run{run}.parquet"
        result = runner.invoke(app, ["generate", str(SAMPLE), str(out), "--limit", "16", "--max-new-tokens", "32",
                                     "--dtype", "bfloat16", "--quiet"])
        assert result.exit_code == 0, result.output
        rows.append([r["completion_token_ids"] for r in pq.read_table(out).to_pylist()])
    verified = runner.invoke(app, ["verify", str(tmp_path / "run1.parquet")])
    assert verified.exit_code == 0 and "16 rows" in verified.output and "0 unexplained" in verified.output, \
        verified.output
    assert rows[0] == rows[1]
    assert sum(map(len, rows[0])) > 16 * 10


def test_mixed_rows_are_the_same_at_every_batch_and_mode_and_pass_their_audit(tmp_path):
    """`--dtype mixed` (bfloat16 products, float32 sums and activations), 12 prompts x 24 tokens: `ar` at batch 1,
    the default (auto, the batch measured, the shipped draft) and `exspec -b 5` write the same tokens row for row,
    and `batchspec verify` (transformers' float32 arithmetic on the same rounded numbers) finds none unexplained."""
    from batchspec_cli.models import native

    if not native.load().linear:
        pytest.skip("--dtype mixed keeps rows batch-independent on batchspec's kernel: this CPU has no AVX512-BF16")
    torch.set_num_threads(1)
    load_model(None, quiet=True)
    rows = {}
    arms = (("ar1", ["--mode", "ar", "-b", "1"]), ("default", []), ("ex5", ["--mode", "exspec", "-b", "5"]))
    for name, extra in arms:
        out = tmp_path / f"{name}.parquet"
        result = runner.invoke(app, ["generate", str(SAMPLE), str(out), "--limit", "12", "--max-new-tokens", "24",
                                     "--dtype", "mixed", "--quiet", *extra])
        assert result.exit_code == 0, result.output
        rows[name] = [r["completion_token_ids"] for r in pq.read_table(out).to_pylist()]
    assert rows["default"] == rows["ar1"] and rows["ex5"] == rows["ar1"]
    assert sum(map(len, rows["ar1"])) > 12 * 12
    assert json.loads(pq.read_schema(tmp_path / "default.parquet").metadata[b"batchspec"])["dtype"] == "mixed"
    verified = runner.invoke(app, ["verify", str(tmp_path / "default.parquet")])
    assert verified.exit_code == 0 and "12 rows" in verified.output and "0 unexplained" in verified.output, \
        verified.output
    assert "bfloat16 units" in verified.output


def test_logprobs_5_on_12_prompts_match_a_per_prompt_plain_forward_within_1e_4(tmp_path):
    """`--logprobs 5`, default mode and drafters: every token's log-probability and its top 5 equal those of one
    plain forward of the target over that prompt and completion alone (float32: within 1e-4)."""
    torch.set_num_threads(1)
    loaded = load_model(None, dtype="float32", quiet=True)
    out = tmp_path / "lp.parquet"
    result = runner.invoke(app, ["generate", str(SAMPLE), str(out), "--limit", "12", "--max-new-tokens", "32",
                                 "--logprobs", "5", "--quiet", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    tok, model = loaded.tokenizer, loaded.model
    prompts = [json.loads(line)["prompt"] for line in SAMPLE.read_text().splitlines()[:12]]
    worst, tokens = 0.0, 0
    for prompt, row in zip(prompts, pq.read_table(out).to_pylist()):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        completion = row["completion_token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : len(ids) - 1 + len(completion)]
        ref = torch.log_softmax(logits.double(), -1)
        assert len(row["completion_logprobs"]) == len(completion) > 0
        for j, (entry, token) in enumerate(zip(row["completion_logprobs"], completion)):
            values, best = ref[j].topk(5)
            listed = [t["logprob"] for t in entry["top_logprobs"]]
            worst = max(worst, abs(entry["logprob"] - float(ref[j, token])),
                        *(abs(v - float(e)) for v, e in zip(listed, values)),  # rank by rank
                        *(abs(t["logprob"] - float(ref[j, t["token_id"]])) for t in entry["top_logprobs"]))
            assert len(listed) == 5 and entry["token_id"] == token
            tokens += 1
    assert worst < 1e-4, worst
    assert tokens > 12 * 20


ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "answer", "confident"],
                 "properties": {"topic": {"type": "string", "maxLength": 30},
                                "answer": {"type": "string", "maxLength": 80}, "confident": {"type": "boolean"}}}


def test_json_schema_rows_in_float32_equal_per_prompt_constrained_decoding_in_the_speculative_modes(tmp_path):
    """The real model in float32 under a JSON schema: eqspec, exspec and auto (each with its drafters) at
    batch 4 to 16 (ar is the reference of the float64 tests in test_structured.py). `batchspec verify` re-decodes every row alone with plain `generate` under a fresh llguidance
    matcher's mask and finds no mismatch beyond a float near-tie; every finished row validates (jsonschema)."""
    import jsonschema

    torch.set_num_threads(1)
    load_model(None, quiet=True)
    schema = tmp_path / "answer.schema.json"
    schema.write_text(json.dumps(ANSWER_SCHEMA))
    # eqspec and auto: the defaults (the shipped draft, grammar; auto adds suffix); exspec: the model-free drafters
    runs = {("eqspec", 8): ["-k", "3"], ("exspec", 16): ["--draft", "grammar,suffix", "-k", "4"], ("auto", 4): []}
    tokens = {}
    for (mode, batch), extra in runs.items():
        out = tmp_path / f"{mode}{batch}.parquet"
        result = runner.invoke(app, ["generate", str(SAMPLE), str(out), "--limit", "6", "--max-new-tokens", "40",
                                     "--json-schema", str(schema), "--mode", mode, "--batch-size", str(batch),
                                     "--quiet", "--dtype", "float32", *extra])
        assert result.exit_code == 0, result.output
        verified = runner.invoke(app, ["verify", str(out)])
        assert verified.exit_code == 0 and "6 rows" in verified.output and "0 unexplained" in verified.output, \
            verified.output
        rows = pq.read_table(out).to_pylist()
        tokens[mode] = [r["completion_token_ids"] for r in rows]
        finished = [r for r in rows if r["finish_reason"] == "stop"]
        assert len(finished) >= 3, [r["completion"] for r in rows]
        for r in finished:
            jsonschema.validate(json.loads(r["completion"]), ANSWER_SCHEMA)
    same = sum(len({tuple(t[i]) for t in tokens.values()}) == 1 for i in range(6))
    assert same >= 5, f"only {same} of 6 rows agree across the modes (float32 near-ties aside)"
