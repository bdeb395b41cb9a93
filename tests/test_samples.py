"""--n samples per input row: keys, output-equivalence across modes, and the prompt prefilled once per row."""

from __future__ import annotations

import random

import pytest
import torch

from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult, Sampling, StepStats
from batchspec_cli.engine.sampling import row_key
from conftest import TINY_VOCAB_SIZE, make_tiny_llama, perturbed_copy

torch.set_num_threads(1)

N = 4
SAMPLED = Sampling(temperature=0.8, top_k=0, top_p=1.0, seed=7)


@pytest.fixture(scope="module")
def models():
    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    return target, perturbed_copy(target, scale=0.02, seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(rng.randint(2, 14))] for _ in range(6)]


def sample_requests(prompts, n, settings=SAMPLED, max_new=12):
    """The requests a job makes: sample j of input row i is output row i * n + j, keyed by (seed, id, j)."""
    return [Request(row=i * n + j, id=f"row-{i}", prompt_ids=p, max_new_tokens=max_new, sampling=settings, sample=j)
            for i, p in enumerate(prompts) for j in range(n)]


def run(target, draft, requests, *, mode, batch_size, k=3):
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache") if draft is not None else None, [1],
                    EngineConfig(mode=mode, k=k, batch_size=batch_size))
    events = list(engine.run(requests))
    return {e.row: e.token_ids for e in events if isinstance(e, RowResult)}, \
        [e for e in events if isinstance(e, StepStats)]


def test_sample_zero_key_is_the_rows_key_and_samples_differ():
    assert row_key(3, "x", 0) == row_key(3, "x")
    keys = {row_key(3, "x", j) for j in range(64)} | {row_key(3, f"x{j}", 0) for j in range(64)}
    assert len(keys) == 128  # no (id, sample) pair shares a key with another


def test_samples_equal_across_modes_and_sample_zero_is_the_n1_row(models, prompts):
    target, draft = models
    single, _ = run(target, None, sample_requests(prompts, 1), mode="ar", batch_size=1)
    reference, _ = run(target, None, sample_requests(prompts, N), mode="ar", batch_size=1)
    for i in range(len(prompts)):
        assert reference[i * N] == single[i], i  # adding samples never changes the first
    for mode, batch_size in [("exspec", 8), ("eqspec", 3), ("auto", 8), ("ar", 8)]:
        got, _ = run(target, draft if mode != "ar" else None, sample_requests(prompts, N), mode=mode,
                     batch_size=batch_size)
        assert got == reference, (mode, batch_size)


def test_samples_differ_at_temperature(models, prompts):
    target, _ = models
    got, _ = run(target, None, sample_requests(prompts, N, max_new=16), mode="ar", batch_size=8)
    distinct = [len({tuple(got[i * N + j]) for j in range(N)}) for i in range(len(prompts))]
    # At T = 0.8 over a 100-token vocabulary, 16 tokens: equal samples would be a broken key, not chance.
    assert sum(distinct) >= len(prompts) * (N - 1), distinct


@pytest.mark.parametrize("mode,batch_size,once", [("exspec", 8, True), ("auto", 4, True), ("ar", 4, True),
                                                   ("eqspec", 5, False), ("ar", 3, False)])
def test_prompt_prefilled_once_per_input_row(models, prompts, mode, batch_size, once):
    """A sample admitted while another sample of its row is in flight copies that row's prompt KV. When a batch
    admits whole rows (N divides it) every prompt is prefilled once; otherwise a row whose samples all finished
    before its last one was admitted prefills again (never N times here), and the rows are the same either way."""
    target, draft = models
    got, steps = run(target, draft if mode != "ar" else None, sample_requests(prompts, N), mode=mode,
                     batch_size=batch_size)
    prefills = [s for s in steps if s.group_kind == "prefill"]
    prompt_tokens = sum(len(p) for p in prompts)
    prefilled, reused = sum(s.prompt_prefilled for s in prefills), sum(s.prompt_reused for s in prefills)
    assert prefilled + reused == N * prompt_tokens
    assert prefilled == prompt_tokens if once else prompt_tokens <= prefilled < 2 * prompt_tokens
    assert sum(s.kv_gathered for s in prefills) > 0
    reference, _ = run(target, None, sample_requests(prompts, N), mode="ar", batch_size=1)
    assert got == reference


