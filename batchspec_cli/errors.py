"""The one error a user's file or path causes (`InputError`), and how an exception becomes one line of a message.

The library never prints: cli.py turns an `InputError` into one line and exit code 2.
"""

from __future__ import annotations


class InputError(Exception):
    """A problem with the user's input or output paths; the message is one line."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line of a user message: whitespace collapsed, at most `limit` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
