"""Constrained decoding (JSON schema, any JSON, regex, choice) against an independent per-prompt reference.

The reference (``constrained_reference``) decodes one prompt alone: a plain Hugging Face
forward over the growing sequence (batch 1, no padding), llguidance's mask from a fresh
matcher fed the completion so far, then the argmax (greedy) or the argmax of the warped
log-probabilities plus the row's keyed Gumbel noise (``sampling.noise_base``/``gumbel``: only
the noise is shared with the engine, the decoding loop is not). Every mode, batch size and
drafter must give exactly its tokens in float64.

The tokenizer is a real byte-level BPE (Hugging Face ``tokenizers``; llguidance reads it as it
reads SmolLM2's) with a few merges, so a forced text has more than one tokenization; the
model's vocabulary is wider than the tokenizer's (embedding padding the mask must refuse).
"""

from __future__ import annotations

import json
import math

import jsonschema
import llguidance
import pytest
import torch
from conftest import make_tiny_llama, perturbed_copy
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import DynamicCache, PreTrainedTokenizerFast

from batchspec_cli.engine import constraints, drafters
from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
from batchspec_cli.engine.events import Request, RowResult, Sampling
from batchspec_cli.engine.sampling import gumbel, noise_base, row_key
from batchspec_cli.models.loading import cache_kwarg
from batchspec_cli.policy.control import FixedK

EOS = 1
PADDED_VOCAB = 7  # model logits past the tokenizer's vocabulary
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "level"],
          "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"},
                         "level": {"enum": ["low", "high"]}},
          "x-guidance": {"whitespace_flexible": False}}
REGEX = r"[a-z]{1,4}@[a-z]{2,3}\.(com|org)"
CHOICES = ["yes", "no", "maybe not"]
PROMPTS = ["Give me JSON:", "ab", "The answer", "x = {", "Hello there, friend", "Q: 3", "name?", "zz top",
           "{\"a\":", "Extract the fields", "", "-", "OK then", "Why?", "say", "Tell me a story about"]


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("{", '"'), ('"', ":"), ("Ġ", '"'), ('"', ","), ('"', "}"), ("t", "r"), ("tr", "u"), ("o", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


TOKENIZER = make_byte_tokenizer()
LLT = constraints.tokenizer_for(TOKENIZER, [EOS])
JOB_CONSTRAINTS = {"schema": constraints.json_schema(SCHEMA), "json": constraints.any_json(),
                   "regex": constraints.regex(REGEX), "choice": constraints.choice(CHOICES)}


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(len(TOKENIZER) + PADDED_VOCAB, seed=5)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, 0.02, seed=1)


def prompt_ids(i: int) -> list[int]:
    return [2] + TOKENIZER.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)


