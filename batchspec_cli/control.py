"""The speculation policy: which k a group runs this round (0 = a plain decoding step).

Policy apart from mechanism: the round asks ``choose(...)`` before it drafts and reports
what it measured with ``observe_*``; nothing here touches a model or a tensor.

``auto`` maximises the expected committed tokens per second of the group (goodput, as
SmartSpec/TurboSpec and vLLM's adaptive verification do):

    goodput(k) = sum_i E_i(k) / cost(k)
    E_i(k)     = (1 - a_i^(k_i+1)) / (1 - a_i),  k_i = min(k, the row's draft length)
    cost(k)    = verify(G, k+1) + k * draft_step(G) + catch-up   (k = 0: verify(G, 1))

``a_i`` is the row's own per-token acceptance: a Beta estimate whose evidence decays by
``decay`` per round (it follows the row), with the job-wide estimate as its prior (a new
row starts from what the job has seen). The costs are seconds, measured on the run's own
models, device and dtype: a short calibration at start-up (``Calibration``) seeds them,
every step's own timers refine them (an exponential moving average per group size and
verify width). Group sizes never measured are interpolated linearly between the nearest
measured ones.

Catch-up: a draft model's cache lags behind rows that ran plain steps (or were admitted
without a draft prefill). Before it can propose it is fed the missing tokens in one
forward; that forward is charged to the step, spread over the rounds the group still has
ahead (it serves all of them): ``catch_up(G, tokens) * E / remaining``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

PRIOR_ALPHA = 0.5  # per-token acceptance assumed before anything was measured
PRIOR_WEIGHT = 4.0  # the prior counts as this many drafted tokens of a row's evidence
DECAY = 0.9  # a row's evidence weight per round: recent rounds count more
TIME_EMA = 0.2  # weight of a new timing in the moving averages
JOB_DECAY = 0.999  # the job-wide acceptance forgets slowly: it is the prior of rows to come


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a row commits in a round of k drafts: accepted drafts plus the correction or bonus."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Acceptance:
    """Per-row, per-drafter and job-wide per-token acceptance (Beta estimates with decaying evidence).

    Keys are (drafter name, row). A round that drafted n tokens and accepted the first a
    decided a + 1 of them (a accepted, the first rejection) or n (all accepted); the drafts
    after the first rejection say nothing.
    """

    def __init__(self, prior: float = PRIOR_ALPHA, weight: float = PRIOR_WEIGHT, decay: float = DECAY):
        self.prior, self.weight, self.decay = prior, weight, decay
        self.rows: dict[int, dict[str, list[float]]] = {}  # row -> drafter -> [accepted, decided], decayed
        self.jobs: dict[str, list[float]] = {}  # drafter -> [accepted, decided] over the job, slowly decayed

    def job(self, name: str = "model") -> float:
        accepted, decided = self.jobs.get(name, (0.0, 0.0))
        return (accepted + self.prior * self.weight) / (decided + self.weight)

    def row(self, key: tuple[str, int]) -> float:
        name, row = key
        accepted, decided = self.rows.get(row, {}).get(name, (0.0, 0.0))
        return (accepted + self.job(name) * self.weight) / (decided + self.weight)

    def observe(self, key: tuple[str, int], drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        name, row = key
        decided = accepted + (accepted < drafted)
        mine = self.rows.setdefault(row, {}).setdefault(name, [0.0, 0.0])
        mine[0], mine[1] = self.decay * mine[0] + accepted, self.decay * mine[1] + decided
        job = self.jobs.setdefault(name, [0.0, 0.0])
        job[0], job[1] = JOB_DECAY * job[0] + accepted, JOB_DECAY * job[1] + decided

    def forget_row(self, row: int) -> None:
        self.rows.pop(row, None)


class Timings:
    """Seconds per (group size, width) with a moving average; interpolated over group sizes."""

    def __init__(self, ema: float = TIME_EMA):
        self.ema = ema
        self.table: dict[int, dict[int, float]] = {}  # width -> {group size -> seconds}

    def observe(self, group: int, width: int, seconds: float) -> None:
        """A measurement moves its own entry by the moving average and every other width of the group
        size by the same factor: a round measures only the width it ran, and what drifts (context
        length, load from elsewhere) moves all widths alike, so their ratios keep their calibrated shape."""
        old = self.table.get(width, {}).get(group)
        if old is None or old <= 0:
            self.table.setdefault(width, {})[group] = seconds
            return
        factor = (1 - self.ema) + self.ema * seconds / old
        for row in self.table.values():
            if group in row:
                row[group] *= factor

    def get(self, group: int, width: int) -> float | None:
        row = self.table.get(width)
        if not row:
            return None
        if group in row:
            return row[group]
        sizes = sorted(row)
        i = bisect.bisect_left(sizes, group)
        if i == 0:
            return row[sizes[0]] * group / sizes[0]  # below the smallest: no cheaper than proportional
        if i == len(sizes):
            return row[sizes[-1]] * group / sizes[-1]  # past the largest: compute-bound, proportional
        lo, hi = sizes[i - 1], sizes[i]
        return row[lo] + (row[hi] - row[lo]) * (group - lo) / (hi - lo)


@dataclass
class Choice:
    """The policy's decision for one round, and what it expected of it."""

    k: int
    expected_tokens: float  # sum over rows of E_i(k)
    expected_s: float  # modelled cost of the round (0 when not modelled)
    plain_s: float  # modelled cost of a plain step for the same group (0 when not modelled)


