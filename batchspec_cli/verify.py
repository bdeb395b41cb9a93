"""Audit a finished run: re-decode rows one at a time with plain decoding.

The reference is Hugging Face ``generate(do_sample=False)`` on one prompt, batch 1, no
padding — no engine code. Greedy rows take the argmax of the logits; sampled rows the
argmax of the warped log-probabilities plus the row's keyed Gumbel noise (a logits
processor over ``sampling``'s pure functions: the same noise any run of that row drew,
whatever its mode, draft, k or batch). A constrained row (``constraints.py``) is decoded under
its mask, taken from a fresh llguidance matcher fed the tokens generated so far. For each mismatch we report the first differing
position and, there, the reference's score for its own token minus its score for the
token the run chose (the *margin*). A margin within the tolerance is a float near-tie
(docs/design.md, "What is guaranteed"); anything else is *unexplained*.

The tolerance is stated in the dtype's own units (``unit``): one unit in the last place of the
model's dtype at the magnitude of the two scores compared (bfloat16 at a logit of 20: 0.125;
float32: 1.9e-6). A margin within ``units`` such units (default ``DEFAULT_UNITS``), or under the
absolute ``tolerance`` (default 1e-3, the float32 audit as before), is a near-tie.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import DEFAULT
from .engine import sampling
from .errors import InputError
from .io.cells import DEFAULT_PROMPT_COLUMN, BadPrompt, parse_prompt, prompt_column_in
from .io.jsonl import JSONL_SUFFIXES
from .io.prompts import render_prompt
from .io.row_settings import OVERRIDES, row_value
from .models import loading as models
from .models.kernels import free_memory, is_mixed
from .store.outputs import read_completions, read_run_metadata

DEFAULT_TOLERANCE = 1e-3  # an absolute margin that is always a near-tie (the float32 audit's floor)
DEFAULT_UNITS = 4.0  # a margin within this many units of the dtype's rounding is a near-tie (docs/design.md)


def unit(dtype: torch.dtype, magnitude: float) -> float:
    """One unit in the last place of ``dtype`` at ``magnitude``: the spacing of the numbers it can hold there."""
    info = torch.finfo(dtype)  # eps: the spacing just above 1, 2 ** -(stored mantissa bits)
    return 2.0 ** math.floor(math.log2(max(abs(magnitude), info.tiny))) * info.eps


@dataclass
class Mismatch:
    row: int
    id: str
    position: int  # first differing completion position
    run_token: int | None  # None: the run stopped here
    reference_token: int | None  # None: the reference stopped here
    margin: float | None  # reference logit(own) - logit(run's token); None when not defined
    near_tie: bool
    units: float | None = None  # the margin in units of the model's dtype at the scores' magnitude (``unit``)
    float64_margin: float | None = None  # the same margin in float64 (``Float64.margin``), where it was re-checked


@dataclass
class VerifyReport:
    checked: int
    exact: int
    skipped: int  # error rows
    tolerance: float
    units: float = DEFAULT_UNITS
    dtype: str = "float32"
    ruler: str = ""  # the dtype whose units the margins are in, where it is not ``dtype`` (a mixed run: bfloat16)
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def unexplained(self) -> list[Mismatch]:
        return [m for m in self.mismatches if not m.near_tie]

    @property
    def exact_rate(self) -> float:
        return self.exact / self.checked if self.checked else 1.0


def _model_spec(meta: dict, key: str) -> str | None:
    name, source = meta.get(key), meta.get(f"{key}_source")
    if name is None or str(name).startswith("default:"):
        return None
    if source and Path(source).exists():
        return source
    return name


SAMPLE_SEED = 0  # which rows --sample picks, by default


def verify_run(path: Path, sample: int | None = None, tolerance: float = DEFAULT_TOLERANCE, seed: int = SAMPLE_SEED,
               device: str = DEFAULT.device, dtype: str | None = None, progress=None,
               units: float = DEFAULT_UNITS) -> VerifyReport:
    """Re-decode ``sample`` rows (all when None) of the completions file at ``path``, in the dtype the run used
    (its metadata), unless ``dtype`` says otherwise."""
    if Path(path).suffix.lower() in JSONL_SUFFIXES:
        raise InputError(f"{path}: JSON lines; `verify` checks the Parquet completions file `generate` writes "
                         f"(an OpenAI Batch output holds no token ids: to verify a run, write OUT as .parquet)")
    meta = read_run_metadata(path)
    table = read_completions(path)
    missing = [c for c in ("id", "completion_token_ids", "finish_reason") if c not in table.column_names]
    if missing:
        raise InputError(f"{path}: not a batchspec completions file (no column {', '.join(map(repr, missing))}"
                         f"{'; it looks like a statistics file' if 'group_kind' in table.column_names else ''})")
    settings = RunSettings(meta, table)
    loaded = models.load_model(_model_spec(meta, "target"), dtype or settings.run("dtype"), device, quiet=True)
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = list(meta.get("eos_token_ids") or models.eos_ids(model, tokenizer))
    rows = table.to_pylist()
    candidates = [i for i, r in enumerate(rows) if r["finish_reason"] != "error"]
    skipped = len(rows) - len(candidates)
    if sample is not None and sample < len(candidates):
        candidates = sorted(random.Random(seed).sample(candidates, sample))
    prompt_column = prompt_column_in(table.column_names, settings.run("prompt_column") or DEFAULT_PROMPT_COLUMN)
    if prompt_column not in table.column_names:
        raise InputError(f"{path}: prompt column {prompt_column!r} is not in the file")
    report = VerifyReport(checked=0, exact=0, skipped=skipped, tolerance=tolerance, units=units,
                          dtype=models.dtype_name(model))
    # a mixed run's products round their inputs to bfloat16: a difference of one rounding there is bfloat16's unit
    ruler = torch.bfloat16 if is_mixed(model) else model.dtype
    report.ruler = str(ruler).removeprefix("torch.")
    exact = Float64(model)
    for i in candidates:
        r = rows[i]
        try:
            prompt = parse_prompt(r[prompt_column], prompt_column)
        except BadPrompt as exc:
            raise InputError(f"{path}: row {i + 1}: {exc}") from None
        prompt_ids = render_prompt(tokenizer, prompt, bool(settings.run("chat")), settings.run("system"),
                                   bool(settings.run("allow_special_tokens")))
        run = list(r["completion_token_ids"])
        noise = _noise_for(settings, i, r, len(prompt_ids), model.device)
        mask = _mask_for(meta, r, tokenizer, eos, model.config.vocab_size, len(prompt_ids))
        ref, scores, logits = _decode(model, prompt_ids, int(settings.value("max_new_tokens", i)), eos, noise, mask)
        report.checked += 1
        sampled = (logits, noise.temperature) if noise is not None else None
        mismatch = _compare(i, r["id"], run, ref, scores, r["finish_reason"], tolerance, units, ruler, sampled)
        if mismatch is not None and mask is None:
            recheck(mismatch, exact, prompt_ids, ref, tolerance, units, ruler, sampled)
        if mismatch is None:
            report.exact += 1
        else:
            report.mismatches.append(mismatch)
        if progress is not None:
            progress()
    return report


class RunSettings:
    """The run's sampling settings as its metadata records them (a setting it does not record: the default every
    command shares, ``config.DEFAULT``) and the per-row columns it read them from (``row_settings.row_value``)."""

    def __init__(self, meta: dict, table):
        self.meta = meta
        self.columns = {name: table.column(meta[attr]).to_pylist() for name, (attr, *_) in OVERRIDES.items()
                        if meta.get(attr) and meta[attr] in table.column_names}  # name -> [rows] value or None

    def run(self, name: str):
        """The run's value of a setting."""
        value = self.meta.get(name)
        return getattr(DEFAULT, name) if value is None else value

    def value(self, name: str, row: int):
        """A setting's value for one row: its per-row column's when it has one, else the run's."""
        return row_value(self.columns.get(name), row, self.run(name))


