"""The `batchspec` command line. Thin: parse, validate, call the library, report.

Exit codes: 0 success; 1 `verify` found an unexplained mismatch; 2 bad flags, input or
models, or another run holds the output (one-line message, nothing written); 3 the run
finished but some rows errored; 130 / 143 / 129 stopped by SIGINT / SIGTERM / SIGHUP (a
closed terminal): finished rows are saved, rerunning the same command resumes. Other
signals keep their default action (SIGQUIT, SIGUSR1 end the process at once, like SIGKILL:
the rows of the parts saved so far are kept and a rerun resumes from them).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import time
from pathlib import Path
from typing import Annotated, Optional


def _prefer_passive_openmp() -> None:
    """Idle OpenMP threads sleep instead of spinning, unless the user chose a wait policy.

    Read once, when torch loads its OpenMP runtime, so it must be set before torch is first
    imported. On a shared machine a spinning thread whose partner is descheduled wastes its
    core at every barrier (docs/operations.md, "Shared machines").
    The command line owns its process, so it sets this; the library never does.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


_prefer_passive_openmp()

import typer  # after the wait policy: the imports below load torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from . import __version__, interrupts  # from importlib.metadata; interrupts imports nothing heavy
from . import verify as verify_defaults  # verify's own defaults (its --tolerance, its --seed)
from .config import DEFAULT, GenerateConfig, UsageError, bucket_rows, os_error_message, parse_batch_size
from .distributed import BlockDone as WorkerBlockDone  # imports no Ray
from .engine.events import NonFiniteLogits, RowResult, StepStats, WidthChosen
from .errors import InputError, one_line
from .eventlog import JsonLog, interrupted_before_start, signal_name
from .interrupts import StopNow
from .io.input_table import TEXT_COLUMNS
from .io.inputs import read_input
from .job.generation import BucketDone, Generation, Interrupted, Started, work_dir_for
from .models.loading import ModelError
from .stats import acceptance_length
from .store.checkpoint import CheckpointError
from .store.files import check_distinct, naming
from .store.outputs import stats_path_for

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Offline batch generation with output-equivalent "
                  "batched speculative decoding.")
err = Console(stderr=True, soft_wrap=True)

EXIT_USAGE, EXIT_ROW_ERRORS = 2, 3
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # exit 128 + signal number: 130, 143, 129


def _version(value: bool) -> None:
    if value:
        typer.echo(f"batchspec {__version__}")
        raise typer.Exit()


