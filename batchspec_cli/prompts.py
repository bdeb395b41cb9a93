"""Every prompt of an input to token ids, once: the loop `generate` and `batchspec bucket` share.

A prompt that cannot be rendered does not stop the others: its ids are ``[]`` and its reason
is kept by row (`generate` writes it as the row's error; `bucket` refuses the input).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import io as bio
from . import openai_batch


@dataclass(frozen=True)
class RenderedPrompts:
    ids: list[list[int]]  # [rows] the prompt's token ids; [] for a row in errors
    errors: dict[int, str]  # row -> why it has no ids (one line)


def render_prompts(inp: bio.InputTable, tokenizer, chat: bool, system: str | None,
                   most_tokens: int | None = None, what: str = "") -> RenderedPrompts:
    """Render every prompt of ``inp`` (chat template when ``chat``, ``system`` added).

    A row fails, in this order, when the input refused it already (``inp.errors``: an OpenAI
    batch line), when its text has more bytes than ``most_tokens`` tokens could hold (refused
    untokenized: it can never fit; ``what`` names that limit), or when its chat template raises.
    A /v1/completions prompt of an OpenAI batch is rendered raw: no template, no system prompt.
    """
    most_bytes = bio.max_prompt_bytes(tokenizer, most_tokens) if most_tokens is not None else None
    ids, errors = [], {}
    for row, prompt in enumerate(inp.prompts):
        ids.append([])
        if row in inp.errors:
            errors[row] = inp.errors[row]
            continue
        size = bio.prompt_bytes(prompt) if most_bytes is not None else 0
        if most_bytes is not None and size > most_bytes:
            errors[row] = f"prompt has {size} bytes, more than {what} can hold (at most {most_bytes} bytes)"
            continue
        raw = openai_batch.is_text_completion(inp, row)
        try:
            ids[row] = bio.render_prompt(tokenizer, prompt, chat and not raw, None if raw else system)
        except Exception as exc:  # noqa: BLE001 - a chat template may raise anything: that row fails, not the job
            errors[row] = f"cannot render the prompt: {bio.one_line(exc)}"
    return RenderedPrompts(ids, errors)
