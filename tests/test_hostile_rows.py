"""Bad rows stay rows, hostile values are read as written (issue 40): the real CLI on real small files.

Each test runs `batchspec` through typer's CliRunner beside a tiny saved model. A bad row becomes an
error row while its neighbours complete exactly as in a run without it; a bad file is one line and
exit 2; per-row settings are read from the JSON values as written.
"""

from __future__ import annotations

import contextlib
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
from batchspec_cli.io import input_table
from batchspec_cli.models.loading import load_model
from batchspec_cli.store import outputs
from conftest import greedy_reference, save_tiny_model_dir

cli = CliRunner()
GOOD = [{"id": "a", "prompt": "tell me a story"}, {"id": "b", "prompt": "Say yes"},
        {"id": "c", "prompt": [{"role": "user", "content": "hello there"}]}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model_dir(tmp_path_factory.mktemp("hostile_model"), seed=0, layers=1, hidden=32)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generate(inp, out, model, *extra):
    return cli.invoke(app, ["generate", str(inp), str(out), "--target", str(model), "--mode", "ar",
                            "--max-new-tokens", "6", "--batch-size", "2", "--dtype", "float64", "--quiet",
                            *map(str, extra)])


def table(out: Path) -> dict[str, dict]:
    """Output rows by id."""
    return {r["id"]: r for r in pq.read_table(out).to_pylist()}


def refused(result, *needles: str) -> None:
    """Exit 2, one line naming what is wrong, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output


@pytest.fixture(scope="module")
def clean(model, tmp_path_factory) -> dict[str, dict]:
    """The good rows, run alone: what they must produce beside any bad row."""
    root = tmp_path_factory.mktemp("clean")
    result = generate(write_jsonl(root / "in.jsonl", GOOD), root / "out.parquet", model)
    assert result.exit_code == 0, result.output
    return table(root / "out.parquet")


def same_as_clean(out: Path, clean: dict[str, dict]) -> None:
    got = table(out)
    for row_id, row in clean.items():
        assert (got[row_id]["completion_token_ids"], got[row_id]["finish_reason"]) == \
            (row["completion_token_ids"], row["finish_reason"]), row_id


# --------------------------------------------------------------------------- bad rows are error rows


BAD_PROMPTS = {
    "null": (None, "is null"),
    "empty": ("", "column 'prompt' is empty"),
    "whitespace": ("  \n\t ", "column 'prompt' is only whitespace"),  # issue 48: not "is empty"
    "whitespace turn": (["  ", "second"], "first turn is only whitespace"),
    "whitespace messages": ([{"role": "user", "content": " \n"}], "every message is empty or only whitespace"),
    "message without text": ([{"role": "user"}], "no string 'content'"),
    "image part": ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                   "only text content parts"),
    "lone surrogate": ("x\ud800y", "lone UTF-16 surrogate"),
}


def test_bad_prompts_are_error_rows_and_their_neighbours_complete_as_without_them(tmp_path, model, clean):
    rows = [GOOD[0], *({"id": f"bad {name}", "prompt": value} for name, (value, _) in BAD_PROMPTS.items()),
            *GOOD[1:]]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))  # ensure_ascii: the surrogate as its \ud800 escape
    result = generate(inp, tmp_path / "out.parquet", model)
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    got = table(tmp_path / "out.parquet")
    for name, (_, needle) in BAD_PROMPTS.items():
        row = got[f"bad {name}"]
        assert row["finish_reason"] == "error" and needle in row["error"], row
    assert got["bad lone surrogate"]["prompt"] == "x\\ud800y"  # kept as its escape text
    same_as_clean(tmp_path / "out.parquet", clean)


def test_text_content_parts_are_joined(tmp_path, model):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "parts", "prompt": [{"role": "user", "content": parts}]},
        {"id": "joined", "prompt": [{"role": "user", "content": "hello\nthere"}]}])
    result = generate(inp, tmp_path / "out.parquet", model)
    assert result.exit_code == 0, result.output
    got = table(tmp_path / "out.parquet")
    assert got["parts"]["completion_token_ids"] == got["joined"]["completion_token_ids"]
    assert got["parts"]["prompt_tokens"] == got["joined"]["prompt_tokens"]


# --------------------------------------------------------------------------- per-row columns as written


def test_a_stop_column_mixing_strings_and_lists_keeps_the_lists(tmp_path, model, clean):
    text = clean["a"]["completion"]
    stop = text[2:4]
    assert stop.strip() and "zzz" not in clean["b"]["completion"]
    inp = write_jsonl(tmp_path / "in.jsonl", [{**GOOD[0], "stop": [stop]}, {**GOOD[1], "stop": "zzz"}])
    result = generate(inp, tmp_path / "out.parquet", model, "--stop-column", "stop")
    assert result.exit_code == 0, result.output
    got = table(tmp_path / "out.parquet")
    assert got["a"]["finish_reason"] == "stop_string" and got["a"]["completion"] == text[: text.index(stop)]
    assert got["b"]["completion_token_ids"] == clean["b"]["completion_token_ids"]
    assert got["a"]["stop"] == json.dumps([stop])  # passed through as the column's text


def test_a_bucket_directory_refuses_a_setting_column_it_holds_as_text(tmp_path, model):
    inp = write_jsonl(tmp_path / "in.jsonl", [{**GOOD[0], "stop": ["x"]}, {**GOOD[1], "stop": "zzz"}])
    made = cli.invoke(app, ["bucket", str(inp), str(tmp_path / "buckets"), "--target", str(model), "--quiet"])
    assert made.exit_code == 0, made.output
    refused(generate(tmp_path / "buckets", tmp_path / "out.parquet", model, "--stop-column", "stop"),
            "'stop'", "mixes kinds")
    assert generate(tmp_path / "buckets", tmp_path / "out.parquet", model).exit_code == 0  # as a pass-through


@pytest.mark.parametrize("bad", [["I", 5], ["I", None]])
def test_a_stop_list_holding_a_non_string_is_refused_naming_the_row(tmp_path, model, bad):
    inp = write_jsonl(tmp_path / "in.jsonl", [{**GOOD[0], "stop": "zzz"}, {**GOOD[1], "stop": bad}])
    refused(generate(inp, tmp_path / "out.parquet", model, "--stop-column", "stop"), "row 2", "'stop'")
    assert not (tmp_path / "out.parquet").exists()


def test_a_seed_beyond_64_bits_is_an_integer(tmp_path, model):
    big = 2 ** 70
    inp = write_jsonl(tmp_path / "in.jsonl", [{**GOOD[0], "seed": big}, {**GOOD[1], "seed": 3}])
    result = generate(inp, tmp_path / "col.parquet", model, "--seed-column", "seed", "--temperature", "1")
    assert result.exit_code == 0, result.output
    flag = generate(write_jsonl(tmp_path / "plain.jsonl", GOOD[:1]), tmp_path / "flag.parquet", model,
                    "--seed", big, "--temperature", "1")
    assert flag.exit_code == 0, flag.output
    assert table(tmp_path / "col.parquet")["a"]["completion_token_ids"] == \
        table(tmp_path / "flag.parquet")["a"]["completion_token_ids"]


# --------------------------------------------------------------------------- lone surrogates outside a prompt


@pytest.mark.parametrize("line, needle", [
    ('{"id": "x\\ud800", "prompt": "hi"}', "column 'id'"),
    ('{"id": "x", "prompt": "hi", "note": ["ok", "\\udfff"]}', "column 'note'"),
    ('{"id": "x", "prompt": "hi", "n\\ud800": 1}', "a column name"),
])
def test_a_lone_surrogate_outside_a_prompt_refuses_the_file_naming_line_and_column(tmp_path, model, line, needle):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(GOOD[0]) + "\n" + line + "\n")
    refused(generate(inp, tmp_path / "out.parquet", model), "line 2, column ", needle, "surrogate")


def test_openai_lone_surrogates(tmp_path, model):
    def request(custom_id, content):
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": content}]}})
    inp = tmp_path / "batch.jsonl"
    inp.write_text(request("r1", "hi") + "\n" + request("r2", "x\ud800") + "\n")
    result = generate(inp, tmp_path / "out.jsonl", model)
    assert result.exit_code == 3 and "Traceback" not in result.output, result.output
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert lines[0]["error"] is None and "surrogate" in lines[1]["error"]["message"]
    inp.write_text(request("r1", "hi") + "\n" + request("r\ud800", "hi") + "\n")
    refused(generate(inp, tmp_path / "out2.jsonl", model), "line 2, column ", "custom_id")


# --------------------------------------------------------------------------- deep nesting


def deep(levels: int):
    value = 1
    for _ in range(levels):
        value = [value]
    return value


def test_a_deeply_nested_column_is_stored_as_json_text_and_a_stuck_work_directory_is_redone(tmp_path, model,
                                                                                               monkeypatch, clean):
    inp = write_jsonl(tmp_path / "in.jsonl", [{**row, "deep": deep(60)} for row in GOOD])
    out = tmp_path / "out.parquet"
    monkeypatch.setattr(input_table, "MAX_NESTING", 10 ** 6)  # as before: the nested column goes into the buckets
    first = generate(inp, out, model)
    monkeypatch.undo()
    assert first.exit_code != 0 and not out.exists()
    result = generate(inp, out, model)  # resumes the work directory the failed run left
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).column("deep").to_pylist() == [json.dumps(deep(60))] * len(GOOD)
    same_as_clean(out, clean)


# --------------------------------------------------------------------------- control tokens in prompt text


def test_control_token_strings_in_prompts_stay_text_unless_allowed(tmp_path, model):
    prompt = "A<eos>B<bos>"
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": prompt}])
    loaded = load_model(str(model), dtype="float64")
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=False)
    as_text = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    as_tokens = tok(text, add_special_tokens=False)["input_ids"]
    assert len(as_text) == len(as_tokens) + 8  # the tiny tokenizer is one token per character
    for extra, ids in (((), as_text), (("--allow-special-tokens",), as_tokens)):
        out = tmp_path / f"out{len(extra)}.parquet"
        result = generate(inp, out, model, *extra)
        assert result.exit_code == 0, result.output
        row = table(out)["x"]
        assert row["prompt_tokens"] == len(ids)
        assert row["completion_token_ids"] == greedy_reference(loaded.model, ids, 6, [tok.eos_token_id])
    nochat = generate(inp, tmp_path / "raw.parquet", model, "--no-chat")
    assert nochat.exit_code == 0, nochat.output
    assert table(tmp_path / "raw.parquet")["x"]["prompt_tokens"] == \
        len(tok(prompt, add_special_tokens=True, split_special_tokens=True)["input_ids"])


# --------------------------------------------------------------------------- signals


def test_sighup_stops_like_sigterm(tmp_path, model, monkeypatch):
    inp = write_jsonl(tmp_path / "in.jsonl", GOOD)
    out, log = tmp_path / "out.parquet", tmp_path / "log.jsonl"
    real = outputs.write_parquet_stream_atomic  # the finish writes OUT

    def write_under_signals(*args, **kwargs):
        for _ in range(2):  # the second one stops at once, as a second SIGTERM does
            os.kill(os.getpid(), signal.SIGHUP)
        return real(*args, **kwargs)

    monkeypatch.setattr(outputs, "write_parquet_stream_atomic", write_under_signals)
    result = generate(inp, out, model, "--log-json", log)
    monkeypatch.undo()
    assert result.exit_code == 129 and "Traceback" not in result.output, result.output
    assert f"{len(GOOD)} of {len(GOOD)} rows saved" in result.output
    event = json.loads(log.read_text().splitlines()[-1])
    assert event["event"] == "interrupted" and event["signal"] == "SIGHUP" and event["exit_code"] == 129
    assert generate(inp, out, model).exit_code == 0


# --------------------------------------------------------------------------- small contract breaks


def test_disk_full_names_the_path(tmp_path, model, monkeypatch):
    inp, out = write_jsonl(tmp_path / "in.jsonl", GOOD), tmp_path / "out.parquet"

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")  # as a writer that names no file raises it

    monkeypatch.setattr(pq, "write_table", full)
    result = generate(inp, out, model)
    monkeypatch.undo()
    assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output
    assert "a file" not in result.output and str(tmp_path) in result.output.replace("\n", "")


def test_an_openai_file_without_custom_id_on_its_first_line_is_recognised(tmp_path, model):
    inp = tmp_path / "batch.jsonl"
    inp.write_text(json.dumps({"method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    refused(generate(inp, tmp_path / "out.jsonl", model), "custom_id")


@pytest.fixture(scope="module")
def finished(model, tmp_path_factory) -> Path:
    """A directory holding out.parquet (with out.stats.parquet) and openai.jsonl of one run each."""
    root = tmp_path_factory.mktemp("finished")
    inp = write_jsonl(root / "in.jsonl", GOOD)
    assert generate(inp, root / "out.parquet", model).exit_code == 0
    assert generate(inp, root / "openai.jsonl", model, "--stats", root / "openai.stats.parquet").exit_code == 0
    return root


def test_stats_on_a_completions_file_names_its_statistics_file(finished):
    refused(cli.invoke(app, ["stats", str(finished / "out.parquet")]), "not a batchspec statistics file",
            "out.stats.parquet")


def test_verify_on_the_openai_output_says_what_it_checks(finished):
    refused(cli.invoke(app, ["verify", str(finished / "openai.jsonl")]), "Parquet completions file")


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_verify_refuses_a_negative_or_non_finite_tolerance(finished, value):
    refused(cli.invoke(app, ["verify", str(finished / "out.parquet"), "--tolerance", value]), "--tolerance")


def test_overwrite_never_replaces_what_is_not_a_regular_file(tmp_path, model):
    fifo = tmp_path / "fifo.parquet"
    os.mkfifo(fifo)
    refused(generate(write_jsonl(tmp_path / "in.jsonl", GOOD), fifo, model, "--overwrite"), "FIFO",
            "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# --------------------------------------------------------------------------- round three (issue 48)


@pytest.mark.parametrize("suffix, flag, cells, row", [
    (".jsonl", "--temperature-column", [0.5, float("nan")], "row 2"),  # JSON's NaN
    (".jsonl", "--temperature-column", [0.5, True], "row 2"),  # Arrow would make it 1.0
    (".jsonl", "--temperature-column", [True, 0.5], "row 1"),
    (".parquet", "--temperature-column", [0.5, float("nan")], "row 2"),
    (".parquet", "--temperature-column", [True, False], "row 1"),
    (".parquet", "--top-p-column", [0.5, float("nan")], "row 2"),
    (".jsonl", "--temperature-column", [0.5, -1.0], "row 2"),  # the negative cell these must behave like
])
def test_a_nan_or_boolean_setting_cell_is_refused_naming_row_and_column_like_a_negative_one(tmp_path, model, suffix,
                                                                                           flag, cells, row):
    """A NaN was taken as null (the row decoded greedily, exit 0) and a boolean as 1.0: refused as a negative or an
    infinite cell is, with one line naming the row and the column, nothing written."""
    rows = [{**prompt, "s": cell} for prompt, cell in zip(GOOD, cells)]
    inp = tmp_path / f"in{suffix}"
    if suffix == ".jsonl":
        write_jsonl(inp, rows)
    else:
        pq.write_table(pa.table({"id": [r["id"] for r in rows], "prompt": [r["prompt"] for r in rows],
                                 "s": [r["s"] for r in rows]}), inp)
    refused(generate(inp, tmp_path / "out.parquet", model, flag, "s"), row, "column 's'")
    assert not (tmp_path / "out.parquet").exists()


def test_a_column_mixing_booleans_and_numbers_passes_through_as_written(tmp_path, model):
    inp = write_jsonl(tmp_path / "in.jsonl", [{**GOOD[0], "flag": 0.5}, {**GOOD[1], "flag": True}])
    assert generate(inp, tmp_path / "out.parquet", model).exit_code == 0
    assert [r["flag"] for r in pq.read_table(tmp_path / "out.parquet").to_pylist()] == ["0.5", "true"]


def test_a_messages_column_is_the_prompts_where_there_is_no_prompt_column_and_the_start_says_so(tmp_path, model,
                                                                                               clean):
    """The OpenAI / Hugging Face chat shape, `{"id", "messages": [...]}`, was refused ("no prompt column"): its
    messages are the prompts, as the same messages in a `prompt` column are, and the run's first line says so."""
    chats = [{"id": "c", "messages": GOOD[2]["prompt"]},
             {"id": "s", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}]
    as_prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": r["id"], "prompt": r["messages"]} for r in chats])
    assert generate(as_prompts, tmp_path / "expected.parquet", model).exit_code == 0
    expected = table(tmp_path / "expected.parquet")
    assert expected["c"]["completion_token_ids"] == clean["c"]["completion_token_ids"]
    jsonl = write_jsonl(tmp_path / "chats.jsonl", chats)
    parquet = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(chats), parquet)
    for inp in (jsonl, parquet):
        out = tmp_path / f"out-{inp.suffix[1:]}.parquet"
        result = cli.invoke(app, ["generate", str(inp), str(out), "--target", str(model), "--mode", "ar",
                                  "--max-new-tokens", "6", "--dtype", "float64"])
        assert result.exit_code == 0, result.output
        start = result.stdout.split("wrote ")[0]  # the lines before the rows run: the start line and its notes
        assert "note: no 'prompt' column: the prompts are the chat messages of column 'messages'" in start, start
        got = table(out)
        assert {k: r["completion_token_ids"] for k, r in got.items()} == \
            {k: r["completion_token_ids"] for k, r in expected.items()}
    checked = cli.invoke(app, ["verify", str(tmp_path / "out-jsonl.parquet"), "--device", "cpu"])
    assert checked.exit_code == 0 and "0 unexplained" in checked.output, checked.output
    refused(generate(jsonl, tmp_path / "named.parquet", model, "--prompt-column", "text"), "no prompt column 'text'")


