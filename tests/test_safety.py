"""A nightly job never harms what lies around its output, and keeps its exit-code contract.

Every case runs the real CLI (typer's CliRunner, or a subprocess where signals or imports
matter) on real files beside a tiny saved model, then checks the exit code, that no
traceback was printed, that files outside OUT's own paths are untouched, and, after a
failure, that rerunning the same command gives every row exactly once with the
completions of an undisturbed run and leaves no stray files.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.config import GenerateConfig
from batchspec_cli.engine.events import RowResult
from batchspec_cli.job.generation import Generation, work_dir_for
from batchspec_cli.store import files, outputs
from conftest import save_tiny_model_dir

cli = CliRunner()
N_ROWS = 7
COMPARED = ("id", "completion_token_ids", "finish_reason", "error")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model_dir(tmp_path_factory.mktemp("safety_model"), seed=0, layers=1, hidden=32)


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "tell me a story " * (i % 3 + 1)}) + "\n"
                            for i in range(N_ROWS)))
    return path


def flags(model: Path, *extra) -> list[str]:
    return ["--target", str(model), "--mode", "ar", "--max-new-tokens", "3", "--batch-size", "2",
            "--checkpoint-rows", "2", "--quiet", *extra]


def generate(inp, out, model, *extra):
    return cli.invoke(app, ["generate", str(inp), str(out), *flags(model, *map(str, extra))])


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> list[tuple]:
    root = tmp_path_factory.mktemp("safety_ref")
    out = root / "out.parquet"
    result = generate(write_prompts(root / "in.jsonl"), out, model)
    assert result.exit_code == 0, result.output
    return rows(out)


def rows(out: Path) -> list[tuple]:
    table = pq.read_table(out)
    return list(zip(*(table.column(c).to_pylist() for c in COMPARED)))


def snapshot(*paths: Path) -> dict:
    """Bytes (or link targets) of every file under the paths: what must stay untouched."""
    seen = {}
    for root in paths:
        for path in [root, *(root.rglob("*") if root.is_dir() and not root.is_symlink() else [])]:
            if path.is_symlink():
                seen[path] = ("link", os.readlink(path))
            elif path.is_file():
                seen[path] = ("file", path.read_bytes())
    return seen


def refused(result, *needles: str) -> None:
    """Exit 2, one line naming what is wrong, no traceback."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output


def entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


@pytest.fixture
def job_dir(tmp_path) -> tuple[Path, Path]:
    """(input, OUT) in a fresh directory."""
    return write_prompts(tmp_path / "in.jsonl"), tmp_path / "out.parquet"


def interrupted_job(inp: Path, out: Path, model: Path) -> Path:
    """A resumable work directory: one row saved, then a clean stop (the library, as the CLI would)."""
    cfg = GenerateConfig(input=inp, output=out, target=str(model), mode="ar", max_new_tokens=3, batch_size=2,
                         checkpoint_rows=1, quiet=True)
    with Generation.open(cfg) as job:
        for event in job.events():
            if isinstance(event, RowResult):
                job.stop()
    work = work_dir_for(out)
    assert (work / "job.json").exists() and list((work / "parts").glob("part-*.rows.parquet"))
    return work


# --------------------------------------------------------------------------- symbolic links and foreign entries


def test_symlinked_work_dir_is_refused_and_its_target_untouched(tmp_path, job_dir, model):
    inp, out = job_dir
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    (victim / "lock").write_text("not a lock")
    work_dir_for(out).symlink_to(victim, target_is_directory=True)
    before = snapshot(victim)
    result = generate(inp, out, model)
    refused(result, str(work_dir_for(out)), "symbolic link")
    assert snapshot(victim) == before and not out.exists()
    assert entries(tmp_path) == {"in.jsonl", "victim", work_dir_for(out).name}  # no .done-* link either


