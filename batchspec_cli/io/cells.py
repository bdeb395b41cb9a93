"""One cell of a prompts table as what it stands for: a prompt, or an id.

A prompt cell is a string, a list of strings (Spec-Bench's `turns`: the first is the prompt) or chat messages in the
OpenAI and Hugging Face shape (``[{"role", "content"}]``, the content a string or text parts). A cell that is no
prompt raises ``BadPrompt``, and its row becomes an error row; a null id refuses the input (``InputError``). A table
of chat messages may hold them in a `messages` column instead of `prompt` (``prompt_column_in``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import InputError

DEFAULT_PROMPT_COLUMN = "prompt"
MESSAGES_COLUMN = "messages"  # the OpenAI and Hugging Face chat shape: the prompts where there is no `prompt` column

Prompt = str | list[dict]


class BadPrompt(ValueError):
    """A prompt cell that is no prompt (null, empty, a message without text...): its row becomes an error row."""


def prompt_column_in(names: list[str], asked: str) -> str:
    """The column the prompts are read from: ``asked`` (--prompt-column), or, where that is the default `prompt`
    and the input has no such column but a `messages` one, `messages` (rows of chat messages)."""
    if asked == DEFAULT_PROMPT_COLUMN and asked not in names and MESSAGES_COLUMN in names:
        return MESSAGES_COLUMN
    return asked


def parse_prompt(value: Any, column: str) -> Prompt:
    """One prompt cell as a string or chat messages; BadPrompt saying what is wrong with it."""
    at = f"column '{column}'"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise BadPrompt(f"{at} is null")
    if isinstance(value, str):
        if not value.strip():
            raise BadPrompt(f"{at} {_blank(value)}")
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):  # Spec-Bench `turns`: use the first turn
            if not value[0].strip():
                raise BadPrompt(f"{at}: first turn {_blank(value[0])}")
            return value[0]
        if all(isinstance(v, dict) for v in value):
            return parse_messages(value, at)
    if isinstance(value, list) and not value:
        raise BadPrompt(f"{at} is an empty list")
    raise BadPrompt(f"{at}: expected a string, a list of strings or a list of chat messages, "
                    f"got {type(value).__name__}")


def parse_messages(value: list[dict], at: str) -> list[dict]:
    """Chat messages with a string role and text content; content parts of type text (OpenAI's
    ``[{"type": "text", "text": ...}]``) are joined by newlines. BadPrompt naming the message."""
    messages = []
    for j, m in enumerate(value, start=1):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise BadPrompt(f"{at}: message {j} has no string 'role'")
        if isinstance(content, list):
            content = _joined_parts(content, f"{at}: message {j}")
        if not isinstance(content, str):
            raise BadPrompt(f"{at}: message {j} has no string 'content'")
        # Parquet structs give every field to every message: drop the null ones.
        messages.append({k: v for k, v in m.items() if v is not None} | {"content": content})
    if not any(m["content"].strip() for m in messages):
        raise BadPrompt(f"{at}: every message is empty" if not any(m["content"] for m in messages) else
                        f"{at}: every message is empty or only whitespace")
    return messages


def _blank(text: str) -> str:
    """What a string without text is, for a message: "is empty" or "is only whitespace"."""
    return "is only whitespace" if text else "is empty"


def _joined_parts(parts: list, at: str) -> str:
    """The text of content parts, all of type text, joined by newlines (as vLLM does)."""
    parts = [{k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part for part in parts]
    if not parts or not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                            for p in parts):
        raise BadPrompt(f"{at}: only text content parts are supported")
    return "\n".join(part["text"] for part in parts)


def parse_id(value: Any, path: Path, where: Callable[[int], str], row: int, column: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise InputError(f"{path}: {where(row)}: id column '{column}' is null")
    return str(value)


def check_unique(ids: list[str], path: Path, column: str) -> None:
    seen: set[str] = set()
    dupes: dict[str, None] = {}
    for i in ids:
        if i in seen:
            dupes[i] = None
        seen.add(i)
    if dupes:
        shown = ", ".join(repr(d) for d in list(dupes)[:5])
        more = f" and {len(dupes) - 5} more" if len(dupes) > 5 else ""
        raise InputError(f"{path}: duplicate ids in column '{column}': {shown}{more}")
