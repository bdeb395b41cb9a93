"""Scale-out on Ray Data: the same job, its length buckets spread over a pool of workers.

An adapter, nothing more (the engine does not know Ray exists)::

    driver (Generation, no model)               Ray Data actor pool (``--ray-workers N``)
    requests() -> blocks  ---- map_batches ---> Worker.__init__: assembly.assemble(...) once,
       (a length bucket, or a slice of one)                      as a single process does
    events(run=RayExecutor.run) <------------- Worker.__call__: engine.run(block's requests)
       records rows + stats in the job's                        -> the block's RowResults and StepStats,
       checkpoint parts, writes OUT at the end                     and how its engine runs (RunsOn)

The driver holds the job's settings and what it needs of the models without their weights (the tokenizer, the
EOS ids: ``plan.JobPlan``); only the workers load models, so the driver needs no GPU.

Every block holds rows of one bucket, so every worker still sees same-length prompts. A
block's events come back together when the block is done, in the order blocks finish;
the driver's job numbers their steps as one sequence (``done.StepNumbering``) and keeps rows and steps in its
own bookkeeping, so checkpoint parts, resume, fingerprint, lock and the final files are
the single-process ones. A worker that dies is restarted by Ray and its block is run
again (Ray Data retries the task); a block that arrives twice is dropped whole, so no row
is lost or doubled. A row's completion does not depend on its block, its batch or its
worker (docs/design.md, "What is guaranteed"), so the output equals a single-process run's.

``ray`` is imported only here and only when a ``RayExecutor`` starts: the package works
without it (``pip install 'batchspec[ray]'`` adds it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import pickle
import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from .config import AUTO, AUTO_BLOCK_WIDTH, GenerateConfig
from .engine.core import pool_window
from .engine.events import Request, RowResult, StepStats
from .job.assembly import RunsOn, assemble
from .job.generation import Generation

POLL_S = 0.2  # how often the driver looks for a stop while it waits for a block
POOL_START_TIMEOUT_S = 3600  # how long the blocks wait for every worker to load its models
_END = object()
INSTALL_HINT = "--ray needs Ray: pip install 'batchspec[ray]'"


def ray_available() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken install
        return False


@dataclass
class RayConfig:
    address: str | None = None  # None: RAY_ADDRESS, else a new local instance; "local" forces a new one
    workers: int | None = None  # actor pool size (default: one per GPU, else CPUs // threads)
    block_rows: int | None = None  # rows per block at most (default: the engine's window, 4 x batch size)


@dataclass
class BlockDone:
    """A worker finished one block; its rows and steps follow this event."""

    block: int
    bucket: int
    rows: int
    errors: int
    worker: str  # host:pid of the actor that ran it
    seconds: float  # the block's time in the worker (engine only; model loading excluded)


@dataclass
class WorkerSpec:
    """What a worker needs to rebuild the job's engine (pickled to every actor)."""

    cfg: GenerateConfig
    mode: str  # the job's mode after its fallbacks (e.g. ar when there is no draft)
    draft_spec: str | None  # the draft the driver resolved (the shipped one included), None for ar
    lookup_names: list[str]  # model-free drafters (each worker keeps its own index over the blocks it runs)
    threads: int
    # A resumed job's saved rows (prompt, completion or None), in run order: every worker's drafters learn them
    # first, as the drafters of an uninterrupted run had learnt them from the rows it ran.
    preload: tuple = ()


def make_blocks(requests: Iterable[Request], block_rows: int) -> Iterator[list[Request]]:
    """Blocks of one bucket's requests, each cut as soon as it has ``block_rows`` of them or its bucket ends (the
    requests arrive bucket by bucket: ``Generation.requests``): at most one block's requests are held at once."""
    block: list[Request] = []
    for req in requests:
        if block and (req.bucket != block[0].bucket or len(block) == block_rows):
            yield block
            block = []
        block.append(req)
    if block:
        yield block


def block_cost(block: list[Request]) -> int:
    """A block's work: rows x (prompt + new tokens); the most expensive go first, so the pool's tail is short."""
    return sum(max(r.pad_to, len(r.prompt_ids)) + r.max_new_tokens for r in block)


