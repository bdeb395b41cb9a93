"""The composition root: the draft model loads when the engine first uses it, and never for a job that does not.

Whole jobs through ``Generation``, their completions against a plain ``--mode ar`` job's (itself checked against
per-prompt ``generate`` in the CLI tests)."""

from __future__ import annotations

import json

import pytest

from batchspec_cli.config import GenerateConfig, UsageError
from batchspec_cli.engine.events import RowResult, StepStats
from batchspec_cli.job.generation import Generation
from batchspec_cli.models import loading as models


def run(tmp_path, name: str, target, draft, mode: str) -> tuple[dict[int, list[int]], Generation, list[StepStats]]:
    inp = tmp_path / "in.jsonl"
    if not inp.exists():
        inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a b c", "d e", "f g h i", "j")))
    cfg = GenerateConfig(input=inp, output=tmp_path / f"{name}.parquet", target=str(target),
                         draft=None if draft is None else str(draft), mode=mode, batch_size=2, max_new_tokens=5,
                         dtype="float64", quiet=True)
    with Generation.open(cfg) as job:
        events = list(job.events())
        job.finish()
    rows = {e.row: e.token_ids for e in events if isinstance(e, RowResult)}
    return rows, job, [e for e in events if isinstance(e, StepStats)]


def test_auto_that_never_speculates_never_loads_the_draft(tmp_path, tiny_model_dir, tiny_draft_dir):
    """A job too short for a trial (auto runs plain steps throughout) reads no draft weights; eqspec loads the
    draft at its first admission. Both write ar's completions."""
    plain, _, _ = run(tmp_path, "ar", tiny_model_dir, None, "ar")
    auto, job, steps = run(tmp_path, "auto", tiny_model_dir, tiny_draft_dir, "auto")
    assert job.assembly.draft is not None and job.assembly.draft.loaded is None
    assert job.assembly.engine.draft.loaded is None and not any(s.k for s in steps if s.group_kind != "prefill")
    eqspec, job, steps = run(tmp_path, "eqspec", tiny_model_dir, tiny_draft_dir, "eqspec")
    assert job.assembly.draft.loaded is not None and any(s.k for s in steps)
    assert auto == plain and eqspec == plain


def test_a_draft_that_does_not_fit_is_refused_before_the_job_starts(tmp_path, tiny_model_dir):
    """The draft is vetted when the job opens (not when it first loads, mid-run): a draft whose config transformers
    cannot read is refused with a one-line error, and nothing is written."""
    bad = tmp_path / "bad_draft"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    target = models.load_model(str(tiny_model_dir), "float64", quiet=True)
    with pytest.raises(models.ModelError, match="cannot read the config"):
        models.check_draft(str(bad), target, quiet=True)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "a b"}\n')
    cfg = GenerateConfig(input=inp, output=tmp_path / "out.parquet", target=str(tiny_model_dir),
                         draft=str(tiny_model_dir) + "," + "suffix", mode="auto", quiet=True)
    with Generation.open(cfg) as job:  # a draft that fits opens
        assert job.assembly.draft.loaded is None
    with pytest.raises((UsageError, models.ModelError)):
        Generation.open(GenerateConfig(input=inp, output=tmp_path / "out2.parquet", target=str(tiny_model_dir),
                                       draft=str(bad), quiet=True))
    assert not (tmp_path / "out2.parquet").exists()


def test_a_models_facts_read_without_weights_are_the_loaded_models(tiny_model_dir, tiny_draft_dir):
    """What a plan (and a Ray driver) knows of a model without its weights agrees with the loaded model: the EOS
    ids the engine stops on, the vocabulary its embeddings take, the context and the names the files record."""
    for folder in (tiny_model_dir, tiny_draft_dir):
        facts = models.describe(str(folder), quiet=True)
        loaded = models.load_model(str(folder), "float64", quiet=True)
        assert facts.eos_ids == models.eos_ids(loaded.model, loaded.tokenizer)
        assert facts.vocab_size == loaded.model.get_input_embeddings().num_embeddings
        assert facts.context == loaded.model.config.max_position_embeddings
        assert (facts.name, facts.source) == (loaded.name, loaded.source)
