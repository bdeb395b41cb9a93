"""`generate --ray`: the single-process contract, again, through a Ray Data actor pool.

On one local Ray instance (started once for the module, always shut down) with the tiny
saved models in float64: the output equals a single-process run, greedy and sampled, with
the same schema and metadata, while the driver loads no model; a bad row becomes an error row; a worker killed mid-job
(SIGKILL of the actor's process, which Ray restarts and whose blocks it runs again) leaves
every row exactly once; a driver SIGKILLed mid-job resumes from its checkpoint parts and
equals the uninterrupted output.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.distributed import make_blocks
from batchspec_cli.engine.events import Request
from batchspec_cli.job.generation import work_dir_for
from conftest import save_target_and_draft_dirs, save_tiny_model_dir

cli = CliRunner()
REPO = Path(__file__).resolve().parent.parent
N_ROWS = 30
BAD_ROW = 7  # its prompt is longer than the tiny models' context (512): an error row, from a worker
WORDS = "the quick brown fox jumps over a lazy dog by the sea; tell me a story, write a haiku".split()
SAMPLED = ("--temperature", "0.8", "--seed", "1", "--logprobs", "2")  # and log-probabilities, from the workers too
RAY = ("--ray", "--ray-workers", "2", "--ray-block-rows", "3")


# --------------------------------------------------------------------------- without Ray


def test_a_resumed_ray_job_teaches_every_worker_the_saved_rows(tmp_path, tiny_model_dir):
    """The driver reads the requests (and the saved rows) for the workers; each worker's drafters must learn the
    saved rows as a resumed single-process engine's do, not start empty (no Ray needed: a Worker in-process)."""
    from batchspec_cli.config import GenerateConfig
    from batchspec_cli.distributed import RayConfig, RayExecutor, Worker
    from batchspec_cli.engine.events import RowResult
    from batchspec_cli.job.generation import Generation

    inp = tmp_path / "in.jsonl"
    rng = random.Random(3)
    inp.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))})
                           + "\n" for _ in range(12)))
    cfg = GenerateConfig(input=inp, output=tmp_path / "out.parquet", target=str(tiny_model_dir), draft="suffix",
                         batch_size=2, max_new_tokens=6, dtype="float64", checkpoint_rows=2)
    with Generation.open(cfg) as job:  # interrupted after a few rows, as a signal would
        for event in job.events():
            if isinstance(event, RowResult) and job.done_rows == 4:
                job.stop()
        assert job.interrupted and job.saved_rows >= 4

    def documents(engine) -> list:
        (suffix,) = engine.lookups
        return suffix.corpus.index.documents()

    with Generation.open(cfg) as single:  # a resumed single-process run: its own engine is preloaded
        engine = single.engine()
        requests = list(single.requests())
        learnt = documents(engine)
    with Generation.open(cfg) as job:
        executor = RayExecutor(job, RayConfig(workers=1))
        assert [len(b) for b in make_blocks(job.requests(), 3)] and len(job.done.preloads()) == job.saved_rows
        worker = Worker(executor.worker_spec())
    assert learnt and len(requests) == 12 - job.saved_rows
    assert documents(worker.engine) == learnt


def test_ray_missing_exits_2_with_an_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, find_spec says so
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    result = cli.invoke(app, ["generate", str(inp), str(tmp_path / "out.parquet"), "--ray"])
    assert result.exit_code == 2
    assert "pip install 'batchspec[ray]'" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.parquet").exists() and not work_dir_for(tmp_path / "out.parquet").exists()


@pytest.mark.parametrize("flag", ["--ray-workers", "--ray-block-rows"])
def test_bad_ray_flags_exit_2(tmp_path, flag):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    result = cli.invoke(app, ["generate", str(inp), str(tmp_path / "out.parquet"), "--ray", flag, "0"])
    assert result.exit_code == 2 and f"{flag} must be a positive integer" in result.output


def test_blocks_hold_one_bucket_each_cover_every_row_once_and_are_cut_as_the_requests_arrive():
    reqs = sorted((Request(row=i, id=str(i), prompt_ids=[1] * (1 + i % 4), max_new_tokens=8, bucket=i % 4, pad_to=4)
                   for i in range(23)), key=lambda r: r.bucket)  # bucket by bucket, as Generation.requests yields
    read = []

    def arriving():
        for r in reqs:
            read.append(r.row)
            yield r

    blocks = make_blocks(arriving(), block_rows=3)
    first = next(blocks)
    assert len(read) == 4, "a block comes out as soon as it is full: the requests are never all held"
    blocks = [first, *blocks]
    assert all(len({r.bucket for r in b}) == 1 and 1 <= len(b) <= 3 for b in blocks)
    assert [len(b) for b in blocks] == [3, 3, 3, 3, 3, 3, 3, 2]
    assert sorted(r.row for b in blocks for r in b) == list(range(23))


