"""Oracles for the sampling math in batchspec_cli.engine.sampling: warping, keyed Gumbel noise, the coupling.

The statistical tests draw one coupled token per row key (the noise is keyed, so rows are
independent draws) and compare the empirical distribution with the warped target's exact
one within C / sqrt(N) total variation; broken rules must fail the same check.
(`tests/test_auto.py` runs the same kind of check through the whole engine.)
"""

from __future__ import annotations

import functools
import hashlib
import math

import pytest
import torch

from batchspec_cli.engine.sampling import coupled_accept, gumbel, gumbel_tokens, noise_base, row_key, warp_probs

torch.set_num_threads(1)

_M64 = (1 << 64) - 1


@functools.lru_cache(maxsize=None)
def _keys(n: int, seed: int = 1234) -> torch.Tensor:
    return torch.tensor([row_key(seed, f"row-{i}") for i in range(n)], dtype=torch.int64)


def _settings(n: int, temperature: float, top_k: int, top_p: float):
    return (torch.full((n,), temperature, dtype=torch.float64), torch.full((n,), top_k, dtype=torch.int64),
            torch.full((n,), top_p, dtype=torch.float64))


# --- keyed noise -------------------------------------------------------------------------


def _py_mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _py_gumbel(key: int, position: int, token: int) -> float:
    """The keyed noise in plain unsigned Python integers (no int64 wrap-around)."""
    row = _py_mix64(key ^ 0x6A09E667F3BCC909)
    base = _py_mix64((row + (position + 1) * 0x9E3779B97F4A7C15) & _M64)
    z = _py_mix64((base + (token + 1) * 0xBF58476D1CE4E5B9) & _M64)
    u = ((z >> 11) + 0.5) / float(1 << 53)
    return -math.log(-math.log(u))


def test_row_key_is_stable_63_bit_and_distinct():
    # pinned: a resumed run (another process, another version) must draw the same streams
    assert row_key(0, "a") == 6539243125055167529
    digest = hashlib.blake2b(b"0\x1fa", digest_size=8).digest()
    assert row_key(0, "a") == int.from_bytes(digest, "little") & ((1 << 63) - 1)
    keys = [row_key(seed, f"id-{i}") for seed in (0, 1) for i in range(5000)]
    assert all(0 <= key < 1 << 63 for key in keys)
    assert len(set(keys)) == len(keys)  # differs per id and per seed
    assert row_key(3, "x") == row_key(3, "x") != row_key(4, "x")


def test_gumbel_noise_matches_unsigned_reference():
    keys = torch.tensor([0, 1, (1 << 63) - 1, row_key(0, "a"), row_key(9, "long id / with spaces")])
    positions = torch.tensor([0, 1, 7, 4096, 1 << 40]).expand(len(keys), -1)  # [5, 5]
    tokens = torch.tensor([0, 3, 49151, 1 << 20])
    got = gumbel(noise_base(keys, positions)[..., None], tokens)  # [5, 5, 4]
    assert got.dtype == torch.float64 and got.shape == (5, 5, 4)
    expected = [[[_py_gumbel(int(k), int(p), int(t)) for t in tokens] for p in row] for k, row in zip(keys, positions)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)


def test_gumbel_noise_is_independent_of_batch_composition():
    keys = _keys(64)
    positions = torch.randint(0, 1000, (64, 5), generator=torch.Generator().manual_seed(0))
    vocab = torch.arange(50)
    g = gumbel(noise_base(keys, positions)[..., None], vocab)  # [64, 5, 50]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(gumbel(noise_base(keys[perm], positions[perm])[..., None], vocab), g[perm])
    assert torch.equal(gumbel(noise_base(keys[5:6], positions[5:6, 2:4])[..., None], vocab[7:9]), g[5:6, 2:4, 7:9])


def test_gumbel_noise_is_standard_gumbel_and_uncorrelated():
    n = 200_000
    keys = _keys(2000)
    g = gumbel(noise_base(keys, torch.arange(4).expand(2000, -1))[..., None], torch.arange(25))  # [2000, 4, 25]
    flat = g.flatten()[:n]
    u = torch.exp(-torch.exp(-flat))  # back to the uniform
    ecdf = torch.arange(1, u.numel() + 1, dtype=torch.float64) / u.numel()
    assert float((u.sort().values - ecdf).abs().max()) < 1.63 / math.sqrt(u.numel())  # KS, 1 % level
    assert float(flat.mean()) == pytest.approx(0.5772156649, abs=0.01)  # Euler-Mascheroni
    assert float(flat.var()) == pytest.approx(math.pi ** 2 / 6, abs=0.03)
    for other in (g[:, 1, :], g[:, 0, :].roll(1, dims=1), g.roll(1, dims=0)[:, 0, :]):  # position, token, key
        corr = float(torch.corrcoef(torch.stack([g[:, 0, :].flatten(), other.flatten()]))[0, 1])
        assert abs(corr) < 0.01


