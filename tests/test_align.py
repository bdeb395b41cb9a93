"""Unit tests of the alignment module on hand-built layouts and caches."""

from __future__ import annotations

import pytest
import torch

from batchspec_cli.engine import align
from batchspec_cli.engine.align import SlotCache, SlotTable, selection
from batchspec_cli.models import attention
from batchspec_cli.models.attention import attention_inputs
from conftest import TINY_VOCAB_SIZE, make_tiny_llama


def marked_cache(n_slots: int, capacity: int, layers: int = 2) -> SlotCache:
    """A cache whose entry (slot s, column c, layer l) holds 1000*l + 100*s + c in every head/dim."""
    cache = SlotCache(n_slots, capacity)
    for layer in range(layers):
        marks = torch.tensor([[1000 * layer + 100 * s + c for c in range(capacity)] for s in range(n_slots)],
                             dtype=torch.float64)
        keys = marks[:, None, :, None].expand(n_slots, 2, capacity, 3).clone()  # [slots, heads, capacity, dim]
        cache.keys.append(keys)
        cache.values.append(-keys)
    return cache


ENDS, PADS = [9, 7, 8], [2, 0, 3]  # the docstring's rows after their round


def docstring_example(target: SlotCache | None = None, draft: SlotCache | None = None,
                      draft_lag: list[int] | int = 2) -> SlotTable:
    """A table holding the three rows of align.py's docstring after their round (ends 9, 7, 8; pads 2, 0, 3),
    with the given caches (absent: empty ones); the draft cache lags each row by ``draft_lag`` columns."""
    table = SlotTable(3, torch.device("cpu"), with_draft=True, capacity=12)
    table.layout.tokens[:] = torch.arange(12)[None, :] + 100 * torch.arange(3)[:, None]
    table.end, table.pad, table.live = list(ENDS), list(PADS), [0, 1, 2]
    lags = [draft_lag] * 3 if isinstance(draft_lag, int) else draft_lag
    table.draft_end = [e - lag for e, lag in zip(ENDS, lags)]
    table.target, table.draft = target or SlotCache(3, 12), draft or SlotCache(3, 12)
    return table


def move(table: SlotTable, src: list[int], dst: list[int], new_end) -> int:
    """``SlotTable.move`` of the docstring's rows; the KV entries copied, summed over rows."""
    new_ends = [new_end] * len(src) if isinstance(new_end, int) else list(new_end)
    return sum(table.move([(s, d, e) for s, d, e in zip(src, dst, new_ends)]))


@pytest.fixture(params=["blocks", "indexed"])
def copies(request, monkeypatch):
    """Both ways ``realign`` copies KV: a block a row (a CPU's) and indexed entries (an accelerator's)."""
    if request.param == "indexed":
        monkeypatch.setattr(align, "BLOCK_COPIES", set())
    return request.param


@pytest.mark.usefixtures("copies")
def test_realign_shifts_tokens_and_kv_of_every_row_to_one_end():
    target, draft = marked_cache(3, 12), marked_cache(3, 12, layers=1)
    table = docstring_example(target, draft)
    layout = table.layout
    old_tokens = layout.tokens.clone()
    src = [0, 2]  # row 1 already ends at 7: it does not move
    moved = move(table, src, src, 7)
    # Content of each row, right-aligned at column 7, unchanged in order.
    assert layout.tokens[0, 0:7].tolist() == old_tokens[0, 2:9].tolist()
    assert layout.tokens[2, 2:7].tolist() == old_tokens[2, 3:8].tolist()
    assert layout.tokens[1, 0:7].tolist() == old_tokens[1, 0:7].tolist()
    # Target cache (lag 1) covers columns [0, 6): entry of new column c comes from old column c - shift.
    for layer in range(2):
        keys = target.keys[layer][:, 0, :, 0]
        assert keys[0, 0:6].tolist() == [1000 * layer + 0 + c for c in range(2, 8)]
        assert keys[2, 2:6].tolist() == [1000 * layer + 200 + c for c in range(3, 7)]
        assert keys[1, 0:6].tolist() == [1000 * layer + 100 + c for c in range(0, 6)]
        assert torch.equal(target.values[layer], -target.keys[layer])
    # Draft cache (lag 2) covers [0, 5).
    assert draft.keys[0][0, 0, 0:5, 0].tolist() == [2, 3, 4, 5, 6]
    # Moved = each row's covered content columns (pads excluded) x layers, over both caches, counted from the
    # index tensors: row 0 has content 7 (target covers 6, draft 5), row 2 content 5 (4 and 3).
    assert moved == (6 + 4) * 2 + (5 + 3) * 1
    # The geometry moved with them: pads shift by the same amount as ends, and so do draft ends.
    assert (table.end, table.pad, table.draft_end, table.live) == ([7, 7, 7], [0, 0, 2], [5, 5, 5], [0, 1, 2])