class KeyedGumbel:
    """A logits processor: warped log-probabilities plus the row's keyed Gumbel noise at each position."""

    def __init__(self, key: int, prompt_len: int, temperature: float, top_k: int, top_p: float, device):
        self.prompt_len, self.temperature = prompt_len, temperature
        self.key = torch.tensor([key], dtype=torch.long, device=device)
        self.settings = (torch.tensor([temperature], dtype=torch.float64), torch.tensor([top_k]),
                         torch.tensor([top_p], dtype=torch.float64))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # input_ids: [1, prompt + generated]; scores: [1, V]
        position = torch.tensor([[input_ids.shape[1] - self.prompt_len]], device=scores.device)
        probs = sampling.warp_probs(scores[:, None], *self.settings)[:, 0]  # [1, V] float64
        vocab = torch.arange(scores.shape[-1], device=scores.device)
        return probs.log() + sampling.gumbel(sampling.noise_base(self.key, position)[..., None], vocab)[:, 0]


def _noise_for(settings: RunSettings, i: int, row: dict, prompt_len: int, device) -> KeyedGumbel | None:
    temperature = float(settings.value("temperature", i))
    if temperature <= 0:
        return None
    seed = int(settings.value("seed", i))
    meta = settings.meta
    sample = int(row[meta["sample_column"]]) if meta.get("sample_column") else 0  # --n: the row's sample number
    return KeyedGumbel(sampling.row_key(seed, str(row["id"]), sample), prompt_len, temperature,
                       int(settings.value("top_k", i)), float(settings.value("top_p", i)), device)


