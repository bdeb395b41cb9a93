"""Input reading, prompt rendering and output writing (batchspec_cli/io/inputs.py, input_table.py, jsonl.py, cells.py,
prompts.py; batchspec_cli/store/outputs.py, files.py)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchspec_cli.engine.events import RowResult
from batchspec_cli.errors import InputError
from batchspec_cli.io import input_table, inputs, jsonl
from batchspec_cli.io.inputs import read_input
from batchspec_cli.io.prompts import render_prompt
from batchspec_cli.store import files
from batchspec_cli.store.files import check_output_path
from batchspec_cli.store.outputs import (OUTPUT_COLUMNS, results_from_table, results_table, stats_from_table,
                                         stats_path_for, stats_table, write_completions, write_stats)
from batchspec_cli.store.outputs import read_completions, read_run_metadata
from conftest import make_step

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict] | pa.Table) -> Path:
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows)
    pq.write_table(table, path)
    return path


def chunk_rows(monkeypatch, rows: int) -> None:
    """Read inputs ``rows`` rows at a time (every module that reads a chunk: the JSONL parser, the checks, the table)."""
    for module in (input_table, jsonl, inputs):
        monkeypatch.setattr(module, "CHUNK_ROWS", rows)


@contextlib.contextmanager
def raises_input_error(*needles: str):
    """Expect an InputError whose one-line message contains every needle."""
    with pytest.raises(InputError) as info:
        yield info
    msg = str(info.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def results_for(inp, order=None):
    """Fake engine results for every row of `inp` (in `order`), and their texts."""
    order = list(range(len(inp.ids))) if order is None else order
    results = [
        RowResult(
            row=i,
            id=inp.ids[i],
            token_ids=list(range(i + 1)),
            finish_reason="length" if i % 2 else "stop",
            drafted_tokens=5 * i,
            accepted_tokens=3 * i,
            rounds=i,
            prompt_tokens=10 + i,
        )
        for i in order
    ]
    texts = [f"text {i}" for i in order]
    return results, texts


# ---------------------------------------------------------------------------- bad inputs


def test_unsupported_suffix(tmp_path):
    p = tmp_path / "prompts.csv"
    p.write_text("prompt\nhello\n")
    with raises_input_error("prompts.csv", "'.csv'", ".jsonl", ".parquet"):
        read_input(p)


def test_missing_file(tmp_path):
    with raises_input_error("nope.jsonl", "no such file"):
        read_input(tmp_path / "nope.jsonl")


def test_directory(tmp_path):
    d = tmp_path / "dir.jsonl"
    d.mkdir()
    with raises_input_error("dir.jsonl", "directory"):
        read_input(d)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_unreadable_file(tmp_path, monkeypatch, suffix):
    p = tmp_path / f"secret{suffix}"
    if suffix == ".jsonl":
        write_jsonl(p, [{"prompt": "hi"}])
    else:
        write_parquet(p, [{"prompt": "hi"}])
    if os.geteuid() == 0:  # root reads anything: simulate the OS refusing
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        for module in (files, inputs, input_table, jsonl):
            monkeypatch.setattr(module, "open", refuse, raising=False)
    else:
        p.chmod(0)
    with raises_input_error(f"secret{suffix}", "permission denied"):
        read_input(p)


def test_invalid_utf8(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with raises_input_error("bad.jsonl", "line 2", "UTF-8"):
        read_input(p)


def test_malformed_json_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": "b",}\n')
    with raises_input_error("bad.jsonl", "line 3", "malformed JSON"):
        read_input(p)


@pytest.mark.parametrize("line", ['["a", "b"]', '"just a string"', "42", "null"])
def test_json_line_not_an_object(tmp_path, line):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a"}\n' + line + "\n")
    with raises_input_error("bad.jsonl", "line 2", "JSON object"):
        read_input(p)


def test_corrupt_parquet(tmp_path):
    p = tmp_path / "junk.parquet"
    p.write_bytes(b"this is not parquet at all" * 10)
    with raises_input_error("junk.parquet", "Parquet"):
        read_input(p)


def test_truncated_parquet(tmp_path):
    p = write_parquet(tmp_path / "cut.parquet", [{"prompt": f"p{i}" * 50} for i in range(50)])
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with raises_input_error("cut.parquet", "Parquet"):
        read_input(p)


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_empty_jsonl(tmp_path, content):
    p = tmp_path / "empty.jsonl"
    p.write_text(content)
    with raises_input_error("empty.jsonl", "no rows"):
        read_input(p)


def test_empty_parquet(tmp_path):
    p = write_parquet(tmp_path / "empty.parquet", pa.table({"prompt": pa.array([], pa.string())}))
    with raises_input_error("empty.parquet", "no rows"):
        read_input(p)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_missing_prompt_column(tmp_path, suffix):
    rows = [{"id": "a", "text": "hello", "category": "qa"}]
    p = tmp_path / f"in{suffix}"
    write_jsonl(p, rows) if suffix == ".jsonl" else write_parquet(p, rows)
    with raises_input_error(f"in{suffix}", "'prompt'", "'id'", "'text'", "'category'"):
        read_input(p)


@pytest.mark.parametrize(
    "value, needle",
    [
        (None, "null"),
        (float("nan"), "null"),
        (17, "expected a string"),
        ({"text": "hi"}, "expected a string"),
        ([1, 2], "expected a string"),
        ("", "empty"),
        ("   \n\t", "only whitespace"),
        ([], "empty"),
    ],
)
def test_bad_prompt_value_jsonl(tmp_path, value, needle):
    """A prompt cell that is no prompt makes its row an error row; the others are read as they are."""
    p = tmp_path / "in.jsonl"
    # json.dumps writes NaN as the (accepted by Python) literal NaN
    write_jsonl(p, [{"prompt": "fine"}, {"prompt": "also fine"}, {"prompt": value}])
    inp = read_input(p)
    assert inp.prompts[:2] == ["fine", "also fine"] and list(inp.errors) == [2]
    assert "column 'prompt'" in inp.errors[2] and needle in inp.errors[2]


@pytest.mark.parametrize(
    "column, where, needle",
    [
        (pa.array(["ok", None], pa.string()), "row 2", "null"),
        (pa.array([float("nan"), 1.5]), "row 1", "null"),  # a float column: NaN first
        (pa.array([1, 2]), "row 1", "expected a string"),
        (pa.array(["ok", "  "]), "row 2", "only whitespace"),
    ],
)
def test_bad_prompt_value_parquet(tmp_path, column, where, needle):
    p = write_parquet(tmp_path / "in.parquet", pa.table({"text": column}))
    inp = read_input(p, prompt_column="text")
    row = int(where.split()[1]) - 1  # (a float column's other row fails too: a number is no prompt)
    assert row in inp.errors and "column 'text'" in inp.errors[row] and needle in inp.errors[row]


def test_bad_chat_message(tmp_path):
    p = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "user"}]}],
    )
    inp = read_input(p, prompt_column="messages")
    assert list(inp.errors) == [1] and "column 'messages'" in inp.errors[1] and "content" in inp.errors[1]


def test_duplicate_ids(tmp_path):
    rows = [{"id": i % 7, "prompt": f"q{i}"} for i in range(30)]
    p = write_jsonl(tmp_path / "dup.jsonl", rows)
    with raises_input_error("dup.jsonl", "duplicate ids", "'0'", "'4'", "and 2 more") as info:
        read_input(p)
    assert "'5'" not in str(info.value)  # at most five ids named


@pytest.mark.parametrize("chunk", [2, 3, 8192])
def test_one_repeated_id_is_found_wherever_it_lies(tmp_path, monkeypatch, chunk):
    """Ids are checked in sorted order a chunk at a time: a pair of equal ids is found whichever chunks the sorted
    order puts them in (the oracle: Python's set)."""
    chunk_rows(monkeypatch, chunk)
    rng = random.Random(chunk)
    for trial in range(30):
        ids = [f"{rng.randrange(10**6)}" for _ in range(rng.randrange(1, 40))]
        if trial % 2 and len(ids) > 1:
            ids[rng.randrange(len(ids))] = ids[rng.randrange(len(ids))]
        p = write_jsonl(tmp_path / f"in{trial}.jsonl", [{"id": i, "prompt": "q"} for i in ids])
        if len(set(ids)) == len(ids):
            assert list(read_input(p).ids) == ids
        else:
            with raises_input_error("duplicate ids"):
                read_input(p)


def test_duplicate_ids_after_str(tmp_path):
    p = write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "prompt": "a"}, {"id": "1", "prompt": "b"}])
    with raises_input_error("dup.jsonl", "duplicate ids", "'1'"):
        read_input(p)


