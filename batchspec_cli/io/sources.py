"""Where a job's prompts come from: a prompts file, a Hugging Face dataset or an OpenAI batch file.

``read(cfg)`` gives every kind as the same ``input_table.InputTable`` (one pyarrow table, the prompts,
the ids, and for an OpenAI batch the per-row settings of each request) plus the *input hash*
that the resume fingerprint keeps, so everything downstream (rendering, buckets, per-row
columns, resume, the output files) is shared::

    INPUT                                   READ BY                          INPUT HASH
    prompts.jsonl / prompts.parquet         inputs.read_input                sha256 of the file
    an OpenAI batch .jsonl (its lines have  openai_batch.read_batch          sha256 of the file
      custom_id and body; --input-format openai)
    a Dataset(Dict).save_to_disk directory  datasets.load_from_disk          sha256 of its data files
    a glob of .jsonl / .parquet / .csv      datasets.load_dataset(builder)   sha256 of the matched files
    a hub id (owner/name)                   datasets.load_dataset(id)        the dataset's _fingerprint

The output format is Parquet unless OUT ends in ``.jsonl`` or ``--output-format openai``
is given (see openai_batch).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..store.checkpoint import hash_files
from . import datasets_input
from . import openai_batch
from .input_table import InputTable
from .inputs import read_input



def read(cfg, store: Path | None = None) -> tuple[InputTable, str]:
    """The job's input (``cfg``: a config.GenerateConfig) and its hash; InputError with a one-line message.
    A prompts file's rows are written to ``store`` as they are read (``inputs.read_input``)."""
    kind = datasets_input.kind(cfg.input)
    if kind is None:  # a file path (existing or not): the file readers
        if cfg.split != datasets_input.DEFAULT_SPLIT or cfg.dataset_config is not None:
            raise InputError(f"{cfg.input}: --split and --config apply to Hugging Face datasets, not to a file")
        if cfg.input_format == "openai" or (cfg.input_format == "auto" and openai_batch.is_batch_file(cfg.input)):
            inp = openai_batch.read_for_job(cfg)
        else:
            inp = read_input(cfg.input, cfg.prompt_column, cfg.id_column, cfg.limit, store)
        return inp, hash_files([cfg.input])
    if cfg.input_format == "openai":
        raise InputError(f"{cfg.input}: --input-format openai reads one .jsonl file of OpenAI Batch requests")
    return datasets_input.read(str(cfg.input), kind, split=cfg.split, config=cfg.dataset_config,
                               prompt_column=cfg.prompt_column, id_column=cfg.id_column, limit=cfg.limit)


def is_dataset_dir(path: Path) -> bool:
    """A directory written by Dataset.save_to_disk / DatasetDict.save_to_disk (not a bucket directory)."""
    return datasets_input.kind(path) == "saved"


def output_format(cfg) -> str:
    """"parquet" or "openai" for the job's OUT and --output-format; InputError when they disagree."""
    jsonl = Path(cfg.output).suffix.lower() == ".jsonl"
    if cfg.output_format == "auto":
        return "openai" if jsonl else "parquet"
    if cfg.output_format == "openai" and not jsonl:
        raise InputError(f"{cfg.output}: --output-format openai writes JSON lines: give an OUT ending in .jsonl")
    if cfg.output_format == "parquet" and jsonl:
        raise InputError(f"{cfg.output}: --output-format parquet writes Parquet: give an OUT ending in .parquet")
    return cfg.output_format
