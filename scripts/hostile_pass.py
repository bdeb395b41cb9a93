"""A hostile-input pass over the real `batchspec` command (issue 27): run it as a new user and an unlucky
operator would, and check the contract after every case.

    PYTHONPATH=. python scripts/hostile_pass.py [--only SUBSTRING[,SUBSTRING...]] [--json results.json]

Every case runs `python -m batchspec_cli` in a subprocess in its own directory beside a tiny saved
model, then checks: the exit code is the documented one, stderr holds no traceback, every file
outside OUT's own paths is untouched, and nothing unexpected was left in the directory. Kill cases
(SIGKILL / SIGTERM at many moments, a competing writer) rerun the command and check every row is
there exactly once, equal to an undisturbed run's, with no stray files. Prints one line per case
and a JSON summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import save_tiny_model_dir  # noqa: E402  (the tests' tiny float32 Llama and tokenizer)

ROWS = 40
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
COMPARED = ("id", "completion_token_ids", "finish_reason", "error")


def command(*args) -> list[str]:
    return [sys.executable, "-m", "batchspec_cli", *map(str, args)]


def run(args, timeout=300, signals=(), ready=None) -> tuple[int, str, float, int]:
    """(exit code, stderr, seconds, 0); ``signals``: (delay, signal) sent meanwhile, the first delay counted
    from when ``ready()`` first holds (default: from the start)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    while ready is not None and signals and not ready() and proc.poll() is None:
        time.sleep(0.005)
    for delay, sig in signals:
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return -999, "TIMEOUT " + err, time.perf_counter() - start, 0
    return proc.returncode, err, time.perf_counter() - start, 0