def test_null_id(tmp_path):
    p = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": None, "prompt": "y"}])
    with raises_input_error("in.jsonl", "line 2", "'id'", "null"):
        read_input(p)


def test_explicit_id_column_missing(tmp_path):
    p = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    with raises_input_error("in.jsonl", "'uid'", "'prompt'"):
        read_input(p, id_column="uid")


@pytest.mark.parametrize("limit", [0, -3])
def test_bad_limit(tmp_path, limit):
    p = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    with raises_input_error("in.jsonl", "limit"):
        read_input(p, limit=limit)


@pytest.mark.parametrize("name", [c for c in OUTPUT_COLUMNS if c != "id"])
def test_column_clash(tmp_path, name):
    p = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "x", name: 1}])
    with raises_input_error(
        f"prompts.jsonl: input column '{name}' clashes with an output column; rename it"
    ):
        read_input(p)


def test_id_column_named_id_is_no_clash_but_other_id_is(tmp_path):
    p = write_jsonl(tmp_path / "prompts.jsonl", [{"id": 7, "uid": "u1", "prompt": "x"}])
    assert read_input(p).ids == ["7"]
    with raises_input_error("prompts.jsonl", "'id' clashes"):
        read_input(p, id_column="uid")


# ---------------------------------------------------------------------------- good inputs