# --------------------------------------------------------------------------- on a local Ray


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray with one logical CPU per worker and one spare (no read task waits on the pool)."""
    import ray

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), old) if p)  # workers import this checkout
    try:
        info = ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
        yield info.address_info["gcs_address"]
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_target_and_draft_dirs(tmp_path_factory.mktemp("ray_models"))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    rng = random.Random(0)
    rows = [{"id": f"r{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))), "n": i}
            for i in range(N_ROWS)]
    rows[BAD_ROW]["prompt"] = "x" * 600
    path = tmp_path_factory.mktemp("ray_input") / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def flags(models, *extra) -> list[str]:
    target, draft = models
    return ["--target", str(target), "--draft", str(draft), "--batch-size", "3", "--max-new-tokens", "12",
            "--dtype", "float64", "--threads", "1", "--quiet", "--checkpoint-rows", "2", *extra]


def generate(inp, out, *args):
    return cli.invoke(app, ["generate", str(inp), str(out), *[str(a) for a in args]])


def same_rows(a, b) -> bool:
    """Equal tables but for the speculation counters (auto's k follows measured step times) and the
    log-probabilities' last bits (another group, another float rounding): equal token ids, values to 1e-10."""
    timing_dependent = ["drafted_tokens", "accepted_tokens", "rounds", "completion_logprobs"]
    if "completion_logprobs" in a.column_names:
        for x, y in zip(a.column("completion_logprobs").to_pylist(), b.column("completion_logprobs").to_pylist()):
            if (x is None) != (y is None) or len(x or []) != len(y or []):
                return False
            for e, f in zip(x or [], y or []):
                if [t["token_id"] for t in e["top_logprobs"]] != [t["token_id"] for t in f["top_logprobs"]] or \
                        abs(e["logprob"] - f["logprob"]) > 1e-10:
                    return False
    return a.drop_columns([c for c in timing_dependent if c in a.column_names]).equals(
        b.drop_columns([c for c in timing_dependent if c in b.column_names]))


def log_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(ray_cluster, models, prompts, tmp_path_factory):
    """Single-process and --ray runs, greedy and sampled: {(name, 'single'|'ray'): (out, log)}; under
    ('loaded', name, how) the models this process (the driver of a --ray run) loaded, counted."""
    from batchspec_cli.models import loading as model_loading

    root = tmp_path_factory.mktemp("ray_runs")
    done = {}
    for name, extra in (("greedy", ()), ("sampled", SAMPLED)):
        for how, more in (("single", ()), ("ray", RAY)):
            out, log = root / f"{name}-{how}.parquet", root / f"{name}-{how}.log.jsonl"
            loaded = []
            with pytest.MonkeyPatch.context() as patch:  # this process only: Ray's workers are other processes
                for function in ("load_model", "load_draft"):
                    real = getattr(model_loading, function)
                    patch.setattr(model_loading, function,
                                  lambda *a, _real=real, _name=function, **k: loaded.append(_name) or _real(*a, **k))
                result = generate(prompts, out, *flags(models, *extra, *more), "--log-json", log)
            assert result.exit_code == 3, result.output  # the bad row: exit 3, every other row written
            done[name, how] = (out, log)
            done["loaded", name, how] = loaded
    return done


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_the_ray_driver_loads_no_model(runs, name):
    """The driver reads, buckets and routes the rows with the tokenizer and the settings; the workers load the
    models (the single process, its own worker, loads the target). Its rows: the next test."""
    assert runs["loaded", name, "ray"] == []
    assert "load_model" in runs["loaded", name, "single"]


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_ray_output_equals_the_single_process_output(runs, name):
    (single, _), (distributed, log) = runs[name, "single"], runs[name, "ray"]
    a, b = pq.read_table(single), pq.read_table(distributed)
    assert b.column("id").to_pylist() == [f"r{i}" for i in range(N_ROWS)]  # every row once, input order
    assert a.schema.equals(b.schema, check_metadata=True)  # same columns, same run configuration
    assert same_rows(a, b)
    if name == "sampled":
        assert all(len(lp) == n for lp, n in zip(b.column("completion_logprobs").to_pylist(),
                                                 b.column("completion_tokens").to_pylist()) if lp is not None)
    sa = pq.read_table(single.with_name(single.stem + ".stats.parquet"))
    sb = pq.read_table(distributed.with_name(distributed.stem + ".stats.parquet"))
    assert sa.schema.equals(sb.schema, check_metadata=True)
    steps = sb.column("step").to_pylist()
    assert sorted(steps) == list(range(1, len(steps) + 1))  # one step sequence over all workers
    assert sum(sb.column("tokens_emitted").to_pylist()) == sum(b.column("completion_tokens").to_pylist())
    events = log_events(log)
    blocks = [e for e in events if e["event"] == "block_done"]
    assert len({e["worker"] for e in blocks}) == 2  # both workers ran blocks
    assert sum(e["rows"] for e in blocks) == N_ROWS and len({e["block"] for e in blocks}) == len(blocks)
    assert not work_dir_for(distributed).exists()


def test_a_bad_row_is_an_error_row_and_the_job_finishes(runs):
    out, log = runs["greedy", "ray"]
    table = pq.read_table(out).to_pylist()
    bad = table[BAD_ROW]
    assert bad["finish_reason"] == "error" and "context" in bad["error"] and bad["completion"] == ""
    assert all(r["finish_reason"] != "error" for i, r in enumerate(table) if i != BAD_ROW)
    events = log_events(log)
    (row_error,) = [e for e in events if e["event"] == "row_error"]
    assert row_error["row"] == BAD_ROW and row_error["worker"]  # the log names the worker that ran it
    assert events[-1]["event"] == "finish" and events[-1]["errors"] == 1


def _actor_pids() -> set[int]:
    """Processes of Ray Data actors running the batchspec worker on this machine."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"MapWorker" in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def test_a_worker_killed_mid_job_loses_and_doubles_no_row(ray_cluster, tmp_path):
    """SIGKILL one actor after it finished a block, while blocks are queued: Ray restarts it and
    runs its block in flight again; the output equals the single-process run, every row once."""
    root = tmp_path
    target = save_tiny_model_dir(root / "slow", seed=4, layers=4, hidden=128)  # slower steps: time to kill
    rng = random.Random(1)
    inp = root / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"k{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(6))})
                           + "\n" for i in range(24)))
    args = ["--target", target, "--mode", "ar", "--batch-size", "2", "--max-new-tokens", "48", "--dtype",
            "float64", "--threads", "1", "--quiet", "--checkpoint-rows", "2"]
    reference = root / "single.parquet"
    assert generate(inp, reference, *args).exit_code == 0

    out, log = root / "ray.parquet", root / "ray.log.jsonl"
    killed: dict = {}

    def killer():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            if log.exists():
                events = log_events(log)
                done = [e for e in events if e["event"] == "block_done"]
                if any(e["event"] == "finish" for e in events):
                    return
                if done:
                    pid = int(done[0]["worker"].rsplit(":", 1)[1])
                    assert pid in _actor_pids()
                    os.kill(pid, signal.SIGKILL)  # what ray.kill(actor) or an OOM killer does to the process
                    killed.update(pid=pid, rows_before=sum(e["rows"] for e in done), blocks_before=len(done))
                    return
            time.sleep(0.01)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    result = generate(inp, out, *args, "--ray", "--ray-workers", "2", "--ray-block-rows", "2", "--log-json", log)
    thread.join(timeout=10)
    assert result.exit_code == 0, result.output
    assert killed and killed["rows_before"] < 24, "the actor must die while rows are still to do"
    assert same_rows(pq.read_table(out), pq.read_table(reference))  # every row once, in order, same tokens
    events = log_events(log)
    blocks = [e for e in events if e["event"] == "block_done"]
    assert sum(e["rows"] for e in blocks) == 24 and len({e["block"] for e in blocks}) == len(blocks)
    workers = [e["worker"] for e in blocks]
    # the killed actor's block in flight ran again, on its restarted actor or the other one (Ray's choice)
    assert len(set(workers)) >= 2 and f"{workers[0].rsplit(':', 1)[0]}:{killed['pid']}" in workers, workers
    assert events[-1]["event"] == "finish" and events[-1]["generated_rows"] == 24


def test_driver_sigkill_then_rerun_resumes_and_equals_the_uninterrupted_run(ray_cluster, models, prompts, runs,
                                                                           tmp_path):
    out, log = tmp_path / "out.parquet", tmp_path / "log.jsonl"
    command = [sys.executable, "-c", "from batchspec_cli.cli import app; app()", "generate", str(prompts), str(out),
               *flags(models), "--ray", "--ray-workers", "2", "--ray-block-rows", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": ray_cluster}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    parts = work_dir_for(out) / "parts"
    deadline = time.monotonic() + 180
    while not list(parts.glob("part-*.rows.parquet")):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before a part was saved: " \
                                    f"{proc.communicate()}"
        assert time.monotonic() < deadline, "no checkpoint part appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    saved = [r for p in sorted(parts.glob("part-*.rows.parquet")) for r in pq.read_table(p).to_pylist()]
    assert 1 <= len(saved) < N_ROWS and not out.exists()

    result = generate(prompts, out, *flags(models), *RAY, "--log-json", log)
    assert result.exit_code == 3, result.output  # the bad row
    reference, _ = runs["greedy", "single"]
    assert same_rows(pq.read_table(out), pq.read_table(reference))
    events = log_events(log)
    finish = events[-1]
    assert finish["event"] == "finish" and finish["resumed_rows"] == len(saved)
    assert finish["generated_rows"] == N_ROWS - len(saved)  # nothing saved was generated again
    assert sum(e["rows"] for e in events if e["event"] == "block_done") == N_ROWS - len(saved)
