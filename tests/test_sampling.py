"""Oracles for the speculative sampling math in batchspec_cli.sampling.

The central test is statistical: a toy draft and target (fixed Markov tables over a
vocabulary of 6, the draft far from the target) decode N independent rows speculatively,
and the empirical joint distribution of the first committed tokens must be within
C / sqrt(N) total variation of the target's exact joint distribution, computed by
enumeration. Three deliberately broken acceptance rules must fail the same check.
"""

from __future__ import annotations

import functools
import hashlib
import math

import pytest
import torch

from batchspec_cli.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_TARGET,
    greedy_accept,
    keyed_uniform,
    row_key,
    sample_from,
    speculative_accept,
    warp_probs,
)

torch.set_num_threads(1)

VOCAB = 6
START = 0  # the token every toy row's prompt ends with
N_ROWS = 1 << 17  # 131072 rows; the shrink check uses N_ROWS // 16


# --- helpers ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _keys(n: int, seed: int = 1234) -> torch.Tensor:
    return torch.tensor([row_key(seed, f"row-{i}") for i in range(n)], dtype=torch.int64)


def _settings(n: int, temperature: float, top_k: int, top_p: float):
    return (
        torch.full((n,), temperature, dtype=torch.float64),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.full((n,), top_p, dtype=torch.float64),
    )


def _toy_tables(seed: int = 21) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft next-token logits, [V, V] each, row = previous token.

    The draft is half the target's logits plus noise: far from the target (TV 0.49 / 0.56
    on average for the two warpings), yet the first round's accepted count is spread over
    0..k (12-52 % each), so acceptances, corrections and bonuses all occur.
    """
    g = torch.Generator().manual_seed(seed)
    target = 2.5 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    draft = 0.5 * target + 2.0 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    return target, draft


def _warped_table(logits: torch.Tensor, warp: dict) -> torch.Tensor:
    """[V, V] warped probabilities of a Markov table (row = previous token)."""
    return warp_probs(logits[None], *_settings(1, **warp))[0]


def _exact_joint(target_logits: torch.Tensor, warp: dict, m: int) -> torch.Tensor:
    """The target's exact distribution of its first m tokens after START, flattened [V**m]."""
    table = _warped_table(target_logits, warp)
    joint = table[START]  # [V]
    for _ in range(m - 1):
        # P(x_1..x_j, x_{j+1}) = P(x_1..x_j) * p(x_{j+1} | x_j)
        joint = (joint.reshape(-1, VOCAB)[..., None] * table[None]).reshape(-1)  # [V**(j+1)]
    return joint


def _simulate(rule, target_logits, draft_logits, warp: dict, n_rows: int, k: int, m: int):
    """Decode n_rows rows speculatively (rounds of k drafts) until each has m tokens.

    Every row starts after START at completion position 0; a round commits
    drafts[:n] + [next_token]; rows need at most m rounds. Randomness is keyed per
    (row, position, stream) as in the engine. Every row has the same warping, so the
    [V, V] tables are warped once and indexed by the previous token.
    Returns (the first m committed tokens [n_rows, m], first-round n_accepted [n_rows]).
    """
    keys = _keys(n_rows)
    p_table, q_table = _warped_table(target_logits, warp), _warped_table(draft_logits, warp)
    committed = torch.full((n_rows, m * (k + 1)), -1, dtype=torch.int64)
    length = torch.zeros(n_rows, dtype=torch.int64)  # committed tokens per row
    last = torch.full((n_rows,), START, dtype=torch.int64)
    steps = torch.arange(k + 1)
    first_round = None
    while bool((length < m).any()):
        positions = length[:, None] + steps  # [N, k+1]
        # 1. draft: k tokens, one at a time, each sampled from the draft's warped q
        context = [last]
        for i in range(k):
            u = keyed_uniform(keys, positions[:, i : i + 1], STREAM_DRAFT)[:, 0]  # [N]
            context.append(sample_from(q_table[context[-1]], u))
        context = torch.stack(context, 1)  # [N, k+1]: last committed token, then the drafts
        drafts, q = context[:, 1:], q_table[context[:, :k]]  # [N, k], [N, k, V]
        # 2. verify: the target's p after each drafted prefix, plus the bonus position
        p = p_table[context]  # [N, k+1, V]
        # 3. accept
        u_accept = keyed_uniform(keys, positions[:, :k], STREAM_ACCEPT)  # [N, k]
        u_target = keyed_uniform(keys, positions, STREAM_TARGET)  # [N, k+1]
        n_accepted, next_token = rule(drafts, q, p, u_accept, u_target)
        first_round = n_accepted if first_round is None else first_round
        # 4. commit drafts[:n] + [next_token] to the rows that still need tokens
        active = length < m  # [N]
        new = torch.cat([drafts, next_token[:, None]], 1).scatter(
            1, n_accepted[:, None], next_token[:, None]
        )
        keep = (steps[None] <= n_accepted[:, None]) & active[:, None]  # [N, k+1]
        cols = length.clamp(max=m - 1)[:, None] + steps  # [N, k+1]; inactive rows rewrite
        committed.scatter_(1, cols, torch.where(keep, new, committed.gather(1, cols)))
        last = torch.where(active, next_token, last)
        length = torch.where(active, length + n_accepted + 1, length)
    return committed[:, :m], first_round


