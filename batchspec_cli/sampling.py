"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023) as pure torch functions.

A round proposes ``k`` draft tokens ``d_1..d_k`` sampled from the draft's warped
distributions ``q_1..q_k``; the target gives warped distributions ``p_1..p_{k+1}`` in one
forward. Draft ``d_i`` is *accepted* with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the
first rejection the *correction* is sampled from ``normalize(max(0, p_i - q_i))``; when all k
are accepted the *bonus* is sampled from ``p_{k+1}``. The committed tokens are then
distributed exactly as the target's own samples. Greedy rows (temperature 0) are the special
case where p and q are one-hot: acceptance becomes "draft == target argmax".

Randomness is *keyed*, not drawn from a global generator: the uniform that decides a token is
a pure function of (row key, completion position, stream), so a row's completion does not
depend on batch size, grouping, bucket order or a resumed run. The three streams keep the
draft's sample, the acceptance test and the correction/bonus sample on separate draws. A
round that commits tokens at positions ``L..L+n`` only ever reads uniforms at those
positions (the drafts it discards were sampled at positions > L+n and their draws are not
part of the outcome), so the next round, starting at ``L+n+1``, draws fresh uniforms.

Shapes: ``B`` rows, ``k`` drafts per round, ``V`` vocabulary. Nothing here syncs with the
host except ``warp_probs``' check of whether any row filters (free when the per-row settings
live on the CPU).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

STREAM_DRAFT = 0  # the draft's sample for a position
STREAM_ACCEPT = 1  # the acceptance uniform for a position
STREAM_TARGET = 2  # the residual / bonus / plain AR sample for a position

RESIDUAL_EPS = 1e-12  # a residual max(0, p - q) with less mass than this means p ≈ q: sample p


def _i64(c: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)  # splitmix64 increment
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_STREAM_SALT = 0xD1B54A32D192ED03  # spreads the stream tags apart before mixing


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on negative values)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps modulo 2**64)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def row_key(seed: int, row_id: str) -> int:
    """A stable 63-bit key for a row's random streams, from the run seed and the row id."""
    digest = hashlib.blake2b(f"{seed}\x1f{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def keyed_uniform(keys: Tensor, positions: Tensor, stream: int) -> Tensor:
    """Counter-based uniforms in [0, 1): a pure function of (key, position, stream).

    keys: [B] int64 row keys (``row_key``); positions: [B, n] int64 0-based completion
    positions of the tokens being decided. Returns [B, n] float64.

    The (key, stream) pair seeds a splitmix64 sequence and the position indexes into it;
    the top 53 bits of the mixed word make the double.
    """
    keys = keys.to(torch.int64)
    positions = positions.to(device=keys.device, dtype=torch.int64)
    salt = torch.full_like(keys, _i64(stream * _STREAM_SALT % (1 << 64)))  # [B]
    stream_seed = _mix64(keys ^ _mix64(salt))  # [B]
    z = _mix64(_mix64(stream_seed[:, None] + (positions + 1) * _GOLDEN))
    return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))