@torch.no_grad()
def constrained_reference(model, prompt: list[int], constraint, max_new: int, sampling: Sampling = Sampling(),
                          row_id: str = "") -> list[int]:
    """One prompt alone: plain forward, a fresh matcher's mask, argmax (+ the row's keyed noise)."""
    matcher = llguidance.LLMatcher(LLT, constraint.grammar())
    assert not matcher.is_error(), matcher.get_error()
    bitmask = allocate_token_bitmask(1, LLT.vocab_size)
    cache, inputs, out = DynamicCache(), torch.tensor([prompt]), []
    vocab = model.config.vocab_size
    for position in range(max_new):
        logits = model(input_ids=inputs, use_cache=True, **{cache_kwarg(model): cache}).logits[0, -1].to(torch.float64)  # [V]
        fill_next_token_bitmask(matcher, bitmask)
        allowed = torch.tensor([v < LLT.vocab_size and bool((int(bitmask[0, v // 32]) >> (v % 32)) & 1)
                                for v in range(vocab)])
        masked = logits.masked_fill(~allowed, float("-inf"))
        if sampling.greedy:
            token = int(masked.argmax())
        else:
            logp = torch.softmax(masked / sampling.temperature, -1).log()
            base = noise_base(torch.tensor([row_key(sampling.seed, row_id)]), torch.tensor([[position]]))[0, 0]
            token = int((logp + gumbel(base, torch.arange(vocab))).argmax())
        out.append(token)
        if token == EOS:
            break
        assert matcher.consume_token(token)
        inputs = torch.tensor([[token]])
    return out


def run(target, prompts, constraint_of, mode="ar", batch=4, k=3, draft=None, lookups=(), max_new=40,
        sampling=Sampling(), policy=None) -> dict[int, RowResult]:
    cfg = EngineConfig(mode=mode, k=k, batch_size=batch, pad_id=0)
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache") if draft is not None else None, [EOS],
                    cfg, lookups=drafters.make(list(lookups)), policy=policy,
                    guide=constraints.Guide(lambda: LLT, target.config.vocab_size))
    requests = [Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=max_new, sampling=sampling,
                        constraint=constraint_of(i)) for i, p in enumerate(prompts)]
    results = {e.row: e for e in engine.run(requests) if isinstance(e, RowResult)}
    assert sorted(results) == list(range(len(prompts)))
    assert not engine.guide.matchers, "every row's matcher is dropped when it ends"
    return results


def cycle(i: int):
    return list(JOB_CONSTRAINTS.values())[i % len(JOB_CONSTRAINTS)]


@pytest.fixture(scope="module")
def references(target):
    return {i: constrained_reference(target, prompt_ids(i), cycle(i), 40) for i in range(16)}


def text(tokens: list[int]) -> str:
    return TOKENIZER.decode([t for t in tokens if t != EOS])


def test_reference_rows_have_their_shape(references, target):
    """The reference itself: finished rows match their constraint, and the unconstrained model would not."""
    plain = {i: constrained_reference(target, prompt_ids(i), constraints.regex(r"(.|\n)*"), 12) for i in range(4)}
    assert any(not text(p).startswith("{") for p in plain.values())
    for i, tokens in references.items():
        if tokens[-1] != EOS:
            continue
        kind, answer = cycle(i).kind, text(tokens)
        if kind == "json_schema":
            jsonschema.validate(json.loads(answer), SCHEMA)
        elif kind == "json":
            assert isinstance(json.loads(answer), dict)
        elif kind == "choice":
            assert answer in CHOICES
    assert sum(t[-1] == EOS for t in references.values()) >= 10


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_ar_equals_reference(target, references, batch):
    results = run(target, [prompt_ids(i) for i in range(16)], cycle, mode="ar", batch=batch)
    for i, r in results.items():
        assert r.token_ids == references[i], (i, cycle(i).kind)
        assert r.finish_reason == ("stop" if references[i][-1] == EOS else "length")


@pytest.mark.parametrize("mode,batch,k,source", [
    ("eqspec", 4, 3, "model"), ("exspec", 3, 2, "model"), ("exspec", 16, 4, "ngram"), ("eqspec", 1, 5, "grammar"),
    ("exspec", 6, 4, "grammar,suffix"), ("auto", 2, 3, "model,grammar"), ("auto", 8, 5, "grammar")])
def test_speculation_equals_reference(target, draft, references, mode, batch, k, source):
    names = source.split(",")
    policy = FixedK(k) if mode == "auto" else None  # auto's grouping, speculating every round
    results = run(target, [prompt_ids(i) for i in range(16)], cycle, mode=mode, batch=batch, k=k,
                  draft=draft if "model" in names else None, lookups=[n for n in names if n != "model"],
                  policy=policy)
    for i, r in results.items():
        assert r.token_ids == references[i], (i, cycle(i).kind)
    drafted = sum(r.drafted_tokens for r in results.values())
    # a constrained row takes no draft model's drafts (they stay on the device: Engine._constrain)
    assert drafted == 0 if names == ["model"] else drafted > 0


@pytest.mark.parametrize("batch", [1, 8])
def test_auto_takes_forced_runs_while_plain_and_equals_reference(target, draft, references, batch):
    """``auto`` itself (its arms, its PLAIN first): PLAIN verifies the grammar's forced runs where they pay, and
    every row is still the per-prompt constrained decode."""
    results = run(target, [prompt_ids(i) for i in range(16)], cycle, mode="auto", batch=batch, k=4, draft=draft,
                  lookups=["grammar", "suffix"])
    for i, r in results.items():
        assert r.token_ids == references[i], (i, cycle(i).kind)
    assert sum(r.accepted_tokens for r in results.values()) > 0


def test_grammar_drafts_are_accepted(target, references):
    """On a character-unambiguous grammar (a choice between words with no shared merges) forced drafts are the
    target's own choice: every one is accepted, and the rows are those of plain decoding."""
    choice = constraints.choice(["alpha beta gamma", "zeta"])
    prompts = [prompt_ids(i) for i in range(6)]
    results = run(target, prompts, lambda i: choice, mode="exspec", batch=3, k=4, lookups=["grammar"])
    plain = run(target, prompts, lambda i: choice, mode="ar", batch=3)
    assert {i: r.token_ids for i, r in results.items()} == {i: r.token_ids for i, r in plain.items()}
    for r in results.values():  # after the first letter everything is forced: drafts and bonus tokens
        assert r.accepted_tokens == r.drafted_tokens > 0
        assert r.rounds <= 2 + (len(r.token_ids) - 2) // 5


def test_sampled_rows_identical_across_modes(target, draft):
    sampling = Sampling(temperature=0.8, seed=11)
    prompts = [prompt_ids(i) for i in range(8)]
    reference = {i: constrained_reference(target, p, cycle(i), 30, sampling, f"r{i}") for i, p in enumerate(prompts)}
    for mode, batch, k, names in [("ar", 1, 0, []), ("exspec", 4, 3, ["model"]), ("eqspec", 8, 2, ["grammar"]),
                                  ("auto", 3, 4, ["model", "grammar"])]:
        results = run(target, prompts, cycle, mode=mode, batch=batch, k=max(k, 1), max_new=30, sampling=sampling,
                      draft=draft if "model" in names else None, lookups=[n for n in names if n != "model"],
                      policy=FixedK(k) if mode == "auto" else None)
        assert {i: r.token_ids for i, r in results.items()} == reference, mode


def test_unconstrained_rows_alongside(target, draft):
    """Constrained and free rows in one batch: the free rows are what they are without any constraint."""
    prompts = [prompt_ids(i) for i in range(6)]
    free = run(target, prompts, lambda i: None, mode="exspec", batch=6, k=3, draft=draft)
    mixed = run(target, prompts, lambda i: None if i % 2 else cycle(i), mode="exspec", batch=6, k=3, draft=draft)
    for i in range(1, 6, 2):
        assert mixed[i].token_ids == free[i].token_ids
    # the model drafts for the free rows of a mixed group; the constrained rows take none of its drafts
    assert sum(mixed[i].drafted_tokens for i in range(1, 6, 2)) > 0
    assert all(mixed[i].drafted_tokens == 0 for i in range(0, 6, 2))
    assert any(t >= len(TOKENIZER) for r in free.values() for t in r.token_ids), "padding ids occur unmasked"
    for i in range(0, 6, 2):
        assert mixed[i].token_ids == constrained_reference(target, prompts[i], cycle(i), 40)


def test_max_new_tokens_mid_structure_is_length(target):
    results = run(target, [prompt_ids(0)], lambda i: JOB_CONSTRAINTS["schema"], max_new=4)
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 4


def test_bad_constraints():
    assert "unclosed group" in constraints.problem(constraints.regex("a(b"))
    assert "objectx" in constraints.problem(constraints.json_schema({"type": "objectx"}))
    assert constraints.problem(constraints.json_schema(SCHEMA)) is None
    with pytest.raises(constraints.ConstraintError):
        constraints.json_schema("{not json")
    assert constraints.from_response_format({"type": "text"}) == constraints.TEXT  # none, not even the job's
    assert constraints.from_response_format({"type": "json_object"}) == constraints.any_json()
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}}
    assert constraints.from_response_format(json.dumps(wrapped)) == constraints.json_schema(SCHEMA)
    assert constraints.from_response_format(SCHEMA) == constraints.json_schema(SCHEMA)