# --- warping ------------------------------------------------------------------------------


def _softmax_of(values: dict[int, float]) -> list[float]:
    """A [V] distribution over the given {token: logit}, zero elsewhere (by hand)."""
    total = sum(math.exp(v) for v in values.values())
    return [math.exp(values[t]) / total if t in values else 0.0 for t in range(6)]


def test_warp_probs_matches_hand_computed_reference():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])  # [V]; tokens by logit: 5, 0, 1, 2, 3, 4
    settings = [  # (temperature, top_k, top_p, expected distribution)
        # /0.5 -> [4, 2, 1, 0, -2, 6]; top-4 keeps 5, 0, 1, 2 with probs .862, .117, .016, .006;
        # top-p 0.9 keeps 5 (mass before 0) and 0 (mass before .862 < .9), drops 1 (.978)
        (0.5, 4, 0.9, _softmax_of({5: 6.0, 0: 4.0})),
        (1.0, 0, 1.0, _softmax_of({t: float(v) for t, v in enumerate(logits)})),
        (2.0, 2, 1.0, _softmax_of({5: 1.5, 0: 1.0})),
        # softmax: p5 = .605, p0 = .223 -> mass before token 1 is .827 >= .7
        (1.0, 0, 0.7, _softmax_of({5: 3.0, 0: 2.0})),
        (1.0, 1, 1.0, [0, 0, 0, 0, 0, 1.0]),  # top-1 = greedy
        (1.0, 0, 0.5, [0, 0, 0, 0, 0, 1.0]),  # the top token alone has .605 >= .5
        (1.0, 0, 0.0, [0, 0, 0, 0, 0, 1.0]),  # always at least one token
        (0.0, 3, 0.5, [0, 0, 0, 0, 0, 1.0]),  # greedy, filters irrelevant
        (-1.0, 0, 1.0, [0, 0, 0, 0, 0, 1.0]),
        (1.0, 100, 1.0, _softmax_of({t: float(v) for t, v in enumerate(logits)})),  # k > V
    ]
    temperature = torch.tensor([s[0] for s in settings])
    top_k = torch.tensor([s[1] for s in settings])
    top_p = torch.tensor([s[2] for s in settings])
    # two positions per row: the logits, then the same logits reversed
    batch = torch.stack([logits, logits.flip(0)])[None].expand(len(settings), -1, -1)  # [B, 2, V]
    probs = warp_probs(batch, temperature, top_k, top_p)
    assert probs.dtype == torch.float64 and probs.shape == (len(settings), 2, 6)
    expected = torch.tensor([s[3] for s in settings], dtype=torch.float64)  # [B, V]
    torch.testing.assert_close(probs[:, 0], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(probs[:, 1], expected.flip(-1), rtol=0, atol=1e-12)


def test_warp_probs_matches_hugging_face_warpers():
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(6, 3, 50, generator=g, dtype=torch.float64)  # [B, n, V]
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0, 1.0])
    top_k = torch.tensor([0, 10, 0, 5, 20, 1])
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.95, 0.5, 0.9])
    probs = warp_probs(logits, temperature, top_k, top_p)
    for b in range(6):
        warpers = [logits_process.TemperatureLogitsWarper(float(temperature[b]))]
        if top_k[b] > 0:
            warpers.append(logits_process.TopKLogitsWarper(int(top_k[b])))
        if top_p[b] < 1:
            warpers.append(logits_process.TopPLogitsWarper(float(top_p[b])))
        scores = logits[b].clone()  # [n, V]
        for warper in warpers:
            scores = warper(None, scores)
        torch.testing.assert_close(probs[b], torch.softmax(scores, -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_warp_probs_accepts_low_precision_logits(dtype):
    logits = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(0)).to(
        dtype
    )  # [B, n, V]
    probs = warp_probs(
        logits,
        torch.tensor([0.0, 1.0, 0.6]),
        torch.tensor([0, 8, 0]),
        torch.tensor([1.0, 0.9, 0.8]),
    )
    assert probs.dtype == torch.float64
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4, dtype=torch.float64))
    assert torch.equal(probs[0].argmax(-1), logits[0].argmax(-1)) and bool(
        (probs[0].max(-1).values == 1).all()
    )


# --- the coupled token and acceptance -----------------------------------------------------

N_ROWS = 1 << 16


def _coupled_frequencies(logits: torch.Tensor, settings: tuple, n: int, rule=None) -> torch.Tensor:
    """Empirical distribution [V] of the coupled token of ``n`` independent rows (keys) for the same logits [V]."""
    keys = _keys(n)
    batch = logits[None, None].expand(n, 1, -1)  # [n, 1, V]
    temperature, top_k, top_p = _settings(n, *settings)
    base = noise_base(keys, torch.zeros(n, 1, dtype=torch.int64))
    filters = (settings[1] > 0, settings[2] < 1)
    tokens = (rule or gumbel_tokens)(batch, temperature, top_k, top_p, base, [True] * n, filters)[:, 0]
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / n


