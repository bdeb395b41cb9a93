"""The OpenAI Batch file format, in and out (as the OpenAI Batch API and ``vllm run-batch`` use it).

Input: a JSONL file, one request per line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64, "temperature": 0.7, "stop": ["\\n\\n"]}}

``read_batch`` turns it into the same ``input_table.InputTable`` as any input: ``custom_id`` is the row
id; the body's settings become per-row values (``InputTable.overrides``, as the per-row
columns of a table give them), so a row runs exactly as the same row of a Parquet file with
per-row columns would. A field a body leaves out (or sets to null) takes the command's flag
(``--temperature`` defaults to 0, greedy, where OpenAI's default is 1). What a body may hold:

- honoured: ``messages`` (chat) / ``prompt`` (completions: the raw text, no chat template, no
  ``--system``), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
  ``seed``, ``stop`` (a string or a list: the row's stop strings, besides ``--stop``),
  ``logprobs`` / ``top_logprobs`` (chat) or ``logprobs`` (completions), ``n`` (1-128: ``n`` choices, sample j
  keyed by (seed, custom_id, j), choice 0 the one ``n = 1`` gives; a greedy request's choices are equal),
  ``response_format`` ``json_object`` (any JSON object), ``json_schema`` (``strict`` true or false:
  the schema is enforced either way; ``constraints.py``), an invalid schema making the line an error, or
  ``text`` (no constraint, even where the command gives one; a missing or null one takes the command's);
- recorded, never acted on: ``model`` (the ``--target`` runs; the response names it);
- accepted because they cannot change the completion: ``user``, ``store``, ``metadata``,
  ``service_tier``, and the neutral values ``stream: false``, ``echo: false``, ``best_of: 1``,
  ``frequency_penalty: 0``, ``presence_penalty: 0``, ``logit_bias: {}``;
- anything else, a bad value, another ``url`` or ``method``: that line becomes an
  error row naming the field (never silently ignored). A line without a string
  ``custom_id``, or a repeated one, fails the job (exit 2): it could not be answered.

Output (``write_output``): one line per input line, in input order::

    {"id": "batch_req_...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "req_...",
     "body": <chat.completion | text_completion>}, "error": null}
    {"id": "batch_req_...", "custom_id": "r2", "response": null, "error": {"code": "invalid_request",
     "message": "unsupported body field 'tools'"}}

finish_reason ``stop`` and ``stop_string`` are ``"stop"``, ``length`` is ``"length"``. Ids are
derived from the input's hash and the custom_id (the same input gives the same ids).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from .. import __version__
from ..config import MAX_N
from ..engine import constraints
from ..engine.events import RowResult, TokenLogprob
from ..errors import InputError
from ..store.files import check_readable_file, write_text_atomic
from .cells import BadPrompt, Prompt, check_unique, parse_messages
from .input_table import Ids, InputTable
from .jsonl import JSONL_SUFFIXES, read_jsonl

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LINE_FIELDS = {"custom_id", "method", "url", "body"}
HONOURED = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
            "n", "logprobs", "top_logprobs", "model", "response_format"}
NO_EFFECT = {"user", "store", "metadata", "service_tier"}
NEUTRAL = {"stream": False, "echo": False, "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0,
           "logit_bias": {}}
MAX_TOP_LOGPROBS = {CHAT: 20, COMPLETIONS: 20}  # OpenAI: 20 (chat), 5 (completions); interfaces.md: up to 20
ERROR_INVALID, ERROR_GENERATION = "invalid_request", "generation_error"


class RequestError(Exception):
    """A request line that is answered by an error row (its message names the field)."""


# ---------------------------------------------------------------------------- reading


def is_batch_file(path: Path) -> bool:
    """A JSONL file whose first non-blank line is a request: an object whose ``body`` is an object, beside
    ``custom_id``, ``url`` or ``method`` (a line that lacks one of them is then reported by read_batch)."""
    path = Path(path)
    if path.suffix.lower() not in JSONL_SUFFIXES or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    first = json.loads(raw.decode("utf-8-sig"))
                    return isinstance(first, dict) and isinstance(first.get("body"), dict) \
                        and bool({"custom_id", "url", "method"} & set(first))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False  # the JSONL reader reports what is wrong with the file
    return False


def read_for_job(cfg) -> InputTable:
    """read_batch for a `generate` job (``cfg``: config.GenerateConfig); the table-only flags are refused."""
    column_flags = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(cfg)
                    if f.name.endswith("_column") and f.name not in ("prompt_column", "id_column")
                    and getattr(cfg, f.name) is not None]
    if cfg.prompt_column != "prompt":
        column_flags.append("--prompt-column")
    if cfg.id_column != "id":
        column_flags.append("--id-column")
    if column_flags:
        raise InputError(f"{cfg.input}: an OpenAI batch file sets each row from its request body; "
                         f"{', '.join(column_flags)} apply to tables of prompts")
    return read_batch(cfg.input, cfg.limit)


def read_batch(path: Path, limit: int | None = None) -> InputTable:
    """The requests of an OpenAI batch file as an InputTable (see the module docstring)."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise InputError(f"{path}: --limit must be at least 1 (got {limit})")
    check_readable_file(path)
    read = read_jsonl(path, limit, soft="body")  # the file reader's own line checks
    lines, where = read.rows, read.where
    if not lines:
        raise InputError(f"{path}: no rows")
    ids, prompts, endpoints, errors = [], [], [], {}
    settings: dict[str, list] = {name: [] for name in ("max_new_tokens", "temperature", "top_p", "seed", "stop",
                                                       "logprobs", "response_format", "n")}
    for row, (line, at) in enumerate(zip(lines, where)):
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise InputError(f"{path}: {at}: 'custom_id' must be a non-empty string, got {custom_id!r}")
        ids.append(custom_id)
        url = line.get("url")
        endpoints.append(COMPLETIONS if url == COMPLETIONS else CHAT)  # the constants: the line's own string, kept
        # for the job, would pin the memory its line took (a million scattered strings hold ~1.6 kB a row)
        try:
            if row in read.bad:
                raise RequestError(read.bad[row].replace("column 'body'", "'body'"))
            prompt, values = parse_request(line)
        except RequestError as exc:
            prompt, values = "", {}
            errors[row] = str(exc)
        prompts.append(prompt)
        for name, column in settings.items():
            column.append(values.get(name))
    check_unique(ids, path, "custom_id")
    body = [line.get("body") for line in lines]
    table = pa.table({
        "custom_id": pa.array(ids, type=pa.string()),
        "url": pa.array([line.get("url") if isinstance(line.get("url"), str) else None for line in lines],
                        type=pa.string()),
        "model": pa.array([b.get("model") if isinstance(b, dict) and isinstance(b.get("model"), str) else None
                           for b in body], type=pa.string()),
        "body": pa.array([json.dumps(b, ensure_ascii=False) for b in body], type=pa.string()),
    })
    # The ids as the table's Arrow column, not the Python strings: a million of them would stay for the whole job.
    return InputTable(path=path, table=table, prompts=prompts, ids=Ids(table.column("custom_id")), overrides=settings,
                      errors=errors, endpoints=endpoints)


