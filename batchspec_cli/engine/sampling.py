"""Sampling as pure torch functions: warping, and Gumbel-max coupling of draft and target.

The rule (Daliri, Musco and Suresh 2024, "Coupling without communication and
drafter-invariant speculative decoding"): every (row, completion position, token id) has a
standard Gumbel noise ``g`` that is a pure function of the row's key (seed and id), the
position and the token id (``gumbel``: a counter-based hash, no generator state). Then

- the target's token at a position is ``argmax_v(log p_warped[v] + g[v])``: exactly a sample
  of the warped target distribution (the Gumbel-max trick), ``-inf`` outside top-k/top-p;
- the draft proposes ``argmax_v(log q_warped[v] + g[v])`` with the same noise, and a draft
  is *accepted* iff it equals the target's token; the first disagreement is replaced by
  the target's token (the *correction*), and when all k agree the target's token at k+1 is
  the *bonus*;
- greedy rows are the same rule with ``g = 0`` (the argmax of the raw logits).

So a sampled row is a function of (seed, id, prompt, target, sampling settings) alone: the
same under any mode, draft, k schedule, batch or window (bit for bit in float64; up to float
near-ties in float32, as greedy rows). Acceptance is somewhat below standard rejection
sampling: at least (1 - d) / (1 + d) against 1 - d, d the total variation between warped q
and p (``benchmarks/acceptance.py`` measures both; the gap was too small to keep a second rule:
docs/history.md, "Figures once kept in the code").

Shapes: ``B`` rows, ``n`` positions, ``V`` vocabulary. Nothing here syncs with the host
when the callers pass the filter flags they know (``warp_probs``' ``filters``).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def up_cast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 (token choice and noise are exact there); others as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

def _i64(c: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)  # splitmix64 increment
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on negative values)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps modulo 2**64)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def row_key(seed: int, row_id: str, sample: int = 0) -> int:
    """A stable 63-bit key for a row's random streams, from the run seed, the row id and the sample (``--n``).

    The sample number is BLAKE2b's personalization (16 bytes, zero-padded): sample 0 gives the
    all-zero default, so its key is the key the row had before samples existed (adding samples
    never changes the first), and no choice of id can make two (id, sample) pairs share a message.
    """
    digest = hashlib.blake2b(f"{seed}\x1f{row_id}".encode(), digest_size=8,
                             person=sample.to_bytes(16, "little")).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def warp_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
               filters: tuple[bool, bool] | None = None) -> Tensor:
    """Warped next-token probabilities, in float64, in Hugging Face's order.

    logits: [B, n, V] any float dtype; temperature: [B] (<= 0: greedy); top_k: [B] int
    (0: off); top_p: [B] float (>= 1: off). Returns probs [B, n, V] float64.

    Temperature scales the logits, top-k keeps every token whose logit ties or beats the
    k-th largest, top-p then keeps the smallest most-probable set whose mass reaches top_p
    (always the top token). Greedy rows get a one-hot on the argmax of the raw logits.
    ``filters`` = (any row has top-k, any row has top-p), known on the host; when omitted it
    is read from the tensors (a device sync where they live on an accelerator).
    """
    device = logits.device
    x = logits.to(torch.float64)
    vocab = x.shape[-1]
    if filters is None:
        filters = bool((top_k > 0).any()), bool((top_p < 1.0).any())
    any_top_k, any_top_p = filters
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


_NOISE_SALT = _i64(0x6A09E667F3BCC909)  # salts the row key before mixing


def noise_base(keys: Tensor, positions: Tensor) -> Tensor:
    """Per (row, position) seeds of the Gumbel noise. keys: [B] int64; positions: [B, n] -> [B, n] int64."""
    keys = keys.to(torch.int64)
    positions = positions.to(device=keys.device, dtype=torch.int64)
    row = _mix64(keys ^ _NOISE_SALT)  # [B]
    return _mix64(row[:, None] + (positions + 1) * _GOLDEN)


def gumbel(base: Tensor, tokens: Tensor) -> Tensor:
    """Standard Gumbel noise for token ids under ``noise_base`` seeds (broadcast together), float64.

    A splitmix64 step indexed by the token id; its top 53 bits make ``u`` in (0, 1), and
    ``g = -log(-log u)``.
    """
    z = _mix64(base + (tokens.to(torch.int64) + 1) * _MIX1)
    u = (_shr(z, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))
    return -torch.log(-torch.log(u))


def gumbel_tokens(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, base: Tensor,
                  sampled: list[bool], filters: tuple[bool, bool]) -> Tensor:
    """The coupled token at each position: argmax(log p_warped + g), or the raw argmax for greedy rows.

    logits: [B, n, V]; temperature, top_k, top_p: [B] per-row settings on the device; base:
    [B, n] ``noise_base`` seeds; sampled: [B] host flags (temperature > 0); filters: host
    flags (any top-k, any top-p) among the sampled rows. Returns [B, n] int64.

    Noise is needed only where the warped probability is positive: on the CPU it is drawn
    for those entries alone (top-k/top-p leave a few per position), on an accelerator for
    the whole vocabulary at once (no host sync for a data-dependent size). The values are
    the same either way.
    """
    argmax = logits.argmax(-1)  # [B, n]
    if not any(sampled):
        return argmax
    rows = [i for i, s in enumerate(sampled) if s]
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True) if len(rows) < len(sampled) \
        else None
    pick = (lambda t: t) if index is None else (lambda t: t.index_select(0, index))
    probs = warp_probs(pick(logits), pick(temperature), pick(top_k), pick(top_p), filters)  # [S, n, V]
    base = pick(base)
    if logits.device.type == "cpu" and (filters[0] or filters[1]):
        support = (probs > 0).nonzero(as_tuple=True)  # (row, position, token) with p > 0
        scores = torch.full_like(probs, float("-inf"))
        scores[support] = probs[support].log() + gumbel(base[support[0], support[1]], support[2])
    else:
        vocab = torch.arange(probs.shape[-1], device=probs.device)
        scores = probs.log() + gumbel(base[..., None], vocab)  # -inf where p = 0
    chosen = scores.argmax(-1)
    if index is None:
        return chosen
    return argmax.index_copy(0, index, chosen)


def coupled_accept(drafts: Tensor, lengths: Tensor | None, target_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Accept the longest prefix of drafts equal to the target's own tokens.

    drafts: [B, k]; lengths: [B] real drafts per row (the rest is filler), None when all k
    are real; target_tokens: [B, k+1] (``gumbel_tokens`` of the verify logits). Returns
    (n_accepted [B] int64, next_token [B] int64): the target's token at n_accepted, the
    correction, or the bonus when every real draft was accepted.
    """
    k = drafts.shape[1]
    match = drafts == target_tokens[:, :k]  # [B, k]
    if lengths is not None:
        match &= torch.arange(k, device=drafts.device)[None, :] < lengths[:, None]
    n_accepted = match.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    return n_accepted, target_tokens.gather(1, n_accepted[:, None]).squeeze(1)
