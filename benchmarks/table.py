"""The README's Performance table from one or more `bench.py` JSON files.

    python benchmarks/table.py benchmarks/results/cpu_b1.json benchmarks/results/cpu_b4_b8.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODES = ["ar", "eqspec", "exspec"]
HEADER = ("| mode | prompts | batch | tok/s | vs ar (end to end) | vs ar (decode only) | acceptance length (incl. bonus) "
          "| α | ideal | achieved / ideal | group hit | realign+gather share |")


def cell(row: dict, key: str, spec: str, percent: bool = False) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    return f"{value * 100:{spec}} %" if percent else f"{value:{spec}}"


def main(paths: list[str]) -> None:
    rows = []
    for path in paths:
        record = json.loads(Path(path).read_text())
        rows += [dict(row, prompts=record["prompts"]) for row in record["rows"]]
    rows.sort(key=lambda r: (r["batch_size"], r["prompts"], MODES.index(r["mode"]), r["k"]))
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for r in rows:
        print(f"| {r['mode']} | {r['prompts']} | {r['batch_size']} | {r['tokens_per_s']:.1f} "
              f"| {cell(r, 'ratio_vs_ar', '.2f')} | {cell(r, 'decode_ratio_vs_ar', '.2f')} "
              f"| {r['acceptance_length']:.2f} | {cell(r, 'alpha', '.2f')} | {cell(r, 'ideal_speedup', '.2f')} "
              f"| {cell(r, 'achieved_of_ideal', '.0f', True)} | {cell(r, 'hit_rate', '.0f', True)} "
              f"| {cell(r, 'realign_gather_share', '.1f', True)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