class GrammarMask:
    """A logits processor: the row's constraint, from a fresh llguidance matcher fed the tokens generated so far
    (refused tokens, and ids past the tokenizer's vocabulary, at -inf; EOS only where the grammar accepts)."""

    def __init__(self, constraint, llg_tokenizer, vocab: int, prompt_len: int):
        from llguidance import LLMatcher
        from llguidance.torch import allocate_token_bitmask

        self.matcher = LLMatcher(llg_tokenizer, constraint.grammar(), log_level=0)
        self.bitmask = allocate_token_bitmask(1, llg_tokenizer.vocab_size)
        self.vocab, self.words, self.prompt_len = vocab, llg_tokenizer.vocab_size, prompt_len
        self.fed = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from llguidance.torch import fill_next_token_bitmask

        generated = input_ids[0, self.prompt_len :].tolist()
        self.matcher.consume_tokens(generated[self.fed :])
        self.fed = len(generated)
        fill_next_token_bitmask(self.matcher, self.bitmask)
        bits = (self.bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
        n = min(self.words, scores.shape[-1])
        allowed[:n] = bits.reshape(-1)[:n].bool()
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))


def _mask_for(meta: dict, row: dict, tokenizer, eos: list[int], vocab: int, prompt_len: int) -> GrammarMask | None:
    """The row's constraint as the run had it: its response_format cell (``{"type": "text"}``: none), else the
    job's (the run's metadata)."""
    from .engine import constraints

    column, job = meta.get("response_format_column"), meta.get("constraint")
    own = constraints.from_response_format(row[column]) if column and row.get(column) is not None else None
    constraint = constraints.of_row(own, constraints.Constraint(job["kind"], job["text"]) if job else None)
    if constraint is None:
        return None
    key = (id(tokenizer), tuple(eos))
    if key not in _LLG_TOKENIZERS:  # about a second each: once per run verified
        _LLG_TOKENIZERS.clear()
        _LLG_TOKENIZERS[key] = constraints.tokenizer_for(tokenizer, eos)
    return GrammarMask(constraint, _LLG_TOKENIZERS[key], vocab, prompt_len)


_LLG_TOKENIZERS: dict = {}


