"""The CPU attention kernels (models/native.py) against float64 SDPA, and the properties the engine relies on: a
row's output does not depend on the rows or padding beside it, and a verify's query computes what a one-token step
at its position computes; the causal prefill kernel as close to float64 as SDPA's own."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from batchspec_cli.models import native
from batchspec_cli.models.attention import _attend
from conftest import TINY_VOCAB_SIZE, make_tiny_llama

BUILT = native.load()
pytestmark = pytest.mark.skipif(BUILT.attend is None, reason=f"the kernel could not be built: {BUILT.error}")

HEADS, KV = 6, 2
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}  # what SDPA's own kernels reach on the same inputs, x4


def inputs(dtype, rows, q_len, length, dim, pads, seed=0):
    """Random queries, keys and values, and the engine's additive mask: row i's content starts at pads[i], and its
    query j sees every content column up to its own (the last q_len columns are the queries')."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HEADS, q_len, dim, generator=g).to(dtype)
    k = (2 * torch.randn(rows, KV, length, dim, generator=g)).to(dtype)
    v = torch.randn(rows, KV, length, dim, generator=g).to(dtype)
    cols = torch.arange(length)
    last = length - q_len + torch.arange(q_len)
    allowed = (cols[None, None] >= torch.tensor(pads)[:, None, None]) & (cols[None, None] <= last[None, :, None])
    mask = torch.zeros(rows, 1, q_len, length, dtype=dtype).masked_fill(~allowed[:, None], torch.finfo(dtype).min)
    return q, k, v, mask, allowed[:, None]


def exact(q, k, v, allowed):
    rep = HEADS // KV
    return F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(rep, 1),
                                          v.double().repeat_interleave(rep, 1), attn_mask=allowed).transpose(1, 2)


def run(q, k, v, mask):
    return native.attend(BUILT.attend, q, k, v, mask, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 40])  # 64 and 128: the vector paths; 40: the plain one
@pytest.mark.parametrize("q_len", [1, 3])
def test_the_kernel_matches_float64_attention_as_closely_as_sdpa_does(dtype, dim, q_len):
    q, k, v, mask, allowed = inputs(dtype, 4, q_len, 70, dim, [0, 5, 33, 1])
    want = exact(q, k, v, allowed)
    got = run(q, k, v, mask)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert got.shape == sdpa.shape and got.dtype == dtype
    assert (got.double() - want).abs().max() <= TOLERANCE[dtype]
    assert (got.double() - want).abs().max() <= 2 * (sdpa.double() - want).abs().max() + TOLERANCE[dtype] / 8
    bool_mask = run(q, k, v, allowed)  # a boolean mask means the same
    assert torch.equal(bool_mask, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40])
