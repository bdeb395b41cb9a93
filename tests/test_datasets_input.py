"""Hugging Face datasets as input: save_to_disk directories, globs of files, hub ids (offline)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.config import GenerateConfig
from batchspec_cli.engine.events import RowResult
from batchspec_cli.job.generation import Generation, work_dir_for
from conftest import save_tiny_model_dir

torch.set_num_threads(1)
runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"id": f"q{i}", "prompt": p, "temperature": t}
        for i, (p, t) in enumerate(zip(["Hello there", "What is 2+2?", "Write a haiku", "x", "Tell me a story",
                                        "Why?", "List three colours", "abc def"], [None, 0.8] * 4))]
CHATS = [{"id": f"c{i}", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}]}
         for i, p in enumerate(["Hi", "What is up?", "Name a fruit"])]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("ds_model"), seed=0)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def generate(inp, out, target, *extra):
    return invoke("generate", inp, out, "--target", target, "--quiet", "--dtype", "float64", "--max-new-tokens", "10",
                  "--mode", "ar", "--temperature-column", "temperature", *extra)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def completions(path: Path) -> list[tuple]:
    table = pq.read_table(path)
    return list(zip(*(table.column(c).to_pylist() for c in ("id", "completion", "completion_token_ids",
                                                               "finish_reason"))))


def test_saved_dataset_and_parquet_glob_give_the_jsonl_files_completions(tmp_path, target):
    reference = tmp_path / "ref.parquet"
    assert generate(write_jsonl(tmp_path / "in.jsonl", ROWS), reference, target).exit_code == 0
    expected = completions(reference)
    assert {r[3] for r in expected} <= {"stop", "length"}

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    split_dict = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                          "test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(split_dict))
    shards = tmp_path / "shards"
    shards.mkdir()
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table.slice(0, 5), shards / "part-0.parquet")
    pq.write_table(table.slice(5), shards / "part-1.parquet")
    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    (csv_dir / "a.csv").write_text("id,prompt,temperature\n" + "".join(
        f'{r["id"]},"{r["prompt"]}",{"" if r["temperature"] is None else r["temperature"]}\n' for r in ROWS))
    for i, (source, extra) in enumerate([(saved, ()), (split_dict, ("--split", "test")),
                                         (shards / "*.parquet", ()), (csv_dir / "*.csv", ())]):
        out = tmp_path / f"out{i}.parquet"
        result = generate(source, out, target, *extra)
        assert result.exit_code == 0, (source, result.output)
        assert completions(out) == expected, source
        assert pq.read_table(out).column("temperature").to_pylist() == [r["temperature"] for r in ROWS]


def test_chat_messages_from_a_dataset_match_the_jsonl_file(tmp_path, target):
    reference = tmp_path / "ref.parquet"
    flags = ("--prompt-column", "messages", "--id-column", "id", "--system", "ignored: the rows have one")
    inp = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    assert invoke("generate", inp, reference, "--target", target, "--quiet", "--dtype", "float64",
                  "--max-new-tokens", "8", "--mode", "ar", *flags).exit_code == 0
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(CHATS).save_to_disk(str(saved))
    out = tmp_path / "out.parquet"
    result = invoke("generate", saved, out, "--target", target, "--quiet", "--dtype", "float64", "--max-new-tokens",
                    "8", "--mode", "ar", "--limit", "2", *flags)
    assert result.exit_code == 0, result.output
    assert completions(out) == completions(reference)[:2]


def test_missing_split_or_column_exits_2_listing_what_exists(tmp_path, target):
    split_dict = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(split_dict))
    result = generate(split_dict, tmp_path / "o.parquet", target, "--split", "validation")
    assert result.exit_code == 2 and "no split 'validation'; splits are: 'train', 'test'" in result.output
    result = generate(split_dict, tmp_path / "o.parquet", target, "--prompt-column", "question")
    assert result.exit_code == 2, result.output
    assert "no prompt column 'question'; columns are: 'id', 'prompt', 'temperature'" in result.output
    result = generate(tmp_path / "nothing-*.parquet", tmp_path / "o.parquet", target)
    assert result.exit_code == 2 and "no files match" in result.output
    result = generate(write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "o.parquet", target, "--split", "test")
    assert result.exit_code == 2 and "--split and --config apply to Hugging Face datasets" in result.output
    assert not (tmp_path / "o.parquet").exists()


def test_a_changed_saved_dataset_is_refused_on_resume(tmp_path, target):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    out = tmp_path / "out.parquet"
    cfg = GenerateConfig(input=saved, output=out, target=str(target), mode="ar", max_new_tokens=10, dtype="float64",
                         batch_size=2, checkpoint_rows=1, temperature_column="temperature", quiet=True)
    with Generation.open(cfg) as job:
        for event in job.events():
            if isinstance(event, RowResult) and job.done_rows == 3:
                job.stop(signal.SIGINT)
        assert job.interrupted
    changed = [dict(r, prompt=r["prompt"] + "!") if r["id"] == "q6" else r for r in ROWS]
    datasets.Dataset.from_list(changed).save_to_disk(str(tmp_path / "saved2"))
    for f in saved.iterdir():
        f.unlink()
    for f in (tmp_path / "saved2").iterdir():
        f.rename(saved / f.name)
    result = generate(saved, out, target)
    assert result.exit_code == 2 and "the input's contents changed" in result.output, result.output
    assert (work_dir_for(out) / "job.json").exists()


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_fails_fast_offline_with_a_one_line_message(tmp_path, target, offline):
    """No network here: with HF_HUB_OFFLINE=1 only the cache is read; without it, one bounded connect decides."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_ENDPOINT": "http://10.255.255.1:9"}  # blackholed
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", "from batchspec_cli.cli import app; app()", "generate",
                           "someone/no-such-dataset", str(tmp_path / "o.parquet"), "--target", str(target), "--quiet"],
                          env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    message = " ".join(proc.stderr.split())
    assert "someone/no-such-dataset" in message and "HF_HUB_OFFLINE" in message, message
    assert str(tmp_path / "cache") in message and "Traceback" not in proc.stderr
    assert elapsed < 60, elapsed
