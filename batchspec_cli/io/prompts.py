"""Every prompt of an input to token ids, once, a chunk at a time: the loop `generate` and `batchspec bucket` share.

A prompt that cannot be rendered does not stop the others: its ids are ``[]`` and its reason
is kept by row (`generate` writes it as the row's error; `bucket` refuses the input).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ..errors import one_line
from . import openai_batch
from .cells import Prompt
from .input_table import InputTable


def render_prompt(tokenizer, prompt: Prompt, chat: bool, system: str | None, special_tokens: bool = False) -> list[int]:
    """Token ids of one prompt: through the chat template when asked and available.

    The text of a prompt or a message is tokenized as text: a control token's string in it
    (``<|im_end|>``) stays characters, so a prompt cannot forge a turn; control tokens come
    only from the chat template. ``special_tokens`` (--allow-special-tokens) lets them be
    control tokens. A prompt holding no such string tokenizes the same either way."""
    if chat and getattr(tokenizer, "chat_template", None):
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [dict(m) for m in prompt]
        if system is not None and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})
        if not special_tokens and _holds_control_text(tokenizer, [m["content"] for m in messages]):
            return _template_around_text(tokenizer, messages)
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return _as_int_list(out)
    text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
    if system is not None:
        text = f"{system}\n\n{text}"
    literal = {"split_special_tokens": True} if not special_tokens and _holds_control_text(tokenizer, [text]) else {}
    return _as_int_list(tokenizer(text, add_special_tokens=True, **literal)["input_ids"])


def _control_strings(tokenizer) -> list[str]:
    """The strings a tokenizer turns into its special (control) tokens wherever they occur in text."""
    added = getattr(tokenizer, "added_tokens_decoder", {})  # {id: AddedToken}
    return [t.content for t in added.values() if t.special and t.content]


def _holds_control_text(tokenizer, texts: list[str]) -> bool:
    strings = _control_strings(tokenizer)
    return any(s in text for text in texts for s in strings)


_MARK = re.compile("\ue000(\\d+)\ue001")  # a message's place in the rendered template (private-use characters)


def _template_around_text(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's own text tokenized with its control tokens, each message's text tokenized as text.

    The template is rendered around a mark in place of each message's content; a template that
    changes the content it is given (and so loses a mark) cannot be rendered this way."""
    marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    pieces = _MARK.split(rendered)  # template text, message index, template text, ...
    if sorted(int(i) for i in pieces[1::2]) != list(range(len(messages))):
        raise ValueError("the chat template changes the message text, and a message holds a control token's "
                         "string; pass --allow-special-tokens to let it be a control token")
    ids: list[int] = []
    for j, piece in enumerate(pieces):
        if j % 2:
            ids += tokenizer(messages[int(piece)]["content"], add_special_tokens=False,
                             split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


MIN_BYTES_PER_TOKEN = 16  # the byte bound below never assumes tokens shorter than this


def max_prompt_bytes(tokenizer, max_tokens: int) -> int:
    """The most bytes of prompt text that could still tokenize to at most ``max_tokens`` tokens.

    No token stands for more bytes than the longest entry of the vocabulary in UTF-8 (a
    byte-level or SentencePiece token string is never shorter than the bytes it decodes
    to), so a longer prompt can never fit and needs no tokenizing to be refused."""
    longest = max((len(token.encode("utf-8")) for token in tokenizer.get_vocab()), default=0)
    return max_tokens * max(MIN_BYTES_PER_TOKEN, longest)


def prompt_bytes(prompt: Prompt) -> int:
    """UTF-8 bytes of a prompt's own text (a chat template only adds to it)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    return sum(len(m["content"].encode("utf-8")) for m in prompt)


def _as_int_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):  # tensor / ndarray
        ids = ids.tolist()
    ids = list(ids)
    if len(ids) == 1 and isinstance(ids[0], (list, tuple)):  # a batch of one
        ids = list(ids[0])
    return [int(t) for t in ids]


CHUNK_ROWS = 1024  # prompts rendered and tokenized per tokenizer call


@dataclass(frozen=True)
class RenderedPrompts:
    ids: pa.ChunkedArray  # [rows] list<int32>: the prompt's token ids; [] for a row in errors
    errors: dict[int, str]  # row -> why it has no ids (one line)


def render_chunks(inp: InputTable, tokenizer, chat: bool, system: str | None, errors: dict[int, str],
                  most_tokens: int | None = None, what: str = "",
                  special_tokens: bool = False) -> Iterator[tuple[int, pa.Array]]:
    """Render the prompts of ``inp`` a chunk of ``CHUNK_ROWS`` rows at a time: yields (the chunk's first row, its
    rows' ids: ``[chunk rows]`` list<int32>, ``[]`` for a row that failed), and puts a failed row's reason in
    ``errors`` (row -> one line) before its chunk is yielded. Only the chunk's prompts are parsed and held.

    Each chunk is one tokenizer call (chat template when ``chat``, ``system`` added; see render_prompt); the ids
    are kept in Arrow form (four bytes a token), never as Python lists for the job. A prompt holding a control
    token's string is rendered alone (``render_prompt``).

    A row fails, in this order, when the input refused it already (``inp.errors``: an OpenAI
    batch line), when its text has more bytes than ``most_tokens`` tokens could hold (refused
    untokenized: it can never fit; ``what`` names that limit), or when its chat template raises.
    A /v1/completions prompt of an OpenAI batch is rendered raw: no template, no system prompt.
    """
    most_bytes = max_prompt_bytes(tokenizer, most_tokens) if most_tokens is not None else None
    controls = [] if special_tokens else _control_strings(tokenizer)  # strings that would become control tokens
    for start in range(0, len(inp.prompts), CHUNK_ROWS):
        prompts = _chunk(inp.prompts, start, min(len(inp.prompts), start + CHUNK_ROWS))
        ids: list[list[int]] = [[] for _ in prompts]
        kinds: dict[bool, list[int]] = {False: [], True: []}  # raw (an OpenAI /v1/completions row) -> rows
        for row in range(start, start + len(ids)):
            if row in inp.errors:
                errors[row] = inp.errors[row]
                continue
            size = prompt_bytes(prompts[row - start]) if most_bytes is not None else 0
            if most_bytes is not None and size > most_bytes:
                errors[row] = f"prompt has {size} bytes, more than {what} can hold (at most {most_bytes} bytes)"
                continue
            raw = openai_batch.is_text_completion(inp, row)
            if any(c in text for text in _texts(prompts[row - start], system) for c in controls):
                try:  # the template around the text, the text as text: one prompt at a time
                    ids[row - start] = render_prompt(tokenizer, prompts[row - start], chat and not raw,
                                                     None if raw else system, special_tokens)
                except Exception as exc:  # noqa: BLE001 - a chat template may raise anything: that row fails
                    errors[row] = f"cannot render the prompt: {one_line(exc)}"
                continue
            kinds[raw].append(row)
        for raw, rows in kinds.items():
            rendered = _render_rows(tokenizer, [prompts[row - start] for row in rows], chat and not raw,
                                    None if raw else system, errors, rows)
            for row, row_ids in zip(rows, rendered):
                ids[row - start] = row_ids
        yield start, pa.array(ids, type=pa.list_(pa.int32()))


def render_prompts(inp: InputTable, tokenizer, chat: bool, system: str | None,
                   most_tokens: int | None = None, what: str = "", special_tokens: bool = False) -> RenderedPrompts:
    """Every prompt of ``inp`` rendered (``render_chunks``), the ids of all rows at once."""
    errors: dict[int, str] = {}
    chunks = [ids for _, ids in render_chunks(inp, tokenizer, chat, system, errors, most_tokens, what, special_tokens)]
    return RenderedPrompts(pa.chunked_array(chunks, type=pa.list_(pa.int32())), errors)


def _chunk(prompts, start: int, stop: int) -> list[Prompt]:
    """The prompts of rows [start, stop) (``input_table.Prompts`` parses them from the table only now)."""
    return prompts.chunk(start, stop) if hasattr(prompts, "chunk") else list(prompts[start:stop])


def _texts(prompt: Prompt, system: str | None) -> list[str]:
    """The text a prompt puts into the rendered sequence: its messages' contents and the system prompt."""
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    return texts if system is None else [*texts, system]


def _render_rows(tokenizer, prompts: list[Prompt], chat: bool, system: str | None, errors: dict[int, str],
                 rows: list[int]) -> list[list[int]]:
    """``render_prompt`` of every prompt in one tokenizer call; one prompt at a time when a chat template
    raises, so only the rows it raises for fail (``errors``). The prompts hold no control token's string,
    so tokenizing them with or without special tokens gives the same ids."""
    if not prompts:
        return []
    try:
        if chat and getattr(tokenizer, "chat_template", None):
            conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else [dict(m) for m in p]
                             for p in prompts]
            if system is not None:
                conversations = [c if any(m.get("role") == "system" for m in c)
                                 else [{"role": "system", "content": system}, *c] for c in conversations]
            return tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        texts = [p if isinstance(p, str) else "\n\n".join(m["content"] for m in p) for p in prompts]
        if system is not None:
            texts = [f"{system}\n\n{text}" for text in texts]
        return tokenizer(texts, add_special_tokens=True)["input_ids"]
    except Exception:  # noqa: BLE001 - a chat template may raise anything: find the rows it raises for
        out = []
        for row, prompt in zip(rows, prompts):
            try:
                out.append(render_prompt(tokenizer, prompt, chat, system, special_tokens=True))
            except Exception as exc:  # noqa: BLE001 - that row fails, not the job
                errors[row] = f"cannot render the prompt: {one_line(exc)}"
                out.append([])
        return out