# --------------------------------------------------------------------------- whole jobs (the CLI on saved tiny models)

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pyarrow.parquet as pq  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from batchspec_cli.cli import app  # noqa: E402
from batchspec_cli.config import GenerateConfig  # noqa: E402
from batchspec_cli.job.generation import Generation  # noqa: E402
from batchspec_cli.verify import verify_run  # noqa: E402
from conftest import save_target_and_draft_dirs  # noqa: E402

ROWS = 7
WORDS = "the quick brown fox jumps over a lazy dog; tell me a story, write a haiku".split()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_target_and_draft_dirs(tmp_path_factory.mktemp("samples_models"))


@pytest.fixture(scope="module")
def table_input(tmp_path_factory) -> Path:
    rng = random.Random(2)
    path = tmp_path_factory.mktemp("samples_input") / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": " ".join(rng.choice(WORDS)
                                        for _ in range(rng.randint(1, 9))), "count": [3, None, 1, 2, "x", 0, 2][i]})
                            + "\n" for i in range(ROWS)))
    return path


def generate(inp, out, saved, *extra):
    target, draft = saved
    result = CliRunner().invoke(app, ["generate", str(inp), str(out), "--target", str(target), "--draft", str(draft),
                                      "--max-new-tokens", "10", "--dtype", "float64", "--threads", "1", "--quiet",
                                      *map(str, extra)])
    assert result.exit_code in (0, 3), result.output
    return result


def completions(out: Path) -> list[tuple]:
    table = pq.read_table(out)
    sample = table.column("sample").to_pylist() if "sample" in table.column_names else [0] * table.num_rows
    return list(zip(table.column("id").to_pylist(), sample, table.column("completion_token_ids").to_pylist()))


SAMPLED_FLAGS = ("--temperature", "0.8", "--seed", "5")


def test_n_rows_adjacent_sample_zero_is_the_n1_row_and_modes_agree(tmp_path, saved, table_input):
    generate(table_input, tmp_path / "one.parquet", saved, *SAMPLED_FLAGS)
    generate(table_input, tmp_path / "ar.parquet", saved, *SAMPLED_FLAGS, "--n", 4, "--mode", "ar", "-b", 1)
    generate(table_input, tmp_path / "ex.parquet", saved, *SAMPLED_FLAGS, "--n", 4, "--mode", "exspec", "-b", 8)
    one, ar, ex = (completions(tmp_path / f"{name}.parquet") for name in ("one", "ar", "ex"))
    assert [(i, s) for i, s, _ in ar] == [(f"r{i}", j) for i in range(ROWS) for j in range(4)]  # adjacent, in order
    assert ar == ex
    assert [c for _, s, c in ar if s == 0] == [c for _, _, c in one]
    assert "sample" not in pq.read_table(tmp_path / "one.parquet").column_names  # --n 1 writes what it always did
    table = pq.read_table(tmp_path / "ex.parquet")
    assert table.column_names[table.column_names.index("id") + 1] == "sample"
    assert table.column("prompt").to_pylist()[:4] == [table.column("prompt")[0].as_py()] * 4  # input columns repeat
    stats = pq.read_table(tmp_path / "ex.stats.parquet").to_pylist()
    prefilled = sum(s["prompt_prefilled"] for s in stats)
    reused = sum(s["prompt_reused"] for s in stats)
    assert reused == 3 * prefilled  # batch 8 admits two whole rows at a time: each prompt prefilled once
    report = verify_run(tmp_path / "ex.parquet")
    assert report.checked == 4 * ROWS and report.exact == report.checked


def test_greedy_samples_are_decoded_once_and_written_n_times(tmp_path, saved, table_input):
    generate(table_input, tmp_path / "one.parquet", saved)
    generate(table_input, tmp_path / "three.parquet", saved, "--n", 3)
    one, three = completions(tmp_path / "one.parquet"), completions(tmp_path / "three.parquet")
    assert three == [(i, j, c) for i, _, c in one for j in range(3)]
    stats = pq.read_table(tmp_path / "three.stats.parquet").to_pylist()
    assert sum(s["batch_size"] for s in stats if s["group_kind"] == "prefill") == ROWS  # one decode per input row