@app.callback()
def _commands(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
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
AllowSpecialOpt = Annotated[bool, typer.Option("--allow-special-tokens", help="Let a control token's string in a "
                                               "prompt (<|im_end|>) be that control token. Default: prompt text "
                                               "is text; control tokens come only from the chat template.")]
PromptColumnOpt = Annotated[str, typer.Option("--prompt-column", help="Column of the prompts (default: prompt, or "
                                                                   "messages where there is no prompt column).")]
IdColumnOpt = Annotated[str, typer.Option("--id-column")]
ChatOpt = Annotated[bool, typer.Option("--chat/--no-chat", help="Apply the tokenizer's chat template.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", help="System message for chat prompts.")]
BucketWidthOpt = Annotated[Optional[int], typer.Option("--bucket-width", help="Prompt-length bucket width "
                                                       "(default: automatic).")]
LimitOpt = Annotated[Optional[int], typer.Option(help="Only the first N rows.")]


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # [..] is text, not markup
    return typer.Exit(code=code)


def _batch_size(value: str) -> int | str:
    try:
        return parse_batch_size(value)
    except UsageError as exc:
        raise fail(str(exc)) from None


@app.command()
def generate(
    input: Annotated[Path, typer.Argument(help="Prompts: a .jsonl or .parquet file, an OpenAI batch .jsonl, a "
                                          "Hugging Face dataset (hub id, save_to_disk directory, or a glob of "
                                          ".jsonl/.parquet/.csv files), or a bucket directory.")],
    output: Annotated[Path, typer.Argument(help="Completions to write: .parquet, or .jsonl for the OpenAI Batch "
                                           "output format.")],
    input_format: Annotated[str, typer.Option("--input-format", help="auto (an OpenAI batch file is recognised "
                                              "by its fields) | table | openai.")] = DEFAULT.input_format,
    output_format: Annotated[str, typer.Option("--output-format", help="auto (by OUTPUT's suffix) | parquet | "
                                               "openai.")] = DEFAULT.output_format,
    split: Annotated[str, typer.Option("--split", help="Split of a Hugging Face dataset.")] = DEFAULT.split,
    config: Annotated[Optional[str], typer.Option("--config", help="Configuration name of a hub dataset.")]
    = DEFAULT.dataset_config,
    target: TargetOpt = DEFAULT.target,
    draft: DraftOpt = DEFAULT.draft,
    mode: Annotated[str, typer.Option(help="auto (k chosen every round from measured costs) | exspec | eqspec | "
                                       "ar")] = DEFAULT.mode,
    draft_tokens: Annotated[int, typer.Option("--draft-tokens", "-k", help="Draft tokens per round (auto: the "
                                              "most).")] = DEFAULT.k,
    batch_size: Annotated[str, typer.Option("--batch-size", "-b", help="Rows a step runs at most, or auto: the "
                                            "width measured fastest on this machine, within the KV memory "
                                            "budget.")] = str(DEFAULT.batch_size),
    window: Annotated[Optional[int], typer.Option(help="EXSPEC pool size (default 4 x batch size).")] = DEFAULT.window,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = DEFAULT.max_new_tokens,
    max_prompt_tokens: Annotated[Optional[int], typer.Option("--max-prompt-tokens", help="Longer prompts become "
                                                              "error rows (default: the model's context).")]
    = DEFAULT.max_prompt_tokens,
    prompt_column: PromptColumnOpt = DEFAULT.prompt_column,
    id_column: IdColumnOpt = DEFAULT.id_column,
    chat: ChatOpt = DEFAULT.chat,
    system: SystemOpt = DEFAULT.system,
    allow_special_tokens: AllowSpecialOpt = DEFAULT.allow_special_tokens,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = DEFAULT.temperature,
    top_k: Annotated[int, typer.Option("--top-k")] = DEFAULT.top_k,
    top_p: Annotated[float, typer.Option("--top-p")] = DEFAULT.top_p,
    seed: Annotated[int, typer.Option()] = DEFAULT.seed,
    temperature_column: Annotated[Optional[str], typer.Option("--temperature-column", help="Per-row temperature "
                                                               "from this input column.")] = DEFAULT.temperature_column,
    seed_column: Annotated[Optional[str], typer.Option("--seed-column", help="Per-row seed column.")]
    = DEFAULT.seed_column,
    max_new_tokens_column: Annotated[Optional[str], typer.Option("--max-new-tokens-column",
                                                                  help="Per-row max_new_tokens column.")]
    = DEFAULT.max_new_tokens_column,
    top_p_column: Annotated[Optional[str], typer.Option("--top-p-column", help="Per-row top_p column.")]
    = DEFAULT.top_p_column,
    stop_column: Annotated[Optional[str], typer.Option("--stop-column", help="Per-row stop strings (a string or "
                                                       "a list of strings), besides --stop.")] = DEFAULT.stop_column,
    n: Annotated[int, typer.Option("--n", help="Samples per input row (1-128): N adjacent output rows with a "
                                   "`sample` column 0..N-1; sample 0 is the row --n 1 writes. Greedy rows are "
                                   "decoded once and written N times.")] = DEFAULT.n,
    n_column: Annotated[Optional[str], typer.Option("--n-column", help="Per-row --n from this input column "
                                                    "(null: --n).")] = DEFAULT.n_column,
    logprobs: Annotated[Optional[int], typer.Option("--logprobs", help="Store each completion token's "
                                                    "log-probability and the N most probable tokens (0-20; 0: the "
                                                    "token's own only) in a completion_logprobs column.")]
    = DEFAULT.logprobs,
    logprobs_column: Annotated[Optional[str], typer.Option("--logprobs-column", help="Per-row --logprobs N from "
                                                           "this input column (null: --logprobs).")]
    = DEFAULT.logprobs_column,
    logprobs_mode: Annotated[str, typer.Option("--logprobs-mode", help="raw: the target's log-softmax before "
                                               "temperature/top-k/top-p | processed: after them (the distribution "
                                               "sampled from).")] = DEFAULT.logprobs_mode,
    json_schema: Annotated[Optional[Path], typer.Option("--json-schema", help="Every completion is JSON valid "
                                                        "under the JSON schema in this file.")] = DEFAULT.json_schema,
    regex: Annotated[Optional[str], typer.Option("--regex", help="Every completion matches this regular "
                                                 "expression.")] = DEFAULT.regex,
    choice: Annotated[Optional[list[str]], typer.Option("--choice", help="Every completion is exactly one of "
                                                        "these strings (repeatable).")] = DEFAULT.choice,
    json: Annotated[bool, typer.Option("--json", help="Every completion is a JSON object.")] = DEFAULT.json,
    response_format_column: Annotated[Optional[str], typer.Option("--response-format-column", help="Per-row "
                                                                  "constraint: an OpenAI response_format object "
                                                                  "(json_schema, json_object, or text: none) or a "
                                                                  "JSON schema (null: the job's).")] = DEFAULT.response_format_column,
    bucket_width: BucketWidthOpt = DEFAULT.bucket_width,
    stats: Annotated[Optional[Path], typer.Option(help="Statistics file (default: OUT stem + .stats.parquet).")]
    = DEFAULT.stats,
    dtype: DtypeOpt = DEFAULT.dtype,
    device: DeviceOpt = DEFAULT.device,
    limit: LimitOpt = DEFAULT.limit,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = DEFAULT.overwrite,
    restart: Annotated[bool, typer.Option("--restart", help="Discard the saved work of an interrupted run of OUT "
                                                           "instead of resuming it.")] = DEFAULT.restart,
    log_json: Annotated[Optional[Path], typer.Option("--log-json", help="Append one JSON line per event (start, "
                                                      "bucket done, row error, interrupted, finish) to this file.")]
    = None,
    checkpoint_rows: Annotated[int, typer.Option("--checkpoint-rows", hidden=True)] = DEFAULT.checkpoint_rows,
    checkpoint_seconds: Annotated[float, typer.Option("--checkpoint-seconds", hidden=True)]
    = DEFAULT.checkpoint_seconds,
    threads: ThreadsOpt = DEFAULT.threads,
    kernels: Annotated[str, typer.Option("--kernels", help="auto | stock | packed: on a CPU in float32 or "
                                         "bfloat16, linear layers with oneDNN-prepacked weights (faster verifies "
                                         "and batched steps; twice the weight memory) and batchspec's own "
                                         "attention and Llama layer kernels (built once per machine; SDPA and "
                                         "transformers' layers where they cannot be). "
                                         "auto: packed when the copies take at most half the free memory; stock: "
                                         "neither.")] = DEFAULT.kernels,
    ray: Annotated[bool, typer.Option("--ray", help="Spread the length buckets over a Ray actor pool (needs "
                                      "pip install 'batchspec\\[ray]'). Connects to --ray-address, else to "
                                      "RAY_ADDRESS, else starts a local Ray on this machine.")] = DEFAULT.ray,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", help="Ray cluster to use (implies --ray): "
                                                       "host:port, 'auto' (the cluster this machine joined) or "
                                                       "'local' (a new local instance even if RAY_ADDRESS is set).")]
    = DEFAULT.ray_address,
    ray_workers: Annotated[Optional[int], typer.Option("--ray-workers", help="Ray workers, each loading the models "
                                                       "once; each takes one GPU where the cluster has GPUs, else "
                                                       "--threads CPUs (default: one per GPU, else CPUs / threads).")]
    = DEFAULT.ray_workers,
    ray_block_rows: Annotated[Optional[int], typer.Option("--ray-block-rows", hidden=True)] = DEFAULT.ray_block_rows,
    quiet: QuietOpt = DEFAULT.quiet,
) -> None:
    """Generate a completion for every prompt of INPUT and write them to OUTPUT (resumable: rerun after a crash)."""
    cfg = GenerateConfig(
        input=input, output=output, input_format=input_format, output_format=output_format, split=split,
        dataset_config=config, limit=limit, target=target, draft=draft, mode=mode, k=draft_tokens,
        max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, temperature_column=temperature_column, seed_column=seed_column,
        max_new_tokens_column=max_new_tokens_column, top_p_column=top_p_column, stop_column=stop_column,
        n=n, n_column=n_column, stop=tuple(stop or ()), chat=chat, system=system, allow_special_tokens=allow_special_tokens,
        prompt_column=prompt_column, id_column=id_column,
        dtype=dtype, logprobs=logprobs, logprobs_column=logprobs_column, logprobs_mode=logprobs_mode,
        json_schema=json_schema, regex=regex, choice=tuple(choice or ()) or None, json=json,
        response_format_column=response_format_column, batch_size=_batch_size(batch_size), window=window, device=device, stats=stats, bucket_width=bucket_width,
        threads=threads, kernels=kernels, ray=ray, ray_address=ray_address, ray_workers=ray_workers,
        ray_block_rows=ray_block_rows, overwrite=overwrite, restart=restart, quiet=quiet,
        checkpoint_rows=checkpoint_rows, checkpoint_seconds=checkpoint_seconds)
    out = Console(quiet=quiet, soft_wrap=True)
    use_ray = cfg.distributed
    if use_ray:  # before anything is read or loaded
        from .distributed import INSTALL_HINT, ray_available

        if not ray_available():
            raise fail(INSTALL_HINT)
        for flag, value in (("--ray-workers", ray_workers), ("--ray-block-rows", ray_block_rows)):
            if value is not None and value < 1:
                raise fail(f"{flag} must be a positive integer, got {value}")
    try:
        if log_json is not None:  # before it is opened: appending to an input or an output destroys it
            check_distinct([input], [("OUT", output), ("--stats", stats or stats_path_for(output)),
                                     ("--log-json", log_json)])
        log = JsonLog(log_json)
    except InputError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"--log-json {log_json}: cannot open for writing ({exc.strerror or exc})") from None
    with log:
        received: list[int] = []  # stop signals while the job opens

        def stop_at_once(signum, frame) -> None:
            received.append(signum)
            interrupts.raise_stop(signum, frame)

        try:
            with _handling_signals(stop_at_once), interrupts.kept() as swallowed:
                job = Generation.open(cfg)
                if swallowed:  # a finalizer swallowed the stop: act on it all the same
                    job.close()
                    raise StopNow(swallowed[0])
        except UsageError as exc:
            log.write("error", message=str(exc), exit_code=EXIT_USAGE)
            raise fail(str(exc)) from None
        except (KeyboardInterrupt, StopNow) as exc:  # while the input is read or the models load: nothing saved yet
            raise _interrupted_early(log, output, interrupts.signal_of(exc)) from None
        except Exception:  # a stop that landed inside a library's import leaves it half made: the stop, not a bug
            if not received:
                raise
            raise _interrupted_early(log, output, received[0]) from None
        stops = StopSignals()
        with _handling_signals(stops):
            with job, contextlib.ExitStack() as stack:
                executor = _start_ray(job, out, log, ray_address, ray_workers, ray_block_rows, stack) if use_ray \
                    else None
                code = _run(job, out, log, quiet, stops, executor)
            del job, executor  # the models are freed now, under the handlers: it takes a while, and a finished
            gc.collect()  # job must not look interrupted meanwhile
    if code:
        raise typer.Exit(code=code)


