"""prompts.render_prompts: the one rendering loop of `generate` and `batchspec bucket`."""

from __future__ import annotations

import json

import pyarrow as pa
from typer.testing import CliRunner

from batchspec_cli.cli import app
from batchspec_cli.io import prompts as prompts_module
from batchspec_cli.io.input_table import InputTable
from batchspec_cli.io.prompts import max_prompt_bytes, render_prompt
from batchspec_cli.io.prompts import render_chunks, render_prompts
from conftest import make_tokenizer, save_tiny_model_dir

STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
                   "{{ raise_exception('tool messages are not supported') }}{% endif %}"
                   "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>")


def strict_tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = STRICT_TEMPLATE
    return tokenizer


def an_input(prompts: list, errors: dict[int, str] | None = None) -> InputTable:
    ids = [str(i) for i in range(len(prompts))]
    return InputTable(path=None, table=pa.table({"id": ids}), prompts=prompts, ids=ids, errors=errors or {})


def test_each_row_fails_alone_and_the_others_render_as_render_prompt_does():
    tokenizer = strict_tokenizer()
    too_long = max_prompt_bytes(tokenizer, 50) + 1  # bytes no 50 tokens can hold
    prompts = ["hello", [{"role": "tool", "content": "x"}], "x" * too_long, "refused", "bye"]
    rendered = render_prompts(an_input(prompts, {3: "refused by the batch file"}), tokenizer, True, "sys",
                              most_tokens=50, what="--max-prompt-tokens 50")
    assert [row for row, ids in enumerate(rendered.ids.to_pylist()) if ids] == [0, 4]
    for row in (0, 4):
        assert rendered.ids[row].as_py() == render_prompt(tokenizer, prompts[row], True, "sys")
    assert sorted(rendered.errors) == [1, 2, 3]
    assert rendered.errors[1] == "cannot render the prompt: tool messages are not supported"
    assert rendered.errors[2].startswith(f"prompt has {too_long} bytes, more than --max-prompt-tokens 50 can hold")
    assert rendered.errors[3] == "refused by the batch file"


class CountedPrompts(list):
    """Prompts that record which chunks were asked for (as ``input_table.Prompts`` parses a chunk at a time)."""

    def __init__(self, prompts):
        super().__init__(prompts)
        self.asked: list[tuple[int, int]] = []

    def chunk(self, start, stop):
        self.asked.append((start, stop))
        return list(self[start:stop])


def test_chunks_come_one_at_a_time_with_their_errors(monkeypatch):
    monkeypatch.setattr(prompts_module, "CHUNK_ROWS", 2)
    tokenizer = strict_tokenizer()
    prompts = CountedPrompts(["a", [{"role": "tool", "content": "x"}], "bc", "refused", "def"])
    inp = an_input(prompts, {3: "refused by the batch file"})
    errors: dict[int, str] = {}
    chunks = render_chunks(inp, tokenizer, True, None, errors)
    seen = []
    for start, ids in chunks:
        assert prompts.asked[-1] == (start, min(start + 2, 5))  # the next chunk is not parsed yet
        assert sorted(errors) == [row for row in (1, 3) if row < start + len(ids)]  # this chunk's errors are in
        seen.append((start, ids.type, ids.to_pylist()))
    assert [start for start, _, _ in seen] == [0, 2, 4]
    assert all(kind == pa.list_(pa.int32()) for _, kind, _ in seen)
    expected = [[] if row in (1, 3) else render_prompt(tokenizer, prompts[row], True, None) for row in range(5)]
    assert [row_ids for _, _, ids in seen for row_ids in ids] == expected


def test_without_a_limit_no_prompt_is_refused_for_its_size():
    rendered = render_prompts(an_input(["x" * 500]), strict_tokenizer(), False, None)
    assert rendered.errors == {} and len(rendered.ids[0].as_py()) >= 500


def test_bucket_refuses_an_input_whose_template_raises_naming_the_row(tmp_path):
    target = save_tiny_model_dir(tmp_path / "strict", seed=0)
    strict_tokenizer().save_pretrained(target)
    inp = tmp_path / "in.jsonl"
    lines = [{"prompt": "hello"}, {"prompt": [{"role": "tool", "content": "x"}]}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = CliRunner().invoke(app, ["bucket", str(inp), str(tmp_path / "buckets"), "--target", str(target)])
    assert result.exit_code != 0 and not (tmp_path / "buckets").exists()
    message = " ".join(result.output.split())
    assert "row 2: cannot render the prompt: tool messages are not supported" in message, result.output
