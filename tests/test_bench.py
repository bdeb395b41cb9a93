"""The benchmark's bookkeeping: the palindrome order is fair to every mode, pooled runs count all their tokens,
and bench.py end to end on tiny models (auto, hf, model-free drafters, by category).

The benchmarks are scripts, not part of the package: they run here in their own process (``python -c``, with
``benchmarks/`` on the path), as a user runs them; the test process imports none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import round_step as step

ROOT = Path(__file__).resolve().parents[1]

# The pure helpers of bench.py and auto_phases.py on what the test passes (argv[1], JSON); their answers as JSON.
HELPERS = r"""
import json, sys
from types import SimpleNamespace
import auto_phases, bench
from batchspec_cli.engine.events import StepStats

given = json.loads(sys.argv[1])
def run(r):
    results = {0: SimpleNamespace(token_ids=list(range(r["tokens"])))}
    return bench.Run(results, [StepStats.from_record(s) for s in r["steps"]], r["wall"])
try:
    bench.parse_drafters("model+bogus")
    bogus = None
except ValueError as exc:
    bogus = str(exc)
plan = [tuple(p) for p in given["plan"]]
print(json.dumps({
    "palindrome": bench.run_order(plan, "palindrome"), "given": bench.run_order(plan, "given"),
    "parsed": bench.parse_drafters("model+suffix"), "bogus": bogus,
    "labels": [bench.label(*args) for args in given["labels"]],
    "summary": bench.summarize([run(r) for r in given["runs"]]),
    "phases": auto_phases.phases([StepStats.from_record(s) for s in given["phases"]]),
}))
"""

# bench.main() with the bare-forward costs stubbed (a tiny vocabulary) and, when argv[1] names a mode, one row of
# that mode's real runs corrupted; argv[2:] are bench.py's arguments.
MAIN = r"""
import sys
import bench

corrupt = sys.argv[1] or None
real_run_mode, real_run_hf = bench.run_mode, bench.run_hf

def corrupted(run):
    run.results[4].token_ids[-1] += 1
    return run

def run_mode(target, draft, eos, reqs, mode, k, batch_size, drafter="model"):
    run = real_run_mode(target, draft, eos, reqs, mode, k, batch_size, drafter)
    return corrupted(run) if mode == corrupt and len(reqs) > 2 else run  # not the warm-up

def run_hf(model, pad_id, eos, reqs, batch_size):
    run = real_run_hf(model, pad_id, eos, reqs, batch_size)
    return corrupted(run) if corrupt == "hf" and len(reqs) > 2 else run

bench.run_mode, bench.run_hf = run_mode, run_hf
bench.forward_costs = lambda *args: (0.2, {k: 1.5 for k in range(1, 9)})
sys.argv = ["bench.py", *sys.argv[2:]]
bench.main()
"""


def benchmark_process(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def helpers() -> dict:
    """The helpers' answers, from one process."""
    def run(tokens, wall, accepted):
        stats = [step("prefill", 1, 5, [0], 0, 100.0),
                 step("same_length", 1, 5, [accepted], accepted + 1, 400.0, drafted=5, drafter="model")]
        return {"tokens": tokens, "wall": wall, "steps": [s.record() for s in stats]}

    phases = [step("prefill", 4, 0, [], 0, 500.0),
              step("same_length", 4, 0, [0] * 4, 4, 100.0, arm="plain"),
              step("realigned", 4, 2, [1] * 4, 8, 300.0, arm="spec", realign_ms=20.0),
              step("same_length", 4, 0, [0] * 4, 4, 120.0, arm="spec")]
    given = {"plan": [("ar", 0), ("eqspec", 5), ("exspec", 5)], "runs": [run(6, 2.0, 2), run(6, 4.0, 4)],
             "labels": [("exspec", 3, "model"), ("auto", 5, "model+suffix"), ("eqspec", 2, "ngram"), ("hf", 0, ""),
                        ("ar", 0, "")],
             "phases": [s.record() for s in phases]}
    done = benchmark_process(HELPERS, json.dumps(given))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_palindrome_gives_every_mode_the_same_mean_position(helpers):
    plan = [["ar", 0], ["eqspec", 5], ["exspec", 5]]
    order = helpers["palindrome"]
    assert sorted(order) == sorted(plan * 2)
    means = {tuple(m): sum(i for i, x in enumerate(order) if x == m) / 2 for m in plan}
    assert len(set(means.values())) == 1
    assert helpers["given"] == plan


def test_pooled_runs_are_total_tokens_over_total_time(helpers):
    row = helpers["summary"]
    assert row["tokens"] == 12 and row["wall_s"] == 6.0
    assert row["tokens_per_s"] == 2.0  # not the mean of 3 and 1.5 tok/s
    assert row["runs_tokens_per_s"] == [3.0, 1.5]
    assert row["decode_tokens_per_s"] == 12 / 0.8
    assert row["accepted_per_round"] == 3.0 and row["acceptance_length"] == 4.0
    assert row["step_ms"]["total"] == 1000.0 and row["step_ms"]["verify"] == 1000.0
    assert row["acceptance"] == 6 / 10 and row["drafters"] == {"model": 2}


def test_drafter_configurations_and_labels(helpers):
    assert helpers["parsed"] == ["model", "suffix"]
    assert helpers["bogus"] and "bogus" in helpers["bogus"]
    assert helpers["labels"] == ["exspec-k3", "auto[model+suffix]", "eqspec[ngram]-k2", "hf", "ar"]