def _total_variation(tokens: torch.Tensor, exact: torch.Tensor) -> float:
    """TV between the empirical joint of token tuples [N, m] and an exact joint [V**m]."""
    m = tokens.shape[1]
    flat = (tokens * (VOCAB ** torch.arange(m - 1, -1, -1))).sum(1)
    empirical = torch.bincount(flat, minlength=VOCAB**m).double() / tokens.shape[0]
    return 0.5 * float((empirical - exact).abs().sum())


def _bound(m: int, n_rows: int) -> float:
    """C / sqrt(N) with C = 3 sqrt(#outcomes); a correct sampler's expected TV is at most
    sqrt(2 / pi) / 2 * sqrt(#outcomes / N) ~ 0.4 sqrt(#outcomes / N), so this is ~7x slack."""
    return 3.0 * math.sqrt(VOCAB**m) / math.sqrt(n_rows)


# --- broken acceptance rules (each must fail the statistical oracle) --------------------


def _always_accept(drafts, q, p, u_accept, u_target):
    """Broken: accept every draft, then take the bonus from p_{k+1}."""
    k = drafts.shape[1]
    n = torch.full((drafts.shape[0],), k, dtype=torch.int64)
    return n, sample_from(p[:, k], u_target[:, k])


def _abs_residual(drafts, q, p, u_accept, u_target):
    """Broken: correct acceptance, but the correction from normalize(|p - q|)."""
    n, _ = speculative_accept(drafts, q, p, u_accept, u_target)
    k = drafts.shape[1]
    rows = torch.arange(drafts.shape[0])
    q_n = q[rows, n.clamp(max=k - 1)] * (n < k)[:, None]
    return n, sample_from((p[rows, n] - q_n).abs(), u_target[rows, n])


def _target_at_rejection(drafts, q, p, u_accept, u_target):
    """Broken: correct acceptance, but the correction sampled from p, not the residual."""
    n, _ = speculative_accept(drafts, q, p, u_accept, u_target)
    rows = torch.arange(drafts.shape[0])
    return n, sample_from(p[rows, n], u_target[rows, n])


# k drafts, and the warping applied identically to draft and target
CONFIGS = {
    "plain-k2": (2, dict(temperature=1.0, top_k=0, top_p=1.0)),
    "warped-k3": (3, dict(temperature=0.8, top_k=5, top_p=0.9)),
}


def _joint_lengths(k: int) -> tuple[int, ...]:
    """Compare the joint of the first 2 committed tokens, and of the first 3 when k >= 3."""
    return (2, 3) if k >= 3 else (2,)


def _oracle(rule, name: str, n_rows: int) -> list[tuple[int, float, float]]:
    """Run the toy decode; (m, total variation, bound) for each compared joint length m."""
    k, warp = CONFIGS[name]
    target, draft = _toy_tables()
    lengths = _joint_lengths(k)
    tokens, _ = _simulate(rule, target, draft, warp, n_rows, k, max(lengths))
    return [
        (m, _total_variation(tokens[:, :m], _exact_joint(target, warp, m)), _bound(m, n_rows))
        for m in lengths
    ]