@pytest.mark.parametrize("config, words", [
    ("mamba", "has state-space layers, as in Mamba"),
    ("gemma3n", "has layers that reuse another layer's KV, as in Gemma 3n"),
])
@pytest.mark.parametrize("role", ["--target", "--draft"])
def test_a_state_space_or_shared_kv_model_is_refused_in_words_a_user_knows_and_says_what_to_do(tmp_path, model,
                                                                                             config, words, role):
    """It said "has linear_attention layers" (Mamba) and "has dummy layers" (Gemma 3n's shared-KV layers)."""
    from transformers import Gemma3nTextConfig, MambaConfig

    from conftest import make_tokenizer

    made = {"mamba": lambda: MambaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2),
            "gemma3n": lambda: Gemma3nTextConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                                                 head_dim=16, num_kv_shared_layers=2)}[config]()
    folder = tmp_path / config
    made.save_pretrained(folder)  # no weights: the config is refused before any are read
    make_tokenizer(folder)
    models = ["--target", folder] if role == "--target" else ["--target", model, "--draft", folder]
    inp = write_jsonl(tmp_path / "in.jsonl", GOOD)
    result = cli.invoke(app, ["generate", str(inp), str(tmp_path / "out.parquet"), *map(str, models), "--mode",
                              "exspec", "--quiet"])
    refused(result, words, "choose a model built of those")
    assert "linear_attention layers" not in result.output and "dummy" not in result.output
    assert not list(tmp_path.glob("*out*"))