@pytest.mark.usefixtures("copies")
def test_realign_compacts_rows_into_lower_slots():
    cache = marked_cache(3, 12, layers=1)
    table = docstring_example(cache)
    layout = table.layout
    table.free(0)  # row 0 finished; row 2 moves into slot 0, same end
    move(table, [2], [0], 8)
    assert layout.tokens[0, 3:8].tolist() == list(range(203, 208))
    assert cache.keys[0][0, 0, 3:7, 0].tolist() == [203, 204, 205, 206]
    assert table.live == [0, 1] and (table.end[0], table.pad[0]) == (8, 3)
    assert table.free_slots() == [2]


@pytest.mark.usefixtures("copies")
def test_realign_with_per_row_ends_swaps_rows_between_slots():
    """EXSPEC assembles a group by trading slots; each row keeps (or gets) its own end."""
    cache = marked_cache(3, 12, layers=1)
    table = docstring_example(cache)
    layout = table.layout
    old_tokens = layout.tokens.clone()
    # Row 0 (end 9) and row 2 (end 8) trade slots; row 2 is also realigned to end 9 on the way.
    moved = move(table, [0, 2], [2, 0], [9, 9])
    assert layout.tokens[2, 2:9].tolist() == old_tokens[0, 2:9].tolist()
    assert layout.tokens[0, 4:9].tolist() == old_tokens[2, 3:8].tolist()
    assert cache.keys[0][2, 0, 2:8, 0].tolist() == list(range(2, 8))  # row 0's entries, same columns
    assert cache.keys[0][0, 0, 4:8, 0].tolist() == list(range(203, 207))  # row 2's, shifted by one
    assert moved == 6 + 4  # content only: row 0 covers 6 columns, row 2 covers 4
    assert (table.end, table.pad, table.draft_end) == ([9, 7, 9], [4, 0, 2], [7, 5, 7])


@pytest.mark.usefixtures("copies")
def test_realign_with_per_row_ends_stays_in_bounds_when_one_row_moves_left():
    cache = marked_cache(3, 12, layers=1)
    table = docstring_example(cache)  # capacity 12
    layout = table.layout
    old_tokens = layout.tokens.clone()
    # Row 0 shifts left by 2 (end 9 -> 7) while row 2 moves right to 11: reads past row 0's end are clamped.
    move(table, [0, 2], [0, 2], [7, 11])
    assert layout.tokens[0, 0:7].tolist() == old_tokens[0, 2:9].tolist()
    assert layout.tokens[2, 6:11].tolist() == old_tokens[2, 3:8].tolist()
    assert cache.keys[0][0, 0, 0:6, 0].tolist() == list(range(2, 8))
    assert cache.keys[0][2, 0, 6:10, 0].tolist() == list(range(203, 207))


def test_realign_of_nothing_moves_nothing():
    table = docstring_example(marked_cache(3, 12))
    assert move(table, [], [], 9) == 0
    assert (table.end, table.pad) == (ENDS, PADS)