def test_auto_phases_sums_each_arm_and_phase_apart(helpers):
    table = helpers["phases"]
    assert table["prefill"] == [0.5, 1, 0]
    assert table["plain k=0"] == [0.1, 1, 4] and table["spec k=0"] == [0.12, 1, 4]
    assert table["spec k>0"] == [0.3, 1, 8] and table["realign (spec)"] == [0.02, 1, 0]


def run_bench(tmp_path, corrupt: str | None, extra: tuple[str, ...] = (),
              modes: tuple[str, ...] = ("ar", "eqspec", "exspec"), status: int = 0) -> tuple[dict, str]:
    """bench.py on tiny saved models and six Spec-Bench-like questions; `corrupt` alters one row of that mode.
    Its JSON record and what it said on stderr; it must exit with ``status``."""
    from conftest import save_target_and_draft_dirs

    target, draft = save_target_and_draft_dirs(tmp_path / "models")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"category": c, "turns": [f"Question about {c}? {c} {c}"]}) + "\n"
                                 for c in ("writing", "translation", "summarization", "qa", "math_reasoning", "rag")))
    out = tmp_path / "bench.json"
    done = benchmark_process(MAIN, corrupt or "", "--prompts", "6", "--batch-sizes", "2", "--max-new-tokens", "3",
                             "--target", str(target), "--draft", str(draft), "--dtype", "float64",
                             "--questions", str(questions), "--order", "given", "--out", str(out),
                             "--modes", *modes, *extra)
    assert done.returncode == status, done.stderr
    return json.loads(out.read_text()), done.stderr


def test_bench_passes_when_every_mode_gives_the_same_rows(tmp_path):
    record, _ = run_bench(tmp_path, corrupt=None)
    assert record["mismatches_vs_ar"] == {"2": {"ar": 0, "eqspec-k5": 0, "exspec-k5": 0}}


def test_bench_fails_and_names_the_rows_when_a_mode_differs(tmp_path):
    record, stderr = run_bench(tmp_path, corrupt="exspec", status=1)  # the results are written all the same
    message = stderr.strip().splitlines()[-1]
    assert "batch 2: exspec-k5 differs from ar in rows 4" in message
    assert "eqspec" not in message
    assert record["mismatched_rows"] == {"2": {"exspec-k5": [4]}}


def test_auto_hf_and_model_free_drafters_with_a_k_sweep(tmp_path):
    record, _ = run_bench(tmp_path, corrupt="hf", modes=("ar", "auto", "exspec", "hf"),
                       extra=("-k", "1", "2", "--drafters", "model", "ngram"))
    labels = [r["label"] for r in record["rows"]]
    assert labels == ["ar", "auto", "auto[ngram]", "exspec-k1", "exspec-k2", "exspec[ngram]-k1", "exspec[ngram]-k2",
                      "hf"]
    assert set(record["mismatches_vs_ar"]["2"].values()) == {0}  # every engine run equals ar ...
    assert record["hf_mismatched_rows"] == {"2": {"hf": [4]}}  # ... hf's differences are reported, not failed
    rows = {r["label"]: r for r in record["rows"]}
    auto = rows["auto"]
    assert auto["k"] == 2 and set(auto["controller"]) >= {"k_hist", "expected_gain", "realised_gain",
                                                          "controller_share"}
    assert sum(auto["controller"]["k_hist"].values()) > 0 and auto["controller"]["choose_ms"] > 0
    assert "ideal_speedup" in rows["exspec-k1"] and "ideal_speedup" not in rows["exspec[ngram]-k1"]
    assert "ideal_speedup" not in auto
    assert rows["exspec[ngram]-k2"]["drafter"] == "ngram" and "model" not in rows["exspec[ngram]-k2"]["drafters"]


def test_by_category_runs_each_category_as_its_own_job(tmp_path):
    record, _ = run_bench(tmp_path, corrupt=None, modes=("ar", "exspec"),
                       extra=("--by-category", "--drafters", "suffix", "model+ngram"))
    categories = ["math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation"]
    assert [r["category"] for r in record["rows"] if r["mode"] == "ar"] == categories
    for r in record["rows"]:
        assert r["tokens"] > 0 and "ratio_vs_ar" in r
    assert set(record["mismatches_vs_ar"]["2"]) == {f"{c}/{n}" for c in categories
                                                    for n in ("ar", "exspec[suffix]-k5", "exspec[model+ngram]-k5")}
    assert set(record["mismatches_vs_ar"]["2"].values()) == {0}


def test_the_pool0_row_is_the_pooled_engine_with_speculation_off(tmp_path):
    record, _ = run_bench(tmp_path, corrupt=None, modes=("ar", "pool0", "auto"))
    rows = {r["label"]: r for r in record["rows"]}
    assert list(rows) == ["ar", "pool0", "auto"] and record["mismatches_vs_ar"]["2"]["pool0"] == 0
    pool0 = rows["pool0"]
    assert pool0["drafted"] == 0 and pool0["drafters"] == {"-": pool0["drafters"]["-"]}  # every round k = 0
    assert "ratio_vs_ar" in pool0 and pool0["tokens"] == rows["ar"]["tokens"]