@pytest.mark.parametrize("name", ["lock", "job.json", "parts", "buckets", "input", "reading"])
def test_symlinked_entry_of_the_work_dir_is_refused(tmp_path, job_dir, model, name):
    inp, out = job_dir
    work = interrupted_job(inp, out, model) if name != "lock" else work_dir_for(out)
    work.mkdir(exist_ok=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    entry = work / name
    if entry.is_dir():
        (entry).rename(victim / name)  # the real one now lives elsewhere, reached through a link
        entry.symlink_to(victim / name, target_is_directory=True)
    else:
        if entry.exists():
            entry.rename(victim / name)
        else:
            (victim / name).write_text("not a lock")
        entry.symlink_to(victim / name)
    before = snapshot(victim)
    for extra in ((), ("--restart",)):
        refused(generate(inp, out, model, *extra), str(entry), "symbolic link")
        assert snapshot(victim) == before and not out.exists()


def test_symlinked_checkpoint_part_is_refused(tmp_path, job_dir, model):
    inp, out = job_dir
    work = interrupted_job(inp, out, model)
    part = sorted((work / "parts").glob("part-*.rows.parquet"))[0]
    outside = tmp_path / "outside.parquet"
    part.rename(outside)
    part.symlink_to(outside)
    before = snapshot(outside)
    refused(generate(inp, out, model), str(part), "symbolic link")
    assert snapshot(outside) == before and not out.exists()


def test_planted_temporary_file_link_is_never_written_through(tmp_path, job_dir, model, monkeypatch, reference):
    """A link planted at the very temporary name the final write picks: another name is taken."""
    inp, out = job_dir
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    planted = tmp_path / f".out.parquet.{os.getpid()}.deadbeef.tmp"
    planted.symlink_to(victim)
    real, picked = files.temp_path, []

    def first_pick_is_planted(target, kind="tmp"):
        picked.append(Path(target) == out and kind == "tmp" and not picked.count(True))
        return planted if picked[-1] else real(target, kind)

    monkeypatch.setattr(files, "temp_path", first_pick_is_planted)
    result = generate(inp, out, model)
    assert result.exit_code == 0, result.output
    assert any(picked) and victim.read_text() == "keep me" and planted.is_symlink() and rows(out) == reference


@pytest.mark.parametrize("kind", ["work dir is a file", "lock is a directory", "foreign owner"])
def test_work_dir_that_is_not_ours_is_refused(tmp_path, job_dir, model, monkeypatch, kind):
    inp, out = job_dir
    work = work_dir_for(out)
    if kind == "work dir is a file":
        work.write_text("someone's notes")
    elif kind == "lock is a directory":
        (work / "lock").mkdir(parents=True)
        (work / "lock" / "inner").write_text("x")
    else:
        work.mkdir()
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 4242)
    before = snapshot(work)
    result = generate(inp, out, model)
    refused(result, str(work if kind != "lock is a directory" else work / "lock"))
    assert snapshot(work) == before and not out.exists()


def test_stale_temporary_files_of_dead_runs_are_removed_only_if_ours(tmp_path, job_dir, model, reference):
    inp, out = job_dir
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    stale = [tmp_path / f".out.parquet.{dead.pid}.0123abcd.tmp", tmp_path / f".out.stats.parquet.{dead.pid}.0123abcd.tmp",
             tmp_path / f".out.parquet.{dead.pid}.0123abcd.probe.tmp"]
    for path in stale:
        path.write_bytes(b"")
    alive = tmp_path / f".out.parquet.{os.getppid()}.89abcdef.tmp"  # a live process's: not stale
    alive.write_bytes(b"")
    link = tmp_path / f".out.parquet.{dead.pid}.4567cdef.tmp"  # our name, but a link: not ours
    link.symlink_to(victim)
    other = tmp_path / f".other.parquet.{dead.pid}.0123abcd.tmp"  # another output's
    other.write_bytes(b"")
    result = generate(inp, out, model)
    assert result.exit_code == 0, result.output
    assert not any(p.exists() for p in stale) and alive.exists() and link.is_symlink() and other.exists()
    assert victim.read_text() == "keep me"


# --------------------------------------------------------------------------- outputs that are inputs or each other


