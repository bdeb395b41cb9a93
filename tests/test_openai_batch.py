"""The OpenAI Batch format in and out, read back with the `openai` package's own response types."""

from __future__ import annotations

import dataclasses
import json
import random
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.config import GenerateConfig
from batchspec_cli.engine import constraints
from batchspec_cli.engine.events import RowResult, Sampling, TokenLogprob
from batchspec_cli.io import openai_batch
from batchspec_cli.io.input_table import InputTable
from batchspec_cli.job.generation import Generation, work_dir_for
from batchspec_cli.models.loading import load_model
from conftest import greedy_reference, make_tokenizer, save_target_and_draft_dirs

torch.set_num_threads(1)
runner = CliRunner()
WORDS = ["Hello there", "What is 2+2?", "Write a haiku about the sea.", "x", "Tell me a story", "Why?",
         "List three colours", "abc def ghi"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_target_and_draft_dirs(tmp_path_factory.mktemp("openai_models"))


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def generate(inp, out, target, *extra):
    return invoke("generate", inp, out, "--target", target, "--quiet", "--dtype", "float64", "--max-new-tokens",
                  "12", *extra)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def request(custom_id: str, body: dict, url: str = openai_batch.CHAT) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def forty_rows() -> list[dict]:
    """Per-row settings of 40 chat requests: mixed max_tokens, temperature, top_p and seed."""
    rng = random.Random(0)
    rows = []
    for i in range(40):
        row = {"id": f"req-{i}", "prompt": [{"role": "user", "content": f"{WORDS[i % len(WORDS)]} #{i}"}],
               "max_new_tokens": rng.choice([None, 4, 9, 12]), "temperature": rng.choice([None, 0.0, 0.7, 1.3]),
               "top_p": rng.choice([None, 0.9]), "seed": rng.choice([None, i])}
        rows.append(row)
    return rows


def table_of(rows: list[dict], stops: list) -> pa.Table:
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    return pa.table({**columns, "stop": pa.array(stops, type=pa.list_(pa.string()))})


PER_ROW = ("--temperature-column", "temperature", "--max-new-tokens-column", "max_new_tokens", "--top-p-column",
           "top_p", "--seed-column", "seed")


def test_batch_of_40_chat_requests_answers_every_line_as_the_parquet_rows(tmp_path, model_dirs):
    target, draft = model_dirs
    rows = forty_rows()
    # Stop strings that hit: taken from each stopped row's own completion in a run without them.
    base = tmp_path / "base.parquet"
    pq.write_table(table_of(rows, [None] * 40), tmp_path / "base_in.parquet")
    assert generate(tmp_path / "base_in.parquet", base, target, "--mode", "ar", *PER_ROW).exit_code == 0
    texts = pq.read_table(base).column("completion").to_pylist()
    stops = [None] * 40
    for i in range(0, 40, 3):
        if len(texts[i]) >= 4:
            stops[i] = [texts[i][2:4]] if i % 2 else [texts[i][1:3], "never-there"]
    assert sum(s is not None for s in stops) >= 8

    # The same rows as OpenAI requests (one with an unsupported field, one with n: 2: two choices), and as Parquet.
    lines = []
    for r, stop in zip(rows, stops):
        body = {"model": "gpt-4o-mini", "messages": r["prompt"], "max_tokens": r["max_new_tokens"],
                "temperature": r["temperature"], "top_p": r["top_p"], "seed": r["seed"]}
        if stop is not None:
            body["stop"] = stop[0] if len(stop) == 1 else stop  # a string, or a list
        lines.append(request(r["id"], {k: v for k, v in body.items() if v is not None or k == "seed"}))
    lines[5]["body"]["tools"] = [{"type": "function", "function": {"name": "f"}}]
    lines[17]["body"]["n"] = 2
    lines[20]["body"].update(user="u1", stream=False, frequency_penalty=0, n=1)  # harmless, accepted
    lines[21]["body"]["max_completion_tokens"] = lines[21]["body"].pop("max_tokens", 7)
    rows[21]["max_new_tokens"] = lines[21]["body"]["max_completion_tokens"]
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = generate(batch, out, target, "--draft", draft, "--mode", "exspec", "--batch-size", "5")
    assert result.exit_code == 3, result.output  # some rows failed: the job still answers every line

    parquet_in = tmp_path / "rows.parquet"
    pq.write_table(table_of(rows, stops), parquet_in)
    expected = tmp_path / "rows_out.parquet"
    assert generate(parquet_in, expected, target, "--mode", "ar", *PER_ROW, "--stop-column", "stop").exit_code == 0
    reference = pq.read_table(expected).to_pylist()

    answers = read_lines(out)
    assert [a["custom_id"] for a in answers] == [r["id"] for r in rows]  # every line, in input order
    assert len({a["id"] for a in answers}) == 40
    for i, (answer, ref) in enumerate(zip(answers, reference)):
        if i == 5:
            assert answer["response"] is None and answer["error"]["code"] == "invalid_request"
            assert "'tools'" in answer["error"]["message"]
            continue
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        assert answer["response"]["request_id"]
        completion = ChatCompletion.model_validate(answer["response"]["body"])
        choice = completion.choices[0]
        assert choice.message.content == ref["completion"], i
        assert choice.finish_reason == {"stop_string": "stop"}.get(ref["finish_reason"], ref["finish_reason"])
        assert [c.index for c in completion.choices] == list(range(2 if i == 17 else 1))  # n = 2: two choices
        if i == 17:  # usage counts both choices' tokens
            assert completion.usage.completion_tokens > ref["completion_tokens"]
        else:
            assert completion.usage.completion_tokens == ref["completion_tokens"]
        assert completion.usage.prompt_tokens == ref["prompt_tokens"]
        assert completion.model == str(target)  # what ran, not the body's "gpt-4o-mini"
    stopped = [i for i, r in enumerate(reference) if r["finish_reason"] == "stop_string"]
    assert len(stopped) >= 6 and all(stops[i] is not None for i in stopped)
    assert all(reference[i]["completion_tokens"] <= rows[i]["max_new_tokens"] for i in range(40)
               if rows[i]["max_new_tokens"] is not None)


def test_completions_requests_use_the_raw_prompt_and_parquet_output_keeps_the_request(tmp_path, model_dirs):
    target, _ = model_dirs
    lines = [request(f"c{i}", {"prompt": p, "max_tokens": 6, "model": "m"}, url=openai_batch.COMPLETIONS)
             for i, p in enumerate(WORDS[:4])]
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = invoke("generate", batch, out, "--target", target, "--dtype", "float64", "--max-new-tokens", "12",
                    "--mode", "ar", "--output-format", "openai")
    assert result.exit_code == 0, result.output
    assert f"note: the requests name model 'm': recorded, not used; {target} (--target) answers" in \
        " ".join(result.output.split())
    loaded = load_model(str(target), dtype="float64")
    for prompt, answer in zip(WORDS, read_lines(out)):
        body = Completion.model_validate(answer["response"]["body"])
        ids = loaded.tokenizer(prompt, add_special_tokens=True)["input_ids"]  # no chat template
        expected = greedy_reference(loaded.model, ids, 6, [loaded.tokenizer.eos_token_id])
        assert body.object == "text_completion" and body.usage.prompt_tokens == len(ids)
        assert body.choices[0].text == loaded.tokenizer.decode(expected, skip_special_tokens=True)

    parquet = tmp_path / "rows.parquet"
    assert generate(batch, parquet, target, "--mode", "ar").exit_code == 0  # Parquet stays the default
    table = pq.read_table(parquet)
    assert table.column("id").to_pylist() == table.column("custom_id").to_pylist() == ["c0", "c1", "c2", "c3"]
    assert table.column("model").to_pylist() == ["m"] * 4  # recorded
    assert json.loads(table.column("body")[0].as_py())["prompt"] == WORDS[0]
    assert (tmp_path / "out.stats.parquet").exists() and (tmp_path / "rows.stats.parquet").exists()


def test_a_plain_prompts_file_can_be_answered_in_the_openai_format(tmp_path, model_dirs):
    target, _ = model_dirs
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(WORDS[:3])])
    assert generate(inp, tmp_path / "rows.parquet", target, "--mode", "ar").exit_code == 0
    assert generate(inp, tmp_path / "out.jsonl", target, "--mode", "ar").exit_code == 0
    reference = pq.read_table(tmp_path / "rows.parquet").to_pylist()
    for ref, answer in zip(reference, read_lines(tmp_path / "out.jsonl")):
        body = ChatCompletion.model_validate(answer["response"]["body"])
        assert answer["custom_id"] == ref["id"] and body.choices[0].message.content == ref["completion"]


