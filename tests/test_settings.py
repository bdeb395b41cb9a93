"""Job settings are declared once, on GenerateConfig: the CLI, the fingerprint and the metadata follow from it."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from types import SimpleNamespace

import torch
import typer
from typer.testing import CliRunner

from batchspec_cli import config
from batchspec_cli.cli import app
from batchspec_cli.config import FINGERPRINT_LABELS, GenerateConfig, settings
from batchspec_cli.io.samples import Samples
from batchspec_cli.job.assembly import RunsOn
from batchspec_cli.job.generation import Generation
from batchspec_cli.job.plan import fingerprint
from batchspec_cli.job.writer import metadata


def generate_command_params() -> dict:
    command = typer.main.get_command(app).commands["generate"]
    return {p.name: p for p in command.params}


def test_generate_options_and_config_fields_correspond_one_to_one():
    params = generate_command_params()
    assert set(params) - {"log_json"} == {s.name for s in settings()}  # --log-json belongs to the CLI alone
    defaults = {f.name: f.default for f in dataclasses.fields(GenerateConfig)}
    for s in settings():
        param = params[s.name]
        if param.param_type_name == "argument":  # input, output
            assert defaults[s.field] is dataclasses.MISSING, s
            continue
        assert s.label.split("/")[0] in param.opts, (s, param.opts)  # what messages call it is the flag
        default = () if param.default is None and s.name == "stop" else param.default
        assert default == defaults[s.field], s


def test_every_command_takes_a_settings_default_from_its_one_home():
    """`bucket` and `verify` options that are `generate` settings default to GenerateConfig's value (config.DEFAULT),
    and share generate's flag; --min-rows is the batch size's default, verify's own defaults are verify.py's."""
    from batchspec_cli import verify

    commands = typer.main.get_command(app).commands
    by_setting = {s.name: s for s in settings()}
    defaults = {f.name: f.default for f in dataclasses.fields(GenerateConfig)}
    for name in ("bucket", "verify"):
        own = {"seed"} if name == "verify" else set()  # verify's --seed picks the sample: not the run's seed
        shared = [p for p in commands[name].params
                  if p.name in by_setting and p.name not in own and p.param_type_name == "option"]
        assert len(shared) >= (8 if name == "bucket" else 3), name
        for param in shared:
            setting = by_setting[param.name]
            assert param.default == defaults[setting.field], (name, param.name)
            assert setting.label.split("/")[0] in param.opts, (name, param.opts)
    bucket = {p.name: p for p in commands["bucket"].params}
    assert bucket["min_rows"].default == config.bucket_rows(config.DEFAULT) == 8  # --batch-size auto: 8-row buckets
    options = {p.name: p for p in commands["verify"].params}
    assert (options["tolerance"].default, options["seed"].default) == (verify.DEFAULT_TOLERANCE, verify.SAMPLE_SEED)


def test_a_bad_setting_gets_one_message_from_every_command(tmp_path):
    """The bucket-width and limit checks live in config.validate, for generate and bucket alike."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "a"}\n')
    for flag, value, message in (("--bucket-width", "0", "--bucket-width must be positive, got 0"),
                                 ("--limit", "0", "--limit must be a positive integer, got 0")):
        outputs = []
        for command in (["generate", str(inp), str(tmp_path / "o.parquet")], ["bucket", str(inp), str(tmp_path / "b")]):
            result = CliRunner().invoke(app, [*command, flag, value])
            assert result.exit_code == 2, result.output
            outputs.append(" ".join(result.output.split()))
        assert all(message in out for out in outputs), outputs
    assert not (tmp_path / "b").exists() and not (tmp_path / "o.parquet").exists()