def test_sample_jsonl_and_parquet_agree():
    a = read_input(SAMPLE / "prompts.jsonl")
    b = read_input(SAMPLE / "prompts.parquet")
    assert a.table.num_rows == 30
    assert a.table.column_names == ["id", "prompt", "category"]
    assert a.table.equals(b.table)
    assert a.prompts == b.prompts and a.ids == b.ids
    assert a.ids[:2] == ["p01", "p02"]
    assert all(isinstance(p, str) and p.strip() for p in a.prompts)


def test_jsonl_round_trip_types_and_missing_keys(tmp_path):
    rows = [
        {"id": "x", "prompt": "one", "score": 1.5, "tags": ["a"]},
        {"id": "y", "prompt": "two"},  # missing keys -> null
        {"id": "z", "prompt": "three", "extra": True},
    ]
    p = tmp_path / "in.ndjson"
    p.write_text("\ufeff" + "\n".join(json.dumps(r) for r in rows) + "\r\n\n")  # BOM, CRLF
    inp = read_input(p)
    assert inp.path == p
    assert inp.table.column_names == ["id", "prompt", "score", "tags", "extra"]
    assert inp.table.column("score").to_pylist() == [1.5, None, None]
    assert inp.table.column("extra").to_pylist() == [None, None, True]
    assert inp.prompts == ["one", "two", "three"]
    assert inp.ids == ["x", "y", "z"]


def test_mixed_types_fall_back_to_json_strings_and_strings_stay_as_they_were(tmp_path):
    rows = [
        {"prompt": "a", "meta": 1},
        {"prompt": "b", "meta": "two"},
        {"prompt": "c", "meta": [3]},
        {"prompt": "d", "meta": None},
        {"prompt": "e", "meta": 2**80},
    ]
    inp = read_input(write_jsonl(tmp_path / "in.jsonl", rows))
    assert inp.table.schema.field("meta").type == pa.string()
    assert inp.table.column("meta").to_pylist() == ["1", "two", "[3]", None, str(2**80)]


def test_spec_bench_turns(tmp_path):
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["First turn.", "Second turn."]},
        {"question_id": 82, "category": "math", "turns": ["Only turn."]},
    ]
    for p in (write_jsonl(tmp_path / "sb.jsonl", rows), write_parquet(tmp_path / "sb.pq", rows)):
        inp = read_input(p, prompt_column="turns", id_column="question_id")
        assert inp.prompts == ["First turn.", "Only turn."]
        assert inp.ids == ["81", "82"]


def test_chat_messages_column(tmp_path):
    inp = read_input(SAMPLE / "chat.jsonl", prompt_column="messages")
    assert len(inp.prompts) == 8
    assert all(isinstance(m, list) and m for m in inp.prompts)
    assert any(m[0]["role"] == "system" for m in inp.prompts)
    assert any(any(x["role"] == "assistant" for x in m) for m in inp.prompts)
    # through Parquet (structs): the same messages come back
    pq_path = write_parquet(tmp_path / "chat.parquet", inp.table)
    again = read_input(pq_path, prompt_column="messages")
    assert again.prompts == inp.prompts and again.ids == inp.ids