def test_bad_row_constraint_is_an_error_row(target):
    bad = constraints.json_schema({"type": "objectx"})
    results = run(target, [prompt_ids(i) for i in range(3)], lambda i: bad if i == 1 else cycle(i), mode="ar")
    assert results[1].finish_reason == "error" and "objectx" in results[1].error
    assert results[0].token_ids == constrained_reference(target, prompt_ids(0), cycle(0), 40)


# ---------------------------------------------------------------------------- the CLI, end to end

CLI_PROMPTS = ["Give me JSON:", "ab", "The answer", "x = {", "Hello there, friend", "Q: 3"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured_model")
    make_tiny_llama(len(TOKENIZER) + PADDED_VOCAB, seed=5, dtype=torch.float32).save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return path


def cli(model_dir, inp, out, *extra):
    from typer.testing import CliRunner

    from batchspec_cli.cli import app

    args = ["generate", inp, out, "--target", model_dir, "--no-chat", "--max-new-tokens", "40", "--quiet",
            "--dtype", "float64", "--batch-size", "3", *extra]
    return CliRunner().invoke(app, [str(a) for a in args])


def completions(path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_constraint_flags(model_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(CLI_PROMPTS)])
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    checks = {
        "schema": (["--json-schema", schema], lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
        "regex": (["--regex", REGEX], lambda t: __import__("re").fullmatch(REGEX, t)),
        "choice": ([a for c in CHOICES for a in ("--choice", c)], lambda t: t in CHOICES),
        "json": (["--json"], lambda t: isinstance(json.loads(t), dict)),
    }
    for name, (flags, valid) in checks.items():
        rows = {}
        for mode, drafter in (("ar", []), ("auto", ["--draft", "grammar,ngram"]), ("exspec", ["--draft", "grammar"])):
            out = tmp_path / f"{name}-{mode}.parquet"
            result = cli(model_dir, inp, out, "--mode", mode, *drafter, *flags)
            assert result.exit_code == 0, result.output
            rows[mode] = completions(out)
        assert [r["completion"] for r in rows["auto"]] == [r["completion"] for r in rows["ar"]], name
        assert [r["completion"] for r in rows["exspec"]] == [r["completion"] for r in rows["ar"]], name
        finished = [r for r in rows["ar"] if r["finish_reason"] == "stop"]
        assert len(finished) >= (0 if name == "json" else 3), name  # a random model rarely closes a free object
        assert all(r["completion"].startswith("{") for r in rows["ar"]) or name not in ("json", "schema")
        assert all(valid(r["completion"]) for r in finished), name
        assert all(r["finish_reason"] == "length" for r in rows["ar"] if r not in finished)


def test_cli_bad_job_constraint_exits_2(model_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "objectx"}')
    for flags, words in ((["--json-schema", schema], "objectx"), (["--regex", "a(b"], "unclosed group"),
                         (["--json", "--regex", "a"], "exclusive")):
        result = cli(model_dir, inp, tmp_path / "out.parquet", *flags)
        assert result.exit_code == 2 and words in result.output, result.output
        assert not (tmp_path / "out.parquet").exists()


def test_cli_response_format_column_and_openai_batch(model_dir, tmp_path):
    wrapped = {"type": "json_schema", "json_schema": {"name": "rec", "strict": True, "schema": SCHEMA}}
    formats = [json.dumps(wrapped), json.dumps(SCHEMA), json.dumps({"type": "json_object"}), None,
               json.dumps({"type": "objectx"}), json.dumps({"type": "json_schema", "json_schema": {"name": "x",
                                                                                              "strict": False,
                                                                                              "schema": SCHEMA}})]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": p, "rf": f}
                                              for i, (p, f) in enumerate(zip(CLI_PROMPTS, formats))])
    out = tmp_path / "out.parquet"
    result = cli(model_dir, inp, out, "--response-format-column", "rf", "--regex", "[a-c]{2,6}")
    assert result.exit_code == 3, result.output  # one error row
    rows = completions(out)
    assert rows[4]["finish_reason"] == "error" and "objectx" in rows[4]["error"]
    for i in (0, 1, 5):
        if rows[i]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(rows[i]["completion"]), SCHEMA)
    assert __import__("re").fullmatch("[a-c]{2,6}", rows[3]["completion"])

    # The same requests as an OpenAI Batch file (completions endpoint: the raw prompt, as --no-chat).
    lines = []
    for i, (p, f) in enumerate(zip(CLI_PROMPTS, formats)):
        body = {"model": "m", "prompt": p, "max_tokens": 40}
        if f is not None:
            body["response_format"] = json.loads(f) if i != 1 else {"type": "json_schema",
                                                                      "json_schema": {"schema": SCHEMA}}
        lines.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": body})
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    answer = tmp_path / "answer.jsonl"
    result = cli(model_dir, batch, answer, "--regex", "[a-c]{2,6}")
    assert result.exit_code == 3, result.output
    answers = [json.loads(line) for line in answer.read_text().splitlines()]
    assert answers[4]["error"] is not None and "objectx" in answers[4]["error"]["message"]
    for i in (0, 1, 2, 3, 5):
        assert answers[i]["response"]["body"]["choices"][0]["text"] == rows[i]["completion"], i


