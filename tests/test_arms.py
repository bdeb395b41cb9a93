"""`auto`'s arms on invented throughputs: PLAIN against SPEC, judged by measured committed tokens per wall second."""

from __future__ import annotations

import itertools
import math

import pytest

from batchspec_cli.control import (CUT_AT, CUT_BELOW, FIRST_RETEST, PLAIN, SEED_ROUNDS, SPEC, SUB_WINDOWS, TRIAL_ROUNDS,
                                   TRIAL_SHARE, WINDOW_ROUNDS, WINDOW_SECONDS, Arms, Auto, Group, Offer, Window)

ROUND_S = 1.25 * WINDOW_SECONDS / WINDOW_ROUNDS  # a window closes on its round count


def drive(rates: dict[str, float], windows: int, stall: int | None = None, arms: Arms | None = None,
          first_s: float = ROUND_S) -> list[str]:
    """Run ``windows`` windows of rounds of ``ROUND_S`` seconds whose arm commits ``rates[arm]`` tokens per second;
    round number ``stall`` takes 10x as long for the same tokens, the first round ``first_s`` (a prefill before it).
    Returns the arm of every window. By default the arms have no trial budget (tested on its own below)."""
    arms, ran, n = arms or Arms(share=None), [], 0
    while len(ran) < windows:
        arm = arms.arm
        seconds = ROUND_S * (10 if n == stall else 1) if n else first_s
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
    arms, counts, previous = Arms(share=None), [], PLAIN
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
    arms = Arms(share=None)
    for arm, rate in [(PLAIN, 100.0), (SPEC, 110.0), (SPEC, 101.0)]:  # a win, then not: plain resumes
        assert arms.arm == arm
        for _ in range(WINDOW_ROUNDS):
            arms.record(rate * ROUND_S, ROUND_S)
    assert arms.arm == PLAIN and arms.incumbent == PLAIN


def test_close_arms_do_not_switch():
    """A challenger less than 3 % faster never takes over."""
    ran = drive({PLAIN: 100.0, SPEC: 102.0}, 30)
    assert all(length <= 2 for _, length in trials(ran, SPEC)) and ran[-1] == PLAIN


def test_a_job_too_short_to_amortise_a_calibration_trials_nothing_until_it_has_run_long_enough():
    """The first trial waits until SEED_ROUNDS PLAIN rounds are TRIAL_SHARE of the wall clock so far; a SPEC that
    wins is still found and kept."""
    window_s = WINDOW_ROUNDS * ROUND_S
    first = math.ceil(SEED_ROUNDS * ROUND_S / TRIAL_SHARE / window_s)  # windows closed before the first trial
    ran = drive({PLAIN: 100.0, SPEC: 120.0}, first + 10, arms=Arms(TRIAL_SHARE))
    assert ran[:first] == [PLAIN] * first and ran[first] == SPEC and ran[-1] == SPEC
    assert drive({PLAIN: 100.0, SPEC: 120.0}, 5, arms=Arms(TRIAL_SHARE)) == [PLAIN] * 5  # a short job: no trial


def test_cheap_trials_in_a_long_job_keep_the_doubling_schedule():
    """After a long prefill the budget does not bind: the same windows as with no budget."""
    rates = {PLAIN: 100.0, SPEC: 90.0}
    assert drive(rates, 60, arms=Arms(TRIAL_SHARE), first_s=500.0) == drive(rates, 60, first_s=500.0)


def test_losing_trials_cost_at_most_the_share_of_the_wall_clock():
    """Trials clearly behind (a tenth of PLAIN's rate) are cut at half a window: each costs that half window less
    the tokens' time at PLAIN's rate. Whenever one has run, their sum is within TRIAL_SHARE of the time run so far;
    the unbudgeted arms, on the doubling schedule alone, overspend."""
    rates = {PLAIN: 100.0, SPEC: 10.0}
    half = max(round(CUT_AT * WINDOW_ROUNDS), 1)
    per_trial = half * ROUND_S - rates[SPEC] * half * ROUND_S / rates[PLAIN]

    def overspent(ran: list[str]) -> bool:
        elapsed, spent = 0.0, 0.0
        for arm in ran:
            elapsed += (half if arm == SPEC else WINDOW_ROUNDS) * ROUND_S
            spent += per_trial if arm == SPEC else 0.0
            if spent > TRIAL_SHARE * elapsed:
                return True
        return False

    budgeted, free = drive(rates, 200, arms=Arms(TRIAL_SHARE)), drive(rates, 200)
    for ran in (budgeted, free):
        assert ran.count(SPEC) == len(trials(ran, SPEC)) >= 4  # one window each (cut), and re-tested
    assert not overspent(budgeted) and overspent(free)


@pytest.mark.parametrize("incumbent", [PLAIN, SPEC])
def test_no_trial_starts_in_a_jobs_tail(incumbent):
    """With no rows left to admit and fewer rounds left than a trial needs, the incumbent runs to the end."""
    for left, tried in [(TRIAL_ROUNDS - 1, False), (TRIAL_ROUNDS, True), (None, True)]:
        arms = Arms(share=None)
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
