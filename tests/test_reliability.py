"""A killed nightly job costs minutes, never a missing or duplicated row.

Kill-and-resume runs the real CLI in a subprocess on tiny saved models (float64), kills it
once a checkpoint part exists, reruns the same command and compares the final file with an
uninterrupted run: same ids, order, completion tokens and finish reasons, every row once,
and the saved rows were not generated again. Also: SIGTERM, changed settings, --restart,
the lock, --max-prompt-tokens and prompt errors, --log-json, and fuzzed input through the CLI.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.config import GenerateConfig
from batchspec_cli.engine.events import RowResult
from batchspec_cli.job.generation import Generation, work_dir_for
from conftest import save_target_and_draft_dirs, make_tokenizer, save_tiny_model_dir

torch.set_num_threads(1)
cli = CliRunner()
N_ROWS = 36
WORDS = "the quick brown fox jumps over a lazy dog by the sea; tell me a story, write a haiku".split()
COMPARED = ("id", "completion_token_ids", "finish_reason", "error", "prompt_tokens", "n")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target and a perturbed copy as its draft (mixed acceptance)."""
    return save_target_and_draft_dirs(tmp_path_factory.mktemp("reliability_models"))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    rng = random.Random(0)
    rows = [{"id": f"r{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))), "n": i}
            for i in range(N_ROWS)]
    path = tmp_path_factory.mktemp("reliability_input") / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SAMPLED = ("--temperature", "0.8", "--seed", "1")


def flags(models, *extra) -> list[str]:
    target, draft = models
    return ["--target", str(target), "--draft", str(draft), "--batch-size", "3", "--max-new-tokens", "12",
            "--dtype", "float64", "--threads", "1", "--quiet", "--checkpoint-rows", "4", *extra]


def invoke(*args):
    return cli.invoke(app, [str(a) for a in args])


def generate(inp, out, models, *extra):
    return invoke("generate", inp, out, *flags(models, *extra))


@pytest.fixture(scope="module")
def references(models, prompts, tmp_path_factory):
    """Uninterrupted runs, greedy and sampled: what every resumed run must reproduce."""
    root = tmp_path_factory.mktemp("reliability_refs")
    tables = {}
    for name, extra in (("greedy", ()), ("sampled", SAMPLED)):
        out = root / f"{name}.parquet"
        result = generate(prompts, out, models, *extra)
        assert result.exit_code == 0, result.output
        tables[name] = pq.read_table(out)
    return tables


def rows(table: pa.Table) -> list[tuple]:
    return list(zip(*(table.column(c).to_pylist() for c in COMPARED)))


def saved_parts(out: Path) -> tuple[list[dict], list[dict]]:
    """Rows and statistics in the checkpoint parts of OUT's work directory."""
    parts = work_dir_for(out) / "parts"
    saved_rows = [r for p in sorted(parts.glob("part-*.rows.parquet")) for r in pq.read_table(p).to_pylist()]
    saved_stats = [r for p in sorted(parts.glob("part-*.stats.parquet")) for r in pq.read_table(p).to_pylist()]
    return saved_rows, saved_stats


def start_cli(inp, out, models, *extra) -> subprocess.Popen:
    command = [sys.executable, "-c", "from batchspec_cli.cli import app; app()", "generate", str(inp), str(out),
               *flags(models, *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def wait_for_part(proc: subprocess.Popen, out: Path, timeout: float = 180.0) -> None:
    parts = work_dir_for(out) / "parts"
    deadline = time.monotonic() + timeout
    while not list(parts.glob("part-*.rows.parquet")):
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before a part was saved: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no checkpoint part appeared")
        time.sleep(0.01)


def log_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_resumed_run(out: Path, log: Path, reference: pa.Table, saved_rows: list[dict], saved_stats: list[dict]):
    """The resumed OUT equals the uninterrupted one and the saved rows were not generated again."""
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(N_ROWS)]  # every row once, input order
    assert rows(table) == rows(reference)
    events = log_events(log)
    resumed = [e for e in events if e["event"] == "resumed"]
    finish = [e for e in events if e["event"] == "finish"]
    assert resumed and resumed[-1]["rows_saved"] == len(saved_rows)
    assert finish[-1]["resumed_rows"] == len(saved_rows) and finish[-1]["exit_code"] == 0
    assert finish[-1]["generated_rows"] == N_ROWS - len(saved_rows)  # nothing saved was redone
    by_row = {r["row"]: r for r in saved_rows}
    assert len(by_row) == len(saved_rows)  # the parts hold no row twice
    ref = reference.to_pylist()
    for row, saved in by_row.items():  # what was saved before the kill is what the final file holds
        assert saved["token_ids"] == ref[row]["completion_token_ids"]
    stats = pq.read_table(out.with_name(out.stem + ".stats.parquet")).to_pylist()
    steps = [s["step"] for s in stats]
    assert saved_stats and len(steps) == len(set(steps)) and len(stats) > len(saved_stats)
    assert [s["step"] for s in stats[: len(saved_stats)]] == [s["step"] for s in saved_stats]  # kept, in front
    assert not work_dir_for(out).exists()


# --------------------------------------------------------------------------- kill and resume


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_sigkill_then_rerun_resumes_and_matches_an_uninterrupted_run(tmp_path, models, prompts, references,
                                                                     sampling):
    extra = SAMPLED if sampling == "sampled" else ()
    out, log = tmp_path / "out.parquet", tmp_path / "log.jsonl"
    proc = start_cli(prompts, out, models, *extra)
    wait_for_part(proc, out)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() and (work_dir_for(out) / "lock").exists()  # killed mid-run, stale lock left
    saved_rows, saved_stats = saved_parts(out)
    assert 4 <= len(saved_rows) < N_ROWS

    result = generate(prompts, out, models, *extra, "--log-json", log)
    assert result.exit_code == 0, result.output
    assert_resumed_run(out, log, references[sampling], saved_rows, saved_stats)


def test_sigterm_stops_cleanly_then_resumes(tmp_path, models, prompts, references):
    out, log = tmp_path / "out.parquet", tmp_path / "log.jsonl"
    proc = start_cli(prompts, out, models, "--log-json", log)
    wait_for_part(proc, out)
    # One writer per output: while it runs, a second run on OUT is refused at once.
    second = generate(prompts, out, models)
    assert second.exit_code == 2 and f"pid {proc.pid}" in second.output, second.output
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "rerun the same command to resume" in stderr and "Traceback" not in stderr
    saved_rows, saved_stats = saved_parts(out)
    interrupted = [e for e in log_events(log) if e["event"] == "interrupted"]
    assert interrupted and interrupted[0]["signal"] == "SIGTERM" and interrupted[0]["exit_code"] == 143
    assert interrupted[0]["rows_saved"] == len(saved_rows) < N_ROWS
    assert f"{len(saved_rows)} of {N_ROWS} rows saved" in stderr
    assert not (work_dir_for(out) / "lock").exists()  # a clean stop releases the lock

    entries = sorted(p.name for p in work_dir_for(out).iterdir())
    changed = generate(prompts, out, models, "--draft-tokens", "3")
    assert changed.exit_code == 2 and "--draft-tokens: was 5, now 3" in changed.output
    assert "--restart" in changed.output and saved_parts(out)[0] == saved_rows  # nothing was touched
    assert sorted(p.name for p in work_dir_for(out).iterdir()) == entries  # nor added: the input read is not kept

    result = generate(prompts, out, models, "--log-json", log, "--batch-size", "5")  # batch size may change
    assert result.exit_code == 0, result.output
    assert_resumed_run(out, log, references["greedy"], saved_rows, saved_stats)


def library_config(inp: Path, out: Path, models, **kw) -> GenerateConfig:
    """The library's view of `flags(models)` (greedy)."""
    target, draft = models
    return GenerateConfig(input=inp, output=out, target=str(target), draft=str(draft), batch_size=3,
                          max_new_tokens=12, dtype="float64", checkpoint_rows=4, **kw)


def test_changed_settings_refused_and_restart_discards(tmp_path, models, prompts, references):
    small = 16
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(prompts.read_text().splitlines(keepends=True)[:small]))
    out, log = tmp_path / "out.parquet", tmp_path / "log.jsonl"
    with Generation.open(library_config(inp, out, models)) as job:  # stop it as a signal would
        for event in job.events():
            if isinstance(event, RowResult) and job.done_rows == 5:
                job.stop(signal.SIGINT)
        assert job.interrupted and 5 <= job.saved_rows < small

    for changed_flags, needle in ((("--max-new-tokens", "8"), "--max-new-tokens: was 12, now 8"),
                                  (SAMPLED, "--temperature: was 0.0, now 0.8; --seed: was 0, now 1"),
                                  (("--no-chat",), "--chat/--no-chat: was True, now False"),
                                  (("--limit", "10"), "--limit: was None, now 10")):
        result = generate(inp, out, models, *changed_flags)
        assert result.exit_code == 2 and needle in result.output, result.output
        assert "\n" not in result.output.strip() and "Traceback" not in result.output
    inp.write_text(inp.read_text().replace("r7", "r7b"))  # same rows, other content
    result = generate(inp, out, models)
    assert result.exit_code == 2 and "the input's contents changed" in result.output, result.output
    assert (work_dir_for(out) / "job.json").exists() and not (work_dir_for(out) / "lock").exists()

    result = generate(inp, out, models, "--restart", "--log-json", log)
    assert result.exit_code == 0, result.output
    events = log_events(log)
    assert not any(e["event"] == "resumed" for e in events)
    assert events[-1]["event"] == "finish" and events[-1]["resumed_rows"] == 0
    assert events[-1]["generated_rows"] == small
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [("r7b" if i == 7 else f"r{i}") for i in range(small)]
    assert table.column("completion_token_ids").to_pylist() == \
        references["greedy"].column("completion_token_ids").to_pylist()[:small]


def test_crash_while_writing_final_files_recovers_without_overwrite(tmp_path, models, prompts, references):
    """Every row saved, job marked finishing, OUT half written, work dir still there: a rerun rewrites OUT."""
    out = tmp_path / "out.parquet"
    with Generation.open(library_config(prompts, out, models, limit=6)) as job:
        for _ in job.events():
            pass
        job.work.mark_finishing()
        out.write_bytes(b"half-written by a crashed run")
    result = generate(prompts, out, models, "--limit", "6")
    assert result.exit_code == 0, result.output
    assert rows(pq.read_table(out)) == rows(references["greedy"])[:6]
    assert generate(prompts, out, models, "--limit", "6").exit_code == 2  # finished: OUT is protected again


# --------------------------------------------------------------------------- lock


def test_live_lock_refused(tmp_path, models, prompts):
    out = tmp_path / "out.parquet"
    work = work_dir_for(out)
    work.mkdir()
    (work / "lock").write_text(f"{os.getpid()}\n")  # a live process: this one
    result = generate(prompts, out, models)
    assert result.exit_code == 2, result.output
    assert f"pid {os.getpid()}" in result.output and "Traceback" not in result.output
    assert (work / "lock").read_text() == f"{os.getpid()}\n" and not out.exists()


def test_stale_lock_taken_over(tmp_path, models, prompts, references):
    out = tmp_path / "out.parquet"
    work = work_dir_for(out)
    work.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (work / "lock").write_text(json.dumps({"pid": dead.pid}))
    result = generate(prompts, out, models, "--limit", "6")
    assert result.exit_code == 0, result.output
    assert rows(pq.read_table(out)) == rows(references["greedy"])[:6]
    assert not work.exists()


# --------------------------------------------------------------------------- row errors


def test_max_prompt_tokens_makes_error_rows_and_exit_3(tmp_path, models, prompts, references):
    out, log = tmp_path / "out.parquet", tmp_path / "log.jsonl"
    limit = 40
    result = generate(prompts, out, models, "--max-prompt-tokens", limit, "--log-json", log)
    assert result.exit_code == 3, result.output
    assert "rows failed" in result.output and "--max-prompt-tokens is 40" in result.output
    table, reference = pq.read_table(out).to_pylist(), references["greedy"].to_pylist()
    failed = [r for r in table if r["finish_reason"] == "error"]
    assert 0 < len(failed) < N_ROWS
    for got, want in zip(table, reference):
        if want["prompt_tokens"] > limit:
            assert got["finish_reason"] == "error" and got["completion_token_ids"] == []
            assert got["error"] == f"prompt has {want['prompt_tokens']} tokens; --max-prompt-tokens is {limit}"
        else:  # the other rows are untouched (auto's k, hence drafted/accepted/rounds, follows measured timings)
            assert {c: got[c] for c in COMPARED} == {c: want[c] for c in COMPARED}
    events = log_events(log)
    assert {e["id"] for e in events if e["event"] == "row_error"} == {r["id"] for r in failed}
    start, finish = events[0], events[-1]
    assert start["event"] == "start" and start["total_rows"] == N_ROWS and start["resumed_rows"] == 0
    assert finish["event"] == "finish" and finish["rows"] == N_ROWS and finish["errors"] == len(failed)
    assert finish["exit_code"] == 3 and finish["completion_tokens"] == sum(len(r["completion_token_ids"])
                                                                           for r in table)
    done = [e for e in events if e["event"] == "bucket_done"]
    assert sum(e["rows"] for e in done) == N_ROWS and sum(e["errors"] for e in done) == len(failed)


def test_chat_template_error_is_a_row_error(tmp_path, models):
    target = save_tiny_model_dir(tmp_path / "strict", seed=0)
    tokenizer = make_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
                               "{{ raise_exception('tool messages are not supported') }}{% endif %}"
                               "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>")
    tokenizer.save_pretrained(target)
    inp = tmp_path / "in.jsonl"
    lines = [{"prompt": "hello"}, {"prompt": [{"role": "tool", "content": "x"}]}, {"prompt": "bye"}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out.parquet"
    result = invoke("generate", inp, out, "--target", target, "--mode", "ar", "--max-new-tokens", "3", "--quiet")
    assert result.exit_code == 3, result.output
    table = pq.read_table(out).to_pylist()
    assert [r["finish_reason"] == "error" for r in table] == [False, True, False]
    assert "tool messages are not supported" in table[1]["error"] and table[0]["completion_token_ids"]


# --------------------------------------------------------------------------- hostile input through the CLI


@pytest.fixture(scope="module")
def fuzz_model(tmp_path_factory) -> Path:
    return save_tiny_model_dir(tmp_path_factory.mktemp("fuzz_model"), seed=0, layers=1, hidden=32)


def run_fuzz_case(path: Path, model: Path) -> None:
    out = path.with_name("out.parquet")
    for leftover in (out, path.with_name("out.stats.parquet")):
        leftover.unlink(missing_ok=True)
    result = invoke("generate", path, out, "--target", model, "--mode", "ar", "--max-new-tokens", "2",
                    "--batch-size", "4", "--quiet", "--max-prompt-tokens", "300")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert result.exit_code in (0, 2, 3), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert len(result.output.strip().splitlines()) == 1 and not out.exists()
    else:
        assert pq.read_table(out).num_rows >= 1
    assert not work_dir_for(out).exists()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
good_prompts = (st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(str.strip)
                | st.lists(st.just("a turn"), min_size=1, max_size=2)
                | st.just([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", ""]),
                                           "content": st.text(max_size=6) | st.none()}), max_size=2)
good_rows = st.fixed_dictionaries({"prompt": good_prompts}, optional={"meta": json_values, "x": json_values})
any_rows = st.fixed_dictionaries(
    {"prompt": st.text(max_size=10) | json_values | messages},
    optional={"id": st.integers(0, 3) | st.text(max_size=2) | st.none() | st.floats(), "meta": json_values},
)
bad_lines = st.one_of(any_rows.map(json.dumps).map(str.encode), st.binary(max_size=20))


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lines=st.lists(good_rows.map(json.dumps).map(str.encode), min_size=1, max_size=4),
       bad=st.none() | st.tuples(st.integers(0, 4), bad_lines))