@torch.no_grad()
def _decode(model, prompt_ids: list[int], max_new_tokens: int, eos: list[int],
            noise: KeyedGumbel | None, mask: GrammarMask | None = None
            ) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Plain decoding of one prompt: the argmax of the (masked) logits, or of the noised scores for a sampled row.
    Returns the tokens, the scores each was the argmax of, and the model's own logits at each step (none for a
    constrained greedy row: nothing reads them)."""
    from transformers import LogitsProcessorList

    input_ids = torch.tensor([prompt_ids], device=model.device)
    processors = [p for p in (mask, noise) if p is not None]
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0],
                         return_dict_in_generate=True, output_logits=noise is not None or not processors,
                         output_scores=bool(processors),
                         logits_processor=LogitsProcessorList(processors))
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    for j, t in enumerate(tokens):
        if t in eos:
            tokens = tokens[: j + 1]
            break
    raw = [step[0] for step in out.logits] if out.logits is not None else []  # a masked greedy row's: not kept
    return tokens, [step[0] for step in out.scores] if processors else raw, raw


LOW_PRECISION = (torch.bfloat16, torch.float16)  # a reference in these rounds as much as the run: re-checked


class Float64:
    """The model in float64, copied at the first difference that needs it; ``None`` margins where no copy fits."""

    def __init__(self, model):
        self.model, self.copy, self.failed = model, None, False

    @torch.no_grad()
    def margin(self, ids: list[int], ref_tok: int, run_tok: int) -> tuple[float, float] | None:
        """(the reference token's float64 logit minus the run token's, the larger of their magnitudes) after ``ids``."""
        if self.copy is None and not self.failed:
            need = 8 * sum(p.numel() for p in self.model.parameters())
            free = free_memory(next(self.model.parameters()).device)
            try:
                if free is None or need > free // 2:
                    raise torch.OutOfMemoryError
                self.copy = copy.deepcopy(self.model).to(torch.float64)
                models.plain_experts(self.copy)  # grouped-mm experts have no float64 kernel
            except (torch.OutOfMemoryError, RuntimeError):  # a CPU allocation that fails raises RuntimeError
                self.copy, self.failed = None, True
        if self.copy is None:
            return None
        try:
            logits = self.copy(input_ids=torch.tensor([ids], device=next(self.copy.parameters()).device)).logits[0, -1]
        except (torch.OutOfMemoryError, RuntimeError):  # an op without a float64 kernel: the audit stands as it was
            self.copy, self.failed = None, True
            return None
        own, other = float(logits[ref_tok]), float(logits[run_tok])
        return own - other, max(abs(own), abs(other))


def recheck(mismatch: Mismatch, exact: Float64, prompt_ids: list[int], ref: list[int], tolerance: float,
            units: float, dtype: torch.dtype, sampled: tuple[list[torch.Tensor], float] | None = None) -> None:
    """A difference beyond the units in a low-precision dtype, measured again in float64 at the same prefix: a
    near-tie when float64's margin is within the units (or the run's token is float64's own choice). The reference
    rounds as the run does, so its margin alone can exceed the units where the true one does not. A sampled row
    (``sampled``: its raw logits and temperature, as ``_compare`` takes them): its scores' margin with the two
    tokens' logit difference taken in float64 instead (the noise and the warping's shared shift are the same)."""
    m = mismatch
    if m.near_tie or dtype not in LOW_PRECISION or m.run_token is None or m.reference_token is None \
            or m.margin is None or not math.isfinite(m.margin):
        return
    found = exact.margin(prompt_ids + ref[: m.position], m.reference_token, m.run_token)
    if found is None:
        return
    margin, magnitude = found
    ruler = unit(dtype, magnitude)
    if sampled is not None:
        raw, temperature = sampled
        low = float(raw[m.position][m.reference_token]) - float(raw[m.position][m.run_token])
        margin = m.margin + (margin - low) / temperature
        ruler /= temperature
    m.float64_margin = margin
    m.near_tie = margin < tolerance or margin / ruler <= units


def _compare(row: int, row_id: str, run: list[int], ref: list[int], logits: list[torch.Tensor], finish_reason: str,
             tolerance: float, units: float = DEFAULT_UNITS, dtype: torch.dtype = torch.float32,
             sampled: tuple[list[torch.Tensor], float] | None = None) -> Mismatch | None:
    """The first difference between the run's tokens and the reference's, None where there is none. ``logits``: the
    scores the reference took each argmax of. ``sampled``: a sampled row's raw logits at each step and its
    temperature. Its scores are log-probabilities at logits / temperature plus the same Gumbel noise the run drew,
    so a difference between two tokens' scores carries the rounding of their logits divided by the temperature: the
    units are the dtype's at the logits' magnitude, over the temperature (not at the scores' own, often far smaller,
    magnitude)."""
    if finish_reason == "stop_string" and ref[: len(run)] == run:
        return None  # the run cut at a stop string; the reference does not know about stop strings
    if run == ref:
        return None
    j = next((j for j, (a, b) in enumerate(zip(run, ref)) if a != b), min(len(run), len(ref)))
    run_tok = run[j] if j < len(run) else None
    ref_tok = ref[j] if j < len(ref) else None
    margin = in_units = None
    if run_tok is not None and ref_tok is not None and j < len(logits):
        step = logits[j].double()
        own, other = float(step[ref_tok]), float(step[run_tok])
        margin = own - other  # inf where the run's token is outside the reference's top-k / top-p
        in_units = margin  # inf where the margin is
        if math.isfinite(margin):
            ruler = unit(dtype, max(abs(own), abs(other)))
            if sampled is not None:
                raw, temperature = sampled
                ruler = unit(dtype, max(abs(float(raw[j][ref_tok])), abs(float(raw[j][run_tok])))) / temperature
            in_units = margin / ruler
    near_tie = margin is not None and (margin < tolerance or in_units <= units)
    return Mismatch(row, row_id, j, run_tok, ref_tok, margin, near_tie=near_tie, units=in_units)
