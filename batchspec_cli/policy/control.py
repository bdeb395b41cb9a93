"""The speculation policy: *where k is chosen*. Which drafter and which k a group runs this round (k = 0: a plain step).

Policy apart from mechanism: nothing here touches a model or a tensor; every choice is a
function of measured numbers, tested with invented ones. The engine talks to a policy
through one interface (``Policy``):

    policy.seed(calibration)       # bare-forward timings, when ``wants_seed()`` asks for them
    policy.choose(group, sources)  # -> Choice: k, who drafts (and, for model-free drafts, per row)
    policy.observe(report)         # -> what one round did (RoundReport), as measured

``--mode ar|eqspec|exspec`` run ``FixedK``. ``--mode auto`` runs ``Auto``: two whole
policies (*arms*) judged by measured throughput over windows of rounds (``Arms``): PLAIN
(plain steps, no calibration, no draft prefill, no draft model loaded; on a constrained row
it also verifies the grammar's forced runs, the target's own choice, where their width pays)
and SPEC (each
round's drafter and k by expected goodput, ``Goodput``: ``sum_i E_i(k) / cost(option)``,
``E_i(k) = (1 - a_i^(k_i+1)) / (1 - a_i)``). When trials start, what they are charged, and
the measurements behind each constant: docs/design.md, "The speculation policy in detail".
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Protocol

PRIOR_ALPHA = 0.5  # per-token acceptance assumed before anything was measured
# ... except for drafters whose drafts are the target's own choice by construction: a grammar's forced tokens are
# the only tokens its mask allows, so they are refused only where the model writes another tokenization of the
# forced text (measured on SmolLM2: 144 of 144 accepted, docs/history.md)
DRAFTER_PRIORS = {"grammar": 0.95}
FORCED = ("grammar",)  # drafters whose drafts are the target's own choice: PLAIN takes them too (``Auto._plain``)
PRIOR_WEIGHT = 4.0  # the prior counts as this many drafted tokens of a row's evidence ...
# ... halved by every round in a row whose first draft the row refused: a drafter that keeps missing on a row is
# dropped there within about three rounds however well it does on the job's other rows (the job-wide estimate, raised
# by easy rows, kept k = 3 drafts at an expected goodput near 1 on a row that refused them: docs/history.md)
MISS_STREAK_CAP = 8
DECAY = 0.9  # a row's evidence weight per round: recent rounds count more
TIME_EMA = 0.2  # weight of a new timing in the moving averages
EXPLORE_EVERY = 25  # rounds of a group size between two re-measurements of a near-best option
NEAR_BEST = 0.85  # options within this share of the best goodput may be re-measured
OUTLIER = 3.0  # a round measured at more than this x its estimate counts as this x
# A verify of k + 1 tokens is priced at (1 + WIDTH_PRIOR * k) plain steps until a real round of that width is
# measured (only PLAIN's forced rounds need it: SPEC's are seeded by calibration). A 6-token verify cost 1.65
# plain steps at batch 1 and 2.2-2.7 at batch 8-16 on a 2-core CPU (0.13 and 0.25-0.35 per extra token), about 1
# on a GPU: the prior is the pessimistic side (docs/design.md, "The speculation policy in detail").
WIDTH_PRIOR = 0.5
JOB_DECAY = 0.999  # the job-wide acceptance forgets slowly: it is the prior of rows to come

PLAIN, SPEC = "plain", "spec"
WINDOW_ROUNDS = 10  # a window has at least this many rounds ...
WINDOW_SECONDS = 2.0  # ... and lasts at least this long (wall clock)
SUB_WINDOWS = 5  # a window's rate: the median of this many consecutive slices (one stall cannot decide)
MARGIN = 1.03  # a challenger takes over when two windows in a row beat the incumbent's last one by this
FIRST_RETEST = 4  # incumbent windows before a losing arm is re-tested; doubles every time it loses ...
# ... unless the arm's record over its trials (each trial window's gain over the incumbent's, the earlier trials'
# weighing this share less at every new trial) is at least the incumbent's: then that trial lost on the rows it ran
# on (at batch 1 a window is about one row, and SPEC's gain is that row's acceptance), not on the arm
RECORD_DECAY = 0.5
CUT_AT = 0.5  # a challenger's window that has this share of its rounds and seconds ...
CUT_BELOW = 0.8  # ... and measures under this share of the incumbent's rate ends there: a clear loss
TRIAL_ROUNDS = 2 * WINDOW_ROUNDS  # the rounds a SPEC trial is sure to run: a catch-up is charged over these
TRIAL_SHARE = 0.03  # a trial may cost at most this share of the time the job's known work has left ...
TRIAL_PRICE = 5.0  # ... a first SPEC trial, in PLAIN rounds (the calibration it pays measured 3.3-5.6 on a CPU)
TRIAL_ROOM = 4  # windows of work a trial needs left: its two windows, and as many after them to pay back
POOL_DRAFTING = 0.5  # SPEC fills the whole pool while at least this share of its recent rounds speculate ...
DRAFTING_EMA = 0.1  # ... a moving average over SPEC's rounds (about a window's worth)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a row commits in a round of k drafts: accepted drafts plus the correction or bonus."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


# ---------------------------------------------------------------------------- the interface's dataclasses


@dataclass
class Group:
    """The group the engine asks about."""

    rows: list[int]  # [G] row ids
    context: int  # the group's padded length (columns every forward of the round attends to)
    remaining: float  # mean tokens the rows may still commit


@dataclass
class Offer:
    """What one drafter offers a group this round."""

    lengths: list[int] | None  # [G] draft tokens each row has (model-free drafters); None: k for every row
    catch_up: int = 0  # columns the draft model's first forward must feed (2 when it is current)


@dataclass
class Choice:
    """The policy's decision for one round, and what it expected of it."""

    k: int
    source: str = ""  # "model", "lookup" (the model-free drafters) or "" (k = 0)
    drafters: list[str] | None = None  # [G] lookup: which drafter's proposal each row verifies ("" none)
    expected_tokens: float = 0.0  # sum over rows of E_i(k)
    expected_s: float = 0.0  # modelled cost of the round (0 when not modelled)
    plain_s: float = 0.0  # modelled cost of a plain step for the same group (0 when not modelled)
    arm: str = ""  # auto's arm (PLAIN or SPEC); "" for a fixed k