def test_fuzz_jsonl_through_the_cli(tmp_path, fuzz_model, lines, bad):
    """Valid rows with odd pass-through columns, sometimes one hostile line among them."""
    if bad is not None:
        lines.insert(bad[0], bad[1])
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(lines))
    run_fuzz_case(path, fuzz_model)


prompt_columns = st.sampled_from([
    pa.array(["hi", "there", "x"]), pa.array(["hi", None, "x"]), pa.array([1.5, float("nan"), None]),
    pa.array([["a"], ["b", "c"], ["d"]]), pa.array([["a"], [], None]),
    pa.array([[{"role": "user", "content": "yo"}], [{"role": "user", "content": "ho"}],
              [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]]),
    pa.array([[{"role": "user", "content": "yo"}], [], [{"role": "user", "content": None}]]),
    pa.array([b"\xff", b"ok", b""]), pa.array(["", " ", "z"]), pa.array(["z" * 400, "a", "b"]),
])
other_columns = st.sampled_from([
    pa.array([1.5, float("nan"), None]), pa.array([["a"], [], None]), pa.array([True, False, None]),
    pa.array([{"a": 1, "b": [1.0, None]}, None, {"a": None, "b": []}]), pa.array([None, None, None]),
    pa.array(["a", "a", "b"]), pa.array([1, 2, 3]), pa.array([b"\x00", None, b"x"]),
])


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(prompt=prompt_columns,
       others=st.dictionaries(st.sampled_from(["id", "meta", "completion", "__row"]), other_columns, max_size=2),
       cut=st.none() | st.none() | st.floats(0.0, 1.0))
