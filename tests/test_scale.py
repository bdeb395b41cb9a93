"""A job's memory does not grow with its rows; killed three times (once while writing OUT), it still ends with
every row once, equal to an uninterrupted run, readable by pyarrow, pandas and DuckDB in input order.

The kills run the real CLI in subprocesses on tiny saved models, through a wrapper that only slows the run
down (a pause after each checkpoint part and each range of the finish) so a kill lands where it is meant to.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.config import GenerateConfig
from batchspec_cli.job.generation import Generation, work_dir_for
from batchspec_cli.store import merge
from conftest import save_target_and_draft_dirs, save_tiny_model_dir

torch.set_num_threads(1)
WORDS = "the quick brown fox jumps over a lazy dog by the sea; tell me a story, write a haiku".split()


def write_prompts(path: Path, rows: int) -> Path:
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": " ".join(rng.choice(WORDS) for _ in
                                                                            range(rng.randint(1, 8)))}) + "\n"
                            for i in range(rows)))
    return path


# --------------------------------------------------------------------------- memory


def held_by_the_run(model: Path, root: Path, rows: int) -> tuple[int, int]:
    """Python memory (tracemalloc) the job holds once every row ran, and the finish's peak above that."""
    inp = write_prompts(root / f"in{rows}.jsonl", rows)
    cfg = GenerateConfig(input=inp, output=root / f"out{rows}.parquet", target=str(model), mode="ar", batch_size=8,
                         max_new_tokens=4, dtype="float32", checkpoint_rows=16, quiet=True)
    with Generation.open(cfg) as job:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in job.events():
                pass
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.reset_peak()
            job.finish()
            finish_peak = tracemalloc.get_traced_memory()[1] - before - held
        finally:
            tracemalloc.stop()
    assert pq.read_table(cfg.output).num_rows == rows
    return held, finish_peak


def test_memory_held_does_not_grow_with_the_rows(tmp_path, monkeypatch):
    """Between N and 4N rows, what the job holds after its rows ran (today: a bitmap of done rows, one byte a
    row) and the finish's peak (one range of rows at a time) grow by far less than a finished row's objects
    (a RowResult and its share of StepStats: hundreds of bytes a row)."""
    monkeypatch.setattr(merge, "MIN_RANGE_ROWS", 64)
    model = save_tiny_model_dir(tmp_path / "model", seed=0)
    small, large = 100, 400
    held_small, finish_small = held_by_the_run(model, tmp_path, small)
    held_large, finish_large = held_by_the_run(model, tmp_path, large)
    per_row = (held_large - held_small) / (large - small)
    per_row_finish = (finish_large - finish_small) / (large - small)
    assert per_row < 250, (held_small, held_large)
    assert per_row_finish < 250, (finish_small, finish_large)


def held_after_open(model: Path, root: Path, rows: int) -> int:
    """Python (tracemalloc) and Arrow memory the job holds once it is open: input read, prompts tokenized and
    bucketed, model loaded, nothing generated yet."""
    inp = write_prompts(root / f"open{rows}.jsonl", rows)
    cfg = GenerateConfig(input=inp, output=root / f"open{rows}.parquet", target=str(model), mode="ar", batch_size=8,
                         max_new_tokens=4, dtype="float32", quiet=True)
    gc.collect()
    tracemalloc.start()
    try:
        before, arrow_before = tracemalloc.get_traced_memory()[0], pa.total_allocated_bytes()
        with Generation.open(cfg) as job:
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before + pa.total_allocated_bytes() - arrow_before
            assert job.total_rows == rows
    finally:
        tracemalloc.stop()
    return held


def test_input_side_memory_does_not_grow_with_the_rows(tmp_path):
    """Once a job is open, nothing per row of its input is held as Python objects (the prompts, the ids) or as
    the input's table in memory: its columns wait on disk for the finish, the ids are one Arrow string array.
    Between N and 4N rows what the open job holds grows by a few bytes a row (the ids), not by the rows' prompts,
    ids and cells (over a hundred bytes a row as Python strings and lists, and the table besides)."""
    model = save_tiny_model_dir(tmp_path / "model", seed=0)
    held_after_open(model, tmp_path, 100)  # what the first job of a process loads once (imports, caches)
    held_small = held_after_open(model, tmp_path, 1000)
    held_large = held_after_open(model, tmp_path, 4000)
    per_row = (held_large - held_small) / 3000
    assert per_row < 40, (held_small, held_large)