class Worker:
    """A Ray Data callable class: loads the models once, then runs the engine over each block."""

    def __init__(self, spec: WorkerSpec):
        import torch

        torch.set_num_threads(spec.threads)
        # As a single process does (--kernels auto: by this worker's own free memory). run() resets the rows'
        # state; the policy's timings, the drafters' indexes and a loaded draft carry over between blocks.
        assembly = assemble(spec.cfg, spec.mode, spec.draft_spec, spec.lookup_names, quiet=True)
        self.assembly, self.engine = assembly, assembly.engine
        self.engine.preload(spec.preload)
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict) -> dict:
        # batch: {"block": [n], "requests": [n] a reference to a pickled list[Request]}; n is 1 (batch_size=1)
        import ray

        out = {"block": [], "worker": [], "seconds": [], "events": [], "runs_on": []}
        for block, ref in zip(batch["block"], batch["requests"]):
            requests: list[Request] = pickle.loads(ray.get(ref))
            start = time.perf_counter()
            events = list(self.engine.run(requests))
            out["block"].append(int(block))
            out["worker"].append(self.name)
            out["seconds"].append(time.perf_counter() - start)
            out["events"].append(pickle.dumps(events))
            out["runs_on"].append(pickle.dumps(self.assembly.runs_on))  # after the run: the width it measured
        return out


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null meanwhile (Ray's C++ code writes there, not to sys.stderr)."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _quiet_ray_data() -> None:
    """Ray Data logs its plans and warnings to stderr; only the CLI talks."""
    import logging

    logging.getLogger("ray.data").setLevel(logging.ERROR)


class RayExecutor:
    """``Generation.events(run=RayExecutor(job, rcfg).run)``: the job's requests through a Ray actor pool.

    ``connect`` (or the first ``run``) joins or starts Ray; ``close`` shuts Ray down when it started or joined it.
    """

    def __init__(self, job: Generation, rcfg: RayConfig):
        self.job, self.rcfg = job, rcfg
        cfg = job.cfg
        self.threads = cfg.threads or 1
        width = AUTO_BLOCK_WIDTH if cfg.batch_size == AUTO else cfg.batch_size
        self.block_rows = rcfg.block_rows or pool_window(width, cfg.window)
        self.spec = WorkerSpec(cfg=cfg, mode=job.plan.mode, draft_spec=job.plan.draft_spec,
                               lookup_names=list(job.plan.lookup_names), threads=self.threads)
        self.owns_ray = False
        self.workers = 0
        self.gpus_per_worker = 0
        self.address = ""
        self.startup_s = 0.0

    # ------------------------------------------------------------------ cluster
    def connect(self) -> None:
        # Before Ray is imported: (1) the library is silent, and Ray's C++ core logs a warning to
        # stderr for every Ray Data actor pool (about restarts): keep only fatal ones (the line saying
        # so is hidden below); (2) no implicit ray.init: after a stop, Ray Data's result thread may still
        # call Ray while the driver shuts it down, and must fail there, not start a new local Ray.
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
        os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
        import ray

        start = time.perf_counter()
        if not ray.is_initialized():
            address = self.rcfg.address or os.environ.get("RAY_ADDRESS") or "local"
            kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                          configure_logging=True)
            if address == "local":  # a new instance on this machine: enough logical CPUs for the pool and the driver
                workers = self.rcfg.workers or max(1, (os.cpu_count() or 1) // self.threads)
                package_root = str(Path(__file__).resolve().parent.parent)
                path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
                with _stderr_silenced():
                    ray.init(address="local", num_cpus=workers * self.threads + 1,
                             runtime_env={"env_vars": {"PYTHONPATH": path}}, **kwargs)
            else:
                with _stderr_silenced():
                    ray.init(address=address, **kwargs)
            self.owns_ray = True
        resources = ray.cluster_resources()
        self.address = ray.get_runtime_context().gcs_address
        gpus = int(resources.get("GPU", 0)) if self.job.cfg.device != "cpu" else 0
        self.gpus_per_worker = 1 if gpus else 0
        default = gpus or max(1, int(resources.get("CPU", 1)) // self.threads)
        self.workers = self.rcfg.workers or default
        self.startup_s = time.perf_counter() - start

    def close(self) -> None:
        if self.owns_ray:
            import ray

            ray.shutdown()
            self.owns_ray = False

    # ------------------------------------------------------------------ running
    def run(self, requests: Iterable[Request]) -> Iterator[RowResult | StepStats | BlockDone | RunsOn]:
        import ray
        import ray.data

        if not ray.is_initialized():
            self.connect()
        # Each block goes to Ray's object store as it is cut: the driver keeps its cost, its bucket and a
        # reference, never the job's requests (they are cut into blocks as they arrive).
        placed = sorted(((block_cost(block), block[0].bucket, ray.put(pickle.dumps(block)))
                         for block in make_blocks(requests, self.block_rows)), key=lambda p: p[0], reverse=True)
        if not placed:
            return
        _quiet_ray_data()
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the CLI draws the job's one bar
        context.print_on_execution_start = False
        context.execution_options.preserve_order = False  # blocks come back as they finish
        # The blocks start once every worker has loaded its models: a worker that cannot load fails the
        # job before any row runs, and the first worker up does not take every block of a short job.
        context.wait_for_min_actors_s = POOL_START_TIMEOUT_S
        buckets = [bucket for _, bucket, _ in placed]
        ds = ray.data.from_items([{"block": i, "requests": ref} for i, (_, _, ref) in enumerate(placed)],
                                 override_num_blocks=len(placed))
        ds = ds.map_batches(
            Worker, fn_constructor_kwargs={"spec": self.worker_spec()}, batch_size=1,
            # one block at a time per worker: a block is a whole engine run, and one queued behind a busy
            # worker would wait while another worker idles
            compute=ray.data.ActorPoolStrategy(size=min(self.workers, len(buckets)), max_tasks_in_flight_per_actor=1),
            num_cpus=self.threads, num_gpus=self.gpus_per_worker or None, batch_format="default")
        seen: set[int] = set()
        for out in self._arrivals(ds):
            block = int(out["block"])
            if block in seen:  # a retried block delivered twice: every row is already recorded
                continue
            seen.add(block)
            events = pickle.loads(out["events"])
            rows = [e for e in events if isinstance(e, RowResult)]
            # opens the block's events: the job numbers their steps after those before (Generation.events)
            yield pickle.loads(out["runs_on"])
            yield BlockDone(block=block, bucket=buckets[block], rows=len(rows),
                            errors=sum(r.finish_reason == "error" for r in rows), worker=str(out["worker"]),
                            seconds=float(out["seconds"]))
            yield from events

    def worker_spec(self) -> WorkerSpec:
        """The spec every worker is built from, once the job's requests were read (their saved rows included)."""
        return dataclasses.replace(self.spec, preload=tuple(self.job.done.preloads()))

    def _arrivals(self, ds) -> Iterator[dict]:
        """The dataset's output rows as they arrive; ends early once the job is asked to stop.

        A thread waits on Ray Data, so a stop (SIGINT / SIGTERM) is seen within POLL_S even while a
        long block runs, as a single process sees it after the current step; blocks in flight are lost
        (not saved) and run again on resume.
        """
        arrived: queue.Queue = queue.Queue()
        closed = threading.Event()

        def pump() -> None:
            try:
                for out in ds.iter_rows():
                    arrived.put(out)
                    if closed.is_set():
                        break
                arrived.put(_END)
            except BaseException as exc:  # noqa: BLE001 - handed to the driver's thread, raised there
                arrived.put(exc)

        thread = threading.Thread(target=pump, name="batchspec-ray-results", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    item = arrived.get(timeout=POLL_S)
                except queue.Empty:
                    if self.job.stop_requested:
                        return
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    if closed.is_set():
                        return
                    raise item
                yield item
        finally:
            closed.set()