@pytest.mark.usefixtures("copies")
def test_realign_moves_each_row_by_its_own_lag():
    """A draft cache that lags differently per row (plain steps, lazy prefill) moves only what it covers."""
    draft = marked_cache(3, 12, layers=1)
    table = docstring_example(draft=draft, draft_lag=[2, 0, 5])
    before = draft.keys[0].clone()
    # Row 0 covers [0, 7) (lag 2), row 2 covers nothing yet (lag = its content 5: a draft never prefilled).
    # The target cache holds nothing (no layer yet): it copies nothing.
    moved = table.move([(0, 0, 7), (2, 2, 7)])
    assert moved == [5, 0]
    moved = sum(moved)
    assert draft.keys[0][0, 0, 0:5, 0].tolist() == [2, 3, 4, 5, 6]
    assert torch.equal(draft.keys[0][2], before[2])  # nothing of row 2 was copied
    assert moved == 5


def _fail_on_call(n: int, real):
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise torch.OutOfMemoryError("injected")
        return real(*args, **kwargs)
    return wrapper, calls


@pytest.mark.usefixtures("copies")
def test_realign_out_of_memory_midway_leaves_layout_and_caches_as_they_were(monkeypatch):
    target, draft = marked_cache(3, 12), marked_cache(3, 12, layers=1)
    table = docstring_example(target, draft)
    layout = table.layout
    snapshot = [layout.tokens.clone()] + \
        [t.clone() for c in (target, draft) for t in c.keys + c.values]
    geometry = (list(table.end), list(table.pad), list(table.draft_end), list(table.live))
    fail, calls = _fail_on_call(3, align._gather)  # after two layers' copies were made
    monkeypatch.setattr(align, "_gather", fail)
    with pytest.raises(torch.OutOfMemoryError):
        move(table, [0, 2], [0, 2], 7)
    assert calls["n"] == 3
    after = [layout.tokens] + [t for c in (target, draft) for t in c.keys + c.values]
    assert all(torch.equal(a, b) for a, b in zip(after, snapshot))
    assert (table.end, table.pad, table.draft_end, table.live) == geometry


def test_grow_is_all_or_nothing_and_falls_back_to_the_exact_need(monkeypatch):
    cache = marked_cache(2, 64, layers=3)
    snapshot = [t.clone() for t in cache.keys + cache.values]
    real = SlotCache._new_buffer
    fail, calls = _fail_on_call(2, real)  # the generous size fails after one layer was allocated
    monkeypatch.setattr(SlotCache, "_new_buffer", staticmethod(fail))
    cache.grow(70)
    assert cache.capacity == 72  # exactly what was needed (rounded to 8), not 64 + a quarter
    assert all(torch.equal(t[:, :, :64], old) for t, old in zip(cache.keys + cache.values, snapshot))

    def always(*args, **kwargs):
        raise torch.OutOfMemoryError("injected")
    monkeypatch.setattr(SlotCache, "_new_buffer", staticmethod(always))
    with pytest.raises(align.CacheFull):
        cache.grow(200)
    assert cache.capacity == 72 and all(t.shape[2] == 72 for t in cache.keys + cache.values)


