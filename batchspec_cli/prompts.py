"""Every prompt of an input to token ids, once: the loop `generate` and `batchspec bucket` share.

A prompt that cannot be rendered does not stop the others: its ids are ``[]`` and its reason
is kept by row (`generate` writes it as the row's error; `bucket` refuses the input).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import openai_batch
from .errors import one_line
from .inputs import InputTable, Prompt


def render_prompt(tokenizer, prompt: Prompt, chat: bool, system: str | None) -> list[int]:
    """Token ids of one prompt: through the chat template when asked and available."""
    if chat and getattr(tokenizer, "chat_template", None):
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [dict(m) for m in prompt]
        if system is not None and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return _as_int_list(out)
    text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
    if system is not None:
        text = f"{system}\n\n{text}"
    return _as_int_list(tokenizer(text, add_special_tokens=True)["input_ids"])


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


@dataclass(frozen=True)
class RenderedPrompts:
    ids: list[list[int]]  # [rows] the prompt's token ids; [] for a row in errors
    errors: dict[int, str]  # row -> why it has no ids (one line)


def render_prompts(inp: InputTable, tokenizer, chat: bool, system: str | None,
                   most_tokens: int | None = None, what: str = "") -> RenderedPrompts:
    """Render every prompt of ``inp`` (chat template when ``chat``, ``system`` added).

    A row fails, in this order, when the input refused it already (``inp.errors``: an OpenAI
    batch line), when its text has more bytes than ``most_tokens`` tokens could hold (refused
    untokenized: it can never fit; ``what`` names that limit), or when its chat template raises.
    A /v1/completions prompt of an OpenAI batch is rendered raw: no template, no system prompt.
    """
    most_bytes = max_prompt_bytes(tokenizer, most_tokens) if most_tokens is not None else None
    ids, errors = [], {}
    for row, prompt in enumerate(inp.prompts):
        ids.append([])
        if row in inp.errors:
            errors[row] = inp.errors[row]
            continue
        size = prompt_bytes(prompt) if most_bytes is not None else 0
        if most_bytes is not None and size > most_bytes:
            errors[row] = f"prompt has {size} bytes, more than {what} can hold (at most {most_bytes} bytes)"
            continue
        raw = openai_batch.is_text_completion(inp, row)
        try:
            ids[row] = render_prompt(tokenizer, prompt, chat and not raw, None if raw else system)
        except Exception as exc:  # noqa: BLE001 - a chat template may raise anything: that row fails, not the job
            errors[row] = f"cannot render the prompt: {one_line(exc)}"
    return RenderedPrompts(ids, errors)
