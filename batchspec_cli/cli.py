"""The `batchspec` command line. Thin: parse, validate, call the library, report.

Exit codes: 0 success; 1 `verify` found an unexplained mismatch; 2 bad flags, input or
models (one-line message, nothing written); 3 the run finished but some rows errored.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .events import RowResult, StepStats
from .runner import GenerateConfig, Generation, Started, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Offline batch generation with output-equivalent "
                  "batched speculative decoding.")
err = Console(stderr=True, soft_wrap=True)

EXIT_USAGE, EXIT_ROW_ERRORS = 2, 3


@app.callback()
def _commands() -> None:
    """Offline batch generation with output-equivalent batched speculative decoding."""

# Reusable option aliases.
TargetOpt = Annotated[Optional[str], typer.Option("--target", help="Target model: local dir, hub id or .gguf file "
                                                  "(default: embedded SmolLM2-135M-Instruct).")]
DraftOpt = Annotated[Optional[str], typer.Option("--draft", help="Draft model: local dir, hub id or .gguf file "
                                                 "(default: the shipped draft when the default target is used).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto|float32|bfloat16|float16|float64")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto|cpu|cuda|cuda:N")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors (for cron).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads for torch.")]


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code=code)


@app.command()
def generate(
    input: Annotated[Path, typer.Argument(help="Prompts: .jsonl or .parquet file, or a bucket directory.")],
    output: Annotated[Path, typer.Argument(help="Completions .parquet file to write.")],
    target: TargetOpt = None,
    draft: DraftOpt = None,
    mode: Annotated[str, typer.Option(help="exspec | eqspec | ar")] = "exspec",
    draft_tokens: Annotated[int, typer.Option("--draft-tokens", "-k", help="Draft tokens per round.")] = 5,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b")] = 8,
    window: Annotated[Optional[int], typer.Option(help="EXSPEC pool size (default 4 x batch size).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 256,
    prompt_column: Annotated[str, typer.Option("--prompt-column")] = "prompt",
    id_column: Annotated[str, typer.Option("--id-column")] = "id",
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Apply the tokenizer's chat template.")] = True,
    system: Annotated[Optional[str], typer.Option("--system", help="System message for chat prompts.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    temperature_column: Annotated[Optional[str], typer.Option("--temperature-column", help="Per-row temperature "
                                                               "from this input column.")] = None,
    seed_column: Annotated[Optional[str], typer.Option("--seed-column", help="Per-row seed column.")] = None,
    max_new_tokens_column: Annotated[Optional[str], typer.Option("--max-new-tokens-column",
                                                                  help="Per-row max_new_tokens column.")] = None,
    bucket_width: Annotated[Optional[int], typer.Option("--bucket-width", help="Prompt-length bucket width "
                                                         "(default: automatic).")] = None,
    stats: Annotated[Optional[Path], typer.Option(help="Statistics file (default: OUT stem + .stats.parquet).")] = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    limit: Annotated[Optional[int], typer.Option(help="Only the first N rows.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
    threads: ThreadsOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Generate a completion for every prompt of INPUT and write them to OUTPUT."""
    cfg = GenerateConfig(
        input=input, output=output, stats=stats, target=target, draft=draft, mode=mode, k=draft_tokens,
        batch_size=batch_size, window=window, max_new_tokens=max_new_tokens, prompt_column=prompt_column,
        id_column=id_column, chat=chat, system=system, stop=tuple(stop or ()), dtype=dtype, device=device,
        limit=limit, overwrite=overwrite, quiet=quiet, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, bucket_width=bucket_width, threads=threads, temperature_column=temperature_column,
        seed_column=seed_column, max_new_tokens_column=max_new_tokens_column)
    out = Console(quiet=quiet, soft_wrap=True)
    try:
        job = Generation.open(cfg)
    except UsageError as exc:
        raise fail(str(exc)) from None
    summary = _run_with_progress(job, out, quiet)
    if summary["errors"]:
        err.print(f"{summary['errors']} of {summary['rows']} rows failed (finish_reason = error); "
                  f"see the error column of {summary['output']}", highlight=False)
        raise typer.Exit(code=EXIT_ROW_ERRORS)


def _run_with_progress(job: Generation, out: Console, quiet: bool) -> dict:
    started, tokens = time.perf_counter(), 0
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("rows"), TextColumn("{task.fields[tps]:>8.1f} tok/s"), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), console=out, disable=quiet, transient=False)
    with progress:
        task = None
        for event in job.events():
            if isinstance(event, Started):
                for note in event.notes:
                    out.print(f"note: {note}", highlight=False)
                task = progress.add_task(event.mode, total=event.total_rows, tps=0.0)
            elif isinstance(event, RowResult):
                progress.advance(task)
            elif isinstance(event, StepStats):
                tokens += event.tokens_emitted
                progress.update(task, tps=tokens / max(1e-9, time.perf_counter() - started))
    summary = job.finish()
    elapsed = time.perf_counter() - started
    out.print(f"wrote {summary['rows']} rows to {summary['output']} ({summary['completion_tokens']} tokens, "
              f"{summary['completion_tokens'] / max(elapsed, 1e-9):.1f} tok/s); statistics in {summary['stats']}",
              highlight=False)
    return summary


def main() -> None:  # pragma: no cover - console entry point
    app()