def test_messages_and_strings_mixed_in_one_column(tmp_path):
    rows = [{"prompt": "plain"}, {"prompt": [{"role": "user", "content": "chat"}]}]
    inp = read_input(write_jsonl(tmp_path / "in.jsonl", rows))
    assert inp.prompts == ["plain", [{"role": "user", "content": "chat"}]]
    assert inp.table.schema.field("prompt").type == pa.string()  # JSON-encoded fallback


def test_ids_from_row_index(tmp_path):
    inp = read_input(write_jsonl(tmp_path / "in.jsonl", [{"prompt": c} for c in "abc"]))
    assert inp.ids == ["0", "1", "2"]


def test_ids_from_other_column(tmp_path):
    rows = [{"key": 10 - i, "prompt": c} for i, c in enumerate("abc")]
    inp = read_input(write_parquet(tmp_path / "in.parquet", rows), id_column="key")
    assert inp.ids == ["10", "9", "8"]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_limit(tmp_path, suffix):
    rows = [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(10)]
    p = tmp_path / f"in{suffix}"
    write_jsonl(p, rows) if suffix == ".jsonl" else write_parquet(p, rows)
    inp = read_input(p, limit=3)
    assert inp.ids == ["r0", "r1", "r2"] and inp.table.num_rows == 3
    assert read_input(p, limit=100).table.num_rows == 10