LOGITS = torch.tensor([1.5, 0.2, -0.3, 2.1, 0.9, -1.0, 0.0, 1.1], dtype=torch.float64)  # [V = 8]
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 5, 1.0), (1.6, 4, 0.95)]


@pytest.mark.parametrize("settings", SETTINGS)
def test_coupled_token_is_a_sample_of_the_warped_target(settings):
    exact = warp_probs(LOGITS[None, None], *(t[:1] for t in _settings(1, *settings)))[0, 0]
    freq = _coupled_frequencies(LOGITS, settings, N_ROWS)
    tv = 0.5 * float((freq - exact).abs().sum())
    assert tv < 3 * math.sqrt(8) / math.sqrt(N_ROWS) / 2, tv
    assert float(freq[exact == 0].sum()) == 0.0  # never a token outside top-k / top-p


def _plain_probs_plus_noise(logits, temperature, top_k, top_p, base, sampled, filters):
    """Broken: argmax(p + g) instead of argmax(log p + g)."""
    probs = warp_probs(logits, temperature, top_k, top_p, filters)
    return (probs + gumbel(base[..., None], torch.arange(logits.shape[-1]))).argmax(-1)


def _raw_logits_plus_noise(logits, temperature, top_k, top_p, base, sampled, filters):
    """Broken: the noise on the raw logits, ignoring temperature and filters."""
    return (logits.double() + gumbel(base[..., None], torch.arange(logits.shape[-1]))).argmax(-1)


@pytest.mark.parametrize("rule", [_plain_probs_plus_noise, _raw_logits_plus_noise])
def test_broken_rules_fail_the_same_check(rule):
    settings = (0.7, 0, 0.9)
    exact = warp_probs(LOGITS[None, None], *(t[:1] for t in _settings(1, *settings)))[0, 0]
    freq = _coupled_frequencies(LOGITS, settings, N_ROWS, rule)
    assert 0.5 * float((freq - exact).abs().sum()) > 3 * math.sqrt(8) / math.sqrt(N_ROWS) / 2


def test_the_cpu_support_path_equals_the_whole_vocabulary_path():
    """On the CPU with top-k/top-p the noise is drawn only where p > 0; the tokens are the ones the full noise gives."""
    g = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(6, 4, 300, generator=g)  # [B, n, V]
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 0.5], dtype=torch.float64)
    top_k, top_p = torch.tensor([0, 20, 0, 5, 0, 50]), torch.tensor([0.9, 1.0, 1.0, 0.8, 0.95, 1.0])
    base = noise_base(_keys(6), torch.arange(4).expand(6, -1))
    sampled = [bool(t > 0) for t in temperature]
    sparse = gumbel_tokens(logits, temperature, top_k, top_p, base, sampled, (True, True))
    probs = warp_probs(logits, temperature, top_k, top_p)
    dense = (probs.log() + gumbel(base[..., None], torch.arange(300))).argmax(-1)
    assert torch.equal(sparse[[0, 1, 3, 4, 5]], dense[[0, 1, 3, 4, 5]])
    assert torch.equal(sparse[2], logits[2].argmax(-1))  # the greedy row: g = 0


def test_coupled_accept_by_hand():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [5, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [4, 2, 3, 8], [5, 6, 7, 8]])  # [B, k+1]
    n, nxt = coupled_accept(drafts, None, target)
    assert n.tolist() == [3, 1, 0, 3] and nxt.tolist() == [8, 6, 4, 8]  # bonus, corrections
    lengths = torch.tensor([3, 3, 3, 1])  # the last row drafted one real token: filler after it is never accepted
    n, nxt = coupled_accept(drafts, lengths, target)
    assert n.tolist() == [3, 1, 0, 1] and nxt.tolist() == [8, 6, 4, 6]


def test_a_draft_equal_to_the_target_is_always_accepted():
    """The same logits and the same noise give the same token: everything is accepted at any temperature."""
    g = torch.Generator().manual_seed(2)
    logits = 2 * torch.randn(32, 4, 40, generator=g)  # [B, k+1, V]
    for temperature, top_k, top_p in [(0.5, 0, 1.0), (1.0, 10, 0.9), (1.7, 0, 0.95), (0.0, 0, 1.0)]:
        settings = _settings(32, temperature, top_k, top_p)
        base = noise_base(_keys(32), torch.arange(4).expand(32, -1))
        flags = (top_k > 0, top_p < 1)
        target = gumbel_tokens(logits, *settings, base, [temperature > 0] * 32, flags)
        drafts = torch.stack([gumbel_tokens(logits[:, j : j + 1], *settings, base[:, j : j + 1],
                                            [temperature > 0] * 32, flags)[:, 0] for j in range(3)], 1)
        n, nxt = coupled_accept(drafts, None, target)
        assert n.tolist() == [3] * 32 and torch.equal(nxt, target[:, 3])