# --- the statistical oracle -------------------------------------------------------------


def test_toy_draft_is_far_from_target():
    target, draft = _toy_tables()
    for k, warp in CONFIGS.values():
        p_table, q_table = _warped_table(target, warp), _warped_table(draft, warp)
        tv = 0.5 * (p_table - q_table).abs().sum(-1)  # [V]
        assert float(tv.mean()) >= 0.4 and float(tv[START]) >= 0.4
        for m in _joint_lengths(k):
            assert abs(float(_exact_joint(target, warp, m).sum()) - 1.0) < 1e-12


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_sampling_matches_target_distribution(name):
    k, warp = CONFIGS[name]
    target, draft = _toy_tables()
    _, n_accepted = _simulate(speculative_accept, target, draft, warp, N_ROWS, k, 1)
    counts = torch.bincount(n_accepted, minlength=k + 1)  # [k+1]
    assert bool((counts > N_ROWS // 50).all())  # rejections at every position, and bonuses

    small, large = (
        _oracle(speculative_accept, name, N_ROWS // 16),
        _oracle(speculative_accept, name, N_ROWS),
    )
    for m, tv, bound in small + large:
        assert tv < bound, (m, tv, bound)
    for (_, tv_small, bound_small), (_, tv_large, bound_large) in zip(small, large, strict=True):
        assert bound_large == pytest.approx(bound_small / 4)  # C / sqrt(N) shrinks with N
        assert tv_large < tv_small  # and so does the error (~4x expected)


@pytest.mark.parametrize("rule", [_always_accept, _abs_residual, _target_at_rejection])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_broken_rules_fail_the_oracle(name, rule):
    checks = _oracle(rule, name, N_ROWS)
    assert any(tv > bound for _, tv, bound in checks), checks
    m2, tv2, bound2 = checks[0]
    assert m2 == 2 and tv2 > 2 * bound2  # not a near miss: the 2-token joint alone is far off


# --- keyed randomness -------------------------------------------------------------------

_M64 = (1 << 64) - 1


def _py_mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _py_keyed_uniform(key: int, position: int, stream: int) -> float:
    """The counter-based uniform in plain unsigned Python integers (no int64 wrap-around)."""
    stream_seed = _py_mix64(key ^ _py_mix64((stream * 0xD1B54A32D192ED03) & _M64))
    z = _py_mix64(_py_mix64((stream_seed + (position + 1) * 0x9E3779B97F4A7C15) & _M64))
    return (z >> 11) / float(1 << 53)


def test_row_key_is_stable_63_bit_and_distinct():
    # pinned: a resumed run (another process, another version) must draw the same streams
    assert row_key(0, "a") == 6539243125055167529
    digest = hashlib.blake2b(b"0\x1fa", digest_size=8).digest()
    assert row_key(0, "a") == int.from_bytes(digest, "little") & ((1 << 63) - 1)
    keys = [row_key(seed, f"id-{i}") for seed in (0, 1) for i in range(5000)]
    assert all(0 <= key < 1 << 63 for key in keys)
    assert len(set(keys)) == len(keys)  # differs per id and per seed
    assert row_key(3, "x") == row_key(3, "x") != row_key(4, "x")


def test_keyed_uniform_matches_unsigned_reference():
    keys = torch.tensor([0, 1, (1 << 63) - 1, row_key(0, "a"), row_key(9, "long id / with spaces")])
    positions = torch.tensor([0, 1, 7, 4096, 1 << 40]).expand(len(keys), -1)  # [5, 5]
    for stream in (STREAM_DRAFT, STREAM_ACCEPT, STREAM_TARGET):
        got = keyed_uniform(keys, positions, stream)
        assert got.dtype == torch.float64 and got.shape == positions.shape
        expected = [
            [_py_keyed_uniform(int(key), int(pos), stream) for pos in row]
            for key, row in zip(keys, positions, strict=True)
        ]
        assert got.tolist() == expected
    assert (
        keyed_uniform(keys[3:4], torch.tensor([[0]]), STREAM_DRAFT).item() == 0.04789629789461136
    )  # pinned


def test_keyed_uniform_is_deterministic_and_independent_of_batch_composition():
    keys = _keys(64)
    positions = torch.randint(0, 1000, (64, 5), generator=torch.Generator().manual_seed(0))
    u = keyed_uniform(keys, positions, STREAM_ACCEPT)
    assert torch.equal(u, keyed_uniform(keys.clone(), positions.clone(), STREAM_ACCEPT))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(keyed_uniform(keys[perm], positions[perm], STREAM_ACCEPT), u[perm])
    assert torch.equal(keyed_uniform(keys[5:6], positions[5:6, 2:4], STREAM_ACCEPT), u[5:6, 2:4])


def test_keyed_uniform_is_uniform_in_unit_interval():
    n_rows, n_pos = 1000, 100  # 1e5 draws
    u = keyed_uniform(_keys(n_rows), torch.arange(n_pos).expand(n_rows, -1), STREAM_DRAFT).flatten()
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    ecdf = torch.arange(1, u.numel() + 1, dtype=torch.float64) / u.numel()
    ks = float((u.sort().values - ecdf).abs().max())
    assert ks < 1.63 / math.sqrt(u.numel())  # Kolmogorov-Smirnov at the 1 % level
    histogram = torch.histc(u, bins=20, min=0.0, max=1.0)
    chi2 = float(((histogram - u.numel() / 20) ** 2 / (u.numel() / 20)).sum())
    assert chi2 < 43.8  # chi-square with 19 degrees of freedom, 0.1 % level
    assert float(u.mean()) == pytest.approx(0.5, abs=0.005) and float(u.var()) == pytest.approx(
        1 / 12, abs=0.002
    )


def test_keyed_uniform_streams_positions_and_keys_are_uncorrelated():
    n = 100_000
    hashed, consecutive = _keys(n), torch.arange(n)  # consecutive raw keys stress the mixer
    for keys in (hashed, consecutive):
        pos = torch.zeros(n, 1, dtype=torch.int64)
        base = keyed_uniform(keys, pos, STREAM_DRAFT)[:, 0]
        others = {
            "accept stream": keyed_uniform(keys, pos, STREAM_ACCEPT)[:, 0],
            "target stream": keyed_uniform(keys, pos, STREAM_TARGET)[:, 0],
            "next position": keyed_uniform(keys, pos + 1, STREAM_DRAFT)[:, 0],
            "far position": keyed_uniform(keys, pos + 1000, STREAM_DRAFT)[:, 0],
            "next key": base.roll(1),
        }
        for what, other in others.items():
            corr = float(torch.corrcoef(torch.stack([base, other]))[0, 1])
            assert abs(corr) < 0.01, (what, corr)
            assert not torch.equal(base, other)


# --- warping and sampling ---------------------------------------------------------------


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


def test_sample_from_matches_probabilities():
    probs = torch.tensor([0.1, 0.0, 0.25, 0.4, 0.0, 0.25], dtype=torch.float64)  # [V]
    n = 100_000
    u = keyed_uniform(_keys(n), torch.zeros(n, 1, dtype=torch.int64), STREAM_TARGET)[:, 0]  # [N]
    tokens = sample_from(probs.expand(n, -1), u)
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    freq = torch.bincount(tokens, minlength=6).double() / n
    assert 0.5 * float((freq - probs).abs().sum()) < 3 * math.sqrt(6) / math.sqrt(n)
    assert float(freq[1]) == 0.0 and float(freq[4]) == 0.0


def test_sample_from_never_returns_zero_probability_tokens():
    probs = torch.tensor(  # [4, V]: zeros first, in the middle, last; an unnormalised row
        [
            [0.0, 0.0, 0.3, 0.7, 0.0, 0.0],
            [0.5, 0.0, 0.0, 0.0, 0.5, 0.0],
            [1e-300, 0, 0, 0, 0, 0],
            [3.0, 0, 5.0, 0, 0, 0],
        ],
        dtype=torch.float64,
    )
    edges = [
        0.0,
        2.0**-53,
        0.3,
        0.5,
        0.5 - 2.0**-53,
        1.0 - 2.0**-53,
        1.0,
    ]  # 1.0: out of range, clamped
    for u in edges:
        tokens = sample_from(probs, torch.full((4,), u, dtype=torch.float64))
        assert bool((probs.gather(1, tokens[:, None]) > 0).all()), (u, tokens)
    scaled = sample_from(probs * 2.0**10, torch.tensor([0.1, 0.6, 0.9, 0.5]))  # scale is irrelevant
    assert torch.equal(scaled, sample_from(probs, torch.tensor([0.1, 0.6, 0.9, 0.5])))
    assert sample_from(probs, torch.tensor([0.1, 0.6, 0.9, 0.5])).tolist() == [2, 4, 0, 2]


def test_sample_from_falls_back_to_argmax_on_zero_rows_and_keeps_leading_dims():
    probs = torch.zeros(2, 3, 5, dtype=torch.float64)  # [2, 3, V]
    probs[0, 1, 3] = 1.0
    probs[1, 2] = torch.tensor([0.0, 0.2, 0.0, 0.8, 0.0])
    tokens = sample_from(probs, torch.full((2, 3), 0.5))
    assert tokens.shape == (2, 3)
    assert tokens.tolist() == [[0, 3, 0], [0, 0, 3]]  # all-zero rows -> argmax (0)


# --- acceptance -------------------------------------------------------------------------


def _random_round(
    batch: int, k: int, vocab: int, temperature, top_k, top_p, seed: int, noise: float
):
    """Draft and target logits for one round, drafts sampled from q with keyed uniforms.

    The toy models are position-wise (each drafted position has its own fixed logits), which
    is all the acceptance rule looks at. Returns drafts [B, k], q [B, k, V], p [B, k+1, V],
    u_accept [B, k], u_target [B, k+1], target logits [B, k+1, V].
    """
    g = torch.Generator().manual_seed(seed)
    target_logits = 2 * torch.randn(batch, k + 1, vocab, generator=g, dtype=torch.float64)
    draft_logits = target_logits[:, :k] + noise * torch.randn(
        batch, k, vocab, generator=g, dtype=torch.float64
    )
    settings = (torch.as_tensor(temperature), torch.as_tensor(top_k), torch.as_tensor(top_p))
    q, p = warp_probs(draft_logits, *settings), warp_probs(target_logits, *settings)
    keys = _keys(batch, seed)
    positions = torch.arange(k + 1).expand(batch, -1) + 10  # [B, k+1]
    drafts = sample_from(q, keyed_uniform(keys, positions[:, :k], STREAM_DRAFT))
    u_accept = keyed_uniform(keys, positions[:, :k], STREAM_ACCEPT)
    u_target = keyed_uniform(keys, positions, STREAM_TARGET)
    return drafts, q, p, u_accept, u_target, target_logits


def test_acceptance_boundary_and_residual_by_hand():
    q = torch.tensor([[[0.5, 0.5, 0.0]]], dtype=torch.float64)  # [1, 1, V]
    p = torch.tensor([[[0.2, 0.8, 0.0], [0.0, 0.0, 1.0]]], dtype=torch.float64)  # [1, 2, V]
    drafts = torch.tensor([[0]])  # p/q = 0.4 at the drafted token
    u_target = torch.tensor([[0.0, 0.5]])
    n, token = speculative_accept(drafts, q, p, torch.tensor([[0.399]]), u_target)
    assert (n.item(), token.item()) == (1, 2)  # accepted: the bonus comes from p_2
    for u_target_0 in (0.0, 0.5, 1 - 2.0**-53):  # residual max(0, p - q) = [0, .3, 0]: always 1
        n, token = speculative_accept(
            drafts, q, p, torch.tensor([[0.4]]), torch.tensor([[u_target_0, 0.5]])
        )
        assert (n.item(), token.item()) == (0, 1)
    n, _ = speculative_accept(
        torch.tensor([[1]]), q, p, torch.tensor([[0.999]]), u_target
    )  # p/q = 1.6
    assert n.item() == 1


@pytest.mark.parametrize("k", [1, 4])
def test_draft_equal_to_target_accepts_everything_at_any_temperature(k):
    temperature = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 3.0, 1.0, 0.8] * 8)
    top_k = torch.tensor([0, 0, 5, 0, 10, 0, 3, 0] * 8)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 1.0, 1.0, 0.5] * 8)
    drafts, q, p, u_accept, u_target, _ = _random_round(
        64, k, 20, temperature, top_k, top_p, seed=5, noise=0.0
    )
    p[:, :k] = q  # the same warping of the same logits: identical already, assert it anyway
    n, token = speculative_accept(drafts, q, p, u_accept, u_target)
    assert bool((n == k).all())
    assert torch.equal(token, sample_from(p[:, k], u_target[:, k]))  # the bonus