def test_limit_stops_before_a_later_bad_line(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": "b"}\nnot json\n')
    assert read_input(p, limit=2).prompts == ["a", "b"]
    with raises_input_error("line 3"):
        read_input(p)


# ---------------------------------------------------------------------------- render_prompt

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = "<unk> <s> </s> <|system|> <|user|> <|assistant|> be brief hello world how are you"
    vocab = {w: i for i, w in enumerate(words.split())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def ids_of(tokenizer, text: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(w) for w in text.split()]


def test_render_plain(tokenizer):
    ids = render_prompt(tokenizer, "hello world", chat=False, system=None)
    assert ids == ids_of(tokenizer, "<s> hello world")
    assert type(ids) is list and all(type(t) is int for t in ids)


def test_render_plain_with_system_and_messages(tokenizer):
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    assert render_prompt(tokenizer, msgs, chat=False, system="be brief") == ids_of(
        tokenizer, "<s> be brief hello world"
    )


def test_render_chat_string(tokenizer):
    ids = render_prompt(tokenizer, "how are you", chat=True, system=None)
    assert ids == ids_of(tokenizer, "<|user|> how are you <|assistant|>")
    assert type(ids) is list and all(type(t) is int for t in ids)


def test_render_chat_adds_system_once(tokenizer):
    ids = render_prompt(tokenizer, "hello", chat=True, system="be brief")
    assert ids == ids_of(tokenizer, "<|system|> be brief <|user|> hello <|assistant|>")
    msgs = [{"role": "system", "content": "you"}, {"role": "user", "content": "hello"}]
    ids = render_prompt(tokenizer, msgs, chat=True, system="be brief")  # has one: kept as is
    assert ids == ids_of(tokenizer, "<|system|> you <|user|> hello <|assistant|>")
    assert msgs[0]["content"] == "you" and len(msgs) == 2  # caller's list untouched


def test_render_chat_without_template_falls_back(tokenizer):
    class NoTemplate:
        chat_template = None

        def __call__(self, text, add_special_tokens):
            return tokenizer(text, add_special_tokens=add_special_tokens)

    ids = render_prompt(NoTemplate(), "hello world", chat=True, system=None)
    assert ids == ids_of(tokenizer, "<s> hello world")


def test_render_chat_handles_dict_or_batch_returns():
    class DictTemplate:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return {"input_ids": [[4, 5, 6]], "attention_mask": [[1, 1, 1]]}

    assert render_prompt(DictTemplate(), "hi", chat=True, system=None) == [4, 5, 6]


# ---------------------------------------------------------------------------- output paths


def test_check_output_path_ok(tmp_path):
    check_output_path(tmp_path / "out.parquet", overwrite=False)
    assert list(tmp_path.iterdir()) == []  # the write probe is cleaned up


def test_check_output_path_exists(tmp_path):
    out = tmp_path / "out.parquet"
    out.write_bytes(b"x")
    with raises_input_error("out.parquet already exists; pass --overwrite to replace it"):
        check_output_path(out, overwrite=False)
    check_output_path(out, overwrite=True)


def test_check_output_path_directory(tmp_path):
    (tmp_path / "out.parquet").mkdir()
    with raises_input_error("out.parquet", "directory"):
        check_output_path(tmp_path / "out.parquet", overwrite=True)


def test_check_output_path_suffix(tmp_path):
    with raises_input_error("out.csv", ".parquet"):
        check_output_path(tmp_path / "out.csv", overwrite=False)


def test_check_output_path_missing_parent(tmp_path):
    with raises_input_error("out.parquet", "does not exist"):
        check_output_path(tmp_path / "nope" / "out.parquet", overwrite=False)


def test_check_output_path_not_writable(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with raises_input_error("out.parquet", "not writable"):
        check_output_path(tmp_path / "out.parquet", overwrite=False)


def test_check_output_path_probe_fails(tmp_path, monkeypatch):
    real_open = os.open

    def fake_open(path, *args, **kwargs):
        if str(path).endswith(".probe.tmp"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    with raises_input_error("out.parquet", "cannot write"):
        check_output_path(tmp_path / "out.parquet", overwrite=False)


def test_stats_path_for(tmp_path):
    assert stats_path_for(tmp_path / "out.parquet") == tmp_path / "out.stats.parquet"
    assert stats_path_for(Path("runs/a.b.parquet")) == Path("runs/a.b.stats.parquet")


# ---------------------------------------------------------------------------- writing


def test_write_completions_round_trip(tmp_path):
    inp = read_input(SAMPLE / "prompts.jsonl", limit=7)
    order = [3, 0, 6, 1, 5, 2, 4]
    results, texts = results_for(inp, order)
    results[1].finish_reason, results[1].error = "error", "prompt too long"  # row 0
    out = tmp_path / "out.parquet"
    meta = {"target": "m", "k": 5, "seed": 0, "versions": {"torch": "2.13"}}
    write_completions(out, inp.table, inp.ids, results, texts, meta)

    table = read_completions(out)
    assert table.column_names == ["id", "prompt", "category", *OUTPUT_COLUMNS[1:]]
    assert table.column("id").to_pylist() == inp.ids
    assert table.column("prompt").to_pylist() == inp.prompts
    assert table.column("completion").to_pylist() == [f"text {i}" for i in range(7)]
    assert table.column("completion_tokens").to_pylist() == [i + 1 for i in range(7)]
    assert table.column("completion_token_ids").to_pylist() == [list(range(i + 1)) for i in range(7)]
    assert table.column("prompt_tokens").to_pylist() == [10 + i for i in range(7)]
    assert table.column("rounds").to_pylist() == list(range(7))
    assert table.column("error").to_pylist() == ["prompt too long"] + [None] * 6
    assert table.column("finish_reason").to_pylist()[:3] == ["error", "length", "stop"]
    schema = table.schema
    for name in ("prompt_tokens", "completion_tokens", "drafted_tokens", "accepted_tokens", "rounds"):
        assert schema.field(name).type == pa.int32()
    assert schema.field("completion_token_ids").type == pa.list_(pa.int32())
    assert schema.field("id").type == pa.string()
    assert read_run_metadata(out) == meta
    assert [p.name for p in tmp_path.iterdir()] == ["out.parquet"]


def test_write_completions_integer_ids_become_strings(tmp_path):
    inp = read_input(write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "id": 5}, {"prompt": "b", "id": 6}]))
    results, texts = results_for(inp)
    write_completions(tmp_path / "out.parquet", inp.table, inp.ids, results, texts, {})
    table = read_completions(tmp_path / "out.parquet")
    assert table.column_names[:2] == ["prompt", "id"]  # replaced in place
    assert table.column("id").to_pylist() == ["5", "6"]


def test_write_completions_without_id_column(tmp_path):
    inp = read_input(write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "n": 1}, {"prompt": "b", "n": 2}]))
    results, texts = results_for(inp, [1, 0])
    write_completions(tmp_path / "out.parquet", inp.table, inp.ids, results, texts, {})
    table = read_completions(tmp_path / "out.parquet")
    assert table.column_names[:3] == ["prompt", "n", "id"]
    assert table.column("id").to_pylist() == ["0", "1"]


def test_write_completions_missing_row_is_a_bug(tmp_path):
    inp = read_input(SAMPLE / "prompts.jsonl", limit=3)
    results, texts = results_for(inp, [0, 2])
    out = tmp_path / "out.parquet"
    with pytest.raises(RuntimeError, match="row"):
        write_completions(out, inp.table, inp.ids, results, texts, {})
    assert not out.exists()