@dataclass
class Calibration:
    """Bare forward timings at one group size and context (seconds)."""

    group: int
    context: int
    verify: dict[int, float]  # width w -> a target forward of w tokens
    draft: dict[int, float] | None  # width w -> a draft forward of w tokens (1: a draft step); None: no model


@dataclass
class RoundReport:
    """What one round did, as measured. The policy learns from it; the step's ``StepStats`` are made from it."""

    choice: Choice
    context: int  # the group's padded length T
    rows: list[int]  # [G] row ids
    drafted: list[int]  # [G] draft tokens verified per row
    drafters: list[str]  # [G] who drafted each row ("" none)
    accepted: list[int]  # [G] drafts accepted and kept per row
    emitted: list[int]  # [G] tokens committed per row (after stop cuts)
    finished: list[int]  # row ids that ended this round
    fed: int  # columns the draft model's first forward took (its catch-up); 0 without it
    seconds: float  # the round's own clock, from its choice to its last bookkeeping
    prepare_s: float  # bringing the group into one rectangle before the round
    elapsed_s: float  # wall clock since the previous round ended (everything in between counts)
    draft_prefill_s: float = 0.0  # of elapsed_s: draft prefills at admission (made for SPEC, charged to SPEC)
    admit_s: float = 0.0  # of elapsed_s: the target's prefills at admission (either arm pays them)
    tokens_left: int | None = None  # the most tokens the job has left (rows in flight and to come); None: unknown
    draft_s: float = 0.0
    verify_s: float = 0.0
    calibrate_s: float = 0.0  # bare forward timings before the choice (``seed``): in no option's cost

    @property
    def group(self) -> int:
        return len(self.rows)

    @property
    def total_s(self) -> float:
        """The whole round: preparing the group, calibrating (once), and the round's own clock."""
        return self.prepare_s + self.calibrate_s + self.seconds

    @property
    def tokens(self) -> int:
        return sum(self.emitted)