@app.command()
def verify(
    completions: Annotated[Path, typer.Argument(help="Completions .parquet written by `batchspec generate`.")],
    sample: Annotated[Optional[int], typer.Option(help="Check N random rows (default: every row).")] = None,
    tolerance: Annotated[float, typer.Option(help="Logit margin below which a mismatch is a float near-tie.")] = 1e-3,
    seed: Annotated[int, typer.Option(help="Seed for choosing the sample.")] = 0,
    device: DeviceOpt = "auto",
    threads: ThreadsOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Re-decode rows one at a time with plain greedy decoding and compare (exit 1 on an unexplained mismatch)."""
    from . import io as bio
    from . import models
    from .verify import verify_run

    if sample is not None and sample < 1:
        raise fail(f"--sample must be a positive integer, got {sample}")
    if threads:
        import torch

        torch.set_num_threads(threads)
    out = Console(quiet=quiet, soft_wrap=True)
    try:
        report = verify_run(completions, sample=sample, tolerance=tolerance, seed=seed, device=device)
    except (bio.InputError, models.ModelError) as exc:
        raise fail(str(exc)) from None
    out.print(f"checked {report.checked} rows ({report.skipped} error or sampled rows skipped): {report.exact} exact "
              f"({100 * report.exact_rate:.1f} %), {len(report.mismatches) - len(report.unexplained)} near-tie, "
              f"{len(report.unexplained)} unexplained (tolerance {report.tolerance:g})", highlight=False)
    if report.mismatches:
        from rich.table import Table

        table = Table("row", "id", "position", "run token", "reference token", "margin", "class")
        for m in report.mismatches:
            table.add_row(str(m.row), m.id, str(m.position), str(m.run_token), str(m.reference_token),
                          "-" if m.margin is None else f"{m.margin:.3g}", "near-tie" if m.near_tie else "unexplained")
        out.print(table)
    if report.unexplained:
        raise typer.Exit(code=1)


@app.command("stats")
def stats_command(
    stats_file: Annotated[Path, typer.Argument(help="A .stats.parquet file written by `batchspec generate`.")],
) -> None:
    """Summarize a statistics file: group hit rate, acceptance length, realignment share, tokens/s."""
    from rich.table import Table

    from .stats import summarize

    try:
        summaries = summarize(stats_file)
    except (OSError, KeyError) as exc:
        raise fail(f"{stats_file}: not a readable batchspec statistics file ({exc})") from None
    except Exception as exc:  # pyarrow raises its own error types for corrupt files
        raise fail(f"{stats_file}: not a readable batchspec statistics file ({str(exc).splitlines()[0]})") from None
    table = Table(title="acceptance length counts the bonus/correction token; shares are of summed step time")
    table.add_column("", no_wrap=True)
    for header in ("steps", "hit rate", "acc. len", "realign+ gather", "tokens", "tok/s", "KV moved", "KV gathered"):
        table.add_column(header, justify="right")
    pct = lambda v: "-" if v is None else f"{100 * v:.1f} %"  # noqa: E731
    for s in summaries:
        table.add_row(s.label, str(s.steps), pct(s.hit_rate),
                      "-" if s.acceptance_length is None else f"{s.acceptance_length:.2f}", pct(s.realign_share),
                      str(s.tokens), f"{s.tokens_per_s:.1f}", str(s.kv_moved), str(s.kv_gathered))
    Console(width=max(100, Console().width)).print(table)


@app.command()
def bucket(
    input: Annotated[Path, typer.Argument(help="Prompts: .jsonl or .parquet file.")],
    directory: Annotated[Path, typer.Argument(help="Bucket directory to write.")],
    target: TargetOpt = None,
    prompt_column: Annotated[str, typer.Option("--prompt-column")] = "prompt",
    id_column: Annotated[str, typer.Option("--id-column")] = "id",
    chat: Annotated[bool, typer.Option("--chat/--no-chat")] = True,
    system: Annotated[Optional[str], typer.Option("--system")] = None,
    bucket_width: Annotated[Optional[int], typer.Option("--bucket-width")] = None,
    min_rows: Annotated[int, typer.Option("--min-rows", help="Merge sparse lengths until a bucket has this many "
                                                            "rows (typically the batch size).")] = 8,
    limit: Annotated[Optional[int], typer.Option()] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Tokenize INPUT once and write length buckets (Parquet shards + manifest.json) to DIRECTORY."""
    from buckets import BucketError, build_buckets

    from . import io as bio
    from . import models
    from .runner import GenerateConfig, tokenizer_settings

    if bucket_width is not None and bucket_width < 1:
        raise fail(f"--bucket-width must be positive, got {bucket_width}")
    try:
        inp = bio.read_input(input, prompt_column, id_column, limit)
        tokenizer, name = models.load_tokenizer(target, quiet=True)
        ids = [bio.render_prompt(tokenizer, p, chat, system) for p in inp.prompts]
        cfg = GenerateConfig(input=input, output=directory, target=target, prompt_column=prompt_column,
                             id_column=id_column, chat=chat, system=system)
        manifest = build_buckets(directory, inp.table, ids, tokenizer_settings(cfg, name), width=bucket_width,
                                 min_rows=min_rows, overwrite=overwrite)
    except (bio.InputError, models.ModelError, BucketError) as exc:
        raise fail(str(exc)) from None
    Console(quiet=quiet, soft_wrap=True).print(f"wrote {manifest.total_rows} rows in {len(manifest.buckets)} buckets to {directory}",
                               highlight=False)