@pytest.mark.parametrize("job_flag", ["--regex", "--json-schema"])
def test_a_row_asking_for_text_gets_no_constraint_and_a_missing_or_null_one_the_jobs(model_dir, tmp_path, job_flag):
    """Issue 48: under a job-level constraint, a row whose response_format is ``{"type": "text"}`` (a column cell, as
    an object or as JSON text, or an OpenAI line) decodes with no constraint at all; a null or missing one takes the
    job's. The oracles: the same prompts run with no constraint, and with the job's flag alone."""
    import re

    from typer.testing import CliRunner

    from batchspec_cli.cli import app

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    flag = [job_flag, "[a-c]{2,6}" if job_flag == "--regex" else schema]
    prompts = CLI_PROMPTS[:4]
    plain_in = write_jsonl(tmp_path / "plain.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(prompts)])
    assert cli(model_dir, plain_in, tmp_path / "plain.parquet").exit_code == 0
    assert cli(model_dir, plain_in, tmp_path / "job.parquet", *flag).exit_code == 0
    plain = [r["completion_token_ids"] for r in completions(tmp_path / "plain.parquet")]
    job = [r["completion_token_ids"] for r in completions(tmp_path / "job.parquet")]
    assert all(p != j for p, j in zip(plain, job))  # the job's constraint changes every one of these rows
    expected = [plain[0], plain[1], job[2], job[3]]  # text (object, JSON text), null, missing

    cells = [{"rf": {"type": "text"}}, {"rf": json.dumps({"type": "text"})}, {"rf": None}, {}]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": p, **c}
                                              for i, (p, c) in enumerate(zip(prompts, cells))])
    out = tmp_path / "out.parquet"
    result = cli(model_dir, inp, out, "--response-format-column", "rf", *flag)
    assert result.exit_code == 0, result.output
    assert [r["completion_token_ids"] for r in completions(out)] == expected
    checked = CliRunner().invoke(app, ["verify", str(out), "--device", "cpu"])  # verify decodes them the same way
    assert checked.exit_code == 0 and "0 unexplained" in checked.output, checked.output

    formats = [{"type": "text"}, {"type": "text"}, None, "missing"]
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": p, **({} if f == "missing" else {"response_format": f})}}
             for i, (p, f) in enumerate(zip(prompts, formats))]
    answer = tmp_path / "answer.jsonl"
    result = cli(model_dir, write_jsonl(tmp_path / "batch.jsonl", lines), answer, *flag)
    assert result.exit_code == 0, result.output
    texts = [json.loads(line)["response"]["body"]["choices"][0]["text"] for line in answer.read_text().splitlines()]
    assert texts[:2] == [TOKENIZER.decode(t, skip_special_tokens=True) for t in plain[:2]]
    assert texts[2:] == [TOKENIZER.decode(t, skip_special_tokens=True) for t in job[2:]]
    if job_flag == "--regex":
        assert not any(re.fullmatch("[a-c]{2,6}", t) for t in texts[:2]) and all(re.fullmatch("[a-c]{2,6}", t)
                                                                                 for t in texts[2:])