@contextlib.contextmanager
def _handling_signals(handler):
    """``handler`` for the STOP_SIGNALS while the block runs, the previous handlers after it."""
    previous = {}
    for sig in STOP_SIGNALS:
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (embedded use): no handlers, the caller owns signals
            break
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _interrupted_early(log: JsonLog, output: Path, signum: int) -> typer.Exit:
    """A stop while the input is read or the models load: nothing saved yet. One line; the exit of the signal."""
    interrupted_before_start(log, signum)
    prepared = work_dir_for(output).exists()  # the job was planned before the stop was seen: it resumes
    err.print(f"interrupted before any row was generated; "
              f"{'rerun the same command to resume' if prepared else 'nothing was written'}", highlight=False)
    return typer.Exit(code=128 + signum)


class StopSignals:
    """What SIGINT / SIGTERM / SIGHUP do once a job is open: stop at once (StopNow), except while its rows run
    (``running``), when the first asks the job to stop after the current step and a second acts at once; once OUT
    is complete (``finished``), nothing: the job's own exit code (0 or 3) stands, and a scheduler never sees a
    finished job as an interrupted one."""

    def __init__(self):
        self.job: Generation | None = None  # the job whose rows are running
        self.finished = False

    def __call__(self, signum, frame) -> None:
        if self.finished:
            return
        if self.job is None or self.job.stop_requested:
            raise StopNow(signum)
        self.job.stop(signum)

    @contextlib.contextmanager
    def running(self, job: Generation):
        self.job = job
        try:
            yield
        finally:
            self.job = None