def test_outputs_that_are_the_input_or_each_other_are_refused(tmp_path, model):
    jsonl = write_prompts(tmp_path / "in.jsonl")
    parquet = tmp_path / "io.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in jsonl.read_text().splitlines()]), parquet)
    (tmp_path / "hard.parquet").hardlink_to(parquet)
    (tmp_path / "soft.parquet").symlink_to(parquet)
    out = tmp_path / "out.parquet"
    cases = [
        (parquet, parquet, ()),
        (parquet, tmp_path / "hard.parquet", ()),
        (parquet, tmp_path / "soft.parquet", ()),
        (jsonl, out, ("--stats", jsonl)),
        (jsonl, out, ("--log-json", jsonl)),
        (jsonl, out, ("--log-json", out)),
        (jsonl, out, ("--log-json", tmp_path / "out.stats.parquet")),
        (jsonl, out, ("--stats", out)),
    ]
    before = snapshot(tmp_path)
    for inp, target, extra in cases:
        result = generate(inp, target, model, "--overwrite", *extra)
        refused(result, "--overwrite does not change this")
        assert snapshot(tmp_path) == before, (inp, target, extra)


def test_output_inside_an_input_bucket_directory_is_refused(tmp_path, model):
    inp = write_prompts(tmp_path / "in.jsonl")
    buckets = tmp_path / "buckets"
    made = cli.invoke(app, ["bucket", str(inp), str(buckets), "--target", str(model), "--quiet"])
    assert made.exit_code == 0, made.output
    before = snapshot(buckets)
    shard = sorted(buckets.glob("bucket-*.parquet"))[0]
    for out, extra in ((shard, ()), (tmp_path / "out.parquet", ("--stats", buckets / "manifest.json")),
                       (buckets / "new.parquet", ())):
        refused(generate(buckets, out, model, "--overwrite", *extra), "input")
        assert snapshot(buckets) == before


def test_every_output_is_checked_before_the_job_starts(tmp_path, job_dir, model):
    inp, out = job_dir
    (tmp_path / "adir").mkdir()
    for extra, needle in ((("--stats", tmp_path / "nope" / "s.parquet"), "does not exist"),
                          (("--stats", tmp_path / "adir"), "directory"),
                          (("--log-json", tmp_path / "nope" / "log.jsonl"), "--log-json")):
        refused(generate(inp, out, model, *extra), needle)
        assert entries(tmp_path) == {"in.jsonl", "adir"}


# --------------------------------------------------------------------------- a full disk at any write


