"""The composition root: where a job's models load and its engine is built, in the process that runs it.

``assemble(cfg, mode, draft_spec, lookup_names)`` loads the target, applies ``--kernels``,
reads the EOS ids and builds the ``Engine``; ``generation.Generation`` (a single process) and
``distributed.Worker`` (each Ray worker) call it and nothing else builds an engine for a job;
the plan of a job (``plan.plan_job``) reads no weights, so a Ray driver loads no model. The draft model is named and
vetted here (``models.check_draft``: a draft that does not fit the target is refused before
the job starts) but its weights load, and are packed, only when the engine first uses them
(``LazyDraft``): ``auto`` calibrates the draft at its first speculative trial, and on a job
where no trial is affordable it never loads it; ``eqspec``/``exspec`` load it at their first
admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__
from ..config import AUTO, GenerateConfig
from ..engine import constraints
from ..engine import drafters
from ..engine.core import AUTO_WIDTHS, Engine, EngineConfig, ModelHandle
from ..engine.stops import StopStrings
from ..models import loading as models
from ..models import native, widths

PACKED_MEMORY_SHARE = 0.5  # --kernels auto packs only when the packed copies take at most this share of free memory


class LazyDraft:
    """The draft model of a job: named and vetted when the job opens, loaded on its first use (``handle``).

    Loaded in the target's dtype and on its device, and packed when the target's kernels are
    (``packed``, set by ``assemble``; from the rows measured on this machine where ``tuning`` is set, as the
    target's). Loading is quiet: it happens while the job runs."""

    def __init__(self, spec: str, target: models.LoadedModel, dtype: str, device: str, quiet: bool):
        self.spec, self.target, self.dtype, self.device = spec, target, dtype, device
        self.name, folder = models.check_draft(spec, target, quiet)
        self.source = str(folder)
        self.packed = False
        self.tuning: widths.MachineMemory | None = None  # --kernels auto: where the packed rows are remembered
        self.loaded: models.LoadedModel | None = None

    def weight_bytes(self) -> int:
        """The bytes of the draft's weight files: what packing it would add, at most (its linears' weights)."""
        return sum(p.stat().st_size for p in Path(self.source).iterdir()
                   if p.is_file() and p.suffix in (".safetensors", ".bin"))

    def handle(self) -> ModelHandle:
        """The draft model, loaded (and packed) the first time it is asked for."""
        if self.loaded is None:
            draft = models.load_draft(self.spec, self.target, self.dtype, self.device, quiet=True)
            if draft.model.device != self.target.model.device:
                raise models.ModelError("draft and target ended up on different devices")
            if self.packed:
                from ..models import kernels

                kernels.prepack(draft.model)
                native.attach(draft.model)
                if self.tuning is not None:
                    tune_kernels(draft, self.tuning)
                    tune_native(draft, self.tuning)
            self.loaded = draft
        return ModelHandle(self.loaded.model, models.cache_kwarg(self.loaded.model))


@dataclass(frozen=True)
class RunsOn:
    """How a job's engine runs, as the output's metadata records it (a Ray job's: its first worker's)."""

    kernels: str  # stock | packed (use_kernels)
    dtype: str  # the target's, as torch names it without "torch.": float32, bfloat16...
    device: str  # cpu, cuda:0...
    dtype_reason: str = ""  # why that dtype (models.choose_dtype)
    batch_size: int | None = None  # --batch-size auto: the width the engine measured (None: not measured)
    attention: str = ""  # sdpa, or batchspec's kernels and their build's key (native.running)


@dataclass
class Assembly:
    """What ``assemble`` made: the engine and what the job's files record of it."""

    engine: Engine
    target: models.LoadedModel
    draft: LazyDraft | None  # None: no draft model (ar, or model-free drafters only)
    eos_ids: list[int]
    kernels: str  # the kernels that run: stock | packed (use_kernels)
    notes: list[str]  # for the user: a kernel that cannot apply, or that memory leaves out

    @property
    def runs_on(self) -> RunsOn:
        """How the engine runs now (the batch width once it has measured it)."""
        model, engine = self.target.model, self.engine
        return RunsOn(self.kernels, models.dtype_name(model), str(model.device),
                      self.target.dtype_reason, engine.batch_size if engine.width_rates is not None else None,
                      native.running(model))


def mixed_kernel(cfg: GenerateConfig) -> bool:
    """Whether batchspec's bfloat16 kernel would run a mixed model's products in this job: a CPU job whose
    ``--kernels`` are not stock, on a CPU where the kernel builds (``--dtype auto`` may then choose mixed)."""
    if cfg.dtype != "auto" or cfg.kernels == "stock" or models.resolve_device(cfg.device).type != "cpu":
        return False
    return native.load().linear


def assemble(cfg: GenerateConfig, mode: str, draft_spec: str | None, lookup_names: list[str],
             quiet: bool) -> Assembly:
    """Load the target, vet the draft (loaded on first use), apply ``--kernels``, read the EOS ids, build the
    engine of ``mode`` with these drafters."""
    target = models.load_model(cfg.target, cfg.dtype, cfg.device, quiet=quiet, mixed_kernel=mixed_kernel(cfg))
    draft = LazyDraft(draft_spec, target, cfg.dtype, cfg.device, quiet) if draft_spec is not None else None
    tuning = kernel_memory(target) if cfg.kernels == "auto" else None
    kernels_run, notes = use_kernels(cfg.kernels, target, pending_bytes=draft.weight_bytes() if draft else 0,
                                     tuning=tuning)
    if draft is not None:
        draft.packed = kernels_run == "packed"
        draft.tuning = tuning
    eos_ids = models.eos_ids(target.model, target.tokenizer)
    engine = build_engine(cfg, mode, target, draft, eos_ids, lookup_names)
    return Assembly(engine, target, draft, eos_ids, kernels_run, notes)


def build_engine(cfg: GenerateConfig, mode: str, target: models.LoadedModel, draft: LazyDraft | None,
                 eos_ids: list[int], lookup_names: list[str]) -> Engine:
    """The engine of one job for a loaded target and a draft loaded on first use."""
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    auto_width = cfg.batch_size == AUTO
    memory = None
    if auto_width:  # the same command runs at the same width on this machine (its rows the same in bfloat16 too)
        model = target.model
        memory = widths.WidthMemory(models.cache_dir() / widths.FILE_NAME, {
            **widths.machine(str(model.device)), "target": str(model.config.name_or_path or cfg.target),
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": models.dtype_name(model),
            "threads": torch.get_num_threads(), "kernels": cfg.kernels, "batchspec": __version__,  # new kernels
            "attention": native.running(model)})  # a faster attention can move the width that pays
    econf = EngineConfig(mode=mode, k=cfg.k, batch_size=AUTO_WIDTHS[-1] if auto_width else cfg.batch_size,
                         auto_width=auto_width, window=cfg.window, width_memory=memory,
                         pad_id=pad_id, logprobs_mode=cfg.logprobs_mode)
    target_handle = ModelHandle(target.model, models.cache_kwarg(target.model))
    checker = StopStrings(tokenizer, cfg.stop)  # always: rows may bring their own stop strings
    guide = constraints.Guide(lambda: constraints.tokenizer_for(tokenizer, eos_ids),
                              target.model.get_output_embeddings().weight.shape[0])  # its tokenizer built on first use
    return Engine(target_handle, draft.handle if draft else None, eos_ids, econf, stop_checker=checker,
                  lookups=drafters.make(lookup_names), guide=guide)


MIXED_WITHOUT_KERNEL = ("--dtype mixed runs its products without batchspec's bfloat16 kernel here (it needs a CPU with "
                        "AVX512-BF16 and --kernels auto or packed): slower than float32, and its rows may depend on "
                        "the batch as float32's can")


def use_kernels(name: str, *loaded: models.LoadedModel | None, pending_bytes: int = 0,
                tuning: widths.MachineMemory | None = None) -> tuple[str, list[str]]:
    """Apply ``--kernels`` to the loaded models. Returns the kernels that run (stock or packed) and notes for the
    user (packed kernels that cannot apply, or that ``auto`` leaves out for want of memory; a mixed model left
    without its kernel). ``pending_bytes``: what packing a model loaded later (the draft) would add; ``auto`` counts
    it now. ``tuning``: packed models run packed from the rows measured faster on this machine (``tune_kernels``),
    else from the defaults."""
    running, notes = _apply_kernels(name, *loaded, pending_bytes=pending_bytes, tuning=tuning)
    if not all(native.on_kernel(m.model) for m in loaded if m is not None):
        notes = [*notes, MIXED_WITHOUT_KERNEL]
    return running, notes


def _apply_kernels(name: str, *loaded: models.LoadedModel | None, pending_bytes: int = 0,
                   tuning: widths.MachineMemory | None = None) -> tuple[str, list[str]]:
    if name == "stock":
        return "stock", []
    from ..models import kernels

    present = [m.model for m in loaded if m is not None]
    if not kernels.available():
        return "stock", [] if name == "auto" else ["--kernels packed needs a PyTorch build with oneDNN: "
                                                   "running the stock kernels"]
    native_dtypes = native.load().linear_dtypes if any(native.wants(m) for m in present) else ()
    extra = sum(kernels.packable_bytes(m, native_dtypes) for m in present)
    if extra == 0:  # a GPU, or another dtype than float32 and bfloat16
        return "stock", [] if name == "auto" else ["--kernels packed applies to float32 and bfloat16 models on a CPU: "
                                                   "running the stock kernels"]
    extra += pending_bytes
    free = kernels.memory_available()
    if name == "auto" and free is not None and PACKED_MEMORY_SHARE * free < extra:
        return "stock", [f"the packed CPU kernels would take {extra / 2**20:.0f} MiB more memory, and "
                         f"{free / 2**20:.0f} MiB is available: running the stock kernels (--kernels packed "
                         f"forces them)"]
    kernels.bound_caches()  # before the first oneDNN operation (the packing), or it cannot apply
    kernels.keep_freed_memory()
    for model in present:
        kernels.prepack(model)
    if tuning is not None:
        for model in loaded:
            if model is not None:
                tune_kernels(model, tuning)
    notes = attach_attention(present)
    if tuning is not None:
        for model in loaded:
            if model is not None:
                tune_native(model, tuning)
    return "packed", notes


def attach_attention(present: list) -> list[str]:
    """Give the packed CPU models batchspec's attention and layer kernels (``native``); a note for the user the first
    time in a process when they were built now (once per machine) or cannot be."""
    wanted = [model for model in present if native.wants(model)]
    if not wanted:
        return []
    built = native.load()
    for model in wanted:
        native.attach(model)
    return built.news()


def kernel_memory(target: models.LoadedModel) -> widths.MachineMemory:
    """Where the rows from which a model's linears run packed are remembered: by this machine, its threads and the
    versions whose kernels were timed."""
    return widths.MachineMemory(models.cache_dir() / widths.FILE_NAME, {
        **widths.machine(str(target.model.device)), "threads": torch.get_num_threads(), "batchspec": __version__,
        "torch": torch.__version__})


def tune_kernels(loaded: models.LoadedModel, memory: widths.MachineMemory) -> int:
    """Run ``loaded``'s packed linears packed from the rows measured faster than the stock kernel on this machine
    (``kernels.measure_min_rows``), measured once per machine and model and remembered in ``memory``, so that an
    input size takes the same kernel run after run. Returns those rows."""
    from ..models import kernels

    model = loaded.model
    job = {"packed rows of": str(model.config.name_or_path or loaded.name), "dtype": models.dtype_name(model),
           "parameters": sum(p.numel() for p in model.parameters())}
    entry = memory.get(job)
    rows = entry.get("min_rows") if isinstance(entry, dict) else None
    if not (isinstance(rows, int) and 1 <= rows <= kernels.ROWS_TIMED[-1] + 1):
        rows, timings = kernels.measure_min_rows(model)
        memory.put(job, {"min_rows": rows, "ms": timings})
    kernels.set_min_rows(model, rows)
    return rows


def tune_native(loaded: models.LoadedModel, memory: widths.MachineMemory) -> tuple[int, int]:
    """Run ``loaded``'s linears on batchspec's kernel over the rows where this machine measured it no slower than the
    kernels that ran them before (``kernels.measure_native_rows``: a CPU with AMX tiles takes wide bfloat16 products
    back, MKL may keep one row), measured once per machine and model and remembered in ``memory``. Returns those rows,
    (first, last) ((0, 0): the kernels they had run them all, or no kernel applies)."""
    from ..models import kernels

    model = loaded.model
    built = native.load()
    layers = native.packed_linears(model)
    if not any(kernels.nativeable(layer, built.linear_dtypes) for layer in layers):
        return 0, 0
    job = {"native rows of": str(model.config.name_or_path or loaded.name), "dtype": models.dtype_name(model),
           "parameters": sum(p.numel() for p in model.parameters()), "kernels": built.key,
           "repeats": kernels.NATIVE_REPEATS}  # a span measured with fewer attempts is measured again
    entry = memory.get(job)
    span = entry.get("native_rows") if isinstance(entry, dict) else None
    if not _native_span(span):
        span, timings = kernels.measure_native_rows(layers, built.ops, repeats=kernels.NATIVE_REPEATS,
                                                    dtypes=built.linear_dtypes)
        memory.put(job, {"native_rows": list(span), "ms": timings})
    first, last = span
    native.use_native_rows(model, last, first)
    return first, last


def _native_span(span) -> bool:
    """Whether a remembered ``native_rows`` is one ``kernels.native_rows_from`` gives: [first, last] of timed sizes."""
    from ..models import kernels

    sizes = (0, *kernels.NATIVE_ROWS_TIMED)
    return (isinstance(span, list) and len(span) == 2 and all(isinstance(rows, int) for rows in span)
            and span[0] in sizes and (span[1] in sizes or span[1] == kernels.EVERY_ROWS)
            and (span[0] == 0) == (span[1] == 0) and span[0] <= span[1])