def test_stop_strings_cut_constrained_rows_as_documented_and_the_start_says_so(model_dir, tmp_path):
    """Issue 48: --stop with a constraint is allowed, as OpenAI and vLLM allow it (README, Structured output): a
    stop string cuts a constrained answer like any other ("billing" becomes "b", ending stop_string, not stop), and
    the run's first lines say so. The oracle: the same run without --stop, cut before the stop string."""
    from typer.testing import CliRunner

    from batchspec_cli.cli import app

    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(CLI_PROMPTS)])
    choices = ["--choice", "billing", "--choice", "shipping"]
    assert cli(model_dir, inp, tmp_path / "whole.parquet", *choices).exit_code == 0
    whole = completions(tmp_path / "whole.parquet")
    assert all(r["completion"] in ("billing", "shipping") and r["finish_reason"] == "stop" for r in whole)
    out = tmp_path / "cut.parquet"
    result = CliRunner().invoke(app, ["generate", str(inp), str(out), "--target", str(model_dir), "--no-chat",
                                      "--max-new-tokens", "40", "--dtype", "float64", *choices, "--stop", "i"])
    assert result.exit_code == 0, result.output
    assert "note: stop strings cut constrained answers too" in result.stdout, result.stdout
    for cut, full in zip(completions(out), whole):
        assert (cut["completion"], cut["finish_reason"]) == (full["completion"][: full["completion"].index("i")],
                                                             "stop_string")