@pytest.mark.parametrize("existing", [False, True])
def test_write_is_atomic(tmp_path, monkeypatch, existing):
    inp = read_input(SAMPLE / "prompts.jsonl", limit=4)
    results, texts = results_for(inp)
    out = tmp_path / "out.parquet"
    if existing:
        out.write_bytes(b"previous run")

    def half_write(table, where, *args, **kwargs):
        where.write(b"PAR1 half a file")  # real bytes land in the temp file first
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", half_write)
    with pytest.raises(OSError, match="No space"):
        write_completions(out, inp.table, inp.ids, results, texts, {"k": 1})
    if existing:
        assert out.read_bytes() == b"previous run"
        assert [p.name for p in tmp_path.iterdir()] == ["out.parquet"]
    else:
        assert list(tmp_path.iterdir()) == []


STATS_COLUMNS = ["bucket", "step", "group_kind", "batch_size", "k", "accepted", "tokens_emitted", "pad_before",
                 "pad_after", "kv_moved", "kv_gathered", "draft_ms", "verify_ms", "realign_ms", "gather_ms", "total_ms",
                 "drafter", "drafted", "prompt_prefilled", "prompt_reused", "expected_tokens", "expected_ms",
                 "plain_ms", "arm", "window_tokens_per_s"]


def test_write_stats_round_trip(tmp_path):
    stats = [
        make_step(
            filled=True, bucket=0, step=s, group_kind="same_length" if s % 2 else "realigned", batch_size=3,
            k=5, accepted=[s, 0, 5], kv_moved=3 * 10**9, verify_ms=10.0 + s,
        )
        for s in range(3)
    ]
    path = tmp_path / "out.stats.parquet"
    write_stats(path, stats, {"mode": "exspec"})
    table = pq.read_table(path)
    assert table.column_names == STATS_COLUMNS  # the facts, then the policy's trace, one column each
    assert table.to_pylist() == [s.record() for s in stats]
    assert stats_from_table(table) == stats
    assert table.schema.field("accepted").type == pa.list_(pa.int32())
    assert table.schema.field("kv_moved").type == pa.int64()
    assert read_run_metadata(path) == {"mode": "exspec"}


def test_write_stats_empty(tmp_path):
    path = tmp_path / "s.parquet"
    write_stats(path, [], {"mode": "ar"})
    table = pq.read_table(path)
    assert table.num_rows == 0
    assert table.column_names == STATS_COLUMNS
    assert read_run_metadata(path) == {"mode": "ar"}


def test_read_run_metadata_missing(tmp_path):
    p = write_parquet(tmp_path / "plain.parquet", [{"a": 1}])
    with raises_input_error("plain.parquet", "metadata"):
        read_run_metadata(p)
    with raises_input_error("gone.parquet"):
        read_run_metadata(tmp_path / "gone.parquet")


# ---------------------------------------------------------------------------- fuzz

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
row_dicts = st.dictionaries(
    st.sampled_from(["prompt", "id", "meta", "x", "completion", ""]), json_values, max_size=4
)
valid_rows = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=8)},
    optional={"id": st.integers(0, 3) | st.text(max_size=2), "meta": json_values, "x": json_values},
)
line_strategy = st.one_of(
    valid_rows.map(json.dumps).map(str.encode),
    row_dicts.map(json.dumps).map(str.encode),
    json_values.map(json.dumps).map(str.encode),
    st.binary(max_size=30),
    st.just(b""),
)


def _read_and_write(data: bytes, limit):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fuzz.jsonl"
        p.write_bytes(data)
        try:
            inp = read_input(p, limit=limit)
        except InputError as e:
            assert "fuzz.jsonl" in str(e) and "\n" not in str(e)
            return
        assert len(inp.prompts) == len(inp.ids) == inp.table.num_rows >= 1
        # whatever read_input accepts can be written out
        results, texts = results_for(inp, random.Random(0).sample(range(len(inp.ids)), len(inp.ids)))
        write_completions(Path(d) / "out.parquet", inp.table, inp.ids, results, texts, {"fuzz": True})
        assert read_completions(Path(d) / "out.parquet").column("id").to_pylist() == inp.ids


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(line_strategy, max_size=5), limit=st.none() | st.integers(0, 3))
def test_fuzz_jsonl_lines(lines, limit):
    _read_and_write(b"\n".join(lines), limit)


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=200))
def test_fuzz_random_bytes(data):
    _read_and_write(data, None)


