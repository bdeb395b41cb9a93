"""`auto`'s arms on invented throughputs: PLAIN against SPEC, judged by measured committed tokens per wall second."""

from __future__ import annotations

import itertools

import pytest

from batchspec_cli.policy.control import (CUT_AT, CUT_BELOW, FIRST_RETEST, PLAIN, SPEC, SUB_WINDOWS, TRIAL_PRICE,
                                          TRIAL_ROOM, TRIAL_SHARE, WINDOW_ROUNDS, WINDOW_SECONDS, Arms, Auto, Group,
                                          Offer, Window)

ROUND_S = 1.25 * WINDOW_SECONDS / WINDOW_ROUNDS  # a window closes on its round count


def drive(rates: dict[str, float], windows: int, stall: int | None = None, arms: Arms | None = None) -> list[str]:
    """Run ``windows`` windows of rounds of ``ROUND_S`` seconds whose arm commits ``rates[arm]`` tokens per second;
    round number ``stall`` takes 10x as long for the same tokens. Returns the arm of every window. The work left is
    not told (unknown): no trial is priced (``drive_left`` below)."""
    arms, ran, n = arms or Arms(), [], 0
    while len(ran) < windows:
        arm = arms.arm
        seconds = ROUND_S * (10 if n == stall else 1)
        if arms.record(rates[arm] * ROUND_S, seconds) is not None:
            ran.append(arm)
        n += 1
    return ran


def trials(ran: list[str], loser: str) -> list[tuple[int, int]]:
    """(first window, length) of every run of consecutive ``loser`` windows."""
    out, i = [], 0
    while i < len(ran):
        if ran[i] == loser:
            j = i
            while j < len(ran) and ran[j] == loser:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out


def test_a_spec_arm_10_percent_slower_leaves_after_at_most_two_windows_and_is_retested_at_doubling_intervals():
    ran = drive({PLAIN: 100.0, SPEC: 90.0}, 2 + 2 * 4 * (1 + 2 + 4))
    assert ran[0] == PLAIN and ran[1] == SPEC  # start plain, then try speculation
    found = trials(ran, SPEC)
    assert len(found) >= 3 and all(length <= 2 for _, length in found)
    gaps = [b - (a + n) for (a, n), (b, _) in zip(found, found[1:])]
    assert gaps[:2] == [FIRST_RETEST, 2 * FIRST_RETEST]
    assert all(later == 2 * earlier for earlier, later in zip(gaps, gaps[1:]))


def test_a_spec_arm_20_percent_faster_is_chosen_and_kept():
    ran = drive({PLAIN: 100.0, SPEC: 120.0}, 40)
    assert ran[:3] == [PLAIN, SPEC, SPEC]
    found = trials(ran[2:], PLAIN)
    assert all(length == 1 for _, length in found)  # every re-test of plain ends after one window
    assert ran[2:].count(PLAIN) <= 3 and ran[-1] == SPEC  # re-tests are rare (doubling) and speculation stays


@pytest.mark.parametrize("rates", [{PLAIN: 100.0, SPEC: 90.0}, {PLAIN: 100.0, SPEC: 120.0}])
def test_one_10x_stall_in_a_window_does_not_flip_the_choice(rates):
    calm = drive(rates, 30)
    for stall in (3, WINDOW_ROUNDS + 4, 2 * WINDOW_ROUNDS + 5, 7 * WINDOW_ROUNDS + 1):  # in plain and spec windows
        assert drive(rates, 30, stall=stall) == calm, stall


def rounds_per_trial(rates: dict[str, float], windows: int, stall: int | None = None) -> list[int]:
    """The rounds every SPEC trial ran, PLAIN the incumbent throughout."""
    arms, counts, previous = Arms(), [], PLAIN
    for n in itertools.count():
        if len(arms.windows) >= windows:
            return counts
        if arms.arm == SPEC:
            if previous == PLAIN:  # a trial starts
                counts.append(0)
            counts[-1] += 1
        previous = arms.arm
        arms.record(rates[arms.arm] * ROUND_S, ROUND_S * (10 if n == stall else 1))