def test_openai_output_is_written_atomically_and_resumes(tmp_path, model_dirs):
    target, draft = model_dirs
    lines = [request(f"r{i}", {"messages": [{"role": "user", "content": f"{WORDS[i % 8]} {i}"}]}) for i in range(12)]
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    full = tmp_path / "full.jsonl"
    assert generate(batch, full, target, "--mode", "ar").exit_code == 0
    out = tmp_path / "out.jsonl"
    cfg = GenerateConfig(input=batch, output=out, target=str(target), mode="ar", max_new_tokens=12, dtype="float64",
                         batch_size=3, checkpoint_rows=2, quiet=True)
    with Generation.open(cfg) as job:  # stopped as a signal would stop it
        for event in job.events():
            if isinstance(event, RowResult) and job.done_rows == 4:
                job.stop(signal.SIGINT)
        assert job.interrupted and 4 <= job.saved_rows < 12
    assert not out.exists() and (work_dir_for(out) / "job.json").exists()
    log = tmp_path / "log.jsonl"
    result = generate(batch, out, target, "--mode", "ar", "--log-json", log)
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[0]["event"] == "start" and events[0]["version"] and events[1]["event"] == "resumed"
    strip = lambda a: {**a, "response": {**a["response"], "body": {**a["response"]["body"], "created": 0}}}  # noqa
    assert [strip(a) for a in read_lines(out)] == [strip(a) for a in read_lines(full)]
    assert not list(tmp_path.glob(".*tmp")) and not work_dir_for(out).exists()
    # A changed batch file is refused on resume like a changed prompts file.
    with Generation.open(dataclasses.replace(cfg, overwrite=True)) as job:
        for event in job.events():
            if isinstance(event, RowResult) and job.done_rows == 4:
                job.stop(signal.SIGINT)
    out.unlink(missing_ok=True)
    write_jsonl(batch, lines[:11] + [request("r11", {"messages": [{"role": "user", "content": "other"}]})])
    result = generate(batch, out, target, "--mode", "ar", "--overwrite")
    assert result.exit_code == 2 and "the input's contents changed" in result.output, result.output


