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
err = Console(stderr=True)

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
        seed=seed, bucket_width=bucket_width, threads=threads)
    out = Console(quiet=quiet)
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