def test_a_trial_clearly_behind_ends_at_half_a_window():
    half = max(round(CUT_AT * WINDOW_ROUNDS), 1)
    assert rounds_per_trial({PLAIN: 100.0, SPEC: 50.0}, 20) == [half] * 3  # and re-tested as before
    assert rounds_per_trial({PLAIN: 100.0, SPEC: 100.0 * CUT_BELOW + 5}, 20)[0] == WINDOW_ROUNDS  # behind, not clearly
    # one 10x stall in the trial's first rounds does not cut a trial that would win
    assert rounds_per_trial({PLAIN: 100.0, SPEC: 120.0}, 4, stall=WINDOW_ROUNDS + 1)[0] > WINDOW_ROUNDS


def test_one_lucky_challenger_window_is_not_a_switch():
    arms = Arms()
    for arm, rate in [(PLAIN, 100.0), (SPEC, 110.0), (SPEC, 101.0)]:  # a win, then not: plain resumes
        assert arms.arm == arm
        for _ in range(WINDOW_ROUNDS):
            arms.record(rate * ROUND_S, ROUND_S)
    assert arms.arm == PLAIN and arms.incumbent == PLAIN


def test_close_arms_do_not_switch():
    """A challenger less than 3 % faster never takes over."""
    ran = drive({PLAIN: 100.0, SPEC: 102.0}, 30)
    assert all(length <= 2 for _, length in trials(ran, SPEC)) and ran[-1] == PLAIN


def drive_left(rates: dict[str, float], windows: int, tokens: float | None, arms: Arms,
               dear: float = 0.0, starts: list[float] | None = None) -> list[str]:
    """``drive`` for a job with ``tokens`` tokens of work in all (None: unknown), told to the arms every round. The
    first round of every trial takes ``dear`` seconds more (a catch-up, a calibration); ``starts`` gets the tokens
    left when each trial starts."""
    ran, done, previous = [], 0.0, arms.incumbent
    while len(ran) < windows:
        arm = arms.arm
        seconds = ROUND_S + (dear if arm != arms.incumbent and previous == arms.incumbent else 0.0)
        if arm != arms.incumbent and previous == arms.incumbent and starts is not None:
            starts.append(tokens - done)
        previous = arm
        done += rates[arm] * ROUND_S
        if arms.record(rates[arm] * ROUND_S, seconds, None if tokens is None else max(0, round(tokens - done))):
            ran.append(arm)
    return ran


def test_a_trial_starts_only_when_the_work_left_can_pay_for_it():
    """The first trial's price is TRIAL_PRICE PLAIN rounds (its calibration) and half a window's rounds at the
    cut-off rate: it starts when that is at most TRIAL_SHARE of the time the work left takes at PLAIN's rate. A
    short job never trials, a long one trials after its first window, one whose work is unknown keeps the
    doubling schedule; a SPEC that wins is found and kept."""
    rates = {PLAIN: 100.0, SPEC: 120.0}
    window_s = WINDOW_ROUNDS * ROUND_S  # a window closes on its round count (ROUND_S)
    price = TRIAL_PRICE * ROUND_S + CUT_AT * (1 - CUT_BELOW) * window_s  # seconds
    enough = price / TRIAL_SHARE * rates[PLAIN]  # tokens of work left at which the first trial is affordable
    window = WINDOW_ROUNDS * ROUND_S * rates[PLAIN]  # tokens a PLAIN window commits
    short = drive_left(rates, 6, 0.9 * enough + window, Arms(TRIAL_SHARE))
    assert short == [PLAIN] * 6
    long = drive_left(rates, 20, 1.1 * enough + window, Arms(TRIAL_SHARE))
    assert long[:3] == [PLAIN, SPEC, SPEC] and long[-1] == SPEC
    assert drive_left(rates, 20, None, Arms(TRIAL_SHARE)) == drive(rates, 20)


def test_no_spec_trial_starts_in_a_jobs_tail():
    """A job with work for many windows: SPEC (10 % slower) is tried, loses, and is re-tested on the doubling
    schedule; without room for a whole trial and its payback (TRIAL_ROOM windows of work) no trial starts, however
    cheap (a share of 1: the price never binds here)."""
    rates = {PLAIN: 100.0, SPEC: 90.0}
    window = WINDOW_ROUNDS * ROUND_S * rates[PLAIN]
    work = 35 * window  # the fourth re-test (after window 31) would fall in the tail: 3 windows of work left
    starts: list[float] = []
    ran = drive_left(rates, 40, work, Arms(1.0), starts=starts)
    free = drive(rates, 40)
    assert ran[:2] == [PLAIN, SPEC] and trials(ran, SPEC)[:2] == trials(free, SPEC)[:2]
    assert min(starts) >= TRIAL_ROOM * window
    assert len(trials(ran, SPEC)) < len(trials(free, SPEC))  # the tail's re-tests were not run