def test_batch_file_detection_and_bad_lines(tmp_path, model_dirs):
    target, _ = model_dirs
    batch = write_jsonl(tmp_path / "batch.jsonl", [request("a", {"messages": [{"role": "user", "content": "hi"}]})])
    result = generate(batch, tmp_path / "o.parquet", target, "--input-format", "table")
    assert result.exit_code == 2 and "no prompt column 'prompt'" in result.output  # forced to the table reader
    result = generate(batch, tmp_path / "o.parquet", target, "--temperature-column", "t")
    assert result.exit_code == 2 and "--temperature-column" in result.output
    result = generate(batch, tmp_path / "o.parquet", target, "--output-format", "openai")
    assert result.exit_code == 2 and "ending in .jsonl" in result.output
    no_id = write_jsonl(tmp_path / "noid.jsonl", [{"custom_id": "a", "body": {}}, {"method": "POST", "body": {}}])
    result = generate(no_id, tmp_path / "o.jsonl", target)
    assert result.exit_code == 2 and "line 2" in result.output and "custom_id" in result.output
    twice = write_jsonl(tmp_path / "twice.jsonl", [request("a", {"prompt": "x"}, openai_batch.COMPLETIONS)] * 2)
    result = generate(twice, tmp_path / "o.jsonl", target)
    assert result.exit_code == 2 and "duplicate ids" in result.output
    assert not list(tmp_path.glob("o.*"))