def test_the_cli_builds_the_config_from_every_option(monkeypatch):
    seen = {}

    def refuse(cfg):
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(Generation, "open", staticmethod(refuse))
    args = ["generate", "in.jsonl", "out.parquet", "-k", "3", "--stop", "x", "--stop", "yz", "--no-chat",
            "--window", "7", "--top-p", "0.5", "--seed-column", "s", "--checkpoint-rows", "2", "--threads", "1"]
    result = CliRunner().invoke(app, args)
    assert "cfg" in seen, result.output
    cfg = seen["cfg"]
    assert (cfg.input, cfg.output, cfg.k, cfg.stop, cfg.chat, cfg.window, cfg.top_p, cfg.seed_column,
            cfg.checkpoint_rows, cfg.threads) == (Path("in.jsonl"), Path("out.parquet"), 3, ("x", "yz"), False, 7,
                                                  0.5, "s", 2, 1)
    assert cfg.mode == "auto" and cfg.max_new_tokens == 256 and cfg.batch_size == "auto"


OLD_LABELS = {
    "input": "the input's contents", "limit": "--limit", "target": "--target", "draft": "--draft",
    "mode": "--mode", "draft_tokens": "--draft-tokens", "max_new_tokens": "--max-new-tokens",
    "max_prompt_tokens": "--max-prompt-tokens", "temperature": "--temperature", "top_k": "--top-k",
    "top_p": "--top-p", "seed": "--seed", "temperature_column": "--temperature-column",
    "seed_column": "--seed-column", "max_new_tokens_column": "--max-new-tokens-column", "stop": "--stop",
    "chat": "--chat/--no-chat", "system": "--system", "prompt_column": "--prompt-column",
    "id_column": "--id-column", "dtype": "--dtype", "rows": "the number of input rows",
}


RECENT = {"input_format", "split", "config", "top_p_column", "stop_column", "logprobs", "logprobs_column",
          "logprobs_mode", "allow_special_tokens", "json_schema", "regex", "choice", "json",
          "response_format_column", "n", "n_column"}  # recent=True: newer than OLD_LABELS


def test_fingerprint_labels_are_unchanged_in_order():
    assert [(k, v) for k, v in FINGERPRINT_LABELS.items() if k not in RECENT] == list(OLD_LABELS.items())
    assert set(FINGERPRINT_LABELS) - set(OLD_LABELS) == RECENT
    assert {s.name for s in settings() if s.recent} == RECENT


def a_job(draft: bool) -> SimpleNamespace:
    """What fingerprint() and metadata() read of a job (its config and plan), with every setting away from its default."""
    cfg = GenerateConfig(input=Path("in.jsonl"), output=Path("out.parquet"), target="t", draft="d", mode="eqspec", k=3,
                         batch_size=4, window=None, max_new_tokens=9, max_prompt_tokens=99, prompt_column="p",
                         id_column="i", chat=False, system="sys", stop=("a", "b"), dtype="float64", device="cpu",
                         limit=5, temperature=0.7, top_k=4, top_p=0.9, seed=11, temperature_column="tc",
                         seed_column="sc", max_new_tokens_column="mc", threads=1, bucket_width=3)
    return SimpleNamespace(cfg=cfg, constraint=None, input_hash="sha256:00", total_rows=5, input_rows=5,
                           samples=Samples(5), mode="ar" if not draft else "eqspec",
                           target=SimpleNamespace(name="t", source="/nonexistent/t"), target_name="t",
                           draft=SimpleNamespace(name="d", source="/nonexistent/d") if draft else None,
                           draft_spec="d" if draft else None, draft_name="d" if draft else None,
                           draft_source="/nonexistent/d" if draft else None,
                           eos_ids=[1, 2], resumed_rows=2, lookup_names=["suffix"], wants_logprobs=False,
                           runs_on=RunsOn(kernels="packed", dtype="float64", device="cpu"))


def old_fingerprint(job) -> dict:
    """The fingerprint as it was written out field by field: old work directories hold this."""
    cfg = job.cfg
    sig = lambda m: {"name": m.name, "source": m.source, "files": {}}  # noqa: E731
    return {
        "input": job.input_hash, "rows": job.total_rows, "limit": cfg.limit, "target": sig(job.target),
        "draft": sig(job.draft) if job.draft else None,
        "mode": job.mode, "draft_tokens": cfg.k, "max_new_tokens": cfg.max_new_tokens,
        "max_prompt_tokens": cfg.max_prompt_tokens, "temperature": cfg.temperature, "top_k": cfg.top_k,
        "top_p": cfg.top_p, "seed": cfg.seed, "temperature_column": cfg.temperature_column,
        "seed_column": cfg.seed_column, "max_new_tokens_column": cfg.max_new_tokens_column,
        "stop": list(cfg.stop), "chat": cfg.chat, "system": cfg.system, "prompt_column": cfg.prompt_column,
        "id_column": cfg.id_column, "dtype": cfg.dtype,
    }


