"""The real CLI on real small files, through typer's CliRunner, with tiny saved models."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.models import native
from batchspec_cli.models.loading import load_model
from batchspec_cli.store.outputs import read_run_metadata
from conftest import (save_target_and_draft_dirs, greedy_reference, make_tokenizer, save_tiny_model_dir,
                      tamper_token)

torch.set_num_threads(1)
runner = CliRunner()
PROMPTS = ["Hello there", "What is 2+2?", "Write a haiku about the sea.", "x", "Tell me a story about a fox " * 3,
           "Why?", "List three colours", "abc def ghi"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_target_and_draft_dirs(tmp_path_factory.mktemp("cli_models"))


@pytest.fixture()
def prompts_jsonl(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": p, "extra": i} for i, p in enumerate(PROMPTS)])


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def generate(inp, out, target, *extra):
    return invoke("generate", inp, out, "--target", target, "--max-new-tokens", "12", "--quiet", "--dtype",
                  "float64", *extra)


def references(target_dir: Path, max_new: int, chat: bool = True) -> list[list[int]]:
    loaded = load_model(str(target_dir), dtype="float64")
    tok = loaded.tokenizer
    out = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        out.append(greedy_reference(loaded.model, ids, max_new, [tok.eos_token_id]))
    return out


@pytest.mark.parametrize("mode", ["auto", "ar", "eqspec", "exspec"])
def test_generate_jsonl_every_mode_matches_greedy(tmp_path, prompts_jsonl, model_dirs, mode):
    target, draft = model_dirs
    out = tmp_path / "out.parquet"
    result = generate(prompts_jsonl, out, target, "--draft", draft, "--mode", mode, "--batch-size", "3")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [f"q{i}" for i in range(len(PROMPTS))]  # input order
    assert table.column("extra").to_pylist() == list(range(len(PROMPTS)))  # passed through
    assert [list(x) for x in table.column("completion_token_ids").to_pylist()] == references(target, 12)
    meta = read_run_metadata(out)
    assert meta["mode"] == mode and meta["draft_tokens"] == 5 and meta["batch_size"] == 3
    stats = pq.read_table(tmp_path / "out.stats.parquet").to_pylist()
    spec = [s for s in stats if s["group_kind"] != "prefill"]
    assert sum(sum(s["accepted"]) for s in spec) == sum(table.column("accepted_tokens").to_pylist())
    assert not list(tmp_path.glob(".*work*")), "work directory removed after success"


def test_generate_parquet_input_and_verify_and_stats(tmp_path, model_dirs):
    target, draft = model_dirs
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), inp)
    out = tmp_path / "out.parquet"
    result = generate(inp, out, target, "--draft", draft, "--mode", "exspec")
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).column("id").to_pylist() == [str(i) for i in range(len(PROMPTS))]
    verified = invoke("verify", out)
    assert verified.exit_code == 0, verified.output
    assert "8 exact (100.0 %)" in verified.output and "0 unexplained" in verified.output
    summary = invoke("stats", tmp_path / "out.stats.parquet")
    assert summary.exit_code == 0 and "overall" in summary.output


def test_verify_flags_a_tampered_row(tmp_path, prompts_jsonl, model_dirs):
    target, _ = model_dirs
    out = tmp_path / "out.parquet"
    assert generate(prompts_jsonl, out, target, "--mode", "ar").exit_code == 0
    tamper_token(out, 0, 1, 7)
    result = invoke("verify", out)
    assert result.exit_code == 1 and "1 unexplained" in result.output


def test_verify_audits_sampled_rows_and_flags_a_tampered_one(tmp_path, prompts_jsonl, model_dirs):
    target, draft = model_dirs
    out = tmp_path / "out.parquet"
    sampled = ("--temperature", "0.9", "--top-p", "0.9", "--seed", "3", "--draft", draft)
    assert generate(prompts_jsonl, out, target, *sampled, "--mode", "exspec").exit_code == 0
    verified = invoke("verify", out)
    assert verified.exit_code == 0 and "8 exact (100.0 %)" in verified.output, verified.output
    plain = tmp_path / "ar.parquet"  # and the same rows whatever produced them
    assert generate(prompts_jsonl, plain, target, *sampled, "--mode", "ar").exit_code == 0
    assert pq.read_table(plain).column("completion").to_pylist() == pq.read_table(out).column("completion").to_pylist()
    tamper_token(out, 2, 0, 11)
    result = invoke("verify", out)
    assert result.exit_code == 1 and "1 unexplained" in result.output, result.output


def test_bucket_directory_then_generate(tmp_path, prompts_jsonl, model_dirs):
    target, draft = model_dirs
    buckets = tmp_path / "buckets"
    made = invoke("bucket", prompts_jsonl, buckets, "--target", target, "--min-rows", "2")
    assert made.exit_code == 0, made.output
    assert (buckets / "manifest.json").exists()
    out = tmp_path / "out.parquet"
    result = generate(buckets, out, target, "--draft", draft)
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [f"q{i}" for i in range(len(PROMPTS))]
    assert [list(x) for x in table.column("completion_token_ids").to_pylist()] == references(target, 12)


def test_a_target_without_a_draft_gets_the_suffix_drafter(tmp_path, prompts_jsonl, model_dirs):
    target, _ = model_dirs
    out = tmp_path / "out.parquet"
    result = generate(prompts_jsonl, out, target)
    assert result.exit_code == 0, result.output
    meta = read_run_metadata(out)
    assert meta["mode"] == "auto" and meta["drafters"] == ["suffix"] and meta["draft"] is None
    assert [list(x) for x in pq.read_table(out).column("completion_token_ids").to_pylist()] == references(target, 12)
    fixed = tmp_path / "fixed.parquet"  # a fixed k speculates with it every round
    assert generate(prompts_jsonl, fixed, target, "--mode", "exspec", "--draft", "ngram,suffix").exit_code == 0
    assert read_run_metadata(fixed)["drafters"] == ["ngram", "suffix"]
    steps = pq.read_table(tmp_path / "fixed.stats.parquet").to_pylist()
    assert {s["drafter"] for s in steps if s["drafted"]} <= {"ngram", "suffix", "ngram,suffix"}
    assert pq.read_table(fixed).column("completion").to_pylist() == pq.read_table(out).column("completion").to_pylist()


def test_draft_lists_are_checked(tmp_path, prompts_jsonl, model_dirs):
    target, draft = model_dirs
    for bad, needle in (("ngram,,suffix", "empty name"), (f"{draft},{draft}", "at most one draft model")):
        result = generate(prompts_jsonl, tmp_path / "out.parquet", target, "--draft", bad)
        assert result.exit_code == 2 and needle in result.output, result.output


def test_stop_string_cuts_text(tmp_path, model_dirs):
    target, _ = model_dirs
    first = tmp_path / "first.parquet"
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    assert generate(inp, first, target, "--mode", "ar").exit_code == 0
    text = pq.read_table(first).column("completion").to_pylist()[2]
    stop = text[3:5]
    out = tmp_path / "out.parquet"
    assert generate(inp, out, target, "--mode", "ar", "--stop", stop).exit_code == 0
    row = pq.read_table(out).to_pylist()[2]
    assert row["finish_reason"] == "stop_string"
    assert stop not in row["completion"] and text.startswith(row["completion"])


BAD_FLAGS = [
    (["--batch-size", "0"], "--batch-size"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--mode", "fast"], "--mode"),
    (["--draft-tokens", "0"], "--draft-tokens"),
    (["--top-p", "0"], "--top-p"),
]


@pytest.mark.parametrize("flags,needle", BAD_FLAGS)
def test_bad_flags_exit_2_and_write_nothing(tmp_path, prompts_jsonl, model_dirs, flags, needle):
    out = tmp_path / "out.parquet"
    result = invoke("generate", prompts_jsonl, out, "--target", model_dirs[0], *flags)
    assert result.exit_code == 2 and needle in result.output
    assert not out.exists()


def bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    no_column = write_jsonl(tmp_path / "nocol.jsonl", [{"text": "hi"}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    suffix = tmp_path / "in.csv"
    suffix.write_text("prompt\nhi\n")
    return {
        "missing file": (tmp_path / "nope.jsonl", "nope.jsonl"),
        "unknown suffix": (suffix, ".csv"),
        "malformed line": (malformed, "line 2"),
        "missing column": (no_column, "prompt"),
        "empty input": (empty, "empty.jsonl"),
    }


@pytest.mark.parametrize("case", ["missing file", "unknown suffix", "malformed line", "missing column",
                                  "empty input"])  # a bad prompt is an error row: test_hostile_rows.py
def test_bad_input_exit_2_and_write_nothing(tmp_path, model_dirs, case):
    path, needle = bad_inputs(tmp_path)[case]
    out = tmp_path / "out.parquet"
    result = invoke("generate", path, out, "--target", model_dirs[0])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert not out.exists() and not list(tmp_path.glob("*.stats.parquet"))


def test_existing_output_refused_then_overwritten(tmp_path, prompts_jsonl, model_dirs):
    out = tmp_path / "out.parquet"
    out.write_bytes(b"precious")
    result = invoke("generate", prompts_jsonl, out, "--target", model_dirs[0], "--max-new-tokens", "2")
    assert result.exit_code == 2 and "--overwrite" in result.output and out.read_bytes() == b"precious"
    result = invoke("generate", prompts_jsonl, out, "--target", model_dirs[0], "--max-new-tokens", "2",
                    "--overwrite")
    assert result.exit_code == 0 and pq.read_table(out).num_rows == len(PROMPTS)


def test_unwritable_output_directory(tmp_path, prompts_jsonl, model_dirs):
    out = tmp_path / "missing-dir" / "out.parquet"
    result = invoke("generate", prompts_jsonl, out, "--target", model_dirs[0])
    assert result.exit_code == 2 and "missing-dir" in result.output


def test_unknown_model_path(tmp_path, prompts_jsonl):
    out = tmp_path / "out.parquet"
    result = invoke("generate", prompts_jsonl, out, "--target", str(tmp_path / "no-model"))
    assert result.exit_code == 2 and "no-model" in result.output and not out.exists()


def test_mismatched_draft_vocabulary_refused(tmp_path, prompts_jsonl, model_dirs):
    other = save_tiny_model_dir(tmp_path / "other", seed=2)
    make_tokenizer(other, shuffle_seed=1)  # same tokens, other ids
    out = tmp_path / "out.parquet"
    result = invoke("generate", prompts_jsonl, out, "--target", model_dirs[0], "--draft", other, "--mode", "eqspec")
    assert result.exit_code == 2 and "vocab" in result.output.lower() and not out.exists()


def test_column_clash_refused(tmp_path, model_dirs):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", "completion": "x"}])
    result = invoke("generate", inp, tmp_path / "out.parquet", "--target", model_dirs[0])
    assert result.exit_code == 2 and "completion" in result.output


def test_packed_kernels_give_the_stock_kernels_output(tmp_path, prompts_jsonl, model_dirs):
    target, draft = model_dirs
    outs = {}
    for name in ("stock", "packed", None):  # None: the default, auto, which packs a float32 model on a CPU
        out = tmp_path / f"{name}.parquet"
        result = invoke("generate", prompts_jsonl, out, "--target", target, "--draft", draft, "--max-new-tokens",
                        "12", "--quiet", "--dtype", "float32", *(["--kernels", name] if name else []))
        assert result.exit_code == 0, result.output
        assert read_run_metadata(out)["kernels"] == (name or "packed")  # the kernels that ran
        built = native.load()  # packed runs batchspec's attention kernels where they build, and says which
        assert read_run_metadata(out)["attention"] == ("sdpa" if name == "stock" or built.attend is None
                                                       else f"batchspec {built.key}")
        outs[name] = pq.read_table(out).column("completion_token_ids").to_pylist()
    assert outs["packed"] == outs["stock"] == outs[None]
    out = tmp_path / "f64.parquet"
    assert invoke("generate", prompts_jsonl, out, "--target", target, "--max-new-tokens", "4", "--quiet",
                  "--dtype", "float64").exit_code == 0
    assert read_run_metadata(out)["kernels"] == "stock"  # auto: oneDNN packs float32 only
    bad = invoke("generate", prompts_jsonl, tmp_path / "x.parquet", "--target", target, "--kernels", "fast")
    assert bad.exit_code == 2 and "--kernels must be one of auto, stock, packed" in bad.output


def test_threads_apply_to_the_job_alone(tmp_path, prompts_jsonl, model_dirs):
    """--threads sets torch's thread count for the run; the caller's process gets its own back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = generate(prompts_jsonl, tmp_path / "out.parquet", model_dirs[0], "--mode", "ar", "--threads", "1")
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("given,expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_sets_a_passive_openmp_wait_policy_before_torch_loads(given, expected):
    """OpenMP reads its wait policy once, when torch loads it: the command sets it first, unless the user chose."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
    code = ("import os, sys\n"
            "class Spy:  # records the wait policy at the moment torch is first imported\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch': print(os.environ.get('OMP_WAIT_POLICY'))\n"
            "sys.meta_path.insert(0, Spy())\n"
            "import batchspec_cli.cli\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