def parse_request(line: dict) -> tuple[Prompt, dict[str, Any]]:
    """(prompt, per-row settings) of one request line; RequestError naming what is not supported."""
    _refuse_unknown("line", set(line) - LINE_FIELDS)
    if line.get("method") != "POST":
        raise RequestError(f"method {line.get('method')!r} is not supported (only POST)")
    url = line.get("url")
    if url not in (CHAT, COMPLETIONS):
        raise RequestError(f"url {url!r} is not supported (only {CHAT} and {COMPLETIONS})")
    body = line.get("body")
    if not isinstance(body, dict):
        raise RequestError("'body' must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "the default", as in the API
    _refuse_unknown("body", {k for k, v in body.items()
                             if k not in HONOURED | NO_EFFECT and not (k in NEUTRAL and _same(v, NEUTRAL[k]))})
    if url == CHAT:
        if "prompt" in body:
            raise RequestError(f"'prompt' is a {COMPLETIONS} field; {CHAT} takes 'messages'")
        prompt = _messages(body.get("messages"))
    else:
        if "messages" in body:
            raise RequestError(f"'messages' is a {CHAT} field; {COMPLETIONS} takes 'prompt'")
        prompt = _prompt_text(body.get("prompt"))
    values: dict[str, Any] = {}
    if "n" in body:
        values["n"] = _bounded(body, "n", MAX_N, 1)
    limits = {k: _integer(body, k, 1) for k in ("max_completion_tokens", "max_tokens") if k in body}
    if len(set(limits.values())) > 1:
        raise RequestError(f"max_tokens = {body['max_tokens']} and max_completion_tokens = "
                           f"{body['max_completion_tokens']} disagree")
    if limits:
        values["max_new_tokens"] = next(iter(limits.values()))
    if "temperature" in body:
        values["temperature"] = _number(body, "temperature", lambda v: v >= 0, ">= 0")
    if "top_p" in body:
        values["top_p"] = _number(body, "top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    if "seed" in body:
        values["seed"] = _integer(body, "seed", None)
    if "stop" in body:
        stop = body["stop"]
        stops = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(f"'stop' must be a non-empty string or a list of them, got {stop!r}")
        values["stop"] = tuple(stops)
    logprobs = _logprobs(body, url)
    if logprobs is not None:
        values["logprobs"] = logprobs
    if "response_format" in body:  # text: no constraint, not even the command's (``constraints.TEXT``)
        values["response_format"] = _response_format(body["response_format"])
    return prompt, values


def _response_format(value) -> constraints.Constraint:
    """The constraint of a ``response_format`` (``constraints.TEXT`` for ``text``); RequestError naming what is
    wrong."""
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError(f"response_format must be an object of type text, json_object or json_schema, "
                           f"got {value!r}")
    try:
        constraint = constraints.from_response_format(value)
        error = constraints.problem(constraint)
    except constraints.ConstraintError as exc:
        error = str(exc)
    if error:
        raise RequestError(f"response_format: {error}")
    return constraint


def _refuse_unknown(where: str, names: set[str]) -> None:
    if names:
        shown = ", ".join(repr(n) for n in sorted(names))
        raise RequestError(f"unsupported {where} field{'s' if len(names) > 1 else ''} {shown}")


def _same(value, neutral) -> bool:
    return type(value) is type(neutral) and value == neutral or (
        isinstance(neutral, int) and not isinstance(neutral, bool) and isinstance(value, float) and value == neutral)


def _integer(body: dict, name: str, smallest: int | None) -> int:
    value = body[name]
    ok = isinstance(value, int) and not isinstance(value, bool) and (smallest is None or value >= smallest)
    if not ok:
        bound = "" if smallest is None else f" >= {smallest}"
        raise RequestError(f"'{name}' must be an integer{bound}, got {value!r}")
    return value


def _number(body: dict, name: str, check, expected: str) -> float:
    value = body[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not check(value):
        raise RequestError(f"'{name}' must be a number {expected}, got {value!r}")
    return float(value)


def _logprobs(body: dict, url: str) -> int | None:
    """The Request.logprobs integer: None (none), 0 (the chosen token's) or N (and the top N)."""
    most = MAX_TOP_LOGPROBS[url]
    if url == COMPLETIONS:
        if "top_logprobs" in body:
            raise RequestError(f"'top_logprobs' is a {CHAT} field; {COMPLETIONS} takes 'logprobs': N")
        return _bounded(body, "logprobs", most) if "logprobs" in body else None
    wanted = body.get("logprobs", False)
    if not isinstance(wanted, bool):
        raise RequestError(f"'logprobs' must be true or false, got {wanted!r}")
    if "top_logprobs" in body and not wanted:
        raise RequestError("'top_logprobs' needs 'logprobs': true")
    return (_bounded(body, "top_logprobs", most) if "top_logprobs" in body else 0) if wanted else None


def _bounded(body: dict, name: str, most: int, smallest: int = 0) -> int:
    value = _integer(body, name, smallest)
    if value > most:
        raise RequestError(f"'{name}' must be at most {most}, got {value}")
    return value


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of messages")
    out = []
    for j, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise RequestError(f"message {j} is not an object")
        _refuse_unknown(f"message {j}", set(message) - {"role", "content", "name"})
        role = "system" if message.get("role") == "developer" else message.get("role")
        out.append({**message, "role": role})
    try:
        return parse_messages(out, "'messages'")  # content parts of type text are joined there
    except BadPrompt as exc:
        raise RequestError(str(exc)) from None


def _prompt_text(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise RequestError("'prompt' must be one string (lists of prompts and token ids are not supported)")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string")
    if not prompt.strip():
        raise RequestError("'prompt' is only whitespace")
    return prompt


def model_notes(inp: InputTable, running: str) -> list[str]:
    """A note for the user when the requests name models: they are recorded, ``running`` answers them."""
    if inp.endpoints is None:
        return []
    named = sorted({m for m in inp.table.column("model").to_pylist() if m})
    if not named:
        return []
    shown = ", ".join(repr(m) for m in named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    return [f"the requests name model{'s' if len(named) > 1 else ''} {shown}: recorded, not used; "
            f"{running} (--target) answers every request"]


def is_text_completion(inp: InputTable, row: int) -> bool:
    """Is this row a /v1/completions request (a raw prompt, rendered without the chat template)?"""
    return inp.endpoints is not None and inp.endpoints[row] == COMPLETIONS


# ---------------------------------------------------------------------------- writing


FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length"}


def output_lines(inp: InputTable, results: list[RowResult], texts: list[str], tokenizer, model: str,
                 chat: bool, salt: str, created: int | None = None) -> list[dict]:
    """One OpenAI Batch output object per input row, in row order (``results`` sorted by row, ``texts`` aligned):
    an input row's samples (``--n``, the request's ``n``) are adjacent results of that row, its ``choices`` in
    order (``index`` 0 .. n-1); a sample that failed makes the line an error (the first one's message).

    ``chat``: a table input's rows were rendered as chat (``--chat`` and a chat template), so
    they are answered as chat.completion objects; an OpenAI input's rows follow their url."""
    created = int(time.time()) if created is None else created
    as_chat = chat and bool(getattr(tokenizer, "chat_template", None))
    lines = []
    for _, group in itertools.groupby(zip(results, texts), key=lambda pair: pair[0].row):
        group = list(group)
        result = group[0][0]
        key = hashlib.sha256(f"{salt}\0{result.id}".encode()).hexdigest()
        request_id = "req_" + hashlib.sha256(key.encode()).hexdigest()[:32]
        line: dict[str, Any] = {"id": f"batch_req_{key[:32]}", "custom_id": result.id}
        failed = next((r for r, _ in group if r.finish_reason == "error"), None)
        if failed is not None:
            code = ERROR_INVALID if result.row in inp.errors else ERROR_GENERATION
            lines.append({**line, "response": None, "error": {"code": code, "message": failed.error}})
            continue
        is_chat = inp.endpoints[result.row] == CHAT if inp.endpoints is not None else as_chat
        choices = []
        for index, (sample, text) in enumerate(group):
            entries = getattr(sample, "logprobs", None)  # RowResult.logprobs (interfaces.md), None when not asked
            logprobs = None if entries is None else (chat_logprobs if is_chat else text_logprobs)(entries, tokenizer)
            choice: dict[str, Any] = {"index": index, "finish_reason": FINISH_REASONS[sample.finish_reason],
                                      "logprobs": logprobs}
            if is_chat:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            else:
                choice["text"] = text
            choices.append(choice)
        completion_tokens = sum(len(sample.token_ids) for sample, _ in group)
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": result.prompt_tokens + completion_tokens}
        body = {"id": f"{'chatcmpl' if is_chat else 'cmpl'}-{key[32:]}",
                "object": "chat.completion" if is_chat else "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage, "system_fingerprint": f"batchspec-{__version__}"}
        lines.append({**line, "response": {"status_code": 200, "request_id": request_id, "body": body},
                      "error": None})
    return lines


def write_output(path: Path, inp: InputTable, results: list[RowResult], texts: list[str], tokenizer,
                 model: str, chat: bool, salt: str) -> None:
    """The OpenAI Batch output file, written atomically (temp file, fsync, rename) like the Parquet one."""
    write_text_atomic(path, output_text(inp, results, texts, tokenizer, model, chat, salt))


def output_text(inp: InputTable, results: list[RowResult], texts: list[str], tokenizer, model: str,
                chat: bool, salt: str, created: int | None = None) -> str:
    """``output_lines`` as the file's text (one JSON object a line): a piece of the file, ``results`` a
    range of its rows (the finish streams the file range by range, ``created`` fixed)."""
    lines = output_lines(inp, results, texts, tokenizer, model, chat, salt, created)
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    """chat.completion ``choices[0].logprobs``: one entry per completion token."""
    def item(token_id: int, logprob: float) -> dict:
        token = _token(tokenizer, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def text_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    """text_completion ``choices[0].logprobs``; ``text_offset`` counts characters from the completion's start."""
    tokens = [_token(tokenizer, e.token_id) for e in entries]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_token(tokenizer, t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}