def old_metadata(job) -> dict:
    cfg = job.cfg
    return {
        "batchspec_version": "0.1.0", "torch_version": torch.__version__, "transformers_version": "x",
        "target": job.target_name, "target_source": job.target.source,
        "draft": job.draft.name if job.draft else None, "draft_source": job.draft.source if job.draft else None,
        "mode": job.mode, "draft_tokens": cfg.k, "batch_size": cfg.batch_size,
        "window": cfg.window or 4 * cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "temperature": cfg.temperature, "temperature_column": cfg.temperature_column,
        "seed_column": cfg.seed_column, "max_new_tokens_column": cfg.max_new_tokens_column, "top_k": cfg.top_k,
        "top_p": cfg.top_p, "seed": cfg.seed,
        "chat": cfg.chat, "system": cfg.system, "stop": list(cfg.stop), "prompt_column": cfg.prompt_column,
        "id_column": cfg.id_column, "dtype": "float64", "device": "cpu", "eos_token_ids": job.eos_ids,
        "input": str(cfg.input), "resumed_rows": job.resumed_rows,
    }


def test_fingerprint_and_metadata_keep_their_keys_and_values(monkeypatch):
    monkeypatch.setattr("batchspec_cli.job.writer._transformers_version", lambda: "x")
    monkeypatch.setattr("batchspec_cli.job.writer.__version__", "0.1.0")
    for draft in (True, False):
        job = a_job(draft)
        assert fingerprint(job.cfg, job) == old_fingerprint(job)  # an old work directory still resumes
        meta, old = metadata(job.cfg, job, job.runs_on), old_metadata(job)
        assert {key: meta[key] for key in old} == old  # the old keys keep their values
        # added with the model-free drafters, --kernels, then the inputs of issue 28
        assert set(meta) - set(old) == {"drafters", "kernels", "output_format", "dtype_reason", "attention"} | RECENT
        assert meta["drafters"] == (["model"] if draft else []) + ["suffix"] and meta["kernels"] == "packed"


def test_a_recent_setting_enters_the_fingerprint_only_away_from_its_default():
    job = a_job(False)
    assert not RECENT & set(fingerprint(job.cfg, job))  # an old work directory has none of them
    job.cfg.stop_column, job.cfg.split = "s", "test"
    record = fingerprint(job.cfg, job)
    assert record["stop_column"] == "s" and record["split"] == "test" and "top_p_column" not in record


def test_every_option_reaches_its_config_field(monkeypatch, tmp_path):
    """Each `generate` option, set away from its default, arrives in its own GenerateConfig field (the command
    names every field explicitly: a forgotten or crossed option would keep a default or land elsewhere)."""
    seen = {}

    def refuse(cfg):
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(Generation, "open", staticmethod(refuse))
    monkeypatch.setattr("batchspec_cli.distributed.ray_available", lambda: True)
    params = generate_command_params()
    args, expected = ["generate", "in.jsonl", "out.parquet"], {}
    hints = typing.get_type_hints(GenerateConfig)
    for n, s in enumerate(s for s in settings() if params[s.name].param_type_name == "option"):
        param = params[s.name]
        flag = max(param.opts, key=len)
        if param.is_flag:
            default = dataclasses.asdict(GenerateConfig(input=Path(), output=Path()))[s.field]
            args.append(flag if not default else param.secondary_opts[0])
            expected[s.field] = not default
            continue
        kind = str(hints[s.field])
        value = 10 + n if "int" in kind else 0.25 + n if "float" in kind else f"v{n}"
        args += [flag, str(value)]
        expected[s.field] = Path(value) if "Path" in kind else (value,) if s.name in ("stop", "choice") else value
    result = CliRunner().invoke(app, args)
    assert "cfg" in seen, result.output
    assert {field: getattr(seen["cfg"], field) for field in expected} == expected