OPEN_PEAK = """
import sys, tracemalloc
from pathlib import Path
import pyarrow as pa
from batchspec_cli.io import input_table, inputs, jsonl, prompts
from batchspec_cli.config import GenerateConfig
from batchspec_cli.job.generation import Generation
from batchspec_cli.store import buckets as bucketing
# What the setup holds at once, its chunks and buffers, made small, so that both sizes fill them: what grows is
# then what grows with the rows.
input_table.CHUNK_ROWS = jsonl.CHUNK_ROWS = inputs.CHUNK_ROWS = 1024
prompts.CHUNK_ROWS, bucketing.ROW_GROUP_ROWS = 256, 256
bucketing.MAX_OPEN_SHARDS, bucketing.BUFFER_BYTES = 4, 128 << 10
inp, out, model = map(Path, sys.argv[1:])
cfg = GenerateConfig(input=inp, output=out, target=str(model), mode="ar", batch_size=8, max_new_tokens=4,
                     dtype="float32", quiet=True)
arrow_before = pa.default_memory_pool().max_memory()
tracemalloc.start()
with Generation.open(cfg) as job:
    assert job.total_rows == int(inp.stem.removeprefix("peak"))
    print(tracemalloc.get_traced_memory()[1], pa.default_memory_pool().max_memory() - arrow_before)
"""