def test_a_retest_is_priced_at_what_the_last_lost_trial_cost():
    """A SPEC trial whose first round pays 4 s more (a long catch-up) and loses costs the arms those seconds and its
    rounds' loss against PLAIN's rate; the next trial of SPEC starts only when that is at most TRIAL_SHARE of the
    time the work left takes. A cheap loser is re-tested in the same job on the doubling schedule."""
    rates, dear = {PLAIN: 100.0, SPEC: 90.0}, 4.0
    window = WINDOW_ROUNDS * ROUND_S * rates[PLAIN]
    # the trial: one window (10 rounds, 90 % of PLAIN's tokens), 4 s more in its first round
    loss = dear + WINDOW_ROUNDS * ROUND_S * (1 - rates[SPEC] / rates[PLAIN])
    arms = Arms(TRIAL_SHARE)
    starts: list[float] = []
    work = 60 * window
    ran = drive_left(rates, 20, work, arms, dear=dear, starts=starts)
    assert ran[:2] == [PLAIN, SPEC]
    assert arms.price[SPEC] == pytest.approx(loss)
    assert all(left / rates[PLAIN] * TRIAL_SHARE >= loss for left in starts[1:])
    cheap = drive_left(rates, 20, work, Arms(TRIAL_SHARE))
    assert len(trials(ran, SPEC)) < len(trials(cheap, SPEC)) == len(trials(drive(rates, 20), SPEC))
    # a job long enough to repay the loss re-tests the dear loser on the same schedule as the cheap one
    assert trials(drive_left(rates, 20, 1000 * window, Arms(TRIAL_SHARE), dear=dear), SPEC) == trials(cheap, SPEC)


def test_a_trials_price_leaves_out_the_admission_prefills_either_arm_pays():
    """A losing SPEC trial (90 % of PLAIN) during which a new batch was admitted (a 3 s prefill before one of its
    rounds): the price leaves the prefill out."""
    rates = {PLAIN: 100.0, SPEC: 90.0}
    arms = Arms(TRIAL_SHARE)
    for _ in range(WINDOW_ROUNDS):
        arms.record(rates[PLAIN] * ROUND_S, ROUND_S, 10 ** 6)
    assert arms.arm == SPEC
    n = 0
    while arms.arm == SPEC:
        admitted = 3.0 if n == 2 else 0.0
        arms.record(rates[SPEC] * ROUND_S, ROUND_S + admitted, 10 ** 6, admit_s=admitted)
        n += 1
    assert arms.price[SPEC] == pytest.approx(n * ROUND_S * (1 - rates[SPEC] / rates[PLAIN]))


SHORT_ROUND_S = WINDOW_SECONDS / (2 * WINDOW_ROUNDS)  # a window closes on its seconds: 2 x its least rounds


def trial_with_calibration(spec: list[float], calibration: float, once: bool) -> Arms:
    """PLAIN at 100 tokens/s, then a SPEC trial whose first round also calibrates (``calibration`` s more), told to
    the arms as paid once (``once``) or as any other seconds. Rounds of ``SHORT_ROUND_S``; SPEC's n-th round commits
    at ``spec[n]`` tokens/s (the last one from there on). Runs until the trial is decided. Returns the arms."""
    arms = Arms()
    while arms.arm == PLAIN:
        arms.record(100.0 * SHORT_ROUND_S, SHORT_ROUND_S, 10 ** 6)
    for n in itertools.count():
        if not (arms.arm == SPEC and arms.incumbent == PLAIN and arms.trial < 2):
            return arms
        rate, extra = spec[min(n, len(spec) - 1)], calibration if n == 0 else 0.0
        arms.record(rate * SHORT_ROUND_S, SHORT_ROUND_S + extra, 10 ** 6, once_s=extra if once else 0.0)