def _start_ray(job: Generation, out: Console, log: JsonLog, address, workers, block_rows, stack):
    """Connect to (or start) Ray for this job; a cluster that cannot be reached is a one-line error (exit 2)."""
    from .distributed import RayConfig, RayExecutor

    executor = RayExecutor(job, RayConfig(address=address, workers=workers, block_rows=block_rows))
    stack.callback(executor.close)
    try:
        executor.connect()
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ...
        message = f"cannot start or reach Ray ({one_line(exc)})"
        log.write("error", message=message, exit_code=EXIT_USAGE)
        raise fail(message) from None
    out.print(f"ray: {executor.workers} workers x {executor.threads} threads"
              f"{' + 1 GPU' if executor.gpus_per_worker else ''} on {executor.address} "
              f"(ready in {executor.startup_s:.1f} s)", highlight=False)
    log.write("ray", address=executor.address, workers=executor.workers, threads=executor.threads,
              gpus_per_worker=executor.gpus_per_worker, startup_s=round(executor.startup_s, 3))
    return executor


class ProgressView:
    """The progress bar (stdout): rows done, tokens per second, acceptance length, the round's k and drafter."""

    def __init__(self, job: Generation, out: Console, quiet: bool):
        self.job, self.out = job, out
        self.started, self.tokens = time.perf_counter(), 0
        self.accepted = self.spec_rows = 0  # drafts accepted / row-rounds of speculative steps (acceptance length)
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("rows"), TextColumn("{task.fields[tps]:>8.1f} tok/s"),
                            TextColumn("acc {task.fields[acc]}"), TextColumn("k {task.fields[k]}"),
                            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=out,
                            disable=quiet, transient=False)
        self.task = None
        self.handlers = {Started: self.started_job, RowResult: self.row, StepStats: self.step,
                         WidthChosen: self.width}

    def started_job(self, event: Started) -> None:
        if event.dtype and not self.bar.disable:
            self.out.print(f"{event.mode}, {event.dtype} ({event.dtype_reason})", highlight=False)
        for note in event.notes:
            self.out.print(f"note: {note}", highlight=False)
        if event.resumed_rows:
            self.out.print(f"resuming: {event.resumed_rows} of {event.total_rows} rows already saved in "
                           f"{event.work_dir}", highlight=False)
        self.task = self.bar.add_task(event.mode, total=event.total_rows, completed=event.resumed_rows, tps=0.0,
                                      acc="-", k="-")

    def row(self, event: RowResult) -> None:
        self.bar.advance(self.task)

    def width(self, event: WidthChosen) -> None:
        if not self.bar.disable:
            self.out.print(f"batch size {event.width}{_measured(event)}", highlight=False)

    def step(self, event: StepStats) -> None:
        self.tokens += event.tokens_emitted
        if event.k > 0:
            self.accepted, self.spec_rows = self.accepted + sum(event.accepted), self.spec_rows + event.batch_size
        live_k = self.bar.tasks[0].fields["k"] if event.group_kind == "prefill" else \
            f"{event.k}" + (f" {event.drafter}" if event.k else "")  # the round's k and drafter
        length = acceptance_length(self.accepted, self.spec_rows)
        self.bar.update(self.task, tps=self.tokens / max(1e-9, time.perf_counter() - self.started),
                        acc="-" if length is None else f"{length:.2f}", k=live_k)