def chat(**body) -> dict:
    return request("x", {"messages": [{"role": "user", "content": "hi"}], **body})


@pytest.mark.parametrize("line,needle", [
    (chat(tools=[]), "unsupported body field 'tools'"),
    (chat(frequency_penalty=0.5, logit_bias={"1": 2}), "unsupported body fields 'frequency_penalty', 'logit_bias'"),
    (chat(stream=True), "'stream'"),
    ({**chat(), "extra": 1}, "unsupported line field 'extra'"),
    ({**chat(), "method": "GET"}, "method 'GET'"),
    ({**chat(), "url": "/v1/embeddings"}, "url '/v1/embeddings'"),
    (chat(n=0), "'n' must be an integer >= 1"),
    (chat(n=129), "'n' must be at most 128"),
    (chat(max_tokens=5, max_completion_tokens=6), "disagree"),
    (chat(max_tokens=0), "'max_tokens' must be an integer >= 1"),
    (chat(temperature="hot"), "'temperature' must be a number"),
    (chat(top_p=0), "'top_p' must be a number in (0, 1]"),
    (chat(stop=["", "x"]), "'stop'"),
    (chat(top_logprobs=3), "needs 'logprobs': true"),
    (chat(logprobs=True, top_logprobs=21), "at most 20"),
    (request("x", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "only text content"),
    (request("x", {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}), "message 1 field"),
    (request("x", {"prompt": "hi"}), "'prompt' is a /v1/completions field"),
    (request("x", {"prompt": ["a", "b"]}, openai_batch.COMPLETIONS), "one string"),
    (request("x", {"prompt": [1, 2]}, openai_batch.COMPLETIONS), "one string"),
    (request("x", {"prompt": ""}, openai_batch.COMPLETIONS), "'prompt' must be a non-empty string"),
    (request("x", {"prompt": " \n\t"}, openai_batch.COMPLETIONS), "'prompt' is only whitespace"),  # issue 48
    (request("x", {"messages": [{"role": "user", "content": "  "}]}), "every message is empty or only whitespace"),
])
def test_unsupported_or_bad_requests_are_named(line, needle):
    with pytest.raises(openai_batch.RequestError, match=None) as info:
        openai_batch.parse_request(line)
    assert needle in str(info.value), str(info.value)


def test_honoured_fields_become_the_rows_settings():
    prompt, values = openai_batch.parse_request(chat(
        max_completion_tokens=7, temperature=0.5, top_p=0.8, seed=-3, stop="##", logprobs=True, top_logprobs=4,
        user="u", store=False, metadata={"k": "v"}, stream=False, presence_penalty=0.0,
        response_format={"type": "text"},
        model="gpt", n=1, service_tier=None, frequency_penalty=None))
    assert prompt == [{"role": "user", "content": "hi"}]
    assert values == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.8, "seed": -3, "stop": ("##",),
                      "logprobs": 4, "n": 1, "response_format": constraints.TEXT}  # text: none, not the command's
    _, values = openai_batch.parse_request(chat(logprobs=True))
    assert values == {"logprobs": 0}
    _, values = openai_batch.parse_request(chat(logprobs=False))
    assert values == {}
    prompt, values = openai_batch.parse_request(request("x", {"prompt": ["once"], "logprobs": 2, "max_tokens": 3},
                                                        openai_batch.COMPLETIONS))
    assert prompt == "once" and values == {"logprobs": 2, "max_new_tokens": 3}
    messages = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": "q", "name": "ann"}]
    prompt, _ = openai_batch.parse_request(request("x", {"messages": messages}))
    assert prompt == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "q", "name": "ann"}]


