"""The README's Performance table from one or more `bench.py` JSON files.

    python benchmarks/table.py benchmarks/results/cpu.json

Rows are sorted by batch size, category (``--by-category`` runs), prompts, then mode (ar, auto, eqspec, exspec,
hf), drafter and k. Older files (no ``label`` / ``category`` / ``acceptance``) print with ``-`` where a field is
missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODES = ["ar", "pool0", "auto", "eqspec", "exspec", "hf"]
HEADER = ("| run | category | prompts | batch | tok/s | vs ar (end to end) | vs ar (decode only) "
          "| acceptance (accepted / drafted) | acceptance length (incl. bonus) | α | ideal | achieved / ideal "
          "| group hit | realign+gather share | auto: k histogram, expected / realised gain |")


def cell(row: dict, key: str, spec: str, percent: bool = False) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    return f"{value * 100:{spec}} %" if percent else f"{value:{spec}}"


def controller_cell(row: dict) -> str:
    c = row.get("controller")
    if not c:
        return "-"
    hist = " ".join(f"{k}:{n}" for k, n in c["k_hist"].items())
    if c.get("expected_gain") is None:
        return hist
    return f"{hist}; {c['expected_gain']:.2f} / {c['realised_gain']:.2f}"


def label(row: dict) -> str:
    if "label" in row:
        return row["label"]
    return row["mode"] + (f"-k{row['k']}" if row["mode"] in ("eqspec", "exspec") else "")


def main(paths: list[str]) -> None:
    rows = []
    for path in paths:
        record = json.loads(Path(path).read_text())
        rows += [dict(row, prompts=record["prompts"]) for row in record["rows"]]
    rows.sort(key=lambda r: (r["batch_size"], r.get("category", "all"), r["prompts"], MODES.index(r["mode"]),
                             r.get("drafter") or "", r["k"]))
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for r in rows:
        print(f"| {label(r)} | {r.get('category', 'all')} | {r['prompts']} | {r['batch_size']} "
              f"| {r['tokens_per_s']:.1f} | {cell(r, 'ratio_vs_ar', '.2f')} | {cell(r, 'decode_ratio_vs_ar', '.2f')} "
              f"| {cell(r, 'acceptance', '.0f', True)} | {cell(r, 'acceptance_length', '.2f')} "
              f"| {cell(r, 'alpha', '.2f')} | {cell(r, 'ideal_speedup', '.2f')} "
              f"| {cell(r, 'achieved_of_ideal', '.0f', True)} | {cell(r, 'hit_rate', '.0f', True)} "
              f"| {cell(r, 'realign_gather_share', '.1f', True)} | {controller_cell(r)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