class LogView:
    """The JSON log's events of a run (``--log-json``): start, resumed, row errors, blocks and buckets done. A Ray
    block's ``BlockDone`` names its worker, which the row errors that follow it carry."""

    def __init__(self, job: Generation, log: JsonLog):
        self.job, self.log = job, log
        self.worker: str | None = None
        self.handlers = {Started: self.started_job, RowResult: self.row, WorkerBlockDone: self.block,
                         BucketDone: self.bucket, WidthChosen: self.width}

    def started_job(self, event: Started) -> None:
        cfg = self.job.cfg
        self.log.write("start", version=__version__, total_rows=event.total_rows, mode=event.mode,
                       input=str(cfg.input), output=str(cfg.output), pid=os.getpid(), resumed_rows=event.resumed_rows,
                       dtype=event.dtype, dtype_reason=event.dtype_reason)
        if event.resumed_rows:
            self.log.write("resumed", rows_saved=event.resumed_rows, rows_left=event.total_rows - event.resumed_rows)

    def row(self, event: RowResult) -> None:
        if event.finish_reason == "error":
            self.log.write("row_error", row=event.row, id=event.id, error=event.error,
                           **({"worker": self.worker} if self.worker else {}))

    def width(self, event: WidthChosen) -> None:
        self.log.write("batch_size", batch_size=event.width, stopped=event.stopped,
                       tokens_per_s={str(w): round(r, 1) for w, r in event.rates.items()})

    def block(self, event: WorkerBlockDone) -> None:
        self.worker = event.worker
        self.log.write("block_done", block=event.block, bucket=event.bucket, rows=event.rows, errors=event.errors,
                       worker=event.worker, seconds=round(event.seconds, 3))

    def bucket(self, event: BucketDone) -> None:
        self.log.write("bucket_done", bucket=event.bucket, rows=event.rows, errors=event.errors)