class FixedK:
    """``--mode ar|eqspec|exspec``: the same k every round (rows without a draft verify one token)."""

    def __init__(self, k: int):
        self.k = k
        self.acceptance = Acceptance()

    def wants_draft(self) -> bool:
        return self.k > 0

    def choose(self, group: int, keys: list, draft_lengths: list[int] | None, catch_up: int, remaining: float,
               model_draft: bool) -> Choice:
        lengths = draft_lengths or [self.k] * len(keys)
        expected = sum(expected_tokens(self.acceptance.row(key), min(self.k, n)) for key, n in zip(keys, lengths))
        return Choice(self.k, expected, 0.0, 0.0)

    def observe_round(self, group: int, k: int, width: int, feed_s: float, steps_s: float, verify_s: float,
                      fed: int) -> None:
        pass


class AutoK(FixedK):
    """``--mode auto``: the k in 0..max_k with the highest expected goodput for this group."""

    def __init__(self, max_k: int):
        super().__init__(max_k)
        self.verify = Timings()  # (G, tokens verified) -> s of the target forward
        self.draft_feed = Timings()  # (G, tokens fed) -> s of the draft's first forward of a round
        self.draft_step = Timings()  # (G, 1) -> s of each further one-token draft forward

    def wants_draft(self) -> bool:
        """Whether newly admitted rows get a draft prefill now (else the draft catches up when it is needed)."""
        calibrated = self.verify.table.get(1)
        if not calibrated:
            return False
        group, alpha = max(calibrated), self.acceptance.job("model")
        return any(self._goodput(group, [alpha] * group, [self.k] * group, k, 2, 1.0, True)[0] > 1.0
                   for k in range(1, self.k + 1))

    def _cost(self, group: int, k: int, width: int, catch_up: int, per_round: float, model_draft: bool):
        """Modelled seconds of a round (None before any timing exists)."""
        verify = self.verify.get(group, width + 1)
        if verify is None or k == 0 or not model_draft:
            return verify
        feed, step = self.draft_feed.get(group, 2), self.draft_step.get(group, 1)
        if feed is None or step is None:
            return None
        cost = verify + feed + (k - 1) * step
        if catch_up > 2:  # a lagging draft's extra columns serve every round the rows have left
            longest = self.draft_feed.get(group, self.k + 1)
            per_token = max(0.0, (longest or feed) - feed) / max(1, self.k - 1)
            cost += (catch_up - 2) * per_token * min(1.0, per_round)
        return cost

    def _goodput(self, group, alphas, lengths, k, catch_up, remaining, model_draft):
        """(goodput of k relative to a plain step, expected tokens, modelled cost, modelled plain cost)."""
        ks = [min(k, n) for n in lengths]
        expected = sum(expected_tokens(a, n) for a, n in zip(alphas, ks))
        per_round = expected / max(1, group) / max(remaining, 1.0)  # this round's share of the rows' rest
        plain = self._cost(group, 0, 0, 0, per_round, model_draft)
        cost = self._cost(group, k, max(ks, default=0), catch_up, per_round, model_draft)
        if plain is None or cost is None:
            return (1.0 if k == 0 else 0.0), expected, cost or 0.0, plain or 0.0
        return (expected / cost) / (group / plain), expected, cost, plain

    def choose(self, group: int, keys: list, draft_lengths: list[int] | None, catch_up: int, remaining: float,
               model_draft: bool) -> Choice:
        alphas = [self.acceptance.row(key) for key in keys]
        lengths = draft_lengths or [self.k] * len(keys)
        best = None
        for k in range(0, self.k + 1):
            if k > max(lengths, default=0):
                break
            gain, expected, cost, plain = self._goodput(group, alphas, lengths, k, catch_up, remaining, model_draft)
            if best is None or gain > best[0] * (1 + 1e-9):
                best = (gain, Choice(k, expected, cost, plain))
        return best[1]

    def observe_round(self, group: int, k: int, width: int, feed_s: float, steps_s: float, verify_s: float,
                      fed: int) -> None:
        """A round's own timers: the verify of ``width + 1`` tokens, the draft's first forward of ``fed``
        tokens and its ``k - 1`` further steps."""
        self.verify.observe(group, width + 1, verify_s)
        if k and 0 < fed <= self.k + 1:
            self.draft_feed.observe(group, fed, feed_s)
        if k > 1:
            self.draft_step.observe(group, 1, steps_s / (k - 1))