def test_a_calibration_is_paid_once_it_neither_cuts_a_trial_short_nor_prices_a_retest():
    """A SPEC 20 % faster whose trial starts on three hard rounds (half PLAIN's rate) and calibrates first, for as
    long as half a window: judged on its rounds it wins and takes over. Counted in its window, the calibration fills
    the half window after five rounds, three of them hard, and the trial is cut as clearly behind. A SPEC 10 %
    slower that calibrates for 3 s loses its trial; its re-test is priced at its rounds' loss alone (a later trial
    does not calibrate again)."""
    hard_start = [50.0] * 3 + [120.0]
    half_window = CUT_AT * WINDOW_SECONDS
    assert trial_with_calibration(hard_start, half_window, once=True).incumbent == SPEC
    counted = trial_with_calibration(hard_start, half_window, once=False)
    assert counted.incumbent == PLAIN and len(counted.windows) == 2 and counted.arm == PLAIN
    losing = trial_with_calibration([90.0], 3.0, once=True)
    assert losing.incumbent == PLAIN and losing.windows[-1][0] == SPEC
    assert losing.price[SPEC] == pytest.approx(WINDOW_SECONDS * (1 - 90.0 / 100.0))  # one window at 90 % of PLAIN's
    # counted, it is in the price, and the window closes on the rounds it has
    counted_loss = WINDOW_ROUNDS * SHORT_ROUND_S * (1 - 90.0 / 100.0)
    assert trial_with_calibration([90.0], 3.0, once=False).price[SPEC] == pytest.approx(3.0 + counted_loss)


def drive_admitting(rates: dict[str, float], windows: int, admitting: str, prefill: float) -> list[str]:
    """``drive``, with a prefill of ``prefill`` s of rows admitted before every other round of the arm
    ``admitting`` (a batch refilled row by row as its rows finish). Returns the arm of every window."""
    arms, ran, n = Arms(), [], 0
    while len(ran) < windows:
        arm = arms.arm
        admitted = prefill if arm == admitting and n % 2 else 0.0
        if arms.record(rates[arm] * ROUND_S, ROUND_S + admitted, admit_s=admitted) is not None:
            ran.append(arm)
        n += 1
    return ran


@pytest.mark.parametrize("rates", [{PLAIN: 100.0, SPEC: 100.0}, {PLAIN: 100.0, SPEC: 95.0}])
def test_prefills_of_admitted_rows_do_not_hand_an_arm_the_win(rates):
    """Arms at the same rate, or SPEC 5 % behind, while PLAIN's windows happen to hold the admissions (prefills
    of 40 % of a round before every other round: counted, PLAIN would measure 0.83 of its rate). SPEC never takes
    over: a row's prefill is the same work whichever arm runs."""
    ran = drive_admitting(rates, 40, PLAIN, 0.4 * ROUND_S)
    assert ran[1] == SPEC and SPEC not in ran[2:4] and ran[-1] == PLAIN, ran  # tried, lost, re-tested later
    assert ran == drive(rates, 40)


def test_prefills_of_admitted_rows_do_not_hide_a_real_win():
    """SPEC 20 % faster is chosen and kept although its windows hold every admission."""
    ran = drive_admitting({PLAIN: 100.0, SPEC: 120.0}, 40, SPEC, 0.4 * ROUND_S)
    assert ran == drive({PLAIN: 100.0, SPEC: 120.0}, 40)
    assert ran[:3] == [PLAIN, SPEC, SPEC] and ran[-1] == SPEC


@pytest.mark.parametrize("incumbent", [PLAIN, SPEC])
def test_unknown_work_is_no_tail_and_the_tail_has_no_trial_of_either_arm(incumbent):
    window = WINDOW_ROUNDS * ROUND_S * 100.0
    for left, tried in [(0, False), (window, False), (None, True), (10 ** 9, True)]:
        arms = Arms(TRIAL_SHARE)
        arms.incumbent = arms.arm = incumbent
        for _ in range(WINDOW_ROUNDS):
            arms.record(100.0 * ROUND_S, ROUND_S, left)
        assert (arms.arm != incumbent) == tried, left