def _measured(event: WidthChosen) -> str:
    """What ``--batch-size auto`` measured, for the start of a run."""
    if not event.rates:
        return f" ({event.stopped})"
    rates = ", ".join(f"{w}: {r:.0f}" for w, r in sorted(event.rates.items()))
    if event.remembered:
        return f" (auto, measured before on this machine: plain-step tokens/s by width {rates})"
    return f" (auto: plain-step tokens/s by width {rates}; stopped at {event.stopped})"


def _run(job: Generation, out: Console, log: JsonLog, quiet: bool, stops: StopSignals, executor=None) -> int:
    """Stream the job's events to a progress bar and the JSON log; write the files; return the exit code.

    ``executor``: a ``distributed.RayExecutor`` (or None: this process's engine); its ``BlockDone``
    events name the worker, which the log's block and row events then carry."""
    started, total = time.perf_counter(), job.total_rows
    progress = ProgressView(job, out, quiet)
    views = [progress, LogView(job, log)]  # each subscribes to the events it reports
    stopped: Interrupted | None = None
    events = job.events(run=executor.run if executor is not None else None)
    try:
        with progress.bar, stops.running(job):
            for event in events:
                for view in views:
                    handler = view.handlers.get(type(event))
                    if handler is not None:
                        handler(event)
                if isinstance(event, Interrupted):
                    stopped = event
            if stopped is None:
                events.close()
                summary = job.finish()  # under the signal handlers: a stop asked now lets the files be written
                stops.finished = True  # OUT is complete: from here on a stop signal changes nothing
    except (KeyboardInterrupt, StopNow) as exc:  # a second signal: the finished rows are saved all the same
        events.close()
        stopped = Interrupted(saved_rows=job.saved_rows, total_rows=total,
                              signal=interrupts.signal_of(exc))
    except (OSError, CheckpointError) as exc:  # the machine or the work directory: once it is fixed, a rerun resumes
        events.close()
        message = os_error_message(exc) if isinstance(exc, OSError) else str(exc)
        log.write("failed", error=message, rows_saved=job.saved_rows, total_rows=total, exit_code=1)
        err.print(f"[bold red]error:[/] {escape(message)}; {job.saved_rows} of {total} rows saved; "
                  f"rerun the same command to resume", highlight=False)
        return 1
    except (NonFiniteLogits, ModelError) as exc:  # the model: the same command would fail the same way
        events.close()
        log.write("failed", error=str(exc), rows_saved=job.saved_rows, total_rows=total, exit_code=1)
        err.print(f"[bold red]error:[/] {escape(str(exc))}; {job.saved_rows} of {total} rows saved, but the same "
                  f"command would fail the same way: fix the model, or change it or --dtype and pass --restart",
                  highlight=False)
        return 1
    except Exception as exc:  # a bug: say what is kept, then show the traceback (exit 1)
        events.close()
        log.write("failed", error=one_line(exc), rows_saved=job.saved_rows,
                  total_rows=total, exit_code=1)
        err.print(f"[bold red]error:[/] the run failed unexpectedly (a bug: the traceback follows); {job.saved_rows} "
                  f"of {total} rows are saved, and once the cause is fixed rerunning the same command resumes from "
                  f"them", highlight=False)
        raise
    finally:
        events.close()
    if stopped is not None:
        code = 128 + int(stopped.signal or signal.SIGINT)
        err.print(f"interrupted: {stopped.saved_rows} of {stopped.total_rows} rows saved; rerun the same command "
                  f"to resume", highlight=False)
        log.write("interrupted", signal=signal_name(stopped.signal), rows_saved=stopped.saved_rows,
                  total_rows=stopped.total_rows, elapsed_s=round(time.perf_counter() - started, 3), exit_code=code)
        return code
    elapsed = time.perf_counter() - started
    out.print(f"wrote {summary['rows']} rows to {summary['output']} ({summary['completion_tokens']} tokens, "
              f"{summary['completion_tokens'] / max(elapsed, 1e-9):.1f} tok/s); statistics in {summary['stats']}",
              highlight=False)
    code = EXIT_ROW_ERRORS if summary["errors"] else 0
    if summary["errors"]:
        row, row_id, message = summary["first_errors"][0]
        where = "objects" if summary["output"].endswith(".jsonl") else "column"  # OpenAI Batch output: "error"
        err.print(f"{summary['errors']} of {summary['rows']} rows failed (finish_reason = error); see the error "
                  f"{where} of {summary['output']}; first: row {row + 1} (id {row_id}): {message}", highlight=False)
    log.write("finish", rows=summary["rows"], errors=summary["errors"], resumed_rows=summary["resumed_rows"],
              generated_rows=summary["generated_rows"], completion_tokens=summary["completion_tokens"],
              elapsed_s=round(elapsed, 3), finish_s=round(summary["finish_s"], 3), output=summary["output"],
              stats=summary["stats"], exit_code=code)
    return code


