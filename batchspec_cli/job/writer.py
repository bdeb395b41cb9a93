"""What of a job reaches disk: its finished rows and steps, in checkpoint parts as the run goes (``Unsaved``), then
the output files, streamed from those parts at the finish (``Writer.finish``), with the completions decoded to text
there (``Writer.texts_of``) and what the files record of the job (``metadata``).

A row reaches disk in a checkpoint part and leaves memory; the finish regroups the parts by row (``merge``) and writes
the completions (Parquet, or an OpenAI Batch output file) and the statistics file atomically, one range of rows at a
time, then removes the work directory. A kill meanwhile leaves the parts: the rerun writes the files again.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import torch

from .. import __version__
from ..config import AUTO, GenerateConfig, settings_record
from ..engine import logprobs as lp
from ..engine.core import pool_window
from ..engine.events import RowResult, StepStats
from ..engine.stops import StopStrings
from ..io import openai_batch
from ..io.input_table import StoredTable, id_array
from ..io.row_settings import row_value
from ..io.samples import SAMPLE_COLUMN
from ..store import merge
from ..store import outputs
from ..store.checkpoint import WorkDir
from ..store.files import write_text_stream_atomic
from .assembly import RunsOn
from .plan import JobPlan, release_free_memory


def metadata(cfg: GenerateConfig, plan: JobPlan, runs_on: RunsOn | None) -> dict:
    """What the output files record of the job (their Parquet schema metadata). ``runs_on``: how the engine ran (a
    Ray job's first worker's); None when no engine ran in this run (a resumed Ray job with no row left): the
    settings as given."""
    runs_on = runs_on or RunsOn(kernels=cfg.kernels, dtype=cfg.dtype, device=cfg.device)
    batch = runs_on.batch_size or cfg.batch_size  # --batch-size auto: the width the engine measured
    return {
        "batchspec_version": __version__, "torch_version": torch.__version__,
        "transformers_version": _transformers_version(),
        **settings_record(cfg, "metadata", target=plan.target_name, draft=plan.draft_name,
                          mode=plan.mode, window=pool_window(batch, cfg.window) if batch != AUTO else None,
                          batch_size=batch, kernels=runs_on.kernels, dtype=runs_on.dtype, device=runs_on.device),
        "dtype_reason": runs_on.dtype_reason, "attention": runs_on.attention,
        "target_source": plan.target.source, "draft_source": plan.draft_source,
        "drafters": (["model"] if plan.draft_spec else []) + list(plan.lookup_names),
        "eos_token_ids": plan.eos_ids, "resumed_rows": plan.resumed_rows,
        **({"logprobs_distribution": lp.DESCRIPTIONS[cfg.logprobs_mode]} if plan.wants_logprobs else {}),
        **({"constraint": {"kind": plan.constraint.kind, "text": plan.constraint.text}} if plan.constraint else {}),
        **({"sample_column": SAMPLE_COLUMN} if plan.samples.written else {}),
    }


class Unsaved:
    """Finished rows and steps not yet in a checkpoint part; a part is due after ``checkpoint_rows``
    rows, ``MOST_TOKENS`` of their completion tokens (long rows, each perhaps with its logprobs, are
    held no more than 32 rows of 512 tokens were) or ``checkpoint_seconds`` since the previous one.
    Every ``RELEASE_SECONDS`` a save also hands the memory the decode freed back to the system: the C
    heap keeps freed chunks between live ones, and over a long job its resident size would creep with the
    rows (docs/history.md, "Figures once kept in the code")."""

    RELEASE_SECONDS = 10.0
    MOST_TOKENS = 16384

    def __init__(self, work: WorkDir, rows: int, seconds: float):
        self.work, self.most_rows, self.seconds = work, rows, seconds
        self.rows: list[RowResult] = []
        self.stats: list[StepStats] = []
        self.tokens = 0  # the completion tokens of ``rows``
        self.last_save = self.last_release = time.monotonic()

    def add(self, row: RowResult) -> None:
        self.rows.append(row)
        self.tokens += len(row.token_ids)

    def save_if_due(self) -> None:
        if len(self.rows) >= self.most_rows or self.tokens >= self.MOST_TOKENS \
                or time.monotonic() - self.last_save >= self.seconds:
            self.save()

    def save(self) -> None:
        """Write the rows and statistics not yet saved as one checkpoint part."""
        if self.rows or self.stats:
            self.work.save_part(self.rows, self.stats)
            self.rows, self.stats, self.tokens = [], [], 0
        self.last_save = time.monotonic()
        if self.last_save - self.last_release >= self.RELEASE_SECONDS:
            release_free_memory()
            self.last_release = time.monotonic()


class Writer:
    """A job's files: its checkpoint parts as the run goes (``unsaved``), then OUT and the statistics file."""

    def __init__(self, cfg: GenerateConfig, work: WorkDir, plan: JobPlan):
        self.cfg, self.work, self.plan = cfg, work, plan
        self.unsaved = Unsaved(work, cfg.checkpoint_rows, cfg.checkpoint_seconds)

    def texts_of(self, rows: list[int], token_ids: list[list[int]], reasons: list[str]) -> list[str]:
        """Completions as text, decoded in one batch (a stop string and what follows it excluded:
        ``StopStrings.text``); ``rows`` (input rows), ``token_ids`` and ``reasons`` aligned."""
        tokenizer, overrides = self.plan.tokenizer, self.plan.overrides.get("stop")
        plain = tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        if "stop_string" not in reasons:
            return plain
        stops = StopStrings(tokenizer, self.cfg.stop)
        return [stops.text(ids, row_value(overrides, row, ())) if reason == "stop_string" else text
                for row, ids, reason, text in zip(rows, token_ids, reasons, plain)]

    def finish(self, runs_on: RunsOn | None) -> dict:
        """Write both files atomically, streamed from the checkpoint parts (every row's saved: see
        ``Generation.finish``) one range of rows at a time (see ``merge``), then remove the work directory; returns
        a summary. ``runs_on``: how the engine ran (``metadata``)."""
        cfg, plan = self.cfg, self.plan
        began = time.perf_counter()
        meta = metadata(cfg, plan, runs_on)
        self.work.mark_finishing()
        merge.regroup(self.work.part_paths("rows"), self.work.fresh_merge(), plan.total_rows)
        release_free_memory()  # what regrouping freed, before the ranges are written
        summary = {"rows": 0, "errors": 0, "completion_tokens": 0, "first_errors": []}
        pieces = self._output_pieces(summary)
        if plan.output_format == "openai":
            write_text_stream_atomic(cfg.output, pieces)
        else:
            outputs.write_parquet_stream_atomic(cfg.output, pieces, meta)
        schema = outputs.part_schema("stats")
        steps = (outputs.read_table(path).select(schema.names).cast(schema) for path in self.work.part_paths("stats"))
        outputs.write_parquet_stream_atomic(plan.stats_path, merge.batched(steps), meta, schema)
        self.work.remove()
        return {**summary, "resumed_rows": plan.resumed_rows, "generated_rows": summary["rows"] - plan.resumed_rows,
                "output": str(cfg.output), "stats": str(plan.stats_path), "finish_s": time.perf_counter() - began}

    def _output_pieces(self, summary: dict) -> Iterator:
        """OUT's rows, one range of output rows at a time in input order (a table, or the OpenAI file's text);
        counts them into ``summary``. An input row's samples are adjacent output rows: the table repeats its input
        columns for each (with a ``sample`` column when the job asks for samples); the OpenAI file answers it in one
        line of ``n`` choices, so a row whose samples continue in the next range waits for them."""
        cfg, plan, samples = self.cfg, self.plan, self.plan.samples
        token_text = (lambda token: plan.tokenizer.decode([token])) if plan.wants_logprobs else None
        created = int(time.time())
        passthrough = StoredTable(plan.passthrough) if plan.passthrough is not None else plan.inp.table
        waiting: tuple[list, list] = ([], [])  # (results, texts) of an input row whose samples continue
        for first, table in merge.ranges(self.work.merge, plan.total_rows):
            out_rows = table.column("row").to_numpy()
            in_rows = samples.input_rows(out_rows)  # [range] the input row of each output row
            token_ids = table.column("token_ids").to_pylist()
            reasons = table.column("finish_reason").to_pylist()
            texts = self.texts_of(in_rows.tolist(), token_ids, reasons)
            errors = pc.equal(table.column("finish_reason"), "error")
            summary["rows"] += table.num_rows
            summary["errors"] += pc.sum(errors).as_py() or 0
            summary["completion_tokens"] += pc.sum(pc.list_value_length(table.column("token_ids"))).as_py() or 0
            first_errors = table.filter(errors).slice(0, 3 - len(summary["first_errors"]))
            summary["first_errors"] += list(zip(samples.input_rows(first_errors.column("row").to_numpy()).tolist(),
                                                *(first_errors.column(c).to_pylist() for c in ("id", "error"))))
            if plan.output_format == "openai" or plan.wants_logprobs:
                results = outputs.results_from_table(table)  # per row objects, one range at a time
            if plan.output_format == "openai":
                results = waiting[0] + [dataclasses.replace(r, row=int(row)) for r, row in zip(results, in_rows)]
                texts = waiting[1] + texts
                last = int(in_rows[-1])
                cut = len(results)
                if samples.first(last) + samples.count(last) > first + table.num_rows:  # continues in the next range
                    cut = next(i for i, r in enumerate(results) if r.row == last)
                waiting = (results[cut:], texts[cut:])
                yield openai_batch.output_text(plan.inp, results[:cut], texts[:cut], plan.tokenizer,
                                               model=plan.target_name, chat=cfg.chat, salt=plan.input_hash,
                                               created=created)
                continue
            low = int(in_rows[0])
            inputs = passthrough.slice(low, int(in_rows[-1]) + 1 - low)
            if inputs.num_rows != int(in_rows[-1]) + 1 - low:
                raise RuntimeError(f"the kept input has {inputs.num_rows} rows from row {low}, not "
                                   f"{int(in_rows[-1]) + 1 - low}")
            ids = id_array(plan.inp.ids).slice(low, inputs.num_rows)
            if samples.total != plan.input_rows:  # each input row once per sample
                at = pa.array(in_rows - low)
                inputs, ids = inputs.take(at), ids.take(at)
            if plan.wants_logprobs:
                piece = outputs.completions_table(inputs, ids.to_pylist(), results, texts, token_text)
            else:
                piece = outputs.completions_from_parts(inputs, ids, table, texts)
            if samples.written:
                piece = piece.add_column(piece.schema.get_field_index("id") + 1, SAMPLE_COLUMN,
                                         pa.array(samples.sample_of(out_rows), pa.int32()))
            yield piece


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
