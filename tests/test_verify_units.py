"""`batchspec verify` judges a near-tie in the run's dtype's own units: a correct bfloat16 run passes its audit, and a
changed token does not."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from batchspec_cli import verify
from batchspec_cli.cli import app
from batchspec_cli.store.outputs import read_run_metadata
from conftest import save_target_and_draft_dirs, tamper_token
from test_cli import PROMPTS, write_jsonl

runner = CliRunner()


def test_one_unit_is_the_spacing_of_the_dtype_at_that_magnitude():
    assert verify.unit(torch.bfloat16, 20.0) == 0.125  # 20 = 10100b; bfloat16 keeps 8 significant bits
    assert float(torch.tensor(20.0 + 0.0626).bfloat16()) == 20.125  # past half a unit: the next bfloat16 number
    assert float(torch.tensor(20.0 + 0.0624).bfloat16()) == 20.0
    assert verify.unit(torch.bfloat16, -20.0) == verify.unit(torch.bfloat16, 16.0) == 0.125
    assert verify.unit(torch.float32, 20.0) == 2.0 ** -19
    assert verify.unit(torch.float16, 1.0) == 2.0 ** -10
    assert verify.unit(torch.float64, 0.0) > 0  # no log of zero


def test_a_margin_is_a_near_tie_within_the_units_or_the_absolute_floor():
    logits = torch.zeros(1, 5, dtype=torch.float64)
    logits[0, 1], logits[0, 2] = 20.25, 20.0  # the reference's own token 1 leads the run's 2 by 2 bfloat16 units
    close = verify._compare(0, "a", [2], [1], [logits[0]], "length", 1e-3, 4, torch.bfloat16)
    assert close.near_tie and close.units == 2.0 and close.margin == 0.25
    assert not verify._compare(0, "a", [2], [1], [logits[0]], "length", 1e-3, 1, torch.bfloat16).near_tie
    assert not verify._compare(0, "a", [2], [1], [logits[0]], "length", 1e-3, 4, torch.float32).near_tie
    logits[0, 2] = float("-inf")  # the run's token outside the reference's top-p: never a near-tie
    far = verify._compare(0, "a", [2], [1], [logits[0]], "length", 1e-3, 4, torch.bfloat16)
    assert not far.near_tie and far.units == float("inf")
    logits[0, 2] = 20.0
    logits[0, 1] = 20.0005  # under the absolute floor whatever the dtype
    assert verify._compare(0, "a", [2], [1], [logits[0]], "length", 1e-3, 0, torch.float32).near_tie


def test_a_sampled_rows_margin_is_judged_in_units_of_its_logits_over_the_temperature():
    """A sampled row's scores are log-probabilities at logits / T plus the run's own noise: the two tokens' scores
    differ by their logits' difference over T (and the noise), so the rounding that can move them is the logits'
    unit over T, not a unit at the scores' magnitude (here under 1, where bfloat16's unit is 64x finer)."""
    scores = torch.full((1, 5), float("-inf"), dtype=torch.float64)
    scores[0, 1], scores[0, 2] = 0.55, 0.40  # the reference's token ahead by 0.15 in score space
    raw = torch.zeros(1, 5)
    raw[0, 1], raw[0, 2] = 17.0, 16.5  # the model's own logits there: a bfloat16 unit of 0.125
    plain = verify._compare(0, "a", [2], [1], [scores[0]], "length", 1e-3, 4, torch.bfloat16)
    assert not plain.near_tie and plain.units > 4  # 0.15 against a unit of 2 ** -8: 38 units
    sampled = verify._compare(0, "a", [2], [1], [scores[0]], "length", 1e-3, 4, torch.bfloat16, ([raw[0]], 0.8))
    assert sampled.near_tie and sampled.units == pytest.approx(0.15 / (0.125 / 0.8))
    scores[0, 1] = 0.40 + 8 * 0.125 / 0.8  # 8 units of the logits over T: beyond the ruler
    assert not verify._compare(0, "a", [2], [1], [scores[0]], "length", 1e-3, 4, torch.bfloat16,
                               ([raw[0]], 0.8)).near_tie


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_target_and_draft_dirs(tmp_path_factory.mktemp("verify_models"))


@pytest.mark.parametrize("mode", ["ar", "exspec"])
def test_a_bfloat16_run_passes_its_audit_and_a_changed_token_does_not(tmp_path, model_dirs, mode):
    target, draft = model_dirs
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out.parquet"
    result = runner.invoke(app, ["generate", str(inp), str(out), "--target", target, "--max-new-tokens", "12",
                                 "--quiet", "--dtype", "bfloat16", "--batch-size", "4", "--mode", mode,
                                 *(["--draft", draft] if mode != "ar" else [])])
    assert result.exit_code == 0, result.output
    meta = read_run_metadata(out)
    assert meta["dtype"] == "bfloat16" and meta["dtype_reason"] == "asked for (--dtype)"
    audit = runner.invoke(app, ["verify", str(out)])
    assert audit.exit_code == 0 and "0 unexplained" in audit.output and "bfloat16 units" in audit.output, audit.output
    tamper_token(out, 1, 0, 13)  # a token the reference did not choose
    audit = runner.invoke(app, ["verify", str(out)])
    assert audit.exit_code == 1 and "1 unexplained" in audit.output, audit.output


def test_a_sampled_bfloat16_run_passes_its_audit_and_a_changed_token_does_not(tmp_path, model_dirs):
    target, _ = model_dirs
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out.parquet"
    result = runner.invoke(app, ["generate", str(inp), str(out), "--target", target, "--max-new-tokens", "12",
                                 "--quiet", "--dtype", "bfloat16", "--batch-size", "4", "--mode", "ar",
                                 "--temperature", "0.8", "--seed", "5"])
    assert result.exit_code == 0, result.output
    audit = runner.invoke(app, ["verify", str(out)])
    assert audit.exit_code == 0 and "0 unexplained" in audit.output, audit.output
    tamper_token(out, 1, 0, 13)
    audit = runner.invoke(app, ["verify", str(out)])
    assert audit.exit_code == 1 and "1 unexplained" in audit.output, audit.output


def test_a_bfloat16_difference_beyond_the_units_is_rechecked_in_float64():
    """The float64 margin at the same prefix decides: the second-best token is within a ruler that covers float64's
    own margin, the worst token is not (the expected margins from an independent float64 forward)."""
    import torch

    from batchspec_cli.verify import Float64, Mismatch, recheck, unit
    from conftest import TINY_VOCAB_SIZE, make_tiny_llama

    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=3, dtype=torch.bfloat16)
    prompt, ref = [5, 9, 14, 3], [7, 11]
    with torch.no_grad():
        truth = make_tiny_llama(TINY_VOCAB_SIZE, seed=3, dtype=torch.bfloat16).double()(
            input_ids=torch.tensor([prompt + ref[:1]])).logits[0, -1]
    order = truth.argsort(descending=True).tolist()
    best, second, worst = order[0], order[1], order[-1]
    gap = float(truth[best] - truth[second])
    ruler = gap / unit(torch.bfloat16, max(abs(float(truth[best])), abs(float(truth[second])))) + 0.5
    exact = Float64(model)
    close = Mismatch(0, "r0", 1, second, best, margin=9.0, near_tie=False, units=99.0)
    recheck(close, exact, prompt, ref, 1e-9, ruler, torch.bfloat16)
    assert close.near_tie and abs(close.float64_margin - gap) < 1e-9
    far = Mismatch(0, "r0", 1, worst, best, margin=9.0, near_tie=False, units=99.0)
    recheck(far, exact, prompt, ref, 1e-9, ruler, torch.bfloat16)
    assert not far.near_tie and far.float64_margin > gap
    right = Mismatch(0, "r0", 1, best, second, margin=9.0, near_tie=False, units=99.0)  # the run took float64's choice
    recheck(right, exact, prompt, ref, 1e-9, 0.0, torch.bfloat16)
    assert right.near_tie and right.float64_margin < 0
    in_float32 = Mismatch(0, "r0", 1, worst, best, margin=9.0, near_tie=False, units=99.0)
    recheck(in_float32, exact, prompt, ref, 1e-9, 1e9, torch.float32)  # float32 runs keep their own audit
    assert not in_float32.near_tie and in_float32.float64_margin is None