def _parquet_bytes(rows: list[dict]) -> bytes | None:
    try:
        table = pa.Table.from_pylist(rows)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None  # Arrow cannot make a Parquet file of these rows: nothing a user could hand us
    return sink.getvalue().to_pybytes()


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.one_of(valid_rows, row_dicts), min_size=0, max_size=4),
       cut=st.none() | st.floats(0.0, 1.0), flip=st.none() | st.integers(0, 10_000))
def test_fuzz_parquet_tables_truncated_or_corrupted(rows, cut, flip):
    """Parquet files of odd tables, some truncated or with one byte flipped: a message or a good read."""
    data = _parquet_bytes(rows)
    if data is None:
        return
    if cut is not None:
        data = data[: int(len(data) * cut)]
    if flip is not None and data:
        i = flip % len(data)
        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fuzz.parquet"
        p.write_bytes(data)
        try:
            inp = read_input(p)
        except InputError as e:
            assert "fuzz.parquet" in str(e) and "\n" not in str(e)
            return
        results, texts = results_for(inp)
        write_completions(Path(d) / "out.parquet", inp.table, inp.ids, results, texts, {"fuzz": True})


@settings(max_examples=30, deadline=None, derandomize=True)
@given(prefix=st.lists(valid_rows, max_size=3), junk=st.binary(min_size=1, max_size=8),
       huge=st.integers(10_000, 200_000))