class Policy(Protocol):
    def wants_seed(self) -> bool:
        """Whether the engine should time bare forwards (``seed``) before the next choice."""

    def seed(self, calibration: Calibration) -> None: ...

    def wants_draft(self) -> bool:
        """Whether newly admitted rows get a draft prefill now (else the draft catches up when it is needed)."""

    def wants_pool(self) -> bool:
        """Whether the engine should fill its whole pool (rows at many lengths, for speculation to group), or
        hold one batch: rows that only take plain steps stay in step and need no pool."""

    def proposing(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """Which of the model-free drafters ``names`` propose before the next choice (the engine asks no other)."""

    def choose(self, group: Group, sources: dict[str, Offer]) -> Choice: ...

    def observe(self, report: RoundReport) -> float | None:
        """Learn from a round; returns the measured rate (tokens/s) of the window this round closed, if any."""


# ---------------------------------------------------------------------------- acceptance and timings


class Acceptance:
    """Per-row, per-drafter and job-wide per-token acceptance (Beta estimates with decaying evidence).

    Keys are (drafter name, row). A round that drafted n tokens and accepted the first a
    decided a + 1 of them (a accepted, the first rejection) or n (all accepted); the drafts
    after the first rejection say nothing.
    """

    def __init__(self, prior: float = PRIOR_ALPHA, weight: float = PRIOR_WEIGHT, decay: float = DECAY):
        self.prior, self.weight, self.decay = prior, weight, decay
        self.rows: dict[int, dict[str, list[float]]] = {}  # row -> drafter -> [accepted, decided, misses], decayed
        self.jobs: dict[str, list[float]] = {}  # drafter -> [accepted, decided] over the job, slowly decayed

    def job(self, name: str = "model") -> float:
        accepted, decided = self.jobs.get(name, (0.0, 0.0))
        return (accepted + DRAFTER_PRIORS.get(name, self.prior) * self.weight) / (decided + self.weight)

    def row(self, key: tuple[str, int]) -> float:
        name, row = key
        accepted, decided, misses = self.rows.get(row, {}).get(name, (0.0, 0.0, 0))
        weight = self.weight / 2 ** misses  # rounds in a row whose first draft was refused: the row's own say
        return (accepted + self.job(name) * weight) / (decided + weight)

    def observe(self, key: tuple[str, int], drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        name, row = key
        decided = accepted + (accepted < drafted)
        mine = self.rows.setdefault(row, {}).setdefault(name, [0.0, 0.0, 0])
        mine[0], mine[1] = self.decay * mine[0] + accepted, self.decay * mine[1] + decided
        mine[2] = min(mine[2] + 1, MISS_STREAK_CAP) if accepted == 0 else 0
        job = self.jobs.setdefault(name, [0.0, 0.0])
        job[0], job[1] = JOB_DECAY * job[0] + accepted, JOB_DECAY * job[1] + decided

    def forget_row(self, row: int) -> None:
        self.rows.pop(row, None)


def context_bin(context: int) -> int:
    """Timings are kept per power-of-two band of context length (attention grows with it)."""
    return max(1, context).bit_length()


class Timings:
    """Seconds per (option, context band, group size) as moving averages; interpolated over group sizes.

    A context band never measured for an option borrows the nearest band it was measured at,
    scaled by how the ``reference`` option (a plain step) changes from that band to this one
    (as ``get`` estimates it here, when it was measured there): options are compared by their ratio to a plain step, and that ratio
    is what carries over to a band, not seconds measured where attention cost less."""

    def __init__(self, ema: float = TIME_EMA, reference=("", 0)):
        self.ema, self.reference = ema, reference
        self.table: dict = {}  # option -> {context band -> {group size -> seconds}}

    def observe(self, group: int, context: int, option, seconds: float) -> float:
        """A moving average; one measurement counts for at most ``OUTLIER`` x the estimate (a stall elsewhere).
        Returns the weight the measurement got."""
        row = self.table.setdefault(option, {}).setdefault(context_bin(context), {})
        old = row.get(group)
        if old is None:
            row[group] = seconds
            return 1.0
        row[group] = (1 - self.ema) * old + self.ema * min(seconds, OUTLIER * old)
        return self.ema

    def replace(self, group: int, context: int, option, seconds: float) -> None:
        """An option's first real round replaces its seed, capped like any other measurement."""
        old = self.get(group, context, option)
        self.table.setdefault(option, {}).setdefault(context_bin(context), {})[group] = (
            seconds if old is None else min(seconds, OUTLIER * old))

    def add(self, group: int, context: int, option, seconds: float) -> None:
        row = self.table.get(option, {}).get(context_bin(context), {})
        if group in row:
            row[group] += seconds

    def get(self, group: int, context: int, option) -> float | None:
        bands = self.table.get(option)
        if not bands:
            return None
        band = context_bin(context)
        if band in bands:
            return self._at(bands[band], group)
        near = min(bands, key=lambda b: (abs(b - band), b))
        seconds = self._at(bands[near], group)
        reference = self.table.get(self.reference, {})
        if option != self.reference and near in reference:  # as a plain step changes from there to here
            seconds *= self.get(group, context, self.reference) / self._at(reference[near], group)
        return seconds

    def widest(self, option) -> int:
        """The largest group size ``option`` was measured at, in any context band (0: never measured)."""
        return max((size for row in self.table.get(option, {}).values() for size in row), default=0)

    @staticmethod
    def _at(row: dict[int, float], group: int) -> float:
        """One band's seconds at ``group``: measured, interpolated between group sizes, or proportional outside."""
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


# ---------------------------------------------------------------------------- the arms


@dataclass
class Window:
    """One arm's rounds between two decisions: (tokens, seconds, worth) per round. ``worth``: what the round's
    tokens are worth in the unit the arms are compared in (``Arms.record``)."""

    arm: str
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    worth: list[float] = field(default_factory=list)

    def full(self, share: float = 1.0) -> bool:
        return len(self.tokens) >= share * WINDOW_ROUNDS and sum(self.seconds) >= share * WINDOW_SECONDS

    def rate(self) -> float:
        """Committed tokens per second: the median over ``SUB_WINDOWS`` consecutive slices of the rounds."""
        return self._median(self.tokens)

    def gain(self) -> float:
        """Worth per second, the same median of slices: what the arms are judged by."""
        return self._median(self.worth)

    def _median(self, values: list[float]) -> float:
        n, parts = len(values), min(SUB_WINDOWS, len(values))
        cuts = [round(i * n / parts) for i in range(parts + 1)]
        return statistics.median(sum(values[a:b]) / max(sum(self.seconds[a:b]), 1e-9) for a, b in zip(cuts, cuts[1:]))


class Arms:
    """Which whole policy runs, PLAIN or SPEC, judged over windows by what their rounds' tokens are worth per wall
    second: for ``Auto`` the seconds a plain step at the same group size and context takes for them (each round
    against PLAIN at the same context: a window on longer rows or a smaller group is not slower for that), told
    to ``record``; without it committed tokens per second.

    The *incumbent* runs until its wait is over; then the other arm (the *challenger*) runs a
    trial: one window, and a second one when the first beat the incumbent's adjacent window
    by ``MARGIN``. Two such wins in a row and the challenger takes over (one lucky window,
    or one slow incumbent window, is not enough); otherwise the incumbent resumes and waits
    twice as long as last time before the next trial, unless the arm's record over its trials
    (``RECORD_DECAY``) is at least the incumbent's, when the wait stays. A challenger's window ends at half its
    length (``CUT_AT``) when it measures under ``CUT_BELOW`` of the incumbent's rate so far
    (the same median of slices): a clear loss. A trial whose wait is over starts only when it
    is ``affordable``; until then the incumbent runs on, window after window.
    """

    def __init__(self, share: float | None = TRIAL_SHARE):
        self.incumbent = PLAIN
        self.arm = PLAIN  # the arm running now
        self.wait = 1  # incumbent windows left before the next trial (SPEC is first tried after one)
        self.interval = FIRST_RETEST  # the wait after the next lost trial
        self.trial = 0  # challenger windows run in the current trial
        self.baseline = 0.0  # the incumbent's latest window gain (``Window.gain``)
        self.pace = 0.0  # the incumbent's latest window rate, committed tokens per second
        self.record_of: dict[str, list[float]] = {}  # arm -> [sum of weighted gain / baseline, sum of weights]
        self.window = Window(PLAIN)
        self.windows: list[tuple[str, float]] = []  # (arm, measured gain) of every closed window
        self.spec_hopeful = False  # a window of SPEC's latest trial measured at least the incumbent PLAIN's gain
        # A trial's price (``affordable``); share None: trials start whenever their wait is over.
        self.share = share
        self.round_s = 0.0  # the median round of the incumbent's latest window (an admission's prefill is no round)
        self.tokens_left: int | None = None  # the most tokens the job has left (None: unknown)
        self.spent = [0, 0.0]  # the current trial's tokens and seconds, all its windows
        self.price: dict[str, float] = {}  # per arm: what its last lost trial cost, in seconds (``affordable``)

    def record(self, tokens: int, seconds: float, tokens_left: int | None = None, admit_s: float = 0.0,
               worth: float | None = None, once_s: float = 0.0) -> float | None:
        """One round of the running arm; returns the window's rate (tokens/s) when this round closes it. ``worth``:
        what the round's tokens are worth, in one unit for every round (None: the tokens themselves, so windows are
        judged by their rate). ``tokens_left``: the
        most tokens the job has left after it, rows in flight and rows to come (None: unknown). ``admit_s``: of
        ``seconds``, the target's prefills of rows admitted before the round. They count neither in the window nor
        in a trial's price: whichever arm runs, a row is prefilled once, and where one lands decides nothing about
        the arms (a prefill in a window would decide its rate: docs/history.md, "Figures once kept in the
        code"). ``once_s``: of ``seconds``, what an arm pays once in a job (SPEC's calibration): it neither judges
        the window (the rate a win would keep comes after it) nor prices a re-test (which does not pay it again);
        a first trial's price counts it (``affordable``). Everything else between two rounds counts: KV growth,
        realignment, the draft's prefills and catch-up."""
        self.tokens_left = tokens_left
        seconds -= admit_s + once_s  # the arm's own seconds: a row's prefill is the same work whichever arm runs
        self.window.tokens.append(tokens)
        self.window.seconds.append(seconds)
        self.window.worth.append(tokens if worth is None else worth)
        if self.arm != self.incumbent:
            self.spent[0] += tokens
            self.spent[1] += seconds
        full = self.window.full()
        if not full and (self.arm == self.incumbent or not self.window.full(CUT_AT)):
            return None
        gain = self.window.gain()
        if not full and gain >= CUT_BELOW * self.baseline:  # a trial clearly behind ends at CUT_AT: a clear loss
            return None
        rate = self.window.rate()
        self.windows.append((self.arm, gain))
        if self.arm == self.incumbent:
            self.round_s = statistics.median(self.window.seconds)
            self.pace = rate
        self._decide(gain)
        self.window = Window(self.arm)
        return rate

    def affordable(self, arm: str) -> bool:
        """Whether a trial of ``arm`` may start now, when the job's work left is known (else always). Not without
        room for it: ``TRIAL_ROOM`` windows of work (a trial's two windows, and as much again to pay back in). And
        only if its price is at most ``share`` of the time the work left takes at the incumbent's rate: what the
        arm's last lost trial measurably cost, or for a first SPEC trial its calibration (``TRIAL_PRICE`` rounds)
        and half a window at ``CUT_BELOW`` of the incumbent's rate (a first PLAIN trial prepares nothing). A short
        job is not spent on a trial a long one would amortise."""
        if self.share is None or self.tokens_left is None or self.pace <= 0 or self.round_s <= 0:
            return True
        time_left = self.tokens_left / self.pace
        window_s = max(WINDOW_SECONDS, WINDOW_ROUNDS * self.round_s)
        if time_left < TRIAL_ROOM * window_s:
            return False
        first = TRIAL_PRICE * self.round_s + CUT_AT * (1 - CUT_BELOW) * window_s if arm == SPEC else 0.0
        return self.price.get(arm, first) <= self.share * time_left

    def _decide(self, gain: float) -> None:
        other = SPEC if self.incumbent == PLAIN else PLAIN
        if self.arm == self.incumbent:
            self.baseline = gain
            self.wait -= 1
            if self.wait <= 0 and self.affordable(other):
                self.arm, self.trial, self.spent = other, 0, [0, 0.0]
                if other in self.record_of:  # a new trial: the earlier ones weigh less
                    self.record_of[other] = [RECORD_DECAY * part for part in self.record_of[other]]
            return
        self.trial += 1
        record = self.record_of.setdefault(self.arm, [0.0, 0.0])
        record[0], record[1] = record[0] + gain / max(self.baseline, 1e-12), record[1] + 1.0
        if self.arm == SPEC:
            self.spec_hopeful = (self.trial > 1 and self.spec_hopeful) or gain >= self.baseline
        if gain < MARGIN * self.baseline:  # no clear win: the incumbent resumes, the next trial comes later
            tokens, seconds = self.spent  # the loss: seconds beyond what the incumbent takes for the trial's tokens
            self.price[self.arm] = max(0.0, seconds - tokens / self.pace) if self.pace > 0 else 0.0
            level = record[0] >= record[1]  # its record over the trials: at least the incumbent's
            self.arm, self.wait = self.incumbent, self.interval
            self.interval = self.interval if level else 2 * self.interval
        elif self.trial >= 2:  # a clear win twice: the challenger takes over, the loser is re-tested later
            self.incumbent, self.baseline, self.pace = self.arm, gain, self.window.rate()
            self.wait, self.interval = FIRST_RETEST, 2 * FIRST_RETEST
            self.record_of.pop(self.arm, None)


# ---------------------------------------------------------------------------- the policies


class FixedK:
    """``--mode ar|eqspec|exspec``: the same k every round (rows without a draft verify one token)."""

    def __init__(self, k: int):
        self.k = k
        self.acceptance = Acceptance()

    def wants_seed(self) -> bool:
        return False

    def seed(self, calibration: Calibration) -> None:
        pass

    def wants_draft(self) -> bool:
        return self.k > 0

    def wants_pool(self) -> bool:
        return self.k > 0

    def proposing(self, names: tuple[str, ...]) -> tuple[str, ...]:
        return names if self.k > 0 else ()

    def rank(self, group: Group, sources: dict[str, Offer]) -> tuple[list[str], list[int]]:
        """Each row's model-free draft: the drafter with the most expected accepted tokens, ``sum_j a^(j+1)``
        over its proposal (a on this row, for that drafter). Returns ([G] drafter or "", [G] its length)."""
        names, lengths = [""] * len(group.rows), [0] * len(group.rows)
        best = [0.0] * len(group.rows)
        for name, offer in sources.items():
            if name == "model":
                continue
            for i, (row, n) in enumerate(zip(group.rows, offer.lengths)):
                alpha = self.acceptance.row((name, row))
                value = sum(alpha ** (j + 1) for j in range(n))
                if n and value > best[i]:
                    names[i], lengths[i], best[i] = name, n, value
        return names, lengths

    def expected(self, group: Group, names: list[str], lengths: list[int] | None, k: int) -> float:
        lengths = lengths or [k] * len(group.rows)
        return sum(expected_tokens(self.acceptance.row((name or "model", row)), min(k, n))
                   for name, row, n in zip(names, group.rows, lengths))

    def choose(self, group: Group, sources: dict[str, Offer]) -> Choice:
        """The draft model when there is one, else the model-free drafters; k every round."""
        if self.k and "model" in sources:
            names = ["model"] * len(group.rows)
            return Choice(self.k, "model", None, self.expected(group, names, None, self.k))
        names, lengths = self.rank(group, sources)
        if self.k and any(lengths):
            return Choice(self.k, "lookup", names, self.expected(group, names, lengths, self.k))
        return Choice(0, expected_tokens=float(len(group.rows)))

    def observe(self, report: RoundReport) -> float | None:
        for row, name, drafted, accepted in zip(report.rows, report.drafters, report.drafted, report.accepted):
            if drafted:
                self.acceptance.observe((name, row), drafted, accepted)
        for row in report.finished:
            self.acceptance.forget_row(row)
        return None


class Goodput(FixedK):
    """Auto's SPEC arm: the option (drafter, k) with the highest expected goodput for this group."""

    def __init__(self, max_k: int):
        super().__init__(max_k)
        self.rounds = Timings()  # (option, context, G) -> s of a whole round; ("", 0) is a plain step
        self.feed_per_column = 0.0  # s per column a lagging draft is fed (per row of the group: x G)
        self.feed_measured = False  # whether a real catch-up has replaced the calibrated seed of it
        self.draft_step = 0.0  # s of one draft step of the calibrated group (the part of a draft that is no catch-up)
        self.seeded = False
        self.measured: dict = {}  # (G, option) -> the round count at its last measurement
        self.count: dict[int, int] = {}  # G -> rounds chosen
        self.ladder: dict[str, int] = {}  # drafter -> largest k measured in a real round
        self.last_round = None  # (G, context, option, weight) of the last round: the next one's move is added
        # Rounds a catch-up can serve at most: None, the rows' rest; a number while speculation is only on trial
        # (a trial that loses leaves the draft behind again, so the next trial feeds the same columns anew).
        self.horizon: int | None = None

    def seed(self, calibration: Calibration) -> None:
        """Seed every speculative option from bare forwards (plain steps are measured by real rounds)."""
        c = calibration
        self.seeded = True
        verify, draft, top = c.verify, c.draft, self.k + 1
        if self.rounds.get(c.group, c.context, ("", 0)) is None:  # normally measured by the rounds before
            self.rounds.observe(c.group, c.context, ("", 0), verify.get(1, verify[2]))
        for k in range(1, self.k + 1):
            self.rounds.observe(c.group, c.context, ("lookup", k), verify[k + 1])
            if draft:
                self.rounds.observe(c.group, c.context, ("model", k), verify[k + 1] + draft[2] + (k - 1) * draft[1])
        if draft and self.k > 1:
            self.feed_per_column = max(0.0, draft[top] - draft[2]) / (self.k - 1) / c.group
        if draft:
            self.draft_step = draft[1] / c.group

    def wants_draft(self) -> bool:
        plain = self.rounds.table.get(("", 0))
        if not plain:
            return False
        band = max(plain)
        group = max(plain[band])
        probe = Group([-1] * group, 1 << (band - 1), 1.0)  # no row's history: the job's estimate
        _, best, _ = max(self._options(probe, {"model": Offer(None, 2)}), key=lambda o: o[0])
        return best.k > 0

    def _cost(self, group: Group, source: str, k: int, catch_up: int, per_round: float) -> float | None:
        size = len(group.rows)
        cost = self.rounds.get(size, group.context, (source if k else "", k))
        if cost is None and source == "lookup":  # not seeded, not yet measured: the prior's price of its width
            plain = self.rounds.get(size, group.context, ("", 0))
            cost = plain * (1.0 + WIDTH_PRIOR * k) if plain is not None else None
        if cost is not None and source == "model" and catch_up > 2:  # the extra columns serve the rows' rest
            cost += (catch_up - 2) * self.feed_per_column * size * min(1.0, per_round)
        return cost

    def _options(self, group: Group, sources: dict[str, Offer]):
        """(goodput relative to a plain step, Choice, source) of every option, plain first."""
        size = len(group.rows)
        plain = self._cost(group, "", 0, 0, 1.0)
        out = [(1.0, Choice(0, "", None, float(size), plain or 0.0, plain or 0.0), "")]
        if plain is None:
            return out
        offers = {}
        if "model" in sources:
            offers["model"] = (["model"] * size, None, sources["model"].catch_up)
        names, lengths = self.rank(group, sources)
        if any(lengths):
            offers["lookup"] = (names, lengths, 0)
        for source, (names, lengths, catch_up) in offers.items():
            longest = max(lengths) if lengths is not None else self.k
            ladder = self.ladder.get(source, 0) + 1  # one k past the largest already measured (seeds flatter)
            for k in range(1, min(self.k, longest, ladder) + 1):
                expected = self.expected(group, names, lengths, k)
                per_round = expected / size / max(group.remaining, 1.0)  # this round's share of the rows' rest
                if self.horizon:  # ... or of the trial's rounds, when that is shorter
                    per_round = max(per_round, 1.0 / self.horizon)
                cost = self._cost(group, source, k, catch_up, per_round)
                if cost:
                    choice = Choice(k, source, names if source == "lookup" else None, expected, cost, plain)
                    out.append(((expected / cost) / (size / plain), choice, source))
        return out

    def choose(self, group: Group, sources: dict[str, Offer]) -> Choice:
        options = self._options(group, sources)
        gain, choice, _ = max(options, key=lambda o: o[0])
        size = len(group.rows)
        self.count[size] = count = self.count.get(size, 0) + 1
        if count % EXPLORE_EVERY == 0:  # re-measure the near-best option measured longest ago
            near = [o for o in options if o[0] >= NEAR_BEST * gain or o[1].k == 0]
            _, choice, _ = min(near, key=lambda o: self.measured.get((size, (o[2], o[1].k)), -1))
        return choice

    def observe(self, report: RoundReport) -> float | None:
        """A round's own clock. The realignment before a round (``prepare_s``) is caused by the round before it
        (speculation leaves rows at different lengths, a plain step does not), so it is charged to that one."""
        super().observe(report)
        if self.last_round is not None:
            group, context, option, weight = self.last_round
            self.rounds.add(group, context, option, weight * report.prepare_s)
            self.last_round = None
        choice = report.choice
        option = (choice.source if choice.k else "", choice.k)
        group, context = report.group, report.context
        if option[0] == "model" and report.fed > self.k + 1:
            self._observe_catch_up(report)
        first = (group, option) not in self.measured
        if first and report.fed > self.k + 1:
            return None  # a long catch-up (the draft left behind by plain windows) is no first measure of the option
        if first and option != ("", 0):
            self.rounds.replace(group, context, option, report.seconds)
            weight = 1.0
        else:
            weight = self.rounds.observe(group, context, option, report.seconds)
        self.measured[(group, option)] = self.count.get(group, 0)
        self.ladder[option[0]] = max(self.ladder.get(option[0], 0), option[1])
        self.last_round = (group, context, option, weight)
        return None

    def _observe_catch_up(self, report: RoundReport) -> None:
        """A real catch-up prices the next ones: its draft time past k draft steps, per column and row. The first
        replaces the calibrated seed (a slope between two short forwards, which under-prices a long feed)."""
        columns = (report.fed - 2) * report.group
        extra = report.draft_s - report.choice.k * self.draft_step * report.group
        measured = max(0.0, extra) / columns
        self.feed_per_column = measured if not self.feed_measured else (
            (1 - TIME_EMA) * self.feed_per_column + TIME_EMA * measured)
        self.feed_measured = True


class Auto:
    """``--mode auto``: PLAIN against SPEC by measured throughput (``Arms``); SPEC is ``Goodput``."""

    def __init__(self, max_k: int):
        self.k = max_k
        self.arms = Arms(TRIAL_SHARE)
        self.spec = Goodput(max_k)
        self.owed_s = 0.0  # draft prefills PLAIN windows did for SPEC, charged to SPEC's next round
        self.drafting = 1.0  # the moving share of SPEC's rounds that speculated (k > 0)

    def wants_seed(self) -> bool:
        return self.arms.arm == SPEC and not self.spec.seeded

    def seed(self, calibration: Calibration) -> None:
        self.spec.seed(calibration)

    def wants_draft(self) -> bool:
        """Draft prefills at admission while SPEC's ruler says a current draft pays and SPEC holds, or PLAIN holds
        and a window of SPEC's last trial measured at least PLAIN's rate (``Arms.spec_hopeful``: a trial that ran
        mostly without the draft was close). Rows in flight catch up only if a SPEC round picks the draft. The
        prefills are SPEC's cost (``observe``)."""
        if self.arms.incumbent == PLAIN and not self.arms.spec_hopeful:
            return False
        return self.spec.wants_draft()

    def wants_pool(self) -> bool:
        """The whole pool once SPEC has won and while most of its rounds speculate; a SPEC trial runs on the batch
        in flight, so a trial that loses has not paid for admitting and realigning a second batch, and a SPEC
        whose ruler picks plain steps does not pay for growing the KV of rows it will not group."""
        return self.arms.arm == SPEC and self.arms.incumbent == SPEC and self.drafting >= POOL_DRAFTING

    def proposing(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """SPEC's rounds ask every drafter; PLAIN's only the grammar, whose forced runs are the target's own choice
        (the suffix drafts cost 1-2 % of a plain job)."""
        return names if self.arms.arm == SPEC else tuple(n for n in names if n in FORCED)

    def choose(self, group: Group, sources: dict[str, Offer]) -> Choice:
        if self.arms.arm == PLAIN:
            return self._plain(group, sources)
        self.spec.horizon = None if self.arms.incumbent == SPEC else TRIAL_ROUNDS
        choice = self.spec.choose(group, sources)
        choice.arm = SPEC
        return choice

    def _plain(self, group: Group, sources: dict[str, Offer]) -> Choice:
        """PLAIN's round: a plain step, or the grammar's forced runs verified in one forward where their expected
        tokens pay for its width (``Goodput`` over the forced offers alone). A forced token is the only one the
        row's mask allows, so it is the target's choice whatever the logits say: no guess is taken, and a PLAIN
        that takes them stays the target's plain decoding, fewer forwards apart."""
        forced = {name: offer for name, offer in sources.items() if name in FORCED}
        choice = self.spec.choose(group, forced) if forced else Choice(0, expected_tokens=float(len(group.rows)))
        choice.arm = PLAIN
        return choice

    def observe(self, report: RoundReport) -> float | None:
        self.spec.observe(report)  # acceptance, and the plain steps' cost, whichever arm ran
        seconds = report.elapsed_s
        if self.arms.arm == PLAIN:  # draft prefills during a PLAIN window serve SPEC: its next window pays them
            seconds -= report.draft_prefill_s
            self.owed_s += report.draft_prefill_s
        else:
            seconds, self.owed_s = seconds + self.owed_s, 0.0
            self.drafting += DRAFTING_EMA * ((report.choice.k > 0) - self.drafting)
        return self.arms.record(report.tokens, seconds, report.tokens_left, report.admit_s, self.worth(report),
                                report.calibrate_s)

    def worth(self, report: RoundReport) -> float:
        """What the round's tokens are worth: the seconds plain steps at the round's context take for them, at the
        widest group plain steps were measured at (``Timings``: PLAIN's batch; its rounds and SPEC's plain ones
        measure it). So both arms are judged by one ruler that depends on the context alone, whichever rows and
        lengths their windows happened to run on, and a SPEC round that groups fewer rows than PLAIN's batch is
        not credited with a small group's dearer plain step. Before any plain step is measured, the round's own
        seconds (a gain of 1)."""
        width = self.spec.rounds.widest(("", 0))
        plain = self.spec.rounds.get(width, report.context, ("", 0)) if width else None
        return report.tokens * plain / width if plain else report.seconds


# -- the batch width (--batch-size auto) ------------------------------------------------------------------------

WIDTH_GAIN = 1.05  # a wider batch is kept only for at least 5 % more tokens per second


def wider_pays(rates: dict[int, float], gain: float = WIDTH_GAIN) -> bool:
    """Whether to measure the next wider batch: the widest measured so far beat every narrower one by ``gain``.

    rates: tokens per second of a plain step, by batch width."""
    widths = sorted(rates)
    if len(widths) < 2:
        return True
    *narrower, widest = widths
    return rates[widest] >= gain * max(rates[w] for w in narrower)


def choose_width(rates: dict[int, float], gain: float = WIDTH_GAIN) -> int:
    """The narrowest width within ``gain`` of the best measured rate (a narrower batch holds less KV and leaves a
    shorter tail of part-empty steps for the same throughput)."""
    if not rates:
        raise ValueError("no width was measured")
    best = max(rates.values())
    return min(w for w, rate in rates.items() if rate * gain >= best)