def open_peak(model: Path, root: Path, rows: int) -> int:
    """The peak of Python and Arrow memory while a job opens (read, tokenize, bucket), in a fresh process: Arrow's
    high-water mark is the process's."""
    inp = write_prompts(root / f"peak{rows}.jsonl", rows)
    done = subprocess.run([sys.executable, "-c", OPEN_PEAK, str(inp), str(root / f"peak{rows}.parquet"), str(model)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    python_peak, arrow_peak = map(int, done.stdout.split())
    return python_peak + arrow_peak


def test_the_setups_peak_does_not_grow_with_the_rows(tmp_path):
    """Opening a job reads, tokenizes and buckets its prompts a chunk at a time: between N and 5N rows the peak
    of what it holds grows by the few bytes a row it keeps (ids, lengths), not by the input's table and every
    prompt's token ids at once (over a hundred bytes a row)."""
    model = save_tiny_model_dir(tmp_path / "model", seed=0)
    small, large = 8000, 40000
    peak_small, peak_large = open_peak(model, tmp_path, small), open_peak(model, tmp_path, large)
    per_row = (peak_large - peak_small) / (large - small)
    assert per_row < 60, (peak_small, peak_large)  # before: 460 bytes a row


def test_the_merge_holds_its_buffer_however_many_ranges_the_rows_scatter_over(tmp_path, monkeypatch):
    """The finish's regroup reads parts whose rows scatter over every range (rows finish bucket by bucket, not in
    input order). What it holds between parts stays within its buffer's bound, the pieces' own cost counted: a
    piece must not keep its whole part alive, and thousands of small pieces weigh more than their rows. Every row
    comes back once, in input order, as written (the oracle: the parts themselves, sorted)."""
    from batchspec_cli.store import outputs
    from batchspec_cli.engine.events import RowResult

    rows = 20000
    rng = random.Random(0)
    order = sorted(range(rows), key=lambda r: (rng.randrange(10), r))  # ten buckets, input order within each
    parts = []
    for number, start in enumerate(range(0, rows, 1000)):
        results = [RowResult(r, f"r{r}", [r % 97] * 8, "length", prompt_tokens=40) for r in order[start:start + 1000]]
        parts.append(tmp_path / f"part-{number:06d}.rows.parquet")
        pq.write_table(outputs.results_table(results), parts[-1])
    monkeypatch.setattr(merge, "MIN_RANGE_ROWS", 16)  # 256 ranges, as at a million rows
    monkeypatch.setattr(merge, "BUFFER_BYTES", 256 << 10)
    live, read = [], outputs.read_table
    monkeypatch.setattr(outputs, "read_table", lambda path: (live.append(pa.total_allocated_bytes()), read(path))[1])
    before = pa.total_allocated_bytes()
    (tmp_path / "merge").mkdir()
    merge.regroup(parts, tmp_path / "merge", rows)
    assert max(live) - before < 2 * merge.BUFFER_BYTES, (max(live) - before) / 1e6
    merged = pa.concat_tables([table for _, table in merge.ranges(tmp_path / "merge", rows)])
    expected = pa.concat_tables([pq.read_table(p) for p in parts]).sort_by("row")
    assert merged.column("row").to_pylist() == list(range(rows))
    assert merged.select(expected.column_names).equals(expected.combine_chunks())


# --------------------------------------------------------------------------- kills

SLOW = """
import sys, time
from batchspec_cli.store import merge
from batchspec_cli.job import writer
save, ranges = writer.Unsaved.save, merge.ranges
def slow_save(self):
    save(self)
    time.sleep(0.05)
def slow_ranges(*args):
    for item in ranges(*args):
        time.sleep(0.3)
        yield item
writer.Unsaved.save, merge.ranges, merge.MIN_RANGE_ROWS = slow_save, slow_ranges, 8
from batchspec_cli.cli import app
app()
"""
N_ROWS = 36


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_target_and_draft_dirs(tmp_path_factory.mktemp("scale_models"))


def flags(models) -> list[str]:
    target, draft = models
    return ["--target", str(target), "--draft", f"{draft},suffix", "--batch-size", "3", "--max-new-tokens", "8",
            "--dtype", "float64", "--threads", "1", "--quiet", "--checkpoint-rows", "3"]


def start(inp: Path, out: Path, models) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLOW, "generate", str(inp), str(out), *flags(models)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            text=True)


def kill_when(proc: subprocess.Popen, ready, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before the kill: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the kill's moment never came")
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def saved_rows(out: Path) -> int:
    parts = work_dir_for(out) / "parts"
    return sum(pq.read_metadata(p).num_rows for p in parts.glob("part-*.rows.parquet")) if parts.exists() else 0


def finishing(out: Path) -> bool:
    """The finish has written some ranges of OUT (its temporary file exists and has data)."""
    try:
        job = json.loads((work_dir_for(out) / "job.json").read_text())
    except (OSError, ValueError):
        return False
    temps = list(out.parent.glob(f".{out.name}*")) + list(out.parent.glob(f"{out.name}.*"))
    return job.get("finishing") and any(t.is_file() and t.stat().st_size > 0 for t in temps)


def test_three_kills_one_in_the_finish_then_rerun_every_row_once(tmp_path, models):
    inp = write_prompts(tmp_path / "in.jsonl", N_ROWS)
    reference = tmp_path / "reference.parquet"
    done = CliRunner().invoke(app, ["generate", str(inp), str(reference), *flags(models)])
    assert done.exit_code == 0, done.output

    out = tmp_path / "out.parquet"
    kill_when(start(inp, out, models), lambda: saved_rows(out) >= 6)
    first = saved_rows(out)
    kill_when(start(inp, out, models), lambda: saved_rows(out) >= first + 6)
    kill_when(start(inp, out, models), lambda: finishing(out))
    assert not out.exists() and saved_rows(out) == N_ROWS
    rerun = start(inp, out, models)
    stdout, stderr = rerun.communicate(timeout=240)
    assert rerun.returncode == 0, stderr

    table, expected = pq.read_table(out), pq.read_table(reference)
    ids = [f"r{i}" for i in range(N_ROWS)]
    assert table.column("id").to_pylist() == ids  # every row once, in input order
    for name in ("completion", "completion_token_ids", "finish_reason", "prompt_tokens", "error"):
        assert table.column(name).equals(expected.column(name)), name
    assert pq.ParquetFile(out).metadata.num_row_groups > 1  # written range by range
    assert list(__import__("pandas").read_parquet(out)["id"]) == ids
    assert [r[0] for r in duckdb.sql(f"SELECT id FROM read_parquet('{out}')").fetchall()] == ids
    steps = pq.read_table(out.with_name("out.stats.parquet")).column("step").to_pylist()
    assert len(steps) == len(set(steps)) and steps
    assert not work_dir_for(out).exists()


def test_a_checkpoint_part_is_due_by_rows_or_by_tokens_whichever_first():
    """Parts hold up to checkpoint_rows rows, but long rows (each perhaps with its logprobs) leave memory once their
    completion tokens reach Unsaved.MOST_TOKENS: a part every 28 rows of 600 tokens, every 1,024 rows of 8."""
    from batchspec_cli.engine.events import RowResult
    from batchspec_cli.job.writer import Unsaved

    class Parts:  # the work directory's save_part, counted
        def __init__(self):
            self.sizes = []

        def save_part(self, rows, stats):
            self.sizes.append(len(rows))

    for tokens, expected in ((600, -(-Unsaved.MOST_TOKENS // 600)), (8, 1024)):
        parts = Parts()
        unsaved = Unsaved(parts, rows=1024, seconds=1e9)
        for row in range(3000):
            unsaved.add(RowResult(row, f"r{row}", [7] * tokens, "length"))
            unsaved.save_if_due()
        assert parts.sizes[:2] == [expected, expected], (tokens, parts.sizes[:3])
