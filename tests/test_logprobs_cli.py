"""`--logprobs` through the real CLI and library job: the Parquet column, per-row N, resume, refusals."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.config import GenerateConfig
from batchspec_cli.engine.events import RowResult, TokenLogprob
from batchspec_cli.job.generation import Generation
from batchspec_cli.models.loading import load_model
from batchspec_cli.store.outputs import LOGPROBS_TYPE, results_from_table, results_table
from batchspec_cli.store.outputs import read_run_metadata
from conftest import save_target_and_draft_dirs

torch.set_num_threads(1)
runner = CliRunner()
PROMPTS = ["Hello there", "What is 2+2?", "Write a haiku about the sea.", "x", "Tell me a story about a fox " * 3,
           "Why?", "List three colours", "abc def ghi", "zzz", "The end"]
TOPS = [None, 0, 5, None, 20, 1, None, 3, None, 2]  # the lp column: null = the job's --logprobs 2
TEMPERATURES = [None, 0.9, None, 1.2, None, None, 0.7, None, None, 1.0]  # greedy and sampled rows


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_target_and_draft_dirs(tmp_path_factory.mktemp("lp_models"))


@pytest.fixture(scope="module")
def reference_model(model_dirs):
    return load_model(str(model_dirs[0]), dtype="float64")


@pytest.fixture()
def prompts_jsonl(tmp_path):
    rows = [{"id": f"q{i}", "prompt": p, "lp": TOPS[i], "temp": TEMPERATURES[i]} for i, p in enumerate(PROMPTS)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generate(inp, out, model_dirs, *extra):
    target, draft = model_dirs
    args = ["generate", inp, out, "--target", target, "--draft", f"{draft},ngram", "--max-new-tokens", "12",
            "--quiet", "--dtype", "float64", "--batch-size", "3", "--temperature-column", "temp", "--seed", "3",
            *extra]
    return runner.invoke(app, [str(a) for a in args])


LOGPROB_FLAGS = ("--logprobs", "2", "--logprobs-column", "lp")


@torch.no_grad()
def reference_logprobs(loaded, prompt: str, completion: list[int]) -> torch.Tensor:
    """[len(completion), V] raw log-probabilities of one plain forward over the chat prompt + completion."""
    tok = loaded.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    logits = loaded.model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : len(ids) - 1 + len(completion)]
    return torch.log_softmax(logits.to(torch.float64), -1)


def test_the_parquet_column_holds_each_tokens_logprob_and_top_n(tmp_path, prompts_jsonl, model_dirs,
                                                                  reference_model):
    out = tmp_path / "out.parquet"
    result = generate(prompts_jsonl, out, model_dirs, *LOGPROB_FLAGS, "--mode", "auto")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.schema.field("completion_logprobs").type == LOGPROBS_TYPE
    tok = reference_model.tokenizer
    for i, row in enumerate(table.to_pylist()):
        top = 2 if TOPS[i] is None else TOPS[i]
        entries, ids = row["completion_logprobs"], row["completion_token_ids"]
        assert len(entries) == len(ids) > 0
        ref = reference_logprobs(reference_model, PROMPTS[i], ids)
        for j, (entry, token) in enumerate(zip(entries, ids)):
            assert entry["token_id"] == token and entry["token"] == tok.decode([token])
            assert math.isclose(entry["logprob"], float(ref[j, token]), abs_tol=1e-10)
            values, best = ref[j].topk(top)
            assert [t["token_id"] for t in entry["top_logprobs"]] == best.tolist()
            assert all(math.isclose(t["logprob"], float(v), abs_tol=1e-10) for t, v in zip(entry["top_logprobs"],
                                                                                          values))
            assert [t["token"] for t in entry["top_logprobs"]] == [tok.decode([t]) for t in best.tolist()]
    meta = read_run_metadata(out)
    assert (meta["logprobs"], meta["logprobs_column"], meta["logprobs_mode"]) == (2, "lp", "raw")
    assert "raw logits" in meta["logprobs_distribution"]

    plain = tmp_path / "plain.parquet"
    assert generate(prompts_jsonl, plain, model_dirs, "--mode", "auto").exit_code == 0
    without = pq.read_table(plain)
    assert "completion_logprobs" not in without.column_names and "logprobs_distribution" not in read_run_metadata(plain)
    assert without.column("completion_token_ids").to_pylist() == table.column("completion_token_ids").to_pylist()


def test_only_rows_that_ask_get_logprobs(tmp_path, prompts_jsonl, model_dirs):
    out = tmp_path / "out.parquet"
    result = generate(prompts_jsonl, out, model_dirs, "--logprobs-column", "lp", "--mode", "exspec",
                      "--logprobs-mode", "processed")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out).to_pylist()
    assert [r["completion_logprobs"] is not None for r in rows] == [t is not None for t in TOPS]
    for r, top, temperature in zip(rows, TOPS, TEMPERATURES):
        if top is not None:
            assert all(len(e["top_logprobs"]) <= top for e in r["completion_logprobs"])
            if not temperature:  # greedy rows: raw; the chosen token is the most probable
                assert all(e["top_logprobs"][:1] in ([], [{k: e[k] for k in ("token", "token_id", "logprob")}])
                           for e in r["completion_logprobs"])
    assert read_run_metadata(out)["logprobs_mode"] == "processed"


@pytest.mark.parametrize("flags,needle", [
    (("--logprobs", "21"), "--logprobs must be between 0 and 20"),
    (("--logprobs", "-1"), "--logprobs must be between 0 and 20"),
    (("--logprobs", "1", "--logprobs-mode", "warped"), "--logprobs-mode must be one of raw, processed"),
    (("--logprobs-column", "nope"), "--logprobs-column names column 'nope'"),
])
def test_bad_logprobs_flags_exit_2(tmp_path, prompts_jsonl, model_dirs, flags, needle):
    out = tmp_path / "out.parquet"
    result = generate(prompts_jsonl, out, model_dirs, *flags)
    assert result.exit_code == 2 and needle in result.output, result.output
    assert not out.exists()


def test_a_bad_logprobs_cell_and_a_clashing_column_exit_2(tmp_path, model_dirs):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p, "lp": n, "temp": 0}) + "\n" for p, n in (("a", 2), ("b", 21))))
    result = generate(inp, tmp_path / "out.parquet", model_dirs, "--logprobs-column", "lp")
    assert result.exit_code == 2 and "row 2: column 'lp' must be an integer >= 0 and <= 20" in result.output
    inp.write_text(json.dumps({"prompt": "a", "temp": 0, "completion_logprobs": 1}) + "\n")
    result = generate(inp, tmp_path / "out.parquet", model_dirs)
    assert result.exit_code == 2 and "'completion_logprobs' clashes with an output column" in result.output


def test_checkpoint_parts_keep_logprobs():
    rows = [RowResult(0, "a", [5, 6], "length", logprobs=[TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)]),
                                                         TokenLogprob(6, -3.0, [(2, -0.1), (6, -3.0)])]),
            RowResult(1, "b", [7], "stop", logprobs=None), RowResult(2, "c", [], "error", error="x"),
            RowResult(3, "d", [8], "stop", logprobs=[TokenLogprob(8, -1e-300, [])])]
    assert results_from_table(results_table(rows)) == rows


def test_resumed_rows_keep_their_logprobs_and_changed_logprobs_flags_are_refused(tmp_path, prompts_jsonl,
                                                                                  model_dirs):
    reference = tmp_path / "ref.parquet"
    assert generate(prompts_jsonl, reference, model_dirs, *LOGPROB_FLAGS, "--mode", "exspec").exit_code == 0
    out = tmp_path / "out.parquet"
    target, draft = model_dirs
    cfg = GenerateConfig(input=prompts_jsonl, output=out, target=str(target), draft=f"{draft},ngram",
                         max_new_tokens=12, quiet=True, dtype="float64", batch_size=3, temperature_column="temp",
                         seed=3, logprobs=2, logprobs_column="lp", mode="exspec", checkpoint_rows=1)
    with Generation.open(cfg) as job:  # stopped as a signal would stop it, with rows saved
        for event in job.events():
            if isinstance(event, RowResult) and job.done_rows == 4:
                job.stop(signal.SIGINT)
        assert job.interrupted and job.saved_rows >= 4

    result = generate(prompts_jsonl, out, model_dirs, "--logprobs", "3", "--logprobs-column", "lp", "--mode",
                      "exspec")
    assert result.exit_code == 2 and "--logprobs: was 2, now 3" in result.output, result.output
    result = generate(prompts_jsonl, out, model_dirs, "--mode", "exspec")
    assert result.exit_code == 2 and "--logprobs: was 2, now None" in result.output, result.output

    log = tmp_path / "log.jsonl"
    result = generate(prompts_jsonl, out, model_dirs, *LOGPROB_FLAGS, "--mode", "exspec", "--log-json", log)
    assert result.exit_code == 0, result.output
    finish = [json.loads(line) for line in log.read_text().splitlines()][-1]
    assert finish["resumed_rows"] >= 4
    a, b = pq.read_table(reference).to_pylist(), pq.read_table(out).to_pylist()
    for x, y in zip(a, b):
        assert x["completion_token_ids"] == y["completion_token_ids"]
        assert len(x["completion_logprobs"]) == len(y["completion_logprobs"])
        for e, f in zip(x["completion_logprobs"], y["completion_logprobs"]):
            assert (e["token_id"], [t["token_id"] for t in e["top_logprobs"]]) == \
                (f["token_id"], [t["token_id"] for t in f["top_logprobs"]])
            assert math.isclose(e["logprob"], f["logprob"], abs_tol=1e-10)
