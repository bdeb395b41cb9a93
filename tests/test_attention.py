"""The attention module: masks per layer type, no fully masked query row in any dtype or attention implementation,
the non-finite guard of the round, and the folded kernel registered for the run only."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from transformers import AttentionInterface
from typer.testing import CliRunner

from batchspec_cli.engine.core import EngineConfig
from batchspec_cli.engine.events import NonFiniteLogits, RowResult, StepStats
from batchspec_cli.models import attention
from batchspec_cli.models.attention import CHUNKED, FULL, SLIDING, Layers, attention_inputs
from conftest import TINY_VOCAB_SIZE, greedy_reference, make_tiny_llama, run_engine_rows, save_tiny_model_dir

torch.set_num_threads(1)


def allowed(mask: torch.Tensor) -> list[list[str]]:
    """One row's [queries, keys] mask as strings of x (allowed) and . (masked)."""
    return ["".join("x" if v == 0 else "." for v in row) for row in mask[0, 0].tolist()]


def test_masks_per_layer_type_in_content_positions_with_pad_queries_on_their_own_column():
    """The module docstring's example (pad 1, W = 2), and a chunk of 2 counted from the row's first content column."""
    layers = Layers((FULL, SLIDING, CHUNKED), window=2, chunk=2)
    masks, positions = attention_inputs(torch.tensor([1]), 0, 5, torch.float64, layers)
    assert positions.tolist() == [[0, 0, 1, 2, 3]]
    assert allowed(masks[FULL]) == ["x....", ".x...", ".xx..", ".xxx.", ".xxxx"]
    assert allowed(masks[SLIDING]) == ["x....", ".x...", ".xx..", "..xx.", "...xx"]
    assert allowed(masks[CHUNKED]) == ["x....", ".x...", ".xx..", "...x.", "...xx"]
    one, _ = attention_inputs(torch.tensor([1]), 0, 5, torch.float64, Layers((SLIDING,), window=2))
    assert torch.equal(one, masks[SLIDING])  # one layer type: one mask, not a dict
    for mask in masks.values():
        assert (mask == 0).any(-1).all()  # no query row is fully masked
        assert mask[mask != 0].eq(torch.finfo(torch.float64).min).all()  # finfo.min, never -inf
    padding, _ = attention_inputs(torch.tensor([2, 0]), 3, 1, torch.float32, Layers(padding_mask=True))
    assert padding.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]  # ALiBi models: the 2D mask their bias is built from


def ragged(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(rng.randint(1, 20))] for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_eager_attention_with_left_padded_rows_equals_per_prompt_decoding(dtype):
    """Pad rows of a prefill once had every key masked: eager softmax in float32 over a float64 finfo.min mask
    gave NaN, and the NaN reached every row through the pad columns' K/V (24 x token 0, exit 0)."""
    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=0, dtype=dtype)
    model.set_attn_implementation("eager")
    prompts = ragged(6, seed=2)
    references = [greedy_reference(model, p, 8, [1]) for p in prompts]
    results, _ = run_engine_rows(model, None, prompts, EngineConfig(mode="ar", batch_size=6), max_new=8)
    assert [results[i].token_ids for i in range(len(prompts))] == references


def test_a_round_with_non_finite_logits_fails_and_commits_nothing():
    """NaN logits for one row in the third round: the run raises, and nothing of that round is yielded."""
    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    forward, calls = model.forward, []

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) == 4:  # the prefill, then rounds 1, 2, 3
            out.logits[1, -1, 5] = float("nan")
        return out
    model.forward = poisoned
    events = []
    with pytest.raises(NonFiniteLogits, match=r"non-finite logits .* row 'r1' at step 4"):
        for event in _events(model, ragged(3, seed=4)):
            events.append(event)
    rounds = [e for e in events if isinstance(e, StepStats) and e.group_kind != "prefill"]
    assert len(rounds) == 2 and not [e for e in events if isinstance(e, RowResult)]  # each row needed a third token


def _events(model, prompts):
    from batchspec_cli.engine.core import Engine, ModelHandle
    from batchspec_cli.engine.events import Request

    engine = Engine(ModelHandle(model, "cache"), None, [], EngineConfig(mode="ar", batch_size=3))
    yield from engine.run([Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=3) for i, p in enumerate(prompts)])


def test_the_cli_refuses_a_model_giving_nan_in_one_line_exit_1(tmp_path):
    from batchspec_cli.cli import app
    from transformers import LlamaForCausalLM

    folder = save_tiny_model_dir(tmp_path / "nan", seed=0)
    model = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head.weight[7, 0] = float("nan")
    model.save_pretrained(folder)
    (tmp_path / "in.jsonl").write_text('{"prompt": "hello"}\n{"prompt": "a longer prompt"}\n')
    result = CliRunner().invoke(app, ["generate", str(tmp_path / "in.jsonl"), str(tmp_path / "out.parquet"),
                                      "--target", str(folder), "--mode", "ar", "--quiet", "--max-new-tokens", "4"])
    assert result.exit_code == 1, result.output
    assert "non-finite logits" in result.output and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_the_folded_kernel_is_registered_for_the_run_only_and_never_for_eager_or_soft_capped_models():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=0)
    inside = []

    def spy(*args, **kwargs):
        inside.append(attention.FOLDED_SDPA in AttentionInterface._global_mapping)
        return forward(*args, **kwargs)
    forward, model.forward = model.forward, spy
    run_engine_rows(model, None, ragged(2, seed=5), EngineConfig(mode="ar", batch_size=2), max_new=2)
    assert inside and all(inside)
    assert attention.FOLDED_SDPA not in AttentionInterface._global_mapping
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=TINY_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=8))
    gemma.config._attn_implementation = "sdpa"  # even where a user forced SDPA, soft-capping is not dropped by us
    assert not attention.foldable(gemma)