def test_a_window_needs_both_its_rounds_and_its_seconds_and_every_round_counts():
    window = Window(PLAIN)
    for _ in range(WINDOW_ROUNDS - 1):
        window.tokens.append(10)
        window.seconds.append(WINDOW_SECONDS)
    assert not window.full()
    window.tokens.append(10)
    window.seconds.append(0.01)
    assert window.full()
    short = Window(PLAIN, [10] * (3 * WINDOW_ROUNDS), [0.001] * (3 * WINDOW_ROUNDS))
    assert not short.full()
    # the rate is tokens over seconds of every round (in sub-windows): slow rounds count unless they are one stall
    slow_half = Window(PLAIN, [10] * 10, [0.1] * 5 + [0.2] * 5)
    assert slow_half.rate() == pytest.approx(statistics_median_of_parts([10] * 10, [0.1] * 5 + [0.2] * 5))


def statistics_median_of_parts(tokens, seconds):
    import statistics
    n = len(tokens)
    cuts = [round(i * n / SUB_WINDOWS) for i in range(SUB_WINDOWS + 1)]
    return statistics.median(sum(tokens[a:b]) / sum(seconds[a:b]) for a, b in zip(cuts, cuts[1:]))


def test_the_plain_arm_asks_for_no_calibration_and_no_draft_prefill():
    policy = Auto(4)
    group, sources = Group([0, 1], 50, 30.0), {"model": Offer(None, 40)}
    assert policy.arms.arm == PLAIN and not policy.wants_seed() and not policy.wants_draft()
    choice = policy.choose(group, sources)
    assert choice.k == 0 and choice.arm == PLAIN
    policy.arms.arm = SPEC
    assert policy.wants_seed()


def drive_rows(spec_windows: list[float], windows: int) -> list[str]:
    """``drive`` at batch 1, where a window is about one row: PLAIN commits 100 tokens/s on every row, SPEC's n-th
    window ``spec_windows[n]`` x that (its row's acceptance), cycling."""
    arms, ran, n, shares = Arms(), [], 0, itertools.cycle(spec_windows)
    share = next(shares)
    while len(ran) < windows:
        arm = arms.arm
        if arms.record((100.0 * share if arm == SPEC else 100.0) * ROUND_S, ROUND_S) is not None:
            ran.append(arm)
            share = next(shares) if arm == SPEC else share
        n += 1
    return ran


def test_a_trial_lost_on_a_hard_row_does_not_push_the_next_trial_away_while_the_arm_is_ahead_over_its_trials():
    """SPEC's windows alternate an easy row (1.5x PLAIN) and a hard one (0.9x): every trial wins its first window and
    loses its second, so it never takes over by two wins in a row. Its record over the trials (1.2x) is ahead, so the
    wait before each next trial stays FIRST_RETEST instead of doubling; an arm behind over its trials (0.9x, 0.8x)
    still waits twice as long each time."""
    ahead = trials(drive_rows([1.5, 0.9], 60), SPEC)
    gaps = [b - (a + n) for (a, n), (b, _) in zip(ahead, ahead[1:])]
    assert all(n == 2 for _, n in ahead) and gaps and set(gaps) == {FIRST_RETEST}
    behind = trials(drive_rows([0.9, 0.8], 60), SPEC)
    gaps = [b - (a + n) for (a, n), (b, _) in zip(behind, behind[1:])]
    assert gaps[:3] == [FIRST_RETEST, 2 * FIRST_RETEST, 4 * FIRST_RETEST]


def test_windows_are_judged_by_worth_so_a_longer_context_does_not_lose_a_trial():
    """SPEC's trial runs where a plain step takes twice as long (longer rows): at 60 tokens/s against PLAIN's 100
    earlier it loses by rate, but its tokens are worth 1.2x a plain step's there, so judged by worth it wins and
    takes over; judged by rate it never does."""
    def run(with_worth: bool) -> list[str]:
        arms, ran = Arms(), []
        while len(ran) < 6:
            arm = arms.arm
            tokens, plain_s = (100.0, 0.01) if arm == PLAIN else (60.0, 0.02)  # per second; a plain step per token
            worth = tokens * ROUND_S * plain_s if with_worth else None
            if arms.record(tokens * ROUND_S, ROUND_S, worth=worth) is not None:
                ran.append(arm)
        return ran

    assert run(True)[:3] == [PLAIN, SPEC, SPEC] and run(True)[-1] == SPEC
    assert run(False).count(SPEC) == 1  # one trial, cut at half a window, and re-tested only after 6 windows