@app.command()
def verify(
    completions: Annotated[Path, typer.Argument(help="Completions .parquet written by `batchspec generate`.")],
    sample: Annotated[Optional[int], typer.Option(help="Check N random rows (default: every row).")] = None,
    tolerance: Annotated[float, typer.Option(help="Logit margin below which a mismatch is a float near-tie, "
                                                  "whatever the dtype.")] = verify_defaults.DEFAULT_TOLERANCE,
    units: Annotated[float, typer.Option(help="A margin within this many units of the run's dtype at the logits' "
                                              "magnitude is a near-tie (bfloat16 at 20: 1 unit = 0.125).")]
    = verify_defaults.DEFAULT_UNITS,
    seed: Annotated[int, typer.Option(help="Seed for choosing the sample.")] = verify_defaults.SAMPLE_SEED,
    device: DeviceOpt = DEFAULT.device,
    threads: ThreadsOpt = DEFAULT.threads,
    quiet: QuietOpt = DEFAULT.quiet,
) -> None:
    """Re-decode rows one at a time with plain decoding and compare (exit 1 on an unexplained mismatch).

    Greedy rows are re-decoded greedily; sampled rows with the same keyed Gumbel noise as the run."""
    from .models import loading as models
    from .verify import verify_run

    if sample is not None and sample < 1:
        raise fail(f"--sample must be a positive integer, got {sample}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise fail(f"--tolerance must be a finite number >= 0, got {tolerance}")
    if not (math.isfinite(units) and units >= 0):
        raise fail(f"--units must be a finite number >= 0, got {units}")
    if threads:
        import torch

        torch.set_num_threads(threads)
    out = Console(quiet=quiet, soft_wrap=True)
    try:
        report = verify_run(completions, sample=sample, tolerance=tolerance, seed=seed, device=device, units=units)
    except (InputError, models.ModelError) as exc:
        raise fail(str(exc)) from None
    out.print(f"checked {report.checked} rows ({report.skipped} error rows skipped): {report.exact} exact "
              f"({100 * report.exact_rate:.1f} %), {len(report.mismatches) - len(report.unexplained)} near-tie, "
              f"{len(report.unexplained)} unexplained (near-tie: within {report.units:g} "
              f"{report.ruler or report.dtype} units or "
              f"{report.tolerance:g})", highlight=False)
    if report.mismatches:
        from rich.table import Table

        table = Table("row", "id", "position", "run token", "reference token", "margin", "units", "class")
        for m in report.mismatches:
            table.add_row(str(m.row), m.id, str(m.position), str(m.run_token), str(m.reference_token),
                          "-" if m.margin is None else f"{m.margin:.3g}", "-" if m.units is None else f"{m.units:.3g}",
                          ("near-tie" if m.float64_margin is None else "near-tie (float64)") if m.near_tie
                          else "unexplained")
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
    except InputError as exc:
        raise fail(str(exc)) from None
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
    console = Console(width=max(100, Console().width))
    console.print(table)
    overall = summaries[-1]
    if overall.k_histogram:
        steps = sum(overall.k_histogram.values())
        console.print("k per decode step: " + ", ".join(f"k={k}: {n} ({100 * n / steps:.0f} %)"
                                                       for k, n in overall.k_histogram.items()), highlight=False)
    if overall.reuse_share is not None:
        console.print(f"prompt tokens: {overall.prompt_prefilled} prefilled, {overall.prompt_reused} reused (shared "
                      f"prefixes, --n samples): reuse share {100 * overall.reuse_share:.1f} %", highlight=False)
    if overall.expected_gain is not None:
        console.print(f"auto: expected gain {overall.expected_gain:.2f}x, realised {overall.realised_gain:.2f}x "
                      f"(tokens per second over the modelled plain step's)", highlight=False)
    for arm, a in overall.arms.items():
        windows = ", ".join(f"{rate:.1f}" for rate in a.windows) or "none closed"
        console.print(f"auto arm {arm}: ran {a.seconds:.1f} s in {a.rounds} rounds; its windows measured "
                      f"{windows} tok/s", highlight=False)


@app.command()
def bucket(
    input: Annotated[Path, typer.Argument(help="Prompts: .jsonl or .parquet file.")],
    directory: Annotated[Path, typer.Argument(help="Bucket directory to write.")],
    target: TargetOpt = DEFAULT.target,
    prompt_column: PromptColumnOpt = DEFAULT.prompt_column,
    id_column: IdColumnOpt = DEFAULT.id_column,
    chat: ChatOpt = DEFAULT.chat,
    system: SystemOpt = DEFAULT.system,
    allow_special_tokens: AllowSpecialOpt = DEFAULT.allow_special_tokens,
    bucket_width: BucketWidthOpt = DEFAULT.bucket_width,
    min_rows: Annotated[int, typer.Option("--min-rows", help="Merge sparse lengths until a bucket has this many "
                                                            "rows (typically the batch size).")]
    = bucket_rows(DEFAULT),
    limit: LimitOpt = DEFAULT.limit,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DIRECTORY if it is a bucket directory.")]
    = DEFAULT.overwrite,
    quiet: QuietOpt = DEFAULT.quiet,
) -> None:
    """Tokenize INPUT once and write length buckets (Parquet shards + manifest.json) to DIRECTORY."""
    from .store.buckets import BucketError, bucket_chunk, write_buckets
    from .models import loading as models
    from .config import tokenizer_settings, validate
    from .io.prompts import render_chunks

    # the settings generate would tokenize with, checked as generate checks them
    cfg = GenerateConfig(input=input, output=directory, target=target, prompt_column=prompt_column,
                         id_column=id_column, chat=chat, system=system, allow_special_tokens=allow_special_tokens,
                         bucket_width=bucket_width, limit=limit)
    try:
        validate(cfg)
    except UsageError as exc:
        raise fail(str(exc)) from None
    try:
        inp = read_input(input, prompt_column, id_column, limit)
        tokenizer, name = models.load_tokenizer(target, quiet=True)
        settings = tokenizer_settings(cfg, name) | ({TEXT_COLUMNS: sorted(inp.written)} if inp.written else {})
        errors: dict[int, str] = {}

        def chunks():  # the input's rows with their ids, a chunk at a time; the first failed row stops it
            for start, ids in render_chunks(inp, tokenizer, chat, system, errors, special_tokens=allow_special_tokens):
                if errors:
                    row, error = min(errors.items())
                    raise fail(f"{input}: row {row + 1}: {error}; `generate` would report it as an error row")
                yield bucket_chunk(start, ids, inp.table.slice(start, len(ids)))

        with naming(directory):
            manifest = write_buckets(directory, chunks(), settings, width=bucket_width, min_rows=min_rows,
                                     overwrite=overwrite)
    except (InputError, models.ModelError, BucketError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:  # the machine refused a write (a full disk)
        raise fail(os_error_message(exc)) from None
    Console(quiet=quiet, soft_wrap=True).print(f"wrote {manifest.total_rows} rows in {len(manifest.buckets)} buckets to {directory}",
                               highlight=False)