def test_a_rows_output_does_not_depend_on_the_rows_or_padding_beside_it(dtype, dim):
    q, k, v, mask, _ = inputs(dtype, 3, 1, 90, dim, [0, 37, 13])
    together = run(q, k, v, mask)
    for row, pad in enumerate([0, 37, 13]):
        alone = run(q[row:row + 1], k[row:row + 1, :, pad:], v[row:row + 1, :, pad:], mask[row:row + 1, ..., pad:])
        assert torch.equal(alone[0], together[row])
        wider = torch.cat([torch.zeros_like(k[row:row + 1, :, :9]), k[row:row + 1, :, pad:]], 2)  # 9 more pads
        wider_v = torch.cat([torch.ones_like(v[row:row + 1, :, :9]), v[row:row + 1, :, pad:]], 2)
        wider_mask = torch.cat([torch.full_like(mask[row:row + 1, ..., :9], torch.finfo(dtype).min),
                                mask[row:row + 1, ..., pad:]], -1)
        assert torch.equal(run(q[row:row + 1], wider, wider_v, wider_mask)[0], together[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_query_computes_what_a_one_token_step_at_its_position_does(dtype):
    q_len, length = 4, 60
    q, k, v, mask, _ = inputs(dtype, 2, q_len, length, 64, [3, 0])
    verify = run(q, k, v, mask)
    for i in range(q_len):
        end = length - q_len + i + 1
        step = run(q[:, :, i:i + 1], k[:, :, :end], v[:, :, :end], mask[:, :, i:i + 1, :end])
        assert torch.equal(step[:, 0], verify[:, i])


def test_a_query_with_no_allowed_column_gets_the_mean_of_the_values_as_sdpa_gives():
    q, k, v, mask, _ = inputs(torch.float32, 1, 1, 20, 64, [0])
    mask.fill_(torch.finfo(torch.float32).min)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(run(q, k, v, mask), sdpa, atol=1e-6)


def test_the_attention_layers_run_the_kernel_for_short_queries_only():
    """``attention._attend`` hands a layer with the kernel attached its short CPU queries, and a prefill's long
    query to SDPA; without the kernel attached it runs SDPA throughout."""
    calls = []

    def kernel(*args):
        calls.append(args[0].shape[2])
        return BUILT.attend(*args)

    layer = SimpleNamespace(num_key_value_groups=HEADS // KV)
    own = SimpleNamespace(attend=kernel, causal=None)
    for q_len in (1, native.MAX_QUERY, native.MAX_QUERY + 1):
        q, k, v, mask, allowed = inputs(torch.float32, 2, q_len, 80, 64, [0, 4])
        plain = _attend(layer, q, k, v, mask, scaling=64 ** -0.5)[0]
        setattr(layer, native.ATTRIBUTE, own)
        fast = _attend(layer, q, k, v, mask, scaling=64 ** -0.5)[0]
        delattr(layer, native.ATTRIBUTE)
        assert (fast.double() - exact(q, k, v, allowed)).abs().max() <= TOLERANCE[torch.float32]
        assert (plain.double() - exact(q, k, v, allowed)).abs().max() <= TOLERANCE[torch.float32]
    assert calls == [1, native.MAX_QUERY]


def test_where_the_kernel_cannot_be_built_attention_stays_on_sdpa_and_the_user_is_told(monkeypatch):
    from batchspec_cli.job.assembly import attach_attention

    model = make_tiny_llama(TINY_VOCAB_SIZE, seed=0, dtype=torch.float32)
    assert native.running(model) == "sdpa"
    assert native.attach(model) and native.running(model) == f"batchspec {BUILT.key}" and len(BUILT.key) == 16
    native.detach(model)  # what a measured batch width is remembered under (assembly.build_engine) follows it
    assert native.running(model) == "sdpa"

    monkeypatch.setattr(native, "_built", native.Built(error="no C++ compiler"))
    assert attach_attention([model]) == ["batchspec's CPU kernels could not be built (no C++ compiler): "
                                         "attention runs on SDPA and the layers on transformers' modules"]
    assert attach_attention([model]) == []  # once a process
    assert not any(hasattr(m, native.ATTRIBUTE) for m in model.modules())


needs_causal = pytest.mark.skipif(torch.bfloat16 not in BUILT.causal_dtypes,
                                  reason="the bfloat16 causal kernel needs a CPU with AVX512-BF16")


@needs_causal
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("n, m", [(1, 1), (15, 15), (17, 17), (300, 300), (600, 600), (40, 300), (1, 270)])
def test_the_causal_kernel_matches_float64_attention_as_closely_as_sdpa_does(dim, n, m):
    """One row's prefill: n queries against m keys (m > n: a piece after earlier columns, causal from the bottom
    right). Blocks of 16 queries and tiles of 256 keys both end inside the shapes tested."""
    g = torch.Generator().manual_seed(n * 1000 + m)
    q = torch.randn(1, HEADS, n, dim, generator=g).bfloat16()
    k = (2 * torch.randn(1, KV, m, dim, generator=g)).bfloat16()
    v = torch.randn(1, KV, m, dim, generator=g).bfloat16()
    allowed = torch.arange(m)[None] <= torch.arange(m - n, m)[:, None]
    want = exact(q, k, v, allowed)[0]
    got = native.causal(BUILT, q, k, v, dim ** -0.5)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)[0].transpose(0, 1)
    assert got.shape == (n, HEADS, dim) and got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 1.5 * (sdpa.double() - want).abs().max() + 1e-3


needs_causal_float = pytest.mark.skipif(torch.float32 not in BUILT.causal_dtypes,
                                        reason="the float32 causal kernel needs a CPU with AVX-512, or AVX2 and FMA")


@needs_causal_float
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("n, m", [(1, 1), (15, 15), (17, 17), (300, 300), (600, 600), (40, 300), (1, 270), (33, 47)])
def test_the_float32_causal_kernel_matches_float64_attention_as_closely_as_sdpa_does(dim, n, m):
    """The same in float32: blocks of 16 queries, tiles of 256 keys, and key counts that end inside a block of 16."""
    g = torch.Generator().manual_seed(n * 1000 + m)
    q = torch.randn(1, HEADS, n, dim, generator=g)
    k = 2 * torch.randn(1, KV, m, dim, generator=g)
    v = torch.randn(1, KV, m, dim, generator=g)
    allowed = torch.arange(m)[None] <= torch.arange(m - n, m)[:, None]
    want = exact(q, k, v, allowed)[0]
    got = native.causal(BUILT, q, k, v, dim ** -0.5)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)[0].transpose(0, 1)
    assert got.shape == (n, HEADS, dim) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1.5 * (sdpa.double() - want).abs().max() + 1e-6
    strided = native.causal(BUILT, q.transpose(1, 2).contiguous().transpose(1, 2), k, v, dim ** -0.5)
    assert torch.equal(strided, got)  # a layer's query is a transposed view: the same numbers


@pytest.mark.skipif(BUILT.causal is None, reason="no causal kernel was built for this CPU")
def test_the_causal_kernel_leaves_what_it_does_not_take_to_sdpa():
    q = torch.randn(1, HEADS, 5, 64)
    assert native.causal(BUILT, q.half(), q[:, :KV].half(), q[:, :KV].half(), 0.125) is None  # float16
    assert native.causal(BUILT, q[..., :40], q[:, :KV, :, :40], q[:, :KV, :, :40], 0.125) is None  # dim 40
    assert native.causal(None, q, q[:, :KV], q[:, :KV], 0.125) is None  # no kernel built
    for dtype in (torch.float32, torch.bfloat16):
        if dtype not in BUILT.causal_dtypes:  # float32 without AVX2, bfloat16 without AVX512-BF16
            x = q.to(dtype)
            assert native.causal(BUILT, x, x[:, :KV], x[:, :KV], 0.125) is None


def test_a_mask_broadcast_over_rows_means_what_sdpa_makes_of_it_and_a_wrong_shape_is_an_error():
    q, k, v, mask, _ = inputs(torch.float32, 3, 1, 30, 64, [0, 0, 0])
    shared = mask[:1]  # one mask row for all rows
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=shared, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(run(q, k, v, shared), sdpa, atol=TOLERANCE[torch.float32])
    with pytest.raises(RuntimeError):
        BUILT.attend(q, k, v, mask[..., :20], 0.125)  # 20 mask columns for 30 keys
    with pytest.raises(RuntimeError):
        BUILT.attend(q, k[:2], v[:2], mask, 0.125)  # 2 rows of keys for 3 queries


def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_run(monkeypatch):
    """PyTorch's builder waits without end while its lock file exists; one older than any build is removed."""
    import os
    import threading
    import time

    from batchspec_cli.models.loading import cache_dir

    lock = cache_dir() / "kernels" / BUILT.key / "lock"
    lock.write_text("")
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    monkeypatch.setattr(native, "_built", None)  # as a new process: load again
    done = []
    worker = threading.Thread(target=lambda: done.append(native.load()), daemon=True)
    worker.start()
    worker.join(120)
    assert done and done[0].attend is not None and not lock.exists()


def test_a_failed_build_is_one_line_for_the_user_and_nothing_on_the_terminal(tmp_path, monkeypatch, capfd):
    """No compiler (CXX names none): the build fails, PyTorch's builder logs nothing, and the user's note gives the
    shell's complaint, not the compiler's command line."""
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native, "_built", None)
    built = native.load()
    assert built.attend is None and built.causal is None
    assert "not found" in built.error and len(built.error) <= 160 and "-isystem" not in built.error
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert native.Built(error=built.error).news() == [
        f"batchspec's CPU kernels could not be built ({built.error}): attention runs on SDPA and the layers on "
        "transformers' modules"]
