"""Hugging Face datasets as input, loaded by `datasets` itself.

Three kinds of DATASET (``kind`` tells them apart; an existing file is never one of them):

- ``saved``: a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``
  (``datasets.load_from_disk``); ``--split`` picks the split of a DatasetDict;
- ``glob``: a glob of ``.jsonl`` / ``.json`` / ``.ndjson``, ``.parquet`` or ``.csv`` files, read
  in sorted path order by the matching builder (``load_dataset("json" | "parquet" | "csv")``);
  their split is ``train``;
- ``hub``: a hub id (``tatsu-lab/alpaca``) with ``--split`` and ``--config``. Offline it fails at
  once: with ``HF_HUB_OFFLINE=1`` only the local cache is read; otherwise one bounded TCP connect
  to the hub decides whether to try it.

The rows become the same pyarrow table a file would give (``inputs.table_input`` then checks the
prompt and id columns as for a file), so rendering, per-row columns and the output are shared.
The resume fingerprint's input hash is the sha256 of the data files for ``saved`` and ``glob``
and the dataset's own ``_fingerprint`` for ``hub``: a changed dataset is refused on resume.
"""

from __future__ import annotations

import contextlib
import glob as globbing
from pathlib import Path

import pyarrow as pa

from ..errors import InputError, one_line
from ..store.checkpoint import hash_files
from .input_table import InputTable
from .inputs import table_input

DEFAULT_SPLIT = "train"
BUILDERS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".pq": "parquet",
            ".csv": "csv"}
_FILE_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".pq", ".csv", ".txt", ".tsv")


def kind(path) -> str | None:
    """"saved", "glob", "hub", or None for a file path (existing or not) or another directory."""
    from ..models.loading import _HUB_ID

    p, spec = Path(path), str(path)
    if p.is_dir():
        saved = (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file()
                                                       and (p / "dataset_info.json").is_file())
        return "saved" if saved else None
    if p.exists():
        return None
    if any(c in spec for c in "*?["):
        return "glob"
    if _HUB_ID.match(spec) and not spec.lower().endswith(_FILE_SUFFIXES):
        return "hub"
    return None


def read(spec: str, kind: str, split: str, config: str | None, prompt_column: str, id_column: str,
         limit: int | None) -> tuple[InputTable, str]:
    """The dataset's rows as an InputTable, and its input hash; InputError with a one-line message."""
    if kind != "hub" and config is not None:
        raise InputError(f"{spec}: --config applies to a hub dataset")
    import datasets

    with _quiet(datasets):
        if kind == "saved":
            loaded = _load(spec, datasets.load_from_disk, spec)
            if isinstance(loaded, datasets.DatasetDict):
                loaded = _pick_split(spec, loaded, split)
            elif split != DEFAULT_SPLIT:
                raise InputError(f"{spec}: a single Dataset, without splits; --split {split} does not apply")
            files = [Path(f["filename"]) for f in loaded.cache_files]
            digest = hash_files(sorted(files))
        elif kind == "glob":
            files = sorted(Path(f) for f in globbing.glob(spec, recursive=True) if Path(f).is_file())
            if not files:
                raise InputError(f"{spec}: no files match")
            builders = {BUILDERS.get(f.suffix.lower()) for f in files}
            if len(builders) != 1 or None in builders:
                raise InputError(f"{spec}: the files must all be JSON lines, all Parquet or all CSV "
                                 f"(.jsonl/.json/.ndjson, .parquet/.pq, .csv); matched "
                                 f"{', '.join(sorted({f.suffix or '(no suffix)' for f in files}))}")
            loaded = _load(spec, datasets.load_dataset, builders.pop(), data_files=[str(f) for f in files])
            loaded = _pick_split(spec, loaded, split)
            digest = hash_files(files)
        else:
            loaded = _load_hub(datasets, spec, config, split)
            digest = f"datasets-fingerprint:{loaded._fingerprint}"
        if limit is not None:
            loaded = loaded.select(range(min(limit, len(loaded))))
        table = loaded.with_format("arrow")[:] if len(loaded) else loaded.features.arrow_schema.empty_table()
    return table_input(Path(spec), _plain_table(table), prompt_column, id_column), digest


def _load(spec: str, load, *args, **kwargs):
    try:
        return load(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds (FileNotFoundError, DatasetGenerationError...)
        raise InputError(f"{spec}: cannot load the dataset ({one_line(exc)})") from None


def _pick_split(spec: str, loaded, split: str):
    if split not in loaded:
        raise InputError(f"{spec}: no split {split!r}; splits are: {', '.join(repr(s) for s in loaded)}")
    return loaded[split]


def _load_hub(datasets, spec: str, config: str | None, split: str):
    from ..models.loading import _hub_offline, _hub_reachable

    cache = datasets.config.HF_DATASETS_CACHE
    offline = _hub_offline() or bool(datasets.config.HF_HUB_OFFLINE)
    if not offline and not _hub_reachable():
        raise InputError(f"{spec}: no such file or directory, and the Hugging Face hub is unreachable; to read "
                         f"a dataset from the local cache ({cache}) set HF_HUB_OFFLINE=1")
    try:
        return datasets.load_dataset(spec, config, split=split)
    except Exception as exc:  # noqa: BLE001 - connection, missing config, missing dataset, unknown split...
        if isinstance(exc, ValueError) and "Unknown split" in str(exc):  # datasets names the splits there are
            raise InputError(f"{spec}: no split {split!r} ({one_line(exc)})") from None
        where = (f"not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set" if offline
                 else f"cannot load it from the Hugging Face hub (offline, set HF_HUB_OFFLINE=1 to read the local "
                      f"cache, {cache})")
        raise InputError(f"{spec}: no such file or directory; as a hub dataset: {where}: "
                         f"{one_line(exc, 200)}") from None


def _plain_table(table: pa.Table) -> pa.Table:
    """One chunk per column, no schema metadata (the `huggingface` features key stays with datasets)."""
    return table.replace_schema_metadata(None).combine_chunks()


@contextlib.contextmanager
def _quiet(datasets):
    """datasets' progress bars and logging off while loading (the library is silent); restored after."""
    from datasets.utils import logging as ds_logging

    bars_were_on = not datasets.are_progress_bars_disabled()
    verbosity = ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity_error()
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()