def test_fuzz_jsonl_huge_line_and_invalid_utf8(prefix, junk, huge):
    """A huge line reads; invalid UTF-8 (or any junk) after good lines names its line."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fuzz.jsonl"
        rows = [{k: v for k, v in r.items() if k != "id"} for r in prefix] + [{"prompt": "x" * huge}]
        good = [json.dumps(r).encode() for r in rows]
        p.write_bytes(b"\n".join(good + [b"\xff" + junk]))
        with raises_input_error("fuzz.jsonl", f"line {len(good) + 1}"):
            read_input(p)
        assert len(read_input(p, limit=len(good)).prompts[-1]) == huge


def test_results_and_stats_tables_round_trip():
    """The checkpoint part format keeps every field of RowResult and StepStats."""
    results = [RowResult(row=3, id="a", token_ids=[1, 2], finish_reason="error", error="boom", drafted_tokens=4,
                         accepted_tokens=2, rounds=1, prompt_tokens=9),
               RowResult(row=2**40, id="b", token_ids=[], finish_reason="stop")]
    assert results_from_table(results_table(results)) == results
    stats = [make_step(bucket=1, step=2, group_kind="realigned", batch_size=3, k=4, accepted=[1, 0, 4],
                       tokens_emitted=8, pad_before=2, pad_after=1, kv_moved=2**40, kv_gathered=5, draft_ms=1.5,
                       verify_ms=2.25, realign_ms=0.0, gather_ms=0.125, total_ms=4.0, arm="spec", plain_ms=3.0)]
    assert stats_from_table(stats_table(stats)) == stats


def test_jsonl_read_in_chunks_equals_the_whole_file_read(tmp_path, monkeypatch):
    """Chunks whose columns differ (absent, all null, an integer in one and a float in another, a list in one and
    a string in another) give the table the whole-file reader gives, its ids and its prompts."""
    chunk_rows(monkeypatch, 2)
    lines = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"},
             {"id": "c", "prompt": "z", "t": None}, {"id": "d", "prompt": "w", "extra": 1},
             {"id": "e", "prompt": "v", "t": 0.5, "extra": 2}, {"id": "f", "prompt": "u", "t": 1, "extra": 3.5},
             {"id": "g", "prompt": "s", "m": [1]}, {"id": "h", "prompt": "r", "m": "text"}]
    for cut in range(1, len(lines) + 1):
        path = tmp_path / f"in{cut}.jsonl"
        path.write_text("\n".join(json.dumps(line) for line in lines[:cut]) + "\n\n")
        whole = jsonl.jsonl_table(jsonl.read_jsonl(path, None).rows)[0]
        for store in (None, tmp_path / f"rows{cut}.parquet"):  # in memory, and written to disk as it is read
            got = read_input(path, store=store)
            assert got.table.slice(0).equals(input_table.storable(whole, {})[0]), (cut, store)
            assert list(got.ids) == [line["id"] for line in lines[:cut]]
            assert list(got.prompts) == [line["prompt"] for line in lines[:cut]]
    assert all(p.suffix in (".jsonl", ".parquet") for p in tmp_path.iterdir())  # the chunks' own files are gone


def nested(depth: int, leaf):
    return leaf if depth == 0 else [nested(depth - 1, leaf)]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
@pytest.mark.parametrize("limit", [None, 5])
def test_a_file_written_to_disk_as_it_is_read_equals_the_file_read_in_memory(tmp_path, monkeypatch, kind, limit):
    """With a store, the rows go to disk a chunk at a time: the table read back, its prompts, ids, error rows and
    the values as written of a column too deep for Parquet are those of the same file read in memory."""
    chunk_rows(monkeypatch, 3)
    rows = [{"id": 10 * i, "prompt": f"tell me {i}" if i % 4 else None, "score": i / 2 if i > 3 else None,
             "deep": nested(input_table.MAX_NESTING + 2, i), "msgs": [{"role": "user", "content": str(i)}]}
            for i in range(11)]
    path = write_jsonl(tmp_path / "in.jsonl", rows) if kind == "jsonl" else \
        write_parquet(tmp_path / "in.parquet", rows)
    if kind == "parquet":  # several row groups, cut across the chunks
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    memory = read_input(path, limit=limit)
    stored = read_input(path, limit=limit, store=tmp_path / "rows.parquet")
    assert isinstance(stored.table, input_table.StoredTable) and stored.table.num_rows == (limit or len(rows))
    assert stored.table.slice(0).equals(memory.table)
    assert list(stored.ids) == list(memory.ids) == [str(10 * i) for i in range(limit or len(rows))]
    assert list(stored.prompts) == list(memory.prompts)
    assert stored.errors == memory.errors and set(stored.errors) == {i for i in (0, 4, 8) if i < (limit or 11)}
    assert stored.values("deep") == memory.values("deep") == [rows[i]["deep"] for i in range(limit or len(rows))]
    assert stored.values("score") == memory.values("score")


def test_a_stored_table_reads_any_range_as_the_table_does(tmp_path):
    """``StoredTable.slice`` over row groups of uneven sizes, in any order, equals ``pa.Table.slice``."""
    table = pa.table({"n": list(range(50)), "s": [f"v{i}" * (i % 3) for i in range(50)]})
    path = tmp_path / "t.parquet"
    with pq.ParquetWriter(path, table.schema) as writer:
        for first, size in ((0, 7), (7, 1), (8, 20), (28, 22)):
            writer.write_table(table.slice(first, size))
    stored = input_table.StoredTable(path)
    rng = random.Random(0)
    for _ in range(200):
        offset = rng.randrange(0, 55)
        length = rng.randrange(0, 30)
        assert stored.slice(offset, length).equals(table.slice(offset, length)), (offset, length)
    assert stored.column("s").to_pylist() == table.column("s").to_pylist()
    assert stored.num_rows == 50 and stored.column_names == ["n", "s"]


def test_reading_into_a_store_holds_one_chunk_however_long_the_file(tmp_path, monkeypatch):
    """While a file is read into a store, the Arrow memory live at each chunk stays that of a chunk: it does not
    grow with the chunks read before it (read in memory, it grows by every chunk's table)."""
    chunk_rows(monkeypatch, 1000)
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"{i} " + "words " * 40} for i in range(20000)])
    parse = jsonl.jsonl_table

    def live(store):
        seen = []
        monkeypatch.setattr(jsonl, "jsonl_table", lambda rows: (seen.append(pa.total_allocated_bytes()),
                                                                 parse(rows))[1])
        before = pa.total_allocated_bytes()
        inp = read_input(path, store=store)
        return [n - before for n in seen], pa.total_allocated_bytes() - before, inp

    in_memory, _, inp = live(None)
    table_bytes = inp.table.nbytes
    del inp
    gc.collect()  # an InputTable and its Prompts refer to each other
    stored, held, inp = live(tmp_path / "rows.parquet")
    assert len(stored) == 20
    assert in_memory[-1] - in_memory[0] > 0.8 * table_bytes  # the check can see growth: the chunks accumulate
    assert max(stored) < 0.15 * table_bytes, (stored, table_bytes)  # a chunk is 5 % of the table
    assert held < 0.2 * table_bytes, (held, table_bytes)  # the ids and at most a row group or two remain


def test_a_list_of_nulls_reads_as_written(tmp_path):
    """pyarrow's identity cast of a list<null> column builds an invalid array (found by the fuzz test)."""
    p = tmp_path / "in.jsonl"
    p.write_text('{"prompt": "0", "meta": [null, null]}\n')
    inp = read_input(p)
    assert list(inp.values("meta")) == [[None, None]]