class DiskFull:
    """os.fsync of a regular file raises ENOSPC at its `at`-th call (every durable write fsyncs)."""

    def __init__(self, at: int):
        self.at, self.calls, self.real = at, 0, os.fsync

    def __call__(self, fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            self.calls += 1
            if self.calls == self.at:
                raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(fd)


def test_a_full_disk_at_every_write_keeps_the_contract_and_the_rerun_completes(tmp_path, model, monkeypatch,
                                                                                reference):
    at, seen_codes = 1, set()
    while True:
        root = tmp_path / f"at{at}"
        root.mkdir()
        inp, out, log = write_prompts(root / "in.jsonl"), root / "out.parquet", root / "log.jsonl"
        fault = DiskFull(at)
        monkeypatch.setattr(os, "fsync", fault)
        result = generate(inp, out, model, "--log-json", log)
        monkeypatch.setattr(os, "fsync", fault.real)
        if fault.calls < at:  # the run needed fewer writes: every one has failed once
            assert result.exit_code == 0, result.output
            break
        assert result.exit_code in (1, 2), (at, result.output)
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
        assert "No space left on device" in result.output
        events = [json.loads(line) for line in log.read_text().splitlines()]
        if result.exit_code == 1:  # during the run or its final write: rows kept, resumable
            assert "rows saved; rerun the same command to resume" in result.output
            assert events[-1]["event"] == "failed" and events[-1]["exit_code"] == 1
        else:  # the lock, the buckets or the job file: refused with nothing left behind
            assert events[-1]["event"] == "error" and not work_dir_for(out).exists() and not out.exists()
        seen_codes.add(result.exit_code)
        rerun = generate(inp, out, model)
        assert rerun.exit_code == 0, (at, rerun.output)
        assert rows(out) == reference
        assert entries(root) == {"in.jsonl", "out.parquet", "out.stats.parquet", "log.jsonl"}, at
        at += 1
    assert seen_codes == {1, 2} and at > 5


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_during_the_final_write(tmp_path, job_dir, model, monkeypatch, reference, signals):
    """One SIGTERM while OUT is written lets it finish; a second stops at once, every row still saved."""
    inp, out = job_dir
    log = tmp_path / "log.jsonl"
    real = outputs.write_parquet_stream_atomic  # the finish writes OUT (then the statistics)

    calls = []

    def write_under_signals(*args, **kwargs):
        if not calls:  # while OUT is written, not the statistics file after it
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGTERM)
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(outputs, "write_parquet_stream_atomic", write_under_signals)
    result = generate(inp, out, model, "--log-json", log)
    monkeypatch.setattr(outputs, "write_parquet_stream_atomic", real)
    assert "Traceback" not in result.output
    if signals == 1:
        assert result.exit_code == 0 and rows(out) == reference
    else:
        assert result.exit_code == 143, result.output
        assert f"{N_ROWS} of {N_ROWS} rows saved" in result.output and not out.exists()
        assert json.loads(log.read_text().splitlines()[-1])["event"] == "interrupted"
        assert [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
        rerun = generate(inp, out, model)
        assert rerun.exit_code == 0, rerun.output
        assert rows(out) == reference
    assert entries(tmp_path) == {"in.jsonl", "out.parquet", "out.stats.parquet", "log.jsonl"}


# --------------------------------------------------------------------------- inputs that are not regular files


def test_fifo_device_loop_and_dangling_link_inputs_are_refused(tmp_path, model):
    out = tmp_path / "out.parquet"
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone.jsonl")
    cases = {"fifo.jsonl": "FIFO", "zero.jsonl": "character device", "loop.jsonl": "symbolic link loop",
             "dangling.jsonl": "symbolic link to a missing file"}
    previous = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("an input hangs"))
    try:
        for name, needle in cases.items():
            signal.alarm(60)
            refused(generate(tmp_path / name, out, model), name, needle)
            signal.alarm(0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not out.exists() and not work_dir_for(out).exists()


def test_a_huge_prompt_is_an_error_row_without_tokenizing_it(tmp_path, model, monkeypatch):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    inp.write_text(json.dumps({"prompt": "x" * 2_000_000}) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    from transformers import PreTrainedTokenizerBase

    lengths = []
    real = PreTrainedTokenizerBase.apply_chat_template

    def spy(self, conversation, *args, **kwargs):
        lengths.extend(len(m["content"]) for m in conversation)
        return real(self, conversation, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", spy)
    result = generate(inp, out, model)
    assert result.exit_code == 3, result.output
    table = pq.read_table(out).to_pylist()
    assert table[0]["finish_reason"] == "error" and "2000000 bytes" in table[0]["error"]
    assert "context of 512 tokens" in table[0]["error"] and table[1]["finish_reason"] != "error"
    assert lengths and max(lengths) < 100  # the huge prompt never reached the tokenizer


# --------------------------------------------------------------------------- smaller contract breaks


def test_verify_on_a_file_that_is_not_completions_is_exit_2(tmp_path, job_dir, model):
    inp, out = job_dir
    assert generate(inp, out, model).exit_code == 0
    refused(cli.invoke(app, ["verify", str(tmp_path / "out.stats.parquet")]), "not a batchspec completions file")
    refused(cli.invoke(app, ["verify", str(inp)]), "in.jsonl")


def test_bucket_directory_with_an_out_of_range_token_id_is_refused(tmp_path, model):
    inp = write_prompts(tmp_path / "in.jsonl")
    buckets = tmp_path / "buckets"
    assert cli.invoke(app, ["bucket", str(inp), str(buckets), "--target", str(model), "--quiet"]).exit_code == 0
    shard = sorted(buckets.glob("bucket-*.parquet"))[0]
    table = pq.read_table(shard)
    ids = table.column("__prompt_ids").to_pylist()
    ids[0] = ids[0][:-1] + [10**6]
    index = table.column_names.index("__prompt_ids")
    pq.write_table(table.set_column(index, "__prompt_ids", pa.array(ids, type=pa.list_(pa.int32()))), shard)
    refused(generate(buckets, tmp_path / "out.parquet", model), "token id 1000000", "vocabulary")


def test_non_finite_temperatures_are_refused(tmp_path, job_dir, model):
    inp, out = job_dir
    for value in ("inf", "nan", "-inf"):
        refused(generate(inp, out, model, "--temperature", value), "--temperature")
    per_row = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "t": [0.5, float("inf")]}), per_row)
    refused(generate(per_row, out, model, "--temperature-column", "t"), "row 2", "'t'")
    assert not out.exists()


