"""The per-row settings a job reads from its input's columns (``--temperature-column`` ... ``--stop-column``,
``--response-format-column``): each as one list of [rows] values, None where a row has none of its own.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import MAX_TOP_LOGPROBS, GenerateConfig
from ..engine import constraints
from ..engine.constraints import Constraint
from ..errors import InputError
from .input_table import InputTable


def row_value(values: list | None, row: int, default):
    """A per-row override's value for ``row`` (``row_overrides``), or ``default`` where it has none."""
    if values is None or values[row] is None:
        return default
    return values[row]


OVERRIDES = {  # name -> (config attribute naming the column, type, smallest value, flag)
    "temperature": ("temperature_column", float, 0.0, "--temperature-column"),
    "seed": ("seed_column", int, None, "--seed-column"),
    "max_new_tokens": ("max_new_tokens_column", int, 1, "--max-new-tokens-column"),
    "top_p": ("top_p_column", float, 0.0, "--top-p-column"),  # in (0, 1]: 0 itself is refused below
    "logprobs": ("logprobs_column", int, 0, "--logprobs-column"),
}
LARGEST = {"logprobs": MAX_TOP_LOGPROBS}  # overrides with an upper bound


def setting_columns(cfg: GenerateConfig) -> list[str]:
    """The input columns the per-row settings read (--temperature-column ... --stop-column,
    --response-format-column)."""
    named = [getattr(cfg, attr) for attr, *_ in OVERRIDES.values()] + [cfg.stop_column, cfg.response_format_column]
    return [column for column in named if column is not None]


def row_overrides(inp: InputTable, cfg: GenerateConfig) -> dict[str, list]:
    """Per-row temperature / seed / max_new_tokens / top_p / logprobs / stop strings from input columns, read from
    the values as the input wrote them (a list stays a list in a column that mixes kinds; a boolean stays a boolean);
    InputError naming the row and column on a bad cell (a NaN, an infinity, a boolean, a value out of range); null
    takes the job's flag."""
    out = {}
    for name, (attr, kind, smallest, flag) in OVERRIDES.items():
        column = getattr(cfg, attr)
        if column is None:
            continue
        if column not in inp.table.column_names:
            raise InputError(f"{cfg.input}: {flag} names column {column!r}, which is not in the input")
        values = []
        for i, value in enumerate(inp.values(column)):
            if value is None:  # a NaN is no null: it is refused below, like an infinity
                values.append(None)
                continue
            number = _as_number(value, kind)
            largest = LARGEST.get(name)
            if number is None or (smallest is not None and number < smallest) \
                    or (largest is not None and number > largest) or (name == "top_p" and not 0 < number <= 1):
                bound = (" in (0, 1]" if name == "top_p" else
                         f"{'' if smallest is None else f' >= {smallest:g}'}"
                         f"{'' if largest is None else f' and <= {largest:g}'}")
                raise InputError(f"{cfg.input}: row {i + 1}: column {column!r} must be "
                                 f"{'a number' if kind is float else 'an integer'}{bound}, got {value!r}")
            values.append(number)
        out[name] = values
    if cfg.stop_column is not None:
        out["stop"] = stop_cells(inp, cfg.stop_column, cfg.input)
    if cfg.response_format_column is not None:
        out["response_format"] = response_format_cells(inp, cfg.response_format_column, cfg.input)
    return out


def _as_number(value: Any, kind: type) -> int | float | None:
    """A JSON number as ``kind`` (any integer for int: a seed of 2**70 too; an integral float is one), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if kind is int:
        if isinstance(value, int):
            return value
        return int(value) if math.isfinite(value) and value.is_integer() else None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        return None
    return number if math.isfinite(number) else None


def stop_cells(inp: InputTable, column: str, source) -> list[tuple[str, ...]]:
    """Per-row stop strings from a column of strings or lists of strings, as written (null: none of its own)."""
    if column not in inp.table.column_names:
        raise InputError(f"{source}: --stop-column names column {column!r}, which is not in the input")
    out = []
    for i, value in enumerate(inp.values(column)):
        stops = () if value is None else (value,) if isinstance(value, str) else value
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise InputError(f"{source}: row {i + 1}: column {column!r} must be a non-empty string or a list "
                             f"of them, got {value!r}")
        out.append(tuple(stops))
    return out


def response_format_cells(inp: InputTable, column: str, source) -> list[Constraint | None]:
    """Per-row constraints from a column of response_format objects or JSON schemas (as objects or JSON text;
    ``{"type": "text"}``: none, ``constraints.TEXT``; null: the job's). A cell that cannot be used is an ``invalid``
    constraint: that row becomes an error row."""
    if column not in inp.table.column_names:
        raise InputError(f"{source}: --response-format-column names column {column!r}, which is not in the "
                             f"input")
    out = []
    for value in inp.values(column):  # as written (a JSON object stays an object)
        if value is None:
            out.append(None)
            continue
        try:
            constraint = constraints.from_response_format(value)
            error = constraints.problem(constraint)
        except constraints.ConstraintError as exc:
            error = str(exc)
        out.append(constraints.invalid(f"column {column!r}: {error}") if error else constraint)
    return out