def run_measured(args, timeout=600) -> tuple[int, str, float, int]:
    start = time.perf_counter()
    proc = subprocess.Popen(command(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    err = proc.stderr.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, err, time.perf_counter() - start, usage.ru_maxrss // 1024


def snapshot(*paths: Path) -> dict:
    seen = {}
    for root in paths:
        for path in [root, *(root.rglob("*") if root.is_dir() and not root.is_symlink() else [])]:
            if path.is_symlink():
                seen[str(path)] = "link:" + os.readlink(path)
            elif path.is_file():
                seen[str(path)] = path.read_bytes()
    return seen


def rows(out: Path) -> list[tuple]:
    table = pq.read_table(out)
    return list(zip(*(table.column(c).to_pylist() for c in COMPARED)))


class Pass:
    def __init__(self, root: Path, only: str | None):
        self.root, self.results = root, []
        self.only = only.split(",") if only else None  # run the cases whose name holds one of these
        self.model = save_tiny_model_dir(root / "model", seed=0, layers=1, hidden=32)
        self.base = ["--target", self.model, "--mode", "ar", "--max-new-tokens", "8", "--batch-size", "2",
                     "--checkpoint-rows", "2", "--quiet"]
        ref = self.case_dir("reference")
        code, err, _, _ = run(["generate", self.prompts(ref), ref / "out.parquet", *self.base])
        assert code == 0, err
        self.reference = rows(ref / "out.parquet")

    def wanted(self, name: str) -> bool:
        return not self.only or any(part in name for part in self.only)

    def case_dir(self, name: str) -> Path:
        path = self.root / name.replace(" ", "_").replace("/", "_")
        path.mkdir()
        return path

    def prompts(self, where: Path, name: str = "in.jsonl") -> Path:
        path = where / name
        path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "tell me a story " * (i % 5 + 1)}) + "\n"
                                for i in range(ROWS)))
        return path

    def record(self, name, ok, code, expected, seconds, detail=""):
        self.results.append({"case": name, "ok": bool(ok), "exit": code, "expected": expected,
                             "seconds": round(seconds, 1), "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name:<58} exit {code} (want {expected}) {seconds:5.1f}s {detail}",
              flush=True)

    def case(self, name, setup, expected, needle="", allowed=None, untouched=(), check=None, signals=(), ready=None):
        """setup(dir) -> argv; checks exit code, no traceback, untouched paths, leftovers, needle in stderr.
        ``ready(dir)``: the signals' first delay counts from when it first holds (see `run`)."""
        if not self.wanted(name):
            return
        where = self.case_dir(name)
        args = setup(where)
        keep = [where / u for u in untouched]
        before = snapshot(*keep)
        present = {p.name for p in where.iterdir()}
        code, err, seconds, _ = run(args, signals=signals, ready=(lambda: ready(where)) if ready else None)
        problems = []
        if code not in (expected if isinstance(expected, tuple) else (expected,)):
            problems.append("exit code")
        if "Traceback" in err:
            problems.append("traceback")
        if needle and needle not in err:
            problems.append(f"no {needle!r} in stderr")
        if snapshot(*keep) != before:
            problems.append("touched a file outside OUT's paths")
        left = {p.name for p in where.iterdir()} - present - set(allowed or ())
        if left:
            problems.append(f"left {sorted(left)}")
        if check is not None:
            problems += check(where)
        self.record(name, not problems, code, expected, seconds,
                    "; ".join(problems) + (f" | {err.strip().splitlines()[-1][:150]}" if err.strip() else ""))

    # ------------------------------------------------------------------ kill and resume
    def kill_case(self, name, signals, at_final_write=False):
        """Signals counted from when the run holds its lock (or marks its job finishing), then reruns."""
        if not self.wanted(name):
            return
        where = self.case_dir(name)
        inp, out = self.prompts(where), where / "out.parquet"
        work = where / ".out.parquet.batchspec-work"

        def ready() -> bool:
            if not at_final_write:
                return (work / "lock").exists()
            try:
                return '"finishing": true' in (work / "job.json").read_text()
            except OSError:
                return False
        start = time.perf_counter()
        code, err, _, _ = run(["generate", inp, out, *self.base], signals=signals, ready=ready)
        first = code
        problems = ["traceback"] if "Traceback" in err else []
        if out.exists() and not work.exists():
            code = 0  # the signal came after the run had finished: OUT is complete (a rerun would be refused)
        for _ in range(3):  # rerun the same command until it succeeds
            if code == 0 and not work.exists():
                break
            code, err2, _, _ = run(["generate", inp, out, *self.base])
            problems += ["traceback on rerun"] if "Traceback" in err2 else []
        if not out.exists() or rows(out) != self.reference:
            problems.append("rows differ from an undisturbed run")
        left = {p.name for p in where.iterdir()} - {"in.jsonl", "out.parquet", "out.stats.parquet"}
        if left:
            problems.append(f"left {sorted(left)}")
        self.record(name, not problems and code == 0, f"{first}->{code}", "x->0", time.perf_counter() - start,
                    "; ".join(problems))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--big-mb", type=int, default=50)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="batchspec-hostile-"))
    p = Pass(root, args.only)
    g = lambda *a: ["generate", *a, *p.base]  # noqa: E731

    def victim_dir(where: Path) -> Path:
        (where / "victim").mkdir()
        (where / "victim" / "precious.txt").write_text("keep me")
        return where / "victim"

    def interrupted(where: Path) -> Path:
        """A resumable work directory (a run stopped by SIGTERM once a part exists)."""
        inp, out = p.prompts(where), where / "out.parquet"
        proc = subprocess.Popen(command(*g(inp, out)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=ENV)
        parts = where / ".out.parquet.batchspec-work" / "parts"
        while not list(parts.glob("part-*.rows.parquet")) and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return where / ".out.parquet.batchspec-work"

    work = ".out.parquet.batchspec-work"
    resumable = {work}

    # --- symbolic links and entries that are not ours
    def s_workdir_link(w):
        (w / work).symlink_to(victim_dir(w), target_is_directory=True)
        return g(p.prompts(w), w / "out.parquet")
    p.case("work dir is a symlink to a dir with files", s_workdir_link, 2, "symbolic link", untouched=["victim", work])

    def s_lock_link(w):
        (w / work).mkdir()
        (w / "victim.txt").write_text("123\n")
        (w / work / "lock").symlink_to(w / "victim.txt")
        return g(p.prompts(w), w / "out.parquet")
    p.case("lock is a symlink to a file", s_lock_link, 2, "symbolic link", allowed=resumable,
           untouched=["victim.txt"])

    for entry in ("job.json", "parts", "buckets"):
        def s_entry_link(w, entry=entry):
            wd = interrupted(w)
            victim = victim_dir(w)
            (wd / entry).rename(victim / entry)
            (wd / entry).symlink_to(victim / entry, target_is_directory=(victim / entry).is_dir())
            return g(w / "in.jsonl", w / "out.parquet", "--restart")
        p.case(f"{entry} of an interrupted run is a symlink (--restart)", s_entry_link, 2, "symbolic link",
               allowed=resumable, untouched=["victim"])

    def s_part_link(w):
        wd = interrupted(w)
        part = sorted((wd / "parts").glob("part-*.rows.parquet"))[0]
        part.rename(w / "outside.parquet")
        part.symlink_to(w / "outside.parquet")
        return g(w / "in.jsonl", w / "out.parquet")
    p.case("checkpoint part is a symlink", s_part_link, 2, "symbolic link", allowed=resumable,
           untouched=["outside.parquet"])

    def s_workdir_file(w):
        (w / work).write_text("notes")
        return g(p.prompts(w), w / "out.parquet")
    p.case("work dir path is a regular file", s_workdir_file, 2, "not a directory", untouched=[work])

    def s_lock_dir(w):
        (w / work / "lock").mkdir(parents=True)
        (w / work / "lock" / "x").write_text("x")
        return g(p.prompts(w), w / "out.parquet")
    p.case("lock is a directory", s_lock_dir, 2, "not a regular file", untouched=[work])

    # --- outputs that are inputs, or each other
    def parquet_input(w):
        path = w / "in.parquet"
        pq.write_table(pa.Table.from_pylist([json.loads(x) for x in p.prompts(w).read_text().splitlines()]), path)
        return path
    p.case("OUT is the input (--overwrite)", lambda w: g(parquet_input(w), w / "in.parquet", "--overwrite"), 2,
           "is the input", untouched=["in.parquet", "in.jsonl"])
    p.case("--stats is the input (--overwrite)",
           lambda w: g(p.prompts(w), w / "out.parquet", "--stats", w / "in.jsonl", "--overwrite"), 2, "is the input",
           untouched=["in.jsonl"])
    p.case("--log-json is the input", lambda w: g(p.prompts(w), w / "out.parquet", "--log-json", w / "in.jsonl"), 2,
           "is the input", untouched=["in.jsonl"])
    p.case("--log-json is OUT", lambda w: g(p.prompts(w), w / "out.parquet", "--log-json", w / "out.parquet"), 2,
           "OUT")

    def s_hardlink(w):
        src = parquet_input(w)
        (w / "hard.parquet").hardlink_to(src)
        return g(src, w / "hard.parquet", "--overwrite")
    p.case("OUT is a hard link to the input", s_hardlink, 2, "is the input", untouched=["in.parquet"])

    def s_softlink(w):
        src = parquet_input(w)
        (w / "soft.parquet").symlink_to(src)
        return g(src, w / "soft.parquet", "--overwrite")
    p.case("OUT is a symlink to the input", s_softlink, 2, "is the input", untouched=["in.parquet", "soft.parquet"])

    def bucket_dir(w):
        code, err, _, _ = run(["bucket", p.prompts(w), w / "buckets", "--target", p.model, "--quiet"])
        assert code == 0, err
        return w / "buckets"
    p.case("OUT inside the input bucket directory",
           lambda w: g(bucket_dir(w), w / "buckets" / "out.parquet"), 2, "inside the input directory",
           untouched=["buckets"])
    p.case("OUT is a shard of the input bucket directory",
           lambda w: g(bucket_dir(w), w / "buckets" / "bucket-00000.parquet", "--overwrite"), 2, "input",
           untouched=["buckets"])

    # --- every output checked up front
    p.case("--stats in a missing directory",
           lambda w: g(p.prompts(w), w / "out.parquet", "--stats", w / "nope" / "s.parquet"), 2, "does not exist")
    p.case("--stats is an existing directory",
           lambda w: (w / "sdir").mkdir() or g(p.prompts(w), w / "out.parquet", "--stats", w / "sdir"), 2,
           "directory")
    p.case("OUT in a missing directory", lambda w: g(p.prompts(w), w / "nope" / "out.parquet"), 2, "does not exist")
    p.case("--log-json in a missing directory",
           lambda w: g(p.prompts(w), w / "out.parquet", "--log-json", w / "nope" / "l.jsonl"), 2, "--log-json")

    # --- inputs that are not regular files
    p.case("input is a FIFO", lambda w: os.mkfifo(w / "in.jsonl") or g(w / "in.jsonl", w / "out.parquet"), 2, "FIFO")
    p.case("input is a symlink to /dev/zero",
           lambda w: (w / "in.jsonl").symlink_to("/dev/zero") or g(w / "in.jsonl", w / "out.parquet"), 2,
           "character device")
    p.case("input is a symlink loop",
           lambda w: (w / "in.jsonl").symlink_to(w / "in.jsonl") or g(w / "in.jsonl", w / "out.parquet"), 2,
           "symbolic link loop")
    p.case("input is a dangling symlink",
           lambda w: (w / "in.jsonl").symlink_to(w / "gone") or g(w / "in.jsonl", w / "out.parquet"), 2,
           "missing file")
    p.case("input is a plain directory",
           lambda w: (w / "d").mkdir() or g(w / "d", w / "out.parquet"), 2, "not a bucket directory")

    # --- smaller contract breaks
    def s_verify_stats(w):
        code, err, _, _ = run(g(p.prompts(w), w / "out.parquet"))
        assert code == 0, err
        return ["verify", w / "out.stats.parquet"]
    p.case("verify on a statistics file", s_verify_stats, 2, "not a batchspec completions file",
           allowed={"out.parquet", "out.stats.parquet"})
    p.case("verify on a JSONL file", lambda w: ["verify", p.prompts(w)], 2, "Parquet completions file")

    def s_verify_truncated(w):
        code, err, _, _ = run(g(p.prompts(w), w / "out.parquet"))
        data = (w / "out.parquet").read_bytes()
        (w / "out.parquet").write_bytes(data[: len(data) // 2])
        return ["verify", w / "out.parquet"]
    p.case("verify on a truncated completions file", s_verify_truncated, 2, "not a valid Parquet",
           allowed={"out.parquet", "out.stats.parquet"})

    def s_bad_token(w):
        buckets = bucket_dir(w)
        shard = sorted(buckets.glob("bucket-*.parquet"))[0]
        table = pq.read_table(shard)
        ids = table.column("__prompt_ids").to_pylist()
        ids[0] = ids[0] + [99999]
        pq.write_table(table.set_column(table.column_names.index("__prompt_ids"), "__prompt_ids",
                                        pa.array(ids, type=pa.list_(pa.int32()))), shard)
        return g(buckets, w / "out.parquet")
    p.case("bucket dir with an out-of-range token id", s_bad_token, 2, "outside the model's vocabulary",
           untouched=["buckets"])
    for value in ("inf", "nan", "-1"):
        p.case(f"--temperature {value}", lambda w, v=value: g(p.prompts(w), w / "out.parquet", "--temperature", v),
               2, "--temperature")

    def s_temp_column(w):
        pq.write_table(pa.table({"prompt": ["a", "b"], "t": [0.5, float("inf")]}), w / "in.parquet")
        return g(w / "in.parquet", w / "out.parquet", "--temperature-column", "t")
    p.case("--temperature-column holding inf", s_temp_column, 2, "row 2", untouched=["in.parquet"])
    for k in ("0", "33"):
        p.case(f"-k {k}", lambda w, k=k: g(p.prompts(w), w / "out.parquet", "-k", k), 2, "between 1 and 32")

    def s_unterminated(w):
        (w / "in.jsonl").write_text('{"prompt": "ok"}\n{"prompt": "unterminated\n')
        return g(w / "in.jsonl", w / "out.parquet")
    p.case("unterminated JSON string (message wording)", s_unterminated, 2, "starting at column",
           check=lambda w: [])

    def s_mixed(w):
        (w / "in.jsonl").write_text('{"prompt": "Hello", "m": 1}\n{"prompt": ["a turn"], "m": "x"}\n')
        return g(w / "in.jsonl", w / "out.parquet")

    def c_mixed(w):
        t = pq.read_table(w / "out.parquet")
        got = (t.column("prompt").to_pylist(), t.column("m").to_pylist())
        return [] if got == (["Hello", '["a turn"]'], ["1", "x"]) else [f"pass-through columns {got}"]
    p.case("mixed-type pass-through columns", s_mixed, 0, allowed={"out.parquet", "out.stats.parquet"},
           check=c_mixed)

    def s_stale_tmp(w):
        dead = subprocess.Popen(["true"])
        dead.wait()
        (w / f".out.parquet.{dead.pid}.0123abcd.tmp").write_bytes(b"")  # SIGKILL during a final write left it
        (w / "victim.txt").write_text("keep")
        (w / f".out.parquet.{dead.pid}.4567abcd.tmp").symlink_to(w / "victim.txt")  # not ours: a link
        return g(p.prompts(w), w / "out.parquet")

    def c_stale(w):
        names = {x.name for x in w.iterdir()}
        return [] if not any(n.endswith("0123abcd.tmp") for n in names) else ["stale temporary file kept"]
    p.case("stale temp file of a dead run is removed, a planted link kept", s_stale_tmp, 0,
           allowed={"out.parquet", "out.stats.parquet"}, untouched=["victim.txt"], check=c_stale)

    def s_huge(w):
        (w / "in.jsonl").write_text(json.dumps({"id": "big", "prompt": "word " * (args.big_mb * 200_000)}) + "\n"
                                    + json.dumps({"id": "small", "prompt": "hi"}) + "\n")
        return g(w / "in.jsonl", w / "out.parquet")
    if p.wanted(f"{args.big_mb} MB prompt is an error row"):
        where = p.case_dir(f"{args.big_mb} MB prompt")
        argv = s_huge(where)
        code, err, seconds, rss = run_measured(argv)
        table = pq.read_table(where / "out.parquet").to_pylist() if (where / "out.parquet").exists() else []
        ok = code == 3 and table and table[0]["finish_reason"] == "error" and "bytes" in table[0]["error"]
        p.record(f"{args.big_mb} MB prompt is an error row", ok and "Traceback" not in err, code, 3, seconds,
                 f"peak RSS {rss} MiB; {table[0]['error'] if table else err[-200:]}")

    # --- issue 40: bad rows stay rows, values are read as written
    done = {"out.parquet", "out.stats.parquet"}

    def lines(where: Path, extra: list[dict], at: int = 3) -> Path:
        """The usual prompts with ``extra`` rows inserted at row ``at``."""
        rows = [json.loads(x) for x in p.prompts(where).read_text().splitlines()]
        (where / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:at] + extra + rows[at:]))
        return where / "in.jsonl"

    def neighbours_as_reference(w):
        got = [r for r in rows(w / "out.parquet") if not str(r[0]).startswith("bad")]
        bad = [r for r in rows(w / "out.parquet") if str(r[0]).startswith("bad")]
        problems = [] if got == p.reference else ["the good rows differ from a run without the bad ones"]
        return problems + [f"row {r[0]} is not an error row" for r in bad if r[2] != "error"]

    bad_rows = [{"id": "bad null", "prompt": None}, {"id": "bad blank", "prompt": "  \t"},
                {"id": "bad message", "prompt": [{"role": "user"}]}, {"id": "bad surrogate", "prompt": "a\ud800"},
                {"id": "bad image part", "prompt": [{"role": "user", "content": [{"type": "image_url"}]}]}]
    p.case("bad prompts are error rows, the others as without them", lambda w: g(lines(w, bad_rows),
           w / "out.parquet"), 3, "rows failed", allowed=done, check=neighbours_as_reference)

    def s_parts(w):
        parts = [{"type": "text", "text": "tell me"}, {"type": "text", "text": "a story"}]
        lines(w, [{"id": "parts", "prompt": [{"role": "user", "content": parts}]},
                  {"id": "joined", "prompt": [{"role": "user", "content": "tell me\na story"}]}])
        return g(w / "in.jsonl", w / "out.parquet")

    def c_parts(w):
        got = {r[0]: r[1] for r in rows(w / "out.parquet")}
        return [] if got["parts"] == got["joined"] else ["text content parts not joined"]
    p.case("OpenAI-style text content parts in a table are joined", s_parts, 0, allowed=done, check=c_parts)

    def s_mixed_stop(w):
        first = p.case_dir("mixed stop column (no stops)")
        code, err, _, _ = run(g(p.prompts(first), first / "out.parquet"))
        assert code == 0, err
        text = pq.read_table(first / "out.parquet").column("completion").to_pylist()[0]
        w.joinpath("stop.txt").write_text(text[2:4])
        rows_ = [json.loads(x) for x in p.prompts(w).read_text().splitlines()]
        rows_[0]["stop"], rows_[1]["stop"] = [text[2:4]], "zzz-never"
        (w / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_))
        return g(w / "in.jsonl", w / "out.parquet", "--stop-column", "stop")

    def c_mixed_stop(w):
        first = pq.read_table(w / "out.parquet").to_pylist()[0]
        stop = (w / "stop.txt").read_text()
        ok = first["finish_reason"] == "stop_string" and stop not in first["completion"]
        return [] if ok else [f"the list row ran past its stop: {first['finish_reason']} {first['completion']!r}"]
    p.case("stop column mixing strings and lists keeps the lists", s_mixed_stop, 0, allowed=done | {"stop.txt"},
           check=c_mixed_stop)
    p.case("stop list holding a number", lambda w: g(lines(w, [{"id": "x", "prompt": "hi", "stop": ["I", 5]}], 0),
           w / "out.parquet", "--stop-column", "stop"), 2, "row 1")
    p.case("seed 2^70 in --seed-column", lambda w: g(lines(w, [{"id": "x", "prompt": "hi", "seed": 2 ** 70}]),
           w / "out.parquet", "--seed-column", "seed", "--temperature", "1"), 0, allowed=done)

    def raw_lines(where: Path, *texts: str) -> Path:
        (where / "in.jsonl").write_text(p.prompts(where).read_text() + "".join(t + "\n" for t in texts))
        return where / "in.jsonl"
    for what, text in (("an id", '{"id": "x\\ud800", "prompt": "hi"}'),
                       ("a passed-through column", '{"id": "x", "prompt": "hi", "note": "\\udc00"}'),
                       ("a column name", '{"id": "x", "prompt": "hi", "k\\ud800": 1}')):
        p.case(f"lone surrogate in {what}", lambda w, t=text: g(raw_lines(w, t), w / "out.parquet"), 2,
               f"line {ROWS + 1}, column ")

    def request(custom_id: str, content: str) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": content}]}})
    p.case("lone surrogate in an OpenAI custom_id", lambda w: (w / "b.jsonl").write_text(
        request("r1", "hi") + "\n" + request("r\ud800", "hi") + "\n") and g(w / "b.jsonl", w / "out.jsonl"), 2,
        "line 2, column ")
    p.case("lone surrogate in an OpenAI message is an error line", lambda w: (w / "b.jsonl").write_text(
        request("r1", "hi") + "\n" + request("r2", "x\ud800") + "\n") and g(w / "b.jsonl", w / "out.jsonl"), 3,
        "surrogate", allowed={"out.jsonl", "out.stats.parquet"})
    p.case("OpenAI file whose first line lacks custom_id", lambda w: (w / "b.jsonl").write_text(
        json.dumps({"method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n") and g(w / "b.jsonl",
        w / "out.jsonl"), 2, "custom_id")

    def nested(levels: int):
        value = 1
        for _ in range(levels):
            value = [value]
        return value
    p.case("pass-through column nested 60 arrays deep", lambda w: g(lines(w, [{"id": "deep", "prompt": "hi",
           "deep": nested(60)}]), w / "out.parquet"), 0, allowed=done)

    def s_control(w):
        lines(w, [{"id": "ctl", "prompt": "A<eos>B"}])
        code, err, _, _ = run(g(w / "in.jsonl", w / "allowed.parquet", "--allow-special-tokens"))
        assert code == 0, err
        return g(w / "in.jsonl", w / "out.parquet")

    def c_control(w):
        count = {name: {r["id"]: r["prompt_tokens"] for r in pq.read_table(w / name).to_pylist()}["ctl"]
                 for name in ("out.parquet", "allowed.parquet")}
        ok = count["out.parquet"] == count["allowed.parquet"] + 4
        return [] if ok else [f"<eos> in a prompt became a control token: {count}"]
    p.case("control token string in a prompt stays text", s_control, 0,
           allowed=done | {"allowed.parquet", "allowed.stats.parquet"}, check=c_control)

    def finished(w: Path, name: str = "out.parquet") -> Path:
        code, err, _, _ = run(g(p.prompts(w), w / name))
        assert code == 0, err
        return w / name
    p.case("stats on a completions file", lambda w: ["stats", finished(w)], 2, "out.stats.parquet", allowed=done)
    p.case("verify on the tool's own OpenAI output", lambda w: ["verify", finished(w, "out.jsonl")], 2,
           "Parquet completions file", allowed={"out.jsonl", "out.stats.parquet"})
    for value in ("-1", "nan"):
        p.case(f"verify --tolerance {value}", lambda w, v=value: ["verify", finished(w), "--tolerance", v], 2,
               "--tolerance", allowed=done)
    p.case("--overwrite onto a FIFO named like OUT", lambda w: os.mkfifo(w / "out.parquet") or g(
        p.prompts(w), w / "out.parquet", "--overwrite"), 2, "not a regular file",
        check=lambda w: [] if (w / "out.parquet").is_fifo() else ["the FIFO was replaced"])

    # --- signals
    for delay in (0.3, 1.0, 2.5):
        p.case(f"Ctrl-C {delay} s after start", lambda w, d=delay: ["generate", p.prompts(w), w / "out.parquet",
                                                                     *p.base, "--log-json", w / "log.jsonl"],
               (130, -2), allowed={"log.jsonl"} | resumable, signals=[(delay, signal.SIGINT)])
    rng = random.Random(0)
    for i in range(4):
        delay = rng.uniform(0, 4)
        p.kill_case(f"SIGKILL {delay:.2f} s after the lock, rerun", [(delay, signal.SIGKILL)])
    for i in range(3):
        delay = rng.uniform(0, 4)
        p.kill_case(f"SIGTERM {delay:.2f} s after the lock, rerun", [(delay, signal.SIGTERM)])
    p.kill_case("SIGTERM twice, rerun", [(1.5, signal.SIGTERM), (0.01, signal.SIGTERM)])
    p.kill_case("SIGHUP (terminal closed), rerun", [(1.0, signal.SIGHUP)])
    p.case("SIGHUP once the log is open writes the interrupted event", lambda w: ["generate", p.prompts(w),
           w / "out.parquet", *p.base, "--log-json", w / "log.jsonl"], 129, "interrupted",
           allowed={"log.jsonl"} | resumable, signals=[(0.5, signal.SIGHUP)],
           ready=lambda w: (w / "log.jsonl").exists(),
           check=lambda w: [] if '"event": "interrupted"' in (w / "log.jsonl").read_text() else ["no event"])
    p.kill_case("SIGINT then SIGKILL, rerun", [(1.0, signal.SIGINT), (0.05, signal.SIGKILL)])
    p.kill_case("SIGKILL during the final write, rerun", [(0, signal.SIGKILL)], at_final_write=True)
    p.kill_case("SIGTERM twice during the final write, rerun", [(0, signal.SIGTERM), (0, signal.SIGTERM)],
                at_final_write=True)

    if p.wanted("competing writer on the same OUT"):
        where = p.case_dir("competing writer")
        inp, out = p.prompts(where), where / "out.parquet"
        start = time.perf_counter()
        procs = [subprocess.Popen(command(*g(inp, out)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=ENV) for _ in range(2)]
        codes = sorted(proc.wait() for proc in procs)
        errs = "".join(proc.stderr.read() for proc in procs)
        ok = codes == [0, 2] and "Traceback" not in errs and rows(out) == p.reference
        left = {x.name for x in where.iterdir()} - {"in.jsonl", "out.parquet", "out.stats.parquet"}
        p.record("competing writer on the same OUT", ok and not left, codes, [0, 2], time.perf_counter() - start,
                 f"left {sorted(left)}" if left else "")

    failed = [r for r in p.results if not r["ok"]]
    summary = {"cases": len(p.results), "failed": len(failed), "root": str(root), "results": p.results}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"} | {"failed_cases": [r["case"] for r in failed]}))


if __name__ == "__main__":
    main()