@pytest.mark.parametrize("role", ["--target", "--draft"])
def test_an_embedding_smaller_than_the_tokenizer_is_refused_at_load_naming_both_sizes(tmp_path, model, role):
    """A 60-row embedding with a 100-token tokenizer died at prefill (an IndexError traceback, exit 1, "rerunning
    resumes"), and its work directory then refused the corrected command until --restart."""
    import torch
    from conftest import make_tiny_llama, make_tokenizer

    small = tmp_path / "small"
    make_tiny_llama(60, seed=0, dtype=torch.float32, layers=1, hidden=32).save_pretrained(small)
    make_tokenizer(small)
    inp, out, log = write_jsonl(tmp_path / "in.jsonl", GOOD), tmp_path / "out.parquet", tmp_path / "log.jsonl"
    models = ["--target", small] if role == "--target" else ["--target", model, "--draft", small]
    result = cli.invoke(app, ["generate", str(inp), str(out), *map(str, models), "--mode", "exspec", "--quiet",
                              "--max-new-tokens", "4", "--log-json", str(log)])
    refused(result, f"model '{small}'", "embedding of 60 rows", "tokenizer has 100 tokens")
    assert "rerun" not in result.output
    assert not out.exists() and not list(tmp_path.glob(".out.parquet*"))  # no work directory left behind
    assert [json.loads(line)["event"] for line in log.read_text().splitlines()] == ["error"]
    assert generate(inp, out, model).exit_code == 0  # the corrected command runs