def warp_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Warped next-token probabilities, in float64, in Hugging Face's order.

    logits: [B, n, V] any float dtype; temperature: [B] (<= 0: greedy); top_k: [B] int
    (0: off); top_p: [B] float (>= 1: off). Returns probs [B, n, V] float64.

    Temperature scales the logits, top-k keeps every token whose logit ties or beats the
    k-th largest, top-p then keeps the smallest most-probable set whose mass reaches top_p
    (always the top token). Greedy rows get a one-hot on the argmax of the raw logits.
    Keep the [B] settings on the CPU to skip the sort, without a device sync, when no row
    filters.
    """
    device = logits.device
    x = logits.to(torch.float64)
    vocab = x.shape[-1]
    any_top_k = bool((top_k > 0).any())
    any_top_p = bool((top_p < 1.0).any())
    temperature = temperature.to(device=device, dtype=torch.float64)
    top_k = top_k.to(device=device, dtype=torch.int64)
    top_p = top_p.to(device=device, dtype=torch.float64)

    greedy = temperature <= 0  # [B]
    x = x / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None, None]

    if any_top_k:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [B]; off = keep all V
        sorted_x = x.sort(dim=-1, descending=True).values  # [B, n, V]
        kth = sorted_x.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))  # [B, n, 1]
        x = x.masked_fill(x < kth, float("-inf"))

    probs = torch.softmax(x, dim=-1)  # [B, n, V]
    if any_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, n, V]
        mass_before = sorted_p.cumsum(-1) - sorted_p  # [B, n, V]: mass of strictly better tokens
        keep_sorted = (mass_before < top_p[:, None, None]) | (top_p >= 1.0)[:, None, None]
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)

    one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None, None], one_hot, probs)


def sample_from(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: the token whose CDF interval holds ``u * total``.

    probs: [..., V] non-negative weights (rows need not be normalised); u: [...] uniforms in
    [0, 1). Returns [...] int64. Never returns a zero-probability index; an all-zero (or
    non-finite) row, which is a caller bug, falls back to its argmax.
    """
    vocab = probs.shape[-1]
    p = probs.to(torch.float64).reshape(-1, vocab)  # [R, V]
    cdf = p.cumsum(-1)  # [R, V]
    total = cdf[:, -1]  # [R]
    target = u.to(device=p.device, dtype=torch.float64).reshape(-1, 1) * total[:, None]  # [R, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # first i with cdf[i] > target
    positions = torch.arange(vocab, device=p.device)
    last_positive = torch.where(p > 0, positions, -1).amax(-1)  # [R]; rounding can land past it
    idx = torch.minimum(idx, last_positive)
    valid = (total > 0) & torch.isfinite(total)
    idx = torch.where(valid, idx, p.argmax(-1))
    return idx.reshape(probs.shape[:-1])


def speculative_accept(
    draft_tokens: Tensor, q: Tensor, p: Tensor, u_accept: Tensor, u_target: Tensor
) -> tuple[Tensor, Tensor]:
    """One round's acceptance for every row at once.

    draft_tokens: [B, k] int64, sampled from q; q: [B, k, V] warped draft probs at each
    drafted position; p: [B, k+1, V] warped target probs at the k positions plus the bonus
    position; u_accept: [B, k] acceptance uniforms (STREAM_ACCEPT); u_target: [B, k+1]
    correction/bonus uniforms (STREAM_TARGET).

    Returns (n_accepted [B] int64 in 0..k, next_token [B] int64): the correction sampled
    from normalize(max(0, p - q)) at the first rejected position (p itself when that
    residual has no mass), or the bonus sampled from p_{k+1} when all k are accepted.
    """
    k = draft_tokens.shape[1]
    d = draft_tokens[..., None]  # [B, k, 1]
    p_d = p[:, :k].gather(-1, d).squeeze(-1).to(torch.float64)  # [B, k]
    q_d = q.gather(-1, d).squeeze(-1).to(torch.float64)  # [B, k]
    accepted = u_accept < (p_d / q_d).clamp(max=1.0)  # [B, k]
    n_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]: index of first rejection

    vocab = p.shape[-1]
    at = n_accepted[:, None, None].expand(-1, 1, vocab)  # [B, 1, V]
    p_n = p.gather(1, at).squeeze(1).to(torch.float64)  # [B, V]
    q_n = q.gather(1, at.clamp(max=k - 1)).squeeze(1).to(torch.float64)  # [B, V]
    q_n = q_n * (n_accepted < k)[:, None]  # bonus position: no draft to subtract
    residual = (p_n - q_n).clamp(min=0.0)  # [B, V]
    p_like_q = residual.sum(-1, keepdim=True) <= RESIDUAL_EPS  # [B, 1]
    dist = torch.where(p_like_q, p_n, residual)
    u = u_target.gather(1, n_accepted[:, None]).squeeze(1)  # [B]
    return n_accepted, sample_from(dist, u)


def greedy_accept(draft_tokens: Tensor, target_argmax: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy acceptance: the longest prefix of drafts equal to the target's argmax.

    draft_tokens: [B, k]; target_argmax: [B, k+1]. Returns (n_accepted [B] int64,
    next_token [B] int64) where next_token is the target's argmax at position n_accepted:
    the correction, or the bonus when n_accepted == k.
    """
    k = draft_tokens.shape[1]
    match = draft_tokens == target_argmax[:, :k]  # [B, k]
    n_accepted = match.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    return n_accepted, target_argmax.gather(1, n_accepted[:, None]).squeeze(1)
