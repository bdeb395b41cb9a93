"""The benchmark's bookkeeping: the palindrome order is fair to every mode, pooled runs count all their tokens, the
controller's numbers, and bench.main() end to end on tiny models (auto, hf, model-free drafters, by category)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench  # noqa: E402
from conftest import make_step  # noqa: E402


def step(kind, rows, accepted, emitted, total_ms, k=5, **kw):
    return make_step(group_kind=kind, batch_size=rows, k=k, accepted=accepted, tokens_emitted=emitted,
                     verify_ms=total_ms, total_ms=total_ms, **kw)


def test_palindrome_gives_every_mode_the_same_mean_position():
    plan = [("ar", 0), ("eqspec", 5), ("exspec", 5)]
    order = bench.run_order(plan, "palindrome")
    assert sorted(order) == sorted(plan * 2)
    means = {m: sum(i for i, x in enumerate(order) if x == m) / 2 for m in plan}
    assert len(set(means.values())) == 1
    assert bench.run_order(plan, "given") == plan


def test_pooled_runs_are_total_tokens_over_total_time():
    def run(tokens, wall, accepted):
        results = {0: SimpleNamespace(token_ids=list(range(tokens)))}
        stats = [step("prefill", 1, [0], 0, 100.0),
                 step("same_length", 1, [accepted], accepted + 1, 400.0, drafted=5, drafter="model")]
        return bench.Run(results, stats, wall)

    row = bench.summarize([run(6, 2.0, 2), run(6, 4.0, 4)])
    assert row["tokens"] == 12 and row["wall_s"] == 6.0
    assert row["tokens_per_s"] == 2.0  # not the mean of 3 and 1.5 tok/s
    assert row["runs_tokens_per_s"] == [3.0, 1.5]
    assert row["decode_tokens_per_s"] == 12 / 0.8
    assert row["accepted_per_round"] == 3.0 and row["acceptance_length"] == 4.0
    assert row["step_ms"]["total"] == 1000.0 and row["step_ms"]["verify"] == 1000.0
    assert row["acceptance"] == 6 / 10 and row["drafters"] == {"model": 2}


def test_controller_gain_histogram_and_overhead():
    stats = [step("prefill", 2, [], 0, 50.0, k=0),
             step("same_length", 2, [0, 0], 2, 10.0, k=0, expected_tokens=2.0, expected_ms=10.0, plain_ms=10.0),
             step("same_length", 2, [2, 1], 5, 20.0, k=3, expected_tokens=6.0, expected_ms=20.0, plain_ms=10.0),
             step("same_length", 2, [1, 1], 4, 10.0, k=3)]  # not modelled: left out of the gains
    c = bench.controller([bench.Run({}, stats, 1.0, choose_s=0.004)])
    assert c["k_hist"] == {"0": 1, "3": 2} and c["modelled_steps"] == 2
    plain = 4 / 20.0  # rows per modelled plain ms
    assert c["expected_gain"] == pytest.approx((8 / 30.0) / plain)
    assert c["realised_gain"] == pytest.approx((7 / 30.0) / plain)
    assert c["choose_ms"] == pytest.approx(4.0) and c["controller_share"] == pytest.approx(4.0 / 40.0)


def test_drafter_configurations_and_labels():
    assert bench.parse_drafters("model+suffix") == ["model", "suffix"]
    with pytest.raises(ValueError):
        bench.parse_drafters("model+bogus")
    assert bench.label("exspec", 3, "model") == "exspec-k3"
    assert bench.label("auto", 5, "model+suffix") == "auto[model+suffix]"
    assert bench.label("eqspec", 2, "ngram") == "eqspec[ngram]-k2"
    assert bench.label("hf", 0, "") == "hf" and bench.label("ar", 0, "") == "ar"


def run_bench(tmp_path, monkeypatch, corrupt: str | None, extra: tuple[str, ...] = (),
              modes: tuple[str, ...] = ("ar", "eqspec", "exspec")):
    """bench.main() on tiny saved models and six Spec-Bench-like questions; `corrupt` alters one row of that mode."""
    from conftest import save_target_and_draft_dirs

    target, draft = save_target_and_draft_dirs(tmp_path / "models")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"category": c, "turns": [f"Question about {c}? {c} {c}"]}) + "\n"
                                 for c in ("writing", "translation", "summarization", "qa", "math_reasoning", "rag")))
    monkeypatch.setattr(bench, "SPEC_BENCH", questions)
    real_run_mode, real_run_hf = bench.run_mode, bench.run_hf

    def corrupted(run):
        run.results[4].token_ids[-1] += 1
        return run

    def run_mode(target_, draft_, eos, reqs, mode, k, batch_size, drafter="model"):
        run = real_run_mode(target_, draft_, eos, reqs, mode, k, batch_size, drafter)
        return corrupted(run) if mode == corrupt and len(reqs) > 2 else run  # not the warm-up

    def run_hf(model, pad_id, eos, reqs, batch_size):
        run = real_run_hf(model, pad_id, eos, reqs, batch_size)
        return corrupted(run) if corrupt == "hf" and len(reqs) > 2 else run

    monkeypatch.setattr(bench, "run_mode", run_mode)
    monkeypatch.setattr(bench, "run_hf", run_hf)
    monkeypatch.setattr(bench, "forward_costs", lambda *args: (0.2, {k: 1.5 for k in range(1, 9)}))  # tiny vocab
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench.py", "--prompts", "6", "--batch-sizes", "2", "--max-new-tokens", "3",
                                      "--target", str(target), "--draft", str(draft), "--dtype", "float64",
                                      "--order", "given", "--out", str(out), "--modes", *modes, *extra])
    bench.main()
    return json.loads(out.read_text())


def test_bench_passes_when_every_mode_gives_the_same_rows(tmp_path, monkeypatch):
    record = run_bench(tmp_path, monkeypatch, corrupt=None)
    assert record["mismatches_vs_ar"] == {"2": {"ar": 0, "eqspec-k5": 0, "exspec-k5": 0}}


def test_bench_fails_and_names_the_rows_when_a_mode_differs(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        run_bench(tmp_path, monkeypatch, corrupt="exspec")
    message = str(exit_info.value.code)
    assert exit_info.value.code not in (0, None) and "batch 2: exspec-k5 differs from ar in rows 4" in message
    assert "eqspec" not in message
    record = json.loads((tmp_path / "bench.json").read_text())  # the results are written all the same
    assert record["mismatched_rows"] == {"2": {"exspec-k5": [4]}}


def test_auto_hf_and_model_free_drafters_with_a_k_sweep(tmp_path, monkeypatch):
    record = run_bench(tmp_path, monkeypatch, corrupt="hf", modes=("ar", "auto", "exspec", "hf"),
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


def test_by_category_runs_each_category_as_its_own_job(tmp_path, monkeypatch):
    record = run_bench(tmp_path, monkeypatch, corrupt=None, modes=("ar", "exspec"),
                       extra=("--by-category", "--drafters", "suffix", "model+ngram"))
    categories = ["math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation"]
    assert [r["category"] for r in record["rows"] if r["mode"] == "ar"] == categories
    for r in record["rows"]:
        assert r["tokens"] > 0 and "ratio_vs_ar" in r
    assert set(record["mismatches_vs_ar"]["2"]) == {f"{c}/{n}" for c in categories
                                                    for n in ("ar", "exspec[suffix]-k5", "exspec[model+ngram]-k5")}
    assert set(record["mismatches_vs_ar"]["2"].values()) == {0}


def test_the_pool0_row_is_the_pooled_engine_with_speculation_off(tmp_path, monkeypatch):
    record = run_bench(tmp_path, monkeypatch, corrupt=None, modes=("ar", "pool0", "auto"))
    rows = {r["label"]: r for r in record["rows"]}
    assert list(rows) == ["ar", "pool0", "auto"] and record["mismatches_vs_ar"]["2"]["pool0"] == 0
    pool0 = rows["pool0"]
    assert pool0["drafted"] == 0 and pool0["drafters"] == {"-": pool0["drafters"]["-"]}  # every round k = 0
    assert "ratio_vs_ar" in pool0 and pool0["tokens"] == rows["ar"]["tokens"]


def test_auto_phases_sums_each_arm_and_phase_apart():
    import auto_phases

    stats = [step("prefill", 4, [], 0, 500.0, k=0),
             step("same_length", 4, [0] * 4, 4, 100.0, k=0, arm="plain"),
             dataclasses.replace(step("realigned", 4, [1] * 4, 8, 300.0, k=2, arm="spec"), realign_ms=20.0),
             step("same_length", 4, [0] * 4, 4, 120.0, k=0, arm="spec")]
    table = auto_phases.phases(stats)
    assert table["prefill"] == [0.5, 1, 0]
    assert table["plain k=0"] == [0.1, 1, 4] and table["spec k=0"] == [0.12, 1, 4]
    assert table["spec k>0"] == [0.3, 1, 8] and table["realign (spec)"] == [0.02, 1, 0]
