"""Log-probabilities of the committed tokens, taken from the round's verify forward.

The verify forward already holds the target's logits at every position of the round
(``[G, k+1, V]``), and every committed token is the target's own token at its position
(an accepted draft equals it, the correction or bonus is it). So a row that asked
(``Request.logprobs`` = N) gets, per committed token, its log-probability and the N most
probable tokens at that position at no extra forward, equal to what a per-prompt plain
decode gives. Entries exist only for tokens actually committed (after EOS, the row's limit
and stop strings): one per completion token.

Which distribution (``mode``, the job's ``--logprobs-mode``):

- ``raw`` (default): the log-softmax of the target's logits, before temperature, top-k or
  top-p: what OpenAI's and vLLM's (default ``raw_logprobs``) log-probabilities are, and the
  same for greedy and sampled rows.
- ``processed``: the distribution a sampled row's token was drawn from: the log-softmax of
  logits / temperature after top-k and top-p, in Hugging Face's order (``sampling.warp_probs``).
  Tokens these filters remove are never listed among the top ones (a row may list fewer
  than N). Greedy rows get the raw distribution (they are not warped).

Transport, so the round still syncs the host once: per group row, the values
``[chosen (k+1), top (k+1) x N]`` as the bits of float64 and the top ids ``[(k+1) x N]``,
all int64, appended to the commit's host copy (``device_values``), read back from its
``tolist`` (``unpack``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import LOGPROBS_MODES, MAX_TOP_LOGPROBS
from . import sampling
from .align import device_tensor
from .events import Request, TokenLogprob

DESCRIPTIONS = {
    "raw": "log-softmax of the target's raw logits (before temperature, top-k and top-p)",
    "processed": "log-softmax of the logits after temperature, top-k and top-p (greedy rows: raw)",
}


def log_probs(logits: torch.Tensor, mode: str, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              filters: tuple[bool, bool] | None) -> torch.Tensor:
    """Log-probabilities [G, n, V] of the mode's distribution.

    logits: [G, n, V]; temperature, top_k, top_p: [G] the rows' settings; filters: (any
    top-k, any top-p) among the sampled rows, or None when no row is sampled (processed = raw).
    Raw: float32 for half and single precision models (CPU's log-softmax kernel is
    vectorized, unlike its logsumexp); processed: float64, as ``sampling.warp_probs``.
    """
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if mode == "raw" or filters is None:
        return torch.log_softmax(x, -1)
    raw = torch.log_softmax(x.to(torch.float64), -1)
    warped = sampling.warp_probs(x, temperature, top_k, top_p, filters).log()  # greedy rows: a one-hot
    return torch.where((temperature <= 0)[:, None, None], raw, warped)


_CHUNK = 128


def top_n(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(n, dim=-1)`` (values, ids) for x [..., V], without a top-k over the whole vocabulary.

    The n largest entries lie in the n chunks of ``_CHUNK`` columns with the largest maxima
    (ties aside: another chunk's max would otherwise be an (n+1)-th larger entry), so one
    max per chunk, a top-k over the chunk maxima and one over the chosen chunks (plus the
    ragged tail) replace it: on a CPU a top-k over 49152 columns costs more than the log-softmax.
    """
    vocab = x.shape[-1]
    full = vocab // _CHUNK
    if full <= n:
        return x.topk(n, dim=-1)
    blocks = x[..., : full * _CHUNK].unflatten(-1, (full, _CHUNK))  # a view
    best = blocks.amax(-1).topk(n, dim=-1).indices  # [..., n] the chunks with the n largest maxima
    candidates = blocks.gather(-2, best[..., None].expand(*best.shape, _CHUNK)).flatten(-2)  # [..., n * CHUNK]
    ids = (best[..., None] * _CHUNK + torch.arange(_CHUNK, device=x.device)).flatten(-2)
    if full * _CHUNK < vocab:
        candidates = torch.cat([candidates, x[..., full * _CHUNK :]], -1)
        tail = torch.arange(full * _CHUNK, vocab, device=x.device).expand(*x.shape[:-1], -1)
        ids = torch.cat([ids, tail], -1)
    values, picked = candidates.topk(n, dim=-1)
    return values, ids.gather(-1, picked)