def test_greedy_rows_reduce_to_greedy_accept():
    k, batch = 4, 64
    temperature = torch.tensor([0.0, 1.0] * (batch // 2))  # greedy rows inside a sampled batch
    top_k, top_p = torch.zeros(batch, dtype=torch.int64), torch.ones(batch, dtype=torch.float64)
    drafts, q, p, u_accept, u_target, target_logits = _random_round(
        batch, k, 8, temperature, top_k, top_p, seed=11, noise=1.0
    )
    greedy = temperature == 0
    n, token = speculative_accept(drafts, q, p, u_accept, u_target)
    n_ref, token_ref = greedy_accept(drafts, target_logits.argmax(-1))
    assert torch.equal(n[greedy], n_ref[greedy]) and torch.equal(token[greedy], token_ref[greedy])
    assert len(set(n[greedy].tolist())) >= 3  # corrections at several positions, not one case
    for u_a, u_t in [
        (0.0, 0.0),
        (1 - 2.0**-53, 1 - 2.0**-53),
    ]:  # uniforms are irrelevant to greedy rows
        n_u, token_u = speculative_accept(
            drafts, q, p, torch.full_like(u_accept, u_a), torch.full_like(u_target, u_t)
        )
        assert torch.equal(n_u[greedy], n_ref[greedy]) and torch.equal(
            token_u[greedy], token_ref[greedy]
        )


def test_greedy_accept_by_hand():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [7, 2, 3]])  # [B, k]
    target_argmax = torch.tensor(
        [[1, 2, 3, 9], [1, 5, 3, 9], [1, 2, 4, 9], [1, 2, 3, 9]]
    )  # [B, k+1]
    n, token = greedy_accept(drafts, target_argmax)
    assert n.tolist() == [3, 1, 2, 0]  # a later match after a mismatch does not count
    assert token.tolist() == [9, 5, 4, 1]  # bonus, then corrections