def test_mixed_type_columns_keep_strings_as_they_were(tmp_path, model):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    rows_in = [{"prompt": "Hello", "meta": "plain"}, {"prompt": ["a turn"], "meta": {"k": [1, 2]}},
               {"prompt": "again", "meta": None}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    assert generate(inp, out, model).exit_code == 0
    table = pq.read_table(out)
    assert table.column("prompt").to_pylist() == ["Hello", '["a turn"]', "again"]
    assert table.column("meta").to_pylist() == ["plain", '{"k": [1, 2]}', None]


def test_malformed_json_message_reads_well(tmp_path, model):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "unterminated\n')
    result = generate(inp, tmp_path / "out.parquet", model)
    refused(result, "line 1", "starting at column")
    assert "at at" not in result.output


def test_ctrl_c_while_starting_is_the_interrupt_exit_code_without_a_traceback(tmp_path, job_dir, model):
    inp, out = job_dir
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for delay in (0.3, 2.0):
        # as from a terminal: SIGINT at its default (a shell's background job, such as a CI run under `&`,
        # inherits it ignored, and Python then installs no KeyboardInterrupt for it)
        proc = subprocess.Popen([sys.executable, "-m", "batchspec_cli", "generate", str(inp), str(out),
                                 *flags(model)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode in (130, -signal.SIGINT), stderr
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
        if not out.exists():
            assert not work_dir_for(out).exists() or (work_dir_for(out) / "job.json").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_models_load_stops_at_once_with_nothing_left(tmp_path, job_dir, model, monkeypatch,
                                                                        reference, sig):
    from batchspec_cli.models import loading as models

    inp, out = job_dir
    real = models.load_model

    def load_under_signal(*args, **kwargs):
        os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "load_model", load_under_signal)
    result = generate(inp, out, model)
    monkeypatch.setattr(models, "load_model", real)
    assert result.exit_code == 128 + sig and "Traceback" not in result.output, result.output
    assert "nothing was written" in result.output and entries(tmp_path) == {"in.jsonl"}
    assert generate(inp, out, model).exit_code == 0 and rows(out) == reference


def test_an_output_that_a_glob_input_matches_is_refused(tmp_path):
    """A dataset given as a glob reads every file it matches: OUT (or --stats) among them would destroy an input."""
    from batchspec_cli.errors import InputError
    from batchspec_cli.store.files import check_distinct

    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("a.parquet", "b.parquet"):
        (shards / name).write_bytes(b"x")
    with pytest.raises(InputError, match="is the input"):
        check_distinct([shards / "*.parquet"], [("OUT", shards / "b.parquet")])
    check_distinct([shards / "*.parquet"], [("OUT", tmp_path / "out.parquet")])  # elsewhere: fine


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_that_lands_in_a_finalizer_while_the_models_load_still_stops(tmp_path, job_dir, model, monkeypatch,
                                                                              reference, sig):
    """Python swallows an exception raised in __del__ ("Exception ignored in"); the stop must not be lost with it."""
    from batchspec_cli.models import loading as models

    inp, out = job_dir
    real = models.load_model

    class SignalledWhileFinalized:
        def __del__(self):
            os.kill(os.getpid(), sig)
            for _ in range(1000):  # the handler runs at a bytecode boundary inside this finalizer
                pass

    def load_with_a_finalizer(*args, **kwargs):
        SignalledWhileFinalized()
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "load_model", load_with_a_finalizer)
    result = generate(inp, out, model)
    monkeypatch.setattr(models, "load_model", real)
    assert result.exit_code == 128 + sig, result.output
    assert "Traceback" not in result.output and "Exception ignored" not in result.output, result.output
    assert "before any row was generated" in result.output and not out.exists()
    if "nothing was written" not in result.output:  # the job was planned before the stop was seen
        assert "rerun the same command to resume" in result.output and (work_dir_for(out) / "job.json").exists()
    assert generate(inp, out, model).exit_code == 0 and rows(out) == reference