def test_what_a_batch_file_keeps_for_the_job_holds_no_string_per_line(tmp_path):
    """The reader's ids and endpoints stay for the whole job: they are an Arrow column and the two endpoint constants,
    not a Python string per line (a million scattered strings pinned ~1.6 GB of freed parse memory)."""
    path = tmp_path / "batch.jsonl"
    urls = [openai_batch.CHAT, openai_batch.COMPLETIONS, "/v1/embeddings"] * 4
    with open(path, "w", encoding="utf-8") as f:
        for i, url in enumerate(urls):
            body = {"messages": [{"role": "user", "content": f"q{i}"}]} if url != openai_batch.COMPLETIONS \
                else {"prompt": f"q{i}"}
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}) + "\n")
    inp = openai_batch.read_batch(path)
    assert list(inp.ids) == [f"c{i}" for i in range(len(urls))]
    assert isinstance(inp.ids.array, pa.Array)
    assert inp.endpoints == [openai_batch.COMPLETIONS if u == openai_batch.COMPLETIONS else openai_batch.CHAT
                             for u in urls]
    assert {id(e) for e in inp.endpoints} == {id(openai_batch.CHAT), id(openai_batch.COMPLETIONS)}


def test_logprobs_are_formatted_as_openai_logprobs():
    tokenizer = make_tokenizer()
    tid = tokenizer.convert_tokens_to_ids
    entries = [TokenLogprob(tid("h"), -0.25, [(tid("h"), -0.25), (tid("a"), -1.5)]),
               TokenLogprob(tid("i"), -0.75, [(tid("i"), -0.75), (tid("!"), -2.0)]),
               TokenLogprob(tokenizer.eos_token_id, -0.5, [(tokenizer.eos_token_id, -0.5), (tid("?"), -3.0)])]
    rows = []
    for row, url in enumerate((openai_batch.CHAT, openai_batch.COMPLETIONS)):
        result = RowResult(row, f"r{row}", [e.token_id for e in entries], "stop", prompt_tokens=4)
        result.logprobs = entries  # RowResult.logprobs (interfaces.md) comes from the logprobs branch
        rows.append(result)
    inp = InputTable(path=Path("b.jsonl"), table=pa.table({"x": [0, 1]}), prompts=["a", "b"], ids=["r0", "r1"],
                     endpoints=[openai_batch.CHAT, openai_batch.COMPLETIONS])
    chat_line, text_line = openai_batch.output_lines(inp, rows, ["hi", "hi"], tokenizer, "m", True, "salt")
    content = ChatCompletion.model_validate(chat_line["response"]["body"]).choices[0].logprobs.content
    assert [c.token for c in content] == ["h", "i", "<eos>"] and [c.logprob for c in content] == [-0.25, -0.75, -0.5]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("i", -0.75), ("!", -2.0)]
    assert content[0].bytes == list(b"h")
    logprobs = Completion.model_validate(text_line["response"]["body"]).choices[0].logprobs
    assert logprobs.tokens == ["h", "i", "<eos>"] and logprobs.token_logprobs == [-0.25, -0.75, -0.5]
    assert logprobs.top_logprobs[0] == {"h": -0.25, "a": -1.5} and logprobs.text_offset == [0, 1, 2]
    # A row that asked for none has "logprobs": null.
    rows[0].logprobs = None
    chat_line, _ = openai_batch.output_lines(inp, rows, ["hi", "hi"], tokenizer, "m", True, "salt")
    assert chat_line["response"]["body"]["choices"][0]["logprobs"] is None


def test_version_flag():
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"batchspec {version('batchspec')}"


def test_per_row_top_p_and_stop_columns_are_audited_by_verify(tmp_path, model_dirs):
    target, _ = model_dirs
    rows = [{"id": f"r{i}", "prompt": WORDS[i], "top_p": [0.3, None, 0.6, 1.0][i % 4], "stop": None}
            for i in range(8)]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.string()), ("prompt", pa.string()),
                                                                 ("top_p", pa.float64()),
                                                                 ("stop", pa.list_(pa.string()))])), inp)
    out = tmp_path / "out.parquet"
    flags = ("--mode", "ar", "--temperature", "1.5", "--top-p", "0.95", "--top-p-column", "top_p")
    assert generate(inp, out, target, *flags).exit_code == 0
    result = invoke("verify", out, "--quiet")
    assert result.exit_code == 0, result.output  # sampled rows re-decoded with each row's own top_p
    first = pq.read_table(out).to_pylist()
    rows[2]["stop"] = [first[2]["completion"][1:3]]
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(inp)), inp)
    assert generate(inp, out, target, *flags, "--stop-column", "stop", "--overwrite").exit_code == 0
    again = pq.read_table(out).to_pylist()
    assert again[2]["finish_reason"] == "stop_string" and first[2]["completion"].startswith(again[2]["completion"])
    assert rows[2]["stop"][0] not in again[2]["completion"]
    assert [r["completion"] for i, r in enumerate(again) if i != 2] == [r["completion"] for i, r in enumerate(first)
                                                                         if i != 2]
    assert invoke("verify", out, "--quiet").exit_code == 0
    rows[1]["top_p"] = 0.0
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(inp)), inp)
    result = generate(inp, out, target, *flags, "--overwrite")
    assert result.exit_code == 2 and "row 2: column 'top_p' must be a number in (0, 1]" in result.output