def test_n_column_per_row_counts_and_bad_cells_are_error_rows(tmp_path, saved, table_input):
    result = generate(table_input, tmp_path / "col.parquet", saved, *SAMPLED_FLAGS, "--n", 2, "--n-column", "count")
    assert result.exit_code == 3  # rows failed
    table = pq.read_table(tmp_path / "col.parquet")
    counts = {}
    for row in table.to_pylist():
        counts[row["id"]] = counts.get(row["id"], 0) + 1
    assert counts == {"r0": 3, "r1": 2, "r2": 1, "r3": 2, "r4": 1, "r5": 1, "r6": 2}
    errors = {r["id"]: r["error"] for r in table.to_pylist() if r["error"]}
    assert set(errors) == {"r4", "r5"} and all("column 'count'" in e for e in errors.values())
    alone = completions(tmp_path / "col.parquet")
    full = completions(generate(table_input, tmp_path / "n3.parquet", saved, *SAMPLED_FLAGS, "--n", 3) and
                       tmp_path / "n3.parquet")
    assert [x for x in alone if x[0] == "r0"] == [x for x in full if x[0] == "r0"]  # a row's samples: its own


def test_an_input_sample_column_clashes_only_when_samples_are_written(tmp_path, saved):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hello", "sample": "mine"}) + "\n")
    target, draft = saved
    base = ["generate", str(inp), str(tmp_path / "o.parquet"), "--target", str(target), "--mode", "ar",
            "--max-new-tokens", "2", "--quiet"]
    result = CliRunner().invoke(app, base + ["--n", "2"])
    assert result.exit_code == 2 and "'sample' clashes" in result.output
    assert CliRunner().invoke(app, base).exit_code == 0
    assert CliRunner().invoke(app, base[:-1] + ["--n", "0", "--quiet"]).exit_code == 2


def test_openai_n_gives_n_choices_with_index(tmp_path, saved):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 6,
                       "temperature": 0.8, **({"n": n} if n is not None else {})}}
             for i, n in enumerate([3, None, 1, 0, 200, 2])]
    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    generate(inp, tmp_path / "out.jsonl", saved)
    for line in lines:
        line["body"].pop("n", None)
    single = tmp_path / "single.jsonl"
    single.write_text("".join(json.dumps(line) + "\n" for line in lines))
    generate(single, tmp_path / "one.jsonl", saved)
    got = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    one = [json.loads(x) for x in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [f"c{i}" for i in range(6)]  # one line per request
    for g, o, n in zip(got, one, [3, 1, 1, None, None, 2]):
        if n is None:
            assert g["response"] is None and "'n'" in g["error"]["message"]
            continue
        choices = g["response"]["body"]["choices"]
        assert [c["index"] for c in choices] == list(range(n))
        assert choices[0]["message"] == o["response"]["body"]["choices"][0]["message"]
        usage = g["response"]["body"]["usage"]
        assert usage["completion_tokens"] >= o["response"]["body"]["usage"]["completion_tokens"]


def test_an_interrupted_n_job_resumes_every_sample_once(tmp_path, saved, table_input):
    generate(table_input, tmp_path / "ref.parquet", saved, *SAMPLED_FLAGS, "--n", 3, "-b", 2)
    target, draft = saved
    cfg = GenerateConfig(input=table_input, output=tmp_path / "out.parquet", target=str(target), draft=str(draft),
                         max_new_tokens=10, dtype="float64", temperature=0.8, seed=5, n=3, batch_size=2,
                         checkpoint_rows=2, quiet=True)
    with Generation.open(cfg) as job:
        finished = 0
        for event in job.events():
            finished += isinstance(event, RowResult)
            if finished == 8:
                job.stop()
        assert job.interrupted and 8 <= job.saved_rows < 3 * ROWS
    with Generation.open(cfg) as job:
        assert job.plan.resumed_rows >= 8
        for _ in job.events():
            pass
        job.finish()
    assert completions(tmp_path / "out.parquet") == completions(tmp_path / "ref.parquet")
