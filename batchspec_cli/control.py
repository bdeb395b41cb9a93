"""The speculation policy: which drafter and which k a group runs this round (k = 0: a plain step).

Policy apart from mechanism: the round asks ``choose(...)`` before it drafts and reports
what the round cost with ``observe_round``; nothing here touches a model or a tensor.

``auto`` maximises the expected committed tokens per second of the group (goodput, as
SmartSpec/TurboSpec and vLLM's adaptive verification do), over the options plain, the draft
model with k = 1..K, and the model-free drafters with k = 1..K:

    goodput(option) = sum_i E_i(k) / cost(option)
    E_i(k)          = (1 - a_i^(k_i+1)) / (1 - a_i),  k_i = min(k, the row's draft length)

``a_i`` is the row's own per-token acceptance for that drafter: a Beta estimate whose
evidence decays by ``DECAY`` per round (it follows the row), with the job-wide estimate as
its prior (a new row starts from what the job has seen).

``cost(option)`` is the whole round in seconds at this group size, as the round's own clock
measured it: drafting, verifying, bookkeeping, and the realignment of the rows' lengths that
speculation drives apart (timed before the next round, charged to this one), not a bare
forward. A short calibration at start-up
seeds every option from bare forwards (the verify of k+1 tokens plus the draft's forwards);
an option's first real round replaces its seed, and later rounds move it by a moving average.
Seeds flatter speculation (a bare forward leaves out realignment and bookkeeping, which grow
with k), so a drafter's k is tried one step past the largest k it has been measured at. An option that looks
worse than it is would never be measured again, so every ``EXPLORE_EVERY`` rounds of a group
size the near-best option measured longest ago runs instead (plain steps always qualify).
Group sizes never measured are interpolated between measured ones.

Catch-up: a draft model's cache lags behind rows that ran plain steps (or were admitted
without a draft prefill). Before it can propose it is fed the missing columns in one
forward, charged to the round at the calibrated cost per column, spread over the rounds the
rows still have ahead (it serves all of them).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

PRIOR_ALPHA = 0.5  # per-token acceptance assumed before anything was measured
PRIOR_WEIGHT = 4.0  # the prior counts as this many drafted tokens of a row's evidence
DECAY = 0.9  # a row's evidence weight per round: recent rounds count more
TIME_EMA = 0.2  # weight of a new timing in the moving averages
EXPLORE_EVERY = 25  # rounds of a group size between two re-measurements of a near-best option
NEAR_BEST = 0.85  # options within this share of the best goodput may be re-measured
OUTLIER = 3.0  # a round measured at more than this x its estimate counts as this x
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
    """Seconds per (group size, option) as moving averages; interpolated over group sizes."""

    def __init__(self, ema: float = TIME_EMA):
        self.ema = ema
        self.table: dict = {}  # option -> {group size -> seconds}

    def observe(self, group: int, option, seconds: float) -> None:
        """A moving average; one measurement counts for at most ``OUTLIER`` x the estimate (a stall elsewhere)."""
        row = self.table.setdefault(option, {})
        old = row.get(group)
        row[group] = seconds if old is None else (1 - self.ema) * old + self.ema * min(seconds, OUTLIER * old)

    def get(self, group: int, option) -> float | None:
        row = self.table.get(option)
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


@dataclass
class Source:
    """What one drafter offers a group this round."""

    keys: list  # [G] acceptance keys (drafter name, row)
    lengths: list[int] | None  # [G] draft tokens each row has (model-free drafters), None: k for every row
    catch_up: int = 0  # columns the draft model's first forward must feed (2 when it is current)


class FixedK:
    """``--mode ar|eqspec|exspec``: the same k every round (rows without a draft verify one token)."""

    def __init__(self, k: int):
        self.k = k
        self.acceptance = Acceptance()

    def wants_draft(self) -> bool:
        return self.k > 0

    def expected(self, source: Source, k: int) -> float:
        lengths = source.lengths or [k] * len(source.keys)
        return sum(expected_tokens(self.acceptance.row(key), min(k, n)) for key, n in zip(source.keys, lengths))

    def choose(self, group: int, sources: dict[str, Source], remaining: float) -> tuple[Choice, str]:
        """The draft model when there is one, else the model-free drafters; k every round."""
        for name in ("model", "lookup"):
            if name in sources and self.k:
                return Choice(self.k, self.expected(sources[name], self.k), 0.0, 0.0), name
        return Choice(0, float(group), 0.0, 0.0), ""

    def observe_round(self, group: int, source: str, k: int, seconds: float, fed: int, prepare_s: float) -> None:
        pass


class AutoK(FixedK):
    """``--mode auto``: the option (drafter, k) with the highest expected goodput for this group."""

    def __init__(self, max_k: int):
        super().__init__(max_k)
        self.rounds = Timings()  # (G, (source, k)) -> s of a whole round; ("", 0) is a plain step
        self.feed_per_column = 0.0  # s per column a lagging draft is fed (per row of the group: x G)
        self.measured: dict = {}  # (G, option) -> the round count at its last measurement
        self.count: dict[int, int] = {}  # G -> rounds chosen
        self.ladder: dict[str, int] = {}  # drafter -> largest k measured in a real round
        self.pending = None  # (G, option, weight) of the last round, waiting for the next round's preparation

    def calibrate(self, group: int, verify: dict[int, float], draft: dict[int, float] | None) -> None:
        """Seed every option's cost from bare forward timings: verify[w] of w tokens, draft[w] of a draft
        forward of w tokens (1: a draft step)."""
        self.rounds.observe(group, ("", 0), verify[1])
        for k in range(1, self.k + 1):
            self.rounds.observe(group, ("lookup", k), verify[k + 1])
            if draft:
                self.rounds.observe(group, ("model", k), verify[k + 1] + draft[2] + (k - 1) * draft[1])
        if draft and self.k > 1:
            self.feed_per_column = max(0.0, draft[self.k + 1] - draft[2]) / (self.k - 1) / group

    def wants_draft(self) -> bool:
        """Whether newly admitted rows get a draft prefill now (else the draft catches up when it is needed)."""
        plain = self.rounds.table.get(("", 0))
        if not plain:
            return False
        group = max(plain)
        keys = [("model", -1)] * group  # no row's history: the job's estimate
        _, best, _ = max(self._options(group, {"model": Source(keys, None, 2)}, 1.0), key=lambda o: o[0])
        return best.k > 0

    def _cost(self, group: int, source: str, k: int, catch_up: int, per_round: float) -> float | None:
        cost = self.rounds.get(group, (source if k else "", k))
        if cost is not None and source == "model" and catch_up > 2:  # the extra columns serve the rows' rest
            cost += (catch_up - 2) * self.feed_per_column * group * min(1.0, per_round)
        return cost

    def _options(self, group: int, sources: dict[str, Source], remaining: float):
        """(goodput relative to a plain step, Choice, source name) of every option, plain first."""
        plain = self._cost(group, "", 0, 0, 1.0)
        out = [(1.0, Choice(0, float(group), plain or 0.0, plain or 0.0), "")]
        if plain is None:
            return out
        for name, source in sources.items():
            longest = max(source.lengths) if source.lengths is not None else self.k
            ladder = self.ladder.get(name, 0) + 1  # one k past the largest already measured (seeds flatter)
            for k in range(1, min(self.k, longest, ladder) + 1):
                expected = self.expected(source, k)
                per_round = expected / group / max(remaining, 1.0)  # this round's share of the rows' rest
                cost = self._cost(group, name, k, source.catch_up, per_round)
                if cost:
                    out.append(((expected / cost) / (group / plain), Choice(k, expected, cost, plain), name))
        return out

    def choose(self, group: int, sources: dict[str, Source], remaining: float) -> tuple[Choice, str]:
        options = self._options(group, sources, remaining)
        gain, choice, name = max(options, key=lambda o: o[0])
        self.count[group] = count = self.count.get(group, 0) + 1
        if count % EXPLORE_EVERY == 0:  # re-measure the near-best option measured longest ago
            near = [o for o in options if o[0] >= NEAR_BEST * gain or o[1].k == 0]
            _, choice, name = min(near, key=lambda o: self.measured.get((group, (o[2], o[1].k)), -1))
        return choice, name

    def observe_round(self, group: int, source: str, k: int, seconds: float, fed: int, prepare_s: float) -> None:
        """A round's own clock: ``seconds`` from its choice to its last bookkeeping; ``prepare_s``: the time its
        group took to be realigned before it, which the round before caused (speculation leaves rows at
        different lengths, a plain step does not), so it is charged to that round's option."""
        if self.pending is not None:  # the last round's entry took its seconds with this weight: add the move too
            last_group, last_option, weight = self.pending
            self.rounds.table[last_option][last_group] += weight * prepare_s
            self.pending = None
        if source == "model" and fed > self.k + 1:
            return  # a long catch-up is not what the option costs round to round
        option = (source if k else "", k)
        self.pending = (group, option, self._record(group, option, seconds))

    def _record(self, group: int, option, seconds: float) -> float:
        """Enter a measurement; returns the weight it got in the option's estimate."""
        first = (group, option) not in self.measured
        if first:  # the first real round replaces the bare-forward seed
            self.rounds.table.setdefault(option, {}).pop(group, None)
        self.rounds.observe(group, option, seconds)
        self.measured[(group, option)] = self.count.get(group, 0)
        self.ladder[option[0]] = max(self.ladder.get(option[0], 0), option[1])
        return 1.0 if first else self.rounds.ema