def test_the_body_settings_reach_each_rows_request(tmp_path, model_dirs):
    target, _ = model_dirs
    lines = [chat(logprobs=True, top_logprobs=3, stop=["ab", "cd"], top_p=0.5, temperature=0.9, seed=4,
                  max_tokens=3),
             {**chat(), "custom_id": "y"},
             request("z", {"prompt": "p", "logprobs": 0}, openai_batch.COMPLETIONS)]
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    cfg = GenerateConfig(input=batch, output=tmp_path / "o.jsonl", target=str(target), mode="ar", dtype="float64",
                         max_new_tokens=11, temperature=0.1, top_p=0.7, seed=9, stop=("zz",))
    with Generation.open(cfg) as job:
        requests = {r.id: r for r in job.requests()}
    assert (requests["x"].logprobs, requests["x"].stop, requests["x"].max_new_tokens) == (3, ("ab", "cd"), 3)
    assert requests["x"].sampling == Sampling(temperature=0.9, top_k=0, top_p=0.5, seed=4)
    assert (requests["y"].logprobs, requests["y"].stop, requests["y"].max_new_tokens) == (None, (), 11)  # the flags
    assert requests["y"].sampling == Sampling(temperature=0.1, top_k=0, top_p=0.7, seed=9)
    assert requests["z"].logprobs == 0


def test_logprobs_asked_by_requests_reach_both_output_formats(tmp_path, model_dirs):
    """Only the lines that ask get log-probabilities, in the OpenAI output and the Parquet column, and they are
    the target's own log-softmax at each generated token (a plain forward over prompt + completion)."""
    target, draft = model_dirs
    lines = [request(f"c{i}", {"prompt": p, "max_tokens": 6, **({"logprobs": 2} if i % 2 == 0 else {})},
                     url=openai_batch.COMPLETIONS) for i, p in enumerate(WORDS[:4])]
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    out, parquet = tmp_path / "out.jsonl", tmp_path / "rows.parquet"
    for path in (out, parquet):
        result = generate(batch, path, target, "--mode", "exspec", "--draft", draft, "-k", "3")
        assert result.exit_code == 0, result.output
    loaded = load_model(str(target), dtype="float64")
    rows = pq.read_table(parquet).column("completion_logprobs").to_pylist()
    for i, (prompt, answer) in enumerate(zip(WORDS, read_lines(out))):
        choice = Completion.model_validate(answer["response"]["body"]).choices[0]
        if i % 2:
            assert choice.logprobs is None and rows[i] is None
            continue
        ids = loaded.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        completion = greedy_reference(loaded.model, ids, 6, [loaded.tokenizer.eos_token_id])
        with torch.no_grad():
            logits = loaded.model(torch.tensor([ids + completion])).logits[0, len(ids) - 1: -1]
        reference = torch.log_softmax(logits, -1)
        assert [e["token_id"] for e in rows[i]] == completion
        for j, (entry, token) in enumerate(zip(rows[i], completion)):
            assert abs(entry["logprob"] - float(reference[j, token])) < 1e-9
            assert [t["token_id"] for t in entry["top_logprobs"]] == reference[j].topk(2).indices.tolist()
        assert len(choice.logprobs.token_logprobs) == len(completion)
        assert all(abs(a - e["logprob"]) < 1e-9 for a, e in zip(choice.logprobs.token_logprobs, rows[i]))