def pack(logp: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """[G, n (1 + 2 top)] int64: the chosen tokens' and the top values (float64 bits), then the top ids.

    logp: [G, n, V] log-probabilities; tokens: [G, n] the round's target tokens.
    """
    chosen = logp.gather(-1, tokens[..., None])  # [G, n, 1]
    values, ids = top_n(logp, min(top, logp.shape[-1]))  # [G, n, top], most probable first
    values = torch.cat([chosen.flatten(1), values.flatten(1)], 1).to(torch.float64)
    return torch.cat([values.view(torch.int64), ids.flatten(1)], 1)


@dataclass
class RoundLogprobs:
    """One round's values on the host, per group row: [G][n], [G][n][top], [G][n][top]."""

    chosen: list[list[float]]
    top_values: list[list[list[float]]]
    top_ids: list[list[list[int]]]


class Recorder:
    """Collects the log-probabilities of the rows that asked, by input row, as their tokens are committed."""

    def __init__(self, mode: str, device: torch.device):
        if mode not in LOGPROBS_MODES:
            raise ValueError(f"unknown logprobs mode {mode!r}")
        self.mode, self.device = mode, device
        self.rows: dict[int, tuple[int, list[TokenLogprob]]] = {}  # row -> (N, entries so far)

    def admit(self, requests: list[Request]) -> None:
        for req in requests:
            if req.logprobs is not None:
                self.rows[req.row] = (min(req.logprobs, MAX_TOP_LOGPROBS), [])

    def pop(self, row: int) -> list[TokenLogprob] | None:
        entry = self.rows.pop(row, None)
        return None if entry is None else entry[1]

    def device_values(self, requests: list[Request], logits: torch.Tensor, tokens: torch.Tensor,
                      temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
        """[G, (k+1)(1 + 2 N)] int64 to append to the commit's host copy, or None when no row of the group asked.

        requests: [G] the group's rows; logits: [G, k+1, V] the verify's; tokens: [G, k+1] the
        target's tokens; temperature, top_k, top_p: [G]. Rows that did not ask get zeros.
        """
        asked = [i for i, r in enumerate(requests) if r.row in self.rows]
        if not asked:
            return None
        top = max(self.rows[requests[i].row][0] for i in asked)
        sampled = [r for r in (requests[i] for i in asked) if not r.sampling.greedy]
        filters = (any(r.sampling.top_k > 0 for r in sampled), any(r.sampling.top_p < 1.0 for r in sampled)) \
            if sampled else None
        index = None if len(asked) == len(requests) else device_tensor(asked, self.device)
        pick = (lambda t: t) if index is None else (lambda t: t.index_select(0, index))
        logp = log_probs(pick(logits), self.mode, pick(temperature), pick(top_k), pick(top_p), filters)
        packed = pack(logp, pick(tokens), top)
        if index is None:
            return packed
        return packed.new_zeros((len(requests), packed.shape[1])).index_copy(0, index, packed)

    @staticmethod
    def unpack(host: list[list[int]], start: int, n: int) -> RoundLogprobs | None:
        """The round's values from the commit's host rows (``host[i][start:]``, n positions), or None (none there)."""
        width = len(host[0]) - start if host else 0
        if width <= 0:
            return None
        top = (width // n - 1) // 2  # width = n (1 + 2 top)
        bits = torch.tensor([row[start:] for row in host], dtype=torch.int64)  # host memory: no device sync
        values = bits[:, : n * (1 + top)].contiguous().view(torch.float64)
        return RoundLogprobs(values[:, :n].tolist(), values[:, n:].reshape(len(host), n, top).tolist(),
                             bits[:, n * (1 + top):].reshape(len(host), n, top).tolist())

    def record(self, row: int, values: RoundLogprobs | None, i: int, committed: list[int]) -> None:
        """Append group row ``i``'s entries for the tokens it keeps this round (``committed``)."""
        entry = self.rows.get(row)
        if entry is None or values is None:
            return
        top, entries = entry
        for j, token in enumerate(committed):
            alternatives = [(t, v) for t, v in zip(values.top_ids[i][j][:top], values.top_values[i][j][:top])
                            if v != -math.inf]  # processed: a token top-k / top-p removed is no alternative
            entries.append(TokenLogprob(token, values.chosen[i][j], alternatives))