def test_a_model_failure_a_rerun_cannot_fix_does_not_say_a_rerun_resumes(tmp_path):
    """A model that gives a NaN logit fails every rerun the same way: the message says what to change instead."""
    import torch
    from transformers import LlamaForCausalLM

    folder = save_tiny_model_dir(tmp_path / "nan", seed=0, layers=1, hidden=32)
    broken = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        broken.lm_head.weight[7, 0] = float("nan")
    broken.save_pretrained(folder)
    result = generate(write_jsonl(tmp_path / "in.jsonl", GOOD), tmp_path / "out.parquet", folder)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "non-finite logits" in result.output and "rerun the same command to resume" not in result.output
    assert "the same command would fail the same way" in result.output and "--restart" in result.output


def start_batchspec(*args) -> subprocess.Popen:
    """The real command (`python -m batchspec_cli`, as the `batchspec` script runs it) in a new process."""
    return subprocess.Popen([sys.executable, "-m", "batchspec_cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_while_the_command_line_loads_writes_the_interrupted_event(tmp_path, model, signum):
    """A Ctrl-C in the first seconds (torch still importing) exited 130 with no `interrupted` event in --log-json;
    a SIGTERM then killed the process by the signal. Never written to a file the command reads."""
    inp, log = write_jsonl(tmp_path / "in.jsonl", GOOD), tmp_path / "log.jsonl"
    proc = start_batchspec("generate", inp, tmp_path / "out.parquet", "--target", model, "--log-json", log)
    time.sleep(0.5)  # importing torch and transformers takes seconds
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum and "Traceback" not in err, err
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["event"], e["signal"], e["total_rows"], e["exit_code"]) for e in events] == \
        [("interrupted", signal.Signals(signum).name, None, 128 + signum)]

    before = inp.read_bytes()  # --log-json naming the input: the command refuses it, and so does the early event
    proc = start_batchspec("generate", inp, tmp_path / "out.parquet", "--target", model, f"--log-json={inp}")
    time.sleep(0.5)
    proc.send_signal(signum)
    proc.communicate(timeout=120)  # the stop, or the refusal when it came first: the input untouched either way
    assert proc.returncode in (128 + signum, 2) and inp.read_bytes() == before


def test_a_stop_after_the_finish_event_leaves_exit_0(tmp_path, model):
    """OUT complete, the `finish` event written with exit code 0: a SIGINT then killed the process by the signal (or
    printed a traceback from an atexit hook), so a scheduler saw an interrupted job. SIGINTs every 20 ms from the
    finish event to the process's end must leave exit 0."""
    inp, out, log = write_jsonl(tmp_path / "in.jsonl", GOOD), tmp_path / "out.parquet", tmp_path / "log.jsonl"
    proc = start_batchspec("generate", inp, out, "--target", model, "--mode", "ar", "--max-new-tokens", "6",
                           "--dtype", "float64", "--quiet", "--log-json", log)
    sent = 0
    while proc.poll() is None:
        if log.exists() and '"finish"' in log.read_text():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
                sent += 1
            time.sleep(0.02)
        else:
            time.sleep(0.002)
    _, err = proc.communicate()
    assert sent and proc.returncode == 0, (sent, proc.returncode, err)
    assert "Traceback" not in err and "interrupted" not in err and "StopNow" not in err, err
    assert [e["event"] for e in map(json.loads, log.read_text().splitlines())][-1] == "finish"
    assert pq.read_table(out).num_rows == len(GOOD)