def test_the_table_carries_out_the_docstring_example():
    """align.py's worked example through the table's verbs: place three rows at end 6, commit the round's tokens,
    realign to the longest content; pads, ends, draft ends, the live set and the tokens are the docstring's."""
    table = SlotTable(4, torch.device("cpu"), with_draft=True, capacity=8)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12, 13]]  # "a b c d", "e f g h i j", "k l m"
    table.place([0, 1, 2], prompts, 6, pad_id=0)
    assert (table.end, table.pad, table.draft_end, table.live) == ([6, 6, 6, 0], [2, 0, 3, 0], [2, 0, 3, 0],
                                                                   [0, 1, 2])
    assert table.free_slots() == [3] and table.pads([2, 0]).tolist() == [3, 2]
    table.layout.grow(6 + 3)  # the round's block (the engine grows the layout before it writes)
    for slot, emitted, new in ((0, 3, [21, 22, 23]), (1, 1, [31]), (2, 2, [41, 42])):  # accepts 2+1, 0+1, 1+1
        table.layout.tokens[slot, 6 : 6 + emitted] = torch.tensor(new)
        table.commit(slot, emitted, draft_refed=True)
    assert table.end[:3] == [9, 7, 8] and table.draft_end[:3] == [7, 5, 6]
    moves = [(s, s, 7) for s in (0, 1, 2) if table.end[s] != 7]  # EQSPEC: to the longest content, 7
    table.move(moves)
    assert table.pad[:3] == [0, 0, 2] and table.end[:3] == [7, 7, 7] and table.draft_end[:3] == [5, 5, 5]
    assert table.layout.tokens[0, :7].tolist() == [1, 2, 3, 4, 21, 22, 23]
    assert table.layout.tokens[1, :7].tolist() == [5, 6, 7, 8, 9, 10, 31]
    assert table.layout.tokens[2, 2:7].tolist() == [11, 12, 13, 41, 42]
    table.free(1)
    assert table.live == [0, 2] and table.free_slots() == [1, 3]


def test_attention_inputs_mask_and_positions():
    pad = torch.tensor([2, 0])
    mask, positions = attention_inputs(pad, start=4, n_new=2, dtype=torch.float32)
    assert mask.shape == (2, 1, 2, 6)
    allowed = mask[:, 0] == 0
    # Row 0: keys 2..4 for the first query (column 4), 2..5 for the second.
    assert allowed[0, 0].tolist() == [False, False, True, True, True, False]
    assert allowed[0, 1].tolist() == [False, False, True, True, True, True]
    assert allowed[1, 0].tolist() == [True, True, True, True, True, False]
    assert mask[~(mask == 0)].eq(torch.finfo(torch.float32).min).all()  # finfo.min, never -inf
    assert positions.tolist() == [[2, 3], [4, 5]]


def test_slot_cache_views_for_contiguous_groups_and_counted_gathers_otherwise():
    cache = SlotCache(4, 8)
    new = torch.ones(2, 2, 3, 4)
    cache.bind(selection([1, 2], torch.device("cpu")), 0)
    keys, _ = cache.update(new, new, 0)
    assert keys.shape == (2, 2, 3, 4) and keys._base is not None  # a view, nothing copied
    assert cache.gathered == 0
    cache.bind(selection([0, 3], torch.device("cpu")), 3)
    keys, _ = cache.update(new, new, 0)
    assert keys.shape == (2, 2, 6, 4)
    assert cache.gathered == 2 * 6  # rows x columns read through an index
    assert cache.keys[0][3, :, 3:6].eq(1).all() and cache.keys[0][3, :, :3].eq(0).all()


def test_slot_cache_grows_when_a_row_runs_past_capacity():
    cache = SlotCache(2, 4)
    cache.bind(slice(0, 2), 0)
    cache.update(torch.full((2, 1, 4, 2), 7.0), torch.zeros(2, 1, 4, 2), 0)
    cache.bind(slice(0, 2), 4)
    keys, _ = cache.update(torch.full((2, 1, 3, 2), 9.0), torch.zeros(2, 1, 3, 2), 0)
    assert cache.capacity >= 7 and keys[:, :, :4].eq(7).all() and keys[:, :, 4:7].eq(9).all()