@pytest.mark.parametrize("dtype,mode", [(torch.float64, "ar"), (torch.float32, "eqspec")])
def test_rows_of_one_group_read_only_their_own_columns_and_stay_exact(monkeypatch, dtype, mode):
    """24 rows of 3 to 60 tokens in one bucket (one padded layout): decode and verify forwards attend in runs of
    rows from each run's own first column (``column_spans``), and every row equals decoding it alone."""
    target = make_tiny_llama(TINY_VOCAB_SIZE, seed=5, dtype=dtype, heads=4, kv_heads=2)
    draft = make_tiny_llama(TINY_VOCAB_SIZE, seed=6, dtype=dtype, heads=4, kv_heads=2)
    rng = random.Random(7)
    prompts = sorted(([rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(n)] for n in (3, 60, *rng.choices(range(3, 61), k=22))),
                     key=len)
    used = []
    real = attention.column_spans

    def spy(pad, start, n_new):
        spans = real(pad, start, n_new)
        used.append(spans is not None)
        return spans
    monkeypatch.setattr(attention, "column_spans", spy)
    cfg = EngineConfig(mode=mode, batch_size=24, k=3)
    results, _ = run_engine_rows(target, draft if mode != "ar" else None, prompts, cfg, max_new=12, eos=())
    assert [results[i].token_ids for i in range(24)] == [greedy_reference(target, p, 12, []) for p in prompts]
    assert any(used), "the group's spread of lengths should make runs of rows pay"


def test_pack_rows_covers_each_column_once_within_the_budget_and_splits_only_rows_longer_than_it():
    rng = random.Random(3)
    for most in (1, 7, 64):
        rows, slot = [], 0
        for _ in range(40):
            first = rng.randrange(0, 30)
            start = first + rng.choice([0, 0, rng.randrange(0, 20)])  # some rows have cached columns already
            rows.append((slot, first, start, start + rng.randrange(0, 3 * most + 2)))
            slot += 1
        forwards = list(attention.pack_rows(rows, most))
        pieces = [p for f in forwards for p in f]
        covered = collections.Counter((p.slot, c) for p in pieces for c in range(p.start, p.end))
        assert covered == collections.Counter((s, c) for s, _, a, b in rows for c in range(a, b))
        assert all(0 < sum(p.end - p.start for p in f) <= most for f in forwards)
        for s, first, a, b in rows:
            mine = [p for p in pieces if p.slot == s]
            assert all(p.first == first for p in mine)
            assert [p.start for p in mine] == sorted(p.start for p in mine)  # a row's pieces in column order
            if b - a <= most:
                assert len(mine) == (1 if b > a else 0)  # whole, wherever its neighbours end
            else:
                assert all(len(f) == 1 for f in forwards if any(p.slot == s for p in f))  # alone


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_packed_prefill_writes_each_rows_kv_as_prefilling_it_alone(dtype):
    """Three rows packed into one forward (one of them continuing from columns already cached) write, at every
    content column, the keys and values a per-prompt prefill computes; columns outside the pieces stay as they were."""
    from transformers import DynamicCache

    from batchspec_cli.engine.align import SlotCache
    from batchspec_cli.models.loading import cache_kwarg

    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=11, dtype=dtype, heads=4, kv_heads=2)
    rng = random.Random(5)
    prompts = [[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(n)] for n in (9, 4, 13)]
    width = 16
    pads = [width - len(p) for p in prompts]
    tokens = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, pads[i]:] = torch.tensor(p)
    cache, kwarg = SlotCache(3, width), cache_kwarg(model)
    with attention.for_run(model), torch.no_grad():
        assert attention.packable(model, torch.device("cpu"))
        # row 2's first 5 columns first, alone; then rows 0, 1 and the rest of row 2 in one forward
        attention.packed_forward(model, cache, kwarg, tokens,
                                 [attention.Piece(2, pads[2], pads[2], pads[2] + 5)])
        attention.packed_forward(model, cache, kwarg, tokens,
                                 [attention.Piece(0, pads[0], pads[0], width),
                                  attention.Piece(1, pads[1], pads[1], width),
                                  attention.Piece(2, pads[2], pads[2] + 5, width)])
    atol = 1e-12 if dtype == torch.float64 else 1e-5
    for i, p in enumerate(prompts):
        alone = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([p]), use_cache=True, **{kwarg: alone})
        for layer in range(len(cache.keys)):
            want_k, want_v = alone.layers[layer].keys[0], alone.layers[layer].values[0]
            torch.testing.assert_close(cache.keys[layer][i, :, pads[i]:], want_k, rtol=0, atol=atol)
            torch.testing.assert_close(cache.values[layer][i, :, pads[i]:], want_v, rtol=0, atol=atol)
            assert not cache.keys[layer][i, :, :pads[i]].any()  # pad columns are never written