def test_residual_without_mass_samples_from_target():
    vocab, n_rows = 5, 50_000
    probs = torch.tensor([0.1, 0.0, 0.3, 0.6, 0.0], dtype=torch.float64)
    p = probs.expand(n_rows, 3, vocab).clone()  # [N, k+1, V], k = 2
    q = p[:, :2].clone()  # p == q exactly
    q[n_rows // 2 :, 1] += torch.tensor([1e-14, 0, -1e-14, 0, 0], dtype=torch.float64)  # p ≈ q
    drafts = torch.full((n_rows, 2), 2)
    u_accept = torch.tensor([0.0, 1.0]).expand(n_rows, -1)  # u = 1 forces a rejection at position 1
    keys = _keys(n_rows)
    u_target = keyed_uniform(keys, torch.arange(3).expand(n_rows, -1), STREAM_TARGET)
    n, token = speculative_accept(drafts, q, p, u_accept, u_target)
    assert bool((n == 1).all())
    assert bool((probs[token] > 0).all())  # a token from p, not a NaN-driven index
    freq = torch.bincount(token, minlength=vocab).double() / n_rows
    assert 0.5 * float((freq - probs).abs().sum()) < 3 * math.sqrt(vocab) / math.sqrt(n_rows)


def test_speculative_accept_is_independent_of_batch_composition():
    temperature = torch.linspace(0.0, 2.0, 32)
    args = _random_round(
        32, 3, 10, temperature, torch.zeros(32, dtype=torch.int64), torch.ones(32), 2, 1.5
    )[:5]
    n, token = speculative_accept(*args)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    n_perm, token_perm = speculative_accept(*(a[perm] for a in args))
    assert torch.equal(n_perm, n[perm]) and torch.equal(token_perm, token[perm])
    n_one, token_one = speculative_accept(*(a[7:8] for a in args))
    assert (n_one.item(), token_one.item()) == (n[7].item(), token[7].item())