def test_fuzz_parquet_through_the_cli(tmp_path, fuzz_model, prompt, others, cut):
    """Odd column types, nulls, NaN, duplicate ids, clashing names, truncated files."""
    path = tmp_path / "fuzz.parquet"
    pq.write_table(pa.table({"prompt": prompt, **others}), path)
    if cut is not None:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * cut)])
    run_fuzz_case(path, fuzz_model)


HOSTILE = {
    "invalid utf-8": (b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', 2, "UTF-8"),
    "nan prompt": (b'{"prompt": NaN}\n', 3, "null"),  # a bad prompt is an error row (issue 40)
    "null prompt": (b'{"prompt": "a"}\n{"prompt": null}\n', 3, "row 2"),
    "nested prompt": (b'{"prompt": {"a": {"b": [1, 2]}}}\n', 3, "expected a string"),
    "deep nesting": (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}\n", 2, "line 1"),
    "duplicate ids": (b'{"id": 1, "prompt": "a"}\n{"id": "1", "prompt": "b"}\n{"id": 2, "prompt": "c"}\n'
                      b'{"id": 2, "prompt": "d"}\n', 2, "duplicate ids in column 'id': '1', '2'"),
    "truncated line": (b'{"prompt": "a"}\n{"prompt": "b', 2, "line 2"),
    "huge line": (json.dumps({"prompt": "word " * 40000}).encode() + b'\n{"prompt": "ok"}\n', 3, ""),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_a_message_or_a_row_error(tmp_path, fuzz_model, case):
    data, code, needle = HOSTILE[case]
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    out = tmp_path / "out.parquet"
    result = invoke("generate", path, out, "--target", fuzz_model, "--mode", "ar", "--max-new-tokens", "2",
                    "--quiet")
    assert result.exit_code == code and needle in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    if case == "huge line":  # the huge prompt is longer than the model's context: an error row, the other row runs
        table = pq.read_table(out).to_pylist()
        assert table[0]["finish_reason"] == "error" and "context" in table[0]["error"]
        assert table[1]["finish_reason"] != "error"