@pytest.mark.parametrize("n_new", [1, 6, 70])
def test_folded_sdpa_equals_stock_sdpa_on_padded_grouped_query_attention(n_new):
    """The K/V-free GQA attention gives stock SDPA's logits on a left-padded group (prefix cached)."""
    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=4, hidden=48, heads=6, kv_heads=2)  # 3 query heads per KV head
    pad = torch.tensor([0, 3, 9])
    prefix, start = 12, 12
    tokens = torch.randint(4, TINY_VOCAB_SIZE, (3, prefix + n_new), generator=torch.Generator().manual_seed(n_new))
    logits = {}
    for folded in (False, True):
        with attention.folded_sdpa(*([model] if folded else [])):
            assert model.config._attn_implementation == (attention.FOLDED_SDPA if folded else "sdpa")
            cache = SlotCache(3, 128)
            sel = slice(0, 3)
            attention.group_forward(model, cache, "cache", sel, tokens[:, :prefix], pad, 0)
            logits[attention.FOLDED_SDPA if folded else "sdpa"] = attention.group_forward(model, cache, "cache", sel,
                                                                                  tokens[:, prefix:], pad, start)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(logits[attention.FOLDED_SDPA], logits["sdpa"], rtol=1e-10, atol=1e-10)


def test_the_engine_runs_stock_sdpa_models_folded_for_the_run_only():
    """Side effects belong to the run: during it the models run the folded kernel, afterwards their own again."""
    from batchspec_cli.engine.core import Engine, EngineConfig, ModelHandle
    from batchspec_cli.engine.events import Request

    target, draft = make_tiny_llama(TINY_VOCAB_SIZE, seed=0), make_tiny_llama(TINY_VOCAB_SIZE, seed=1)
    eager = make_tiny_llama(TINY_VOCAB_SIZE, seed=2)
    eager.set_attn_implementation("eager")
    seen = []
    forward = target.forward

    def spy(*args, **kwargs):
        seen.append((target.config._attn_implementation, draft.config._attn_implementation))
        return forward(*args, **kwargs)
    target.forward = spy
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [1], EngineConfig(mode="exspec", k=2))
    assert target.config._attn_implementation == draft.config._attn_implementation == "sdpa"  # not at construction
    list(engine.run([Request(row=0, id="0", prompt_ids=[5, 6, 7], max_new_tokens=3)]))
    assert seen and set(seen) == {(attention.FOLDED_SDPA, attention.FOLDED_SDPA)}
    assert target.config._attn_implementation == draft.config._attn_implementation == "sdpa"
    list(Engine(ModelHandle(eager, "cache"), None, [1], EngineConfig(mode="ar")).run(
        [Request(row=0, id="0", prompt_ids=[5, 6], max_new_tokens=2)]))
    assert eager.config._attn_implementation == "eager"  # a user's choice of kernel is kept


def test_importing_align_registers_nothing():
    import subprocess
    import sys

    code = ("from transformers import AttentionInterface; "
            "import batchspec_cli.engine.core, batchspec_cli.models.attention as a; "
            "assert a.FOLDED_SDPA not in AttentionInterface._global_mapping")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_share_prefix_copies_the_prefix_to_each_rows_own_content_offset():
    """A prefix's entries (one row) land at each slot's own first content column; the draft's reach advances."""
    table = SlotTable(4, torch.device("cpu"), with_draft=True, capacity=8)
    table.place([0, 2], [[5, 6, 7, 8, 9], [5, 6, 7]], end=6, pad_id=0)  # pads 1 and 3
    source = SlotCache(1, 6)
    keys = torch.arange(6, dtype=torch.float64).reshape(1, 1, 6, 1).repeat(1, 2, 1, 3)  # entry c holds c
    source.bind(slice(0, 1), 0)
    source.update(keys, -keys, 0)
    copied = table.share_prefix(source, True, [0, 2], [4, 2])
    assert copied == 6
    draft = table.draft
    assert draft.keys[0][0, 0, :, 0].tolist()[:6] == [0, 0, 1, 2, 3, 0]  # pad 1: columns 1..4 hold entries 0..3
    assert draft.keys[0][2, 0, :, 0].tolist()[:6] == [0, 0, 0, 0, 1, 0]  # pad 3: columns 3..4 hold entries 0..1
    assert draft.values[0][2, 1, 4, 0] == -1
    assert (table.draft_end[0], table.draft_end[2]) == (5, 5)
    assert table.target.n_layers == 0  # the target's cache untouched