def test_out_of_memory_mid_verify_leaves_the_matchers_as_committed(target, draft, references):
    """The masks of a round are taken before its verify forward; a forward that fails after them must find every
    matcher holding the committed tokens only: the halved retry decodes exactly the reference."""
    import copy

    from test_engine import _OOMOnce

    victim = copy.deepcopy(target)
    victim.model.layers[1] = _OOMOnce(victim.model.layers[1], fail_at=9)
    results = run(victim, [prompt_ids(i) for i in range(8)], cycle, mode="exspec", batch=8, k=3, draft=draft,
                  lookups=["grammar"])
    assert victim.model.layers[1].calls > 9, "the fault was injected"
    for i, r in results.items():
        assert r.token_ids == references[i], i


def test_fingerprint_holds_the_constraint(tmp_path):
    """A resumed run must have the same constraint: the schema file's contents (not its path), the regex, the
    choices, --json and the per-row column are in the job's fingerprint."""
    from types import SimpleNamespace

    from batchspec_cli.config import GenerateConfig
    from batchspec_cli.job.plan import fingerprint, job_constraint

    schema = tmp_path / "s.json"

    def fp(**kw):
        cfg = GenerateConfig(input=tmp_path / "in.jsonl", output=tmp_path / "out.parquet", **kw)
        model = SimpleNamespace(name="m", source=str(tmp_path / "no-model"))
        plan = SimpleNamespace(input_hash="h", mode="ar", target=model, draft_spec=None, total_rows=1, input_rows=1,
                               constraint=job_constraint(cfg))
        return fingerprint(cfg, plan)

    schema.write_text(json.dumps(SCHEMA))
    first = fp(json_schema=schema)
    schema.write_text(json.dumps({**SCHEMA, "required": ["name"]}))
    assert fp(json_schema=schema) != first
    plain = fp()
    assert "json_schema" not in plain and "regex" not in plain  # jobs without constraints resume as before
    assert len({json.dumps(fp(**kw), sort_keys=True) for kw in (
        {}, {"regex": "a+"}, {"regex": "b+"}, {"choice": ("a", "b")}, {"json": True},
        {"response_format_column": "rf"})}) == 6


@pytest.mark.parametrize("logprobs_mode", ["raw", "processed"])
def test_processed_logprobs_are_masked(target, logprobs_mode):
    """--logprobs-mode processed lists the constrained distribution (only what the grammar allows, summing to 1);
    raw stays the target's own."""
    choice = constraints.choice(["yes", "no", "maybe not"])
    cfg = EngineConfig(mode="ar", batch_size=2, pad_id=0, logprobs_mode=logprobs_mode)
    engine = Engine(ModelHandle(target, "cache"), None, [EOS], cfg,
                    guide=constraints.Guide(lambda: LLT, target.config.vocab_size))
    requests = [Request(row=i, id=f"r{i}", prompt_ids=prompt_ids(i), max_new_tokens=12, logprobs=5, constraint=choice)
                for i in range(2)]
    for result in (e for e in engine.run(requests) if isinstance(e, RowResult)):
        first = result.logprobs[0]
        starts = {TOKENIZER.encode(c, add_special_tokens=False)[0] for c in CHOICES}
        listed = {token for token, _ in first.top}
        if logprobs_mode == "processed":
            assert listed <= starts and first.token_id in starts
            assert abs(sum(math.exp(lp) for _, lp in first.top) - 1) < 1e-9
        else:
            assert len(listed) == 5 and not listed <= starts


def test_verify_decodes_constrained_rows_under_their_mask(model_dir, tmp_path):
    """`batchspec verify` re-decodes a constrained row with the row's own mask (job-wide or per-row cell)."""
    from typer.testing import CliRunner

    from batchspec_cli.cli import app

    rf = [None, json.dumps({"type": "json_object"}), json.dumps(SCHEMA), None]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": p, "rf": f, "t": 0.7 if i % 2 else None}
                                              for i, (p, f) in enumerate(zip(CLI_PROMPTS, rf))])
    out = tmp_path / "out.parquet"
    result = cli(model_dir, inp, out, "--regex", REGEX, "--response-format-column", "rf", "--temperature-column", "t",
                 "--mode", "exspec", "--draft", "grammar,ngram")
    assert result.exit_code == 0, result.output
    checked = CliRunner().invoke(app, ["verify", str(out), "--device", "cpu"])
    assert checked.exit_code == 0, checked.output
    assert "4/4" in checked.output or "4 of 4" in checked.output or "exact" in checked.output, checked.output
