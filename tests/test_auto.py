"""`auto` and the Gumbel-max coupling: the policy's choices, and outputs that no choice can change."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

from batchspec_cli.engine import drafters, sampling
from batchspec_cli.engine.core import Engine, EngineConfig
from batchspec_cli.engine.events import Sampling
from batchspec_cli.policy import control
from batchspec_cli.policy.control import (EXPLORE_EVERY, OUTLIER, PLAIN, SPEC, WINDOW_ROUNDS, Arms, Auto, Calibration,
                                          Choice, FixedK, Goodput, Group, Offer, RoundReport, Timings, expected_tokens)
from conftest import (TINY_VOCAB_SIZE, RandomK, exact_first_two, greedy_reference, make_tiny_llama, perturbed_copy,
                      run_engine_rows, scheduled)

torch.set_num_threads(1)


# ---------------------------------------------------------------------------- the policy, with invented numbers

CONTEXT = 100  # the groups' padded length in the invented rounds


def policy_with(verify: dict[int, float], draft_step: float, draft_feed: float, group: int = 8, k: int = 5,
                feed_longest: float | None = None) -> Goodput:
    """SPEC's per-round choice seeded with invented timings (seconds): verify per width, one draft step, the
    draft's first forward of 2 and of k+1 tokens."""
    policy = Goodput(k)
    draft = {1: draft_step, 2: draft_feed, k + 1: draft_feed if feed_longest is None else feed_longest}
    policy.seed(Calibration(group, CONTEXT, verify, draft))
    return policy


def rows(n: int, remaining: float = 100.0) -> Group:
    return Group(list(range(n)), CONTEXT, remaining)


def model(catch_up: int = 2) -> dict[str, Offer]:
    return {"model": Offer(None, catch_up)}


def report(group: int, source: str, k: int, seconds: float, prepare_s: float = 0.0, tokens: int | None = None,
           context: int = CONTEXT, arm: str = "") -> RoundReport:
    """An invented round: ``group`` rows, ``tokens`` committed in all (default one per row), no drafts kept."""
    emitted = [1] * group if tokens is None else [tokens // group + (i < tokens % group) for i in range(group)]
    return RoundReport(choice=Choice(k, source, arm=arm), context=context, rows=list(range(group)),
                       drafted=[0] * group, drafters=[""] * group, accepted=[0] * group, emitted=emitted,
                       finished=[], fed=2 if source == "model" else 0, seconds=seconds, prepare_s=prepare_s,
                       elapsed_s=seconds + prepare_s)


def test_policy_picks_a_plain_step_when_verifying_is_dear():
    # This CPU at batch 8: a (k+1)-token verify costs ~1 + 0.3 k steps, a draft step 0.15 of one.
    policy = policy_with({w: 0.2 * (1 + 0.3 * (w - 1)) for w in range(1, 7)}, 0.03, 0.035)
    for r in range(8):  # rows that accept a third of their drafts (Spec-Bench: 0.38)
        for accepted in (0, 1) * 10:
            policy.acceptance.observe(("model", r), 5, accepted)
    assert policy.acceptance.row(("model", 0)) == pytest.approx(1 / 3, abs=0.05)
    assert policy.choose(rows(8), model()).k == 0
    assert not policy.wants_draft()


def test_policy_picks_the_most_when_a_perfect_draft_verifies_for_free():
    policy = policy_with({w: 0.2 for w in range(1, 7)}, 0.0, 0.0)
    for r in range(8):
        for _ in range(20):
            policy.acceptance.observe(("model", r), 5, 5)
    ks = []  # k climbs one step past the largest measured one: bare-forward seeds flatter speculation
    for _ in range(7):
        choice = policy.choose(rows(8), model())
        ks.append(choice.k)
        policy.observe(report(8, choice.source, choice.k, 0.2))
    assert ks == [1, 2, 3, 4, 5, 5, 5] and choice.source == "model" and choice.expected_tokens > 8 * 5
    assert policy.wants_draft()


def test_auto_prefills_the_draft_while_spec_holds_or_its_last_trial_came_close():
    """No draft prefill before SPEC is first tried; while PLAIN holds, only after a SPEC trial with a window at least
    at PLAIN's rate; once SPEC holds, whenever its ruler says a current draft pays; never when the ruler says no."""
    good = policy_with({w: 0.2 for w in range(1, 7)}, 0.0, 0.0)  # a draft that verifies for free: it pays
    for r in range(8):
        for _ in range(20):
            good.acceptance.observe(("model", r), 5, 5)
    good.observe(report(8, "", 0, 0.2))
    assert good.wants_draft()
    auto = Auto(5)
    auto.spec = good
    arms = auto.arms
    assert not auto.wants_draft()  # PLAIN holds and SPEC was never tried

    def trial(*rates):  # SPEC trial windows at these shares of PLAIN's rate (100 tok/s)
        arms.baseline, arms.arm, arms.trial = 100.0, SPEC, 0
        for share in rates:
            for _ in range(WINDOW_ROUNDS):
                arms.record(round(25 * share), 0.25)  # 10 rounds of 0.25 s: a window (WINDOW_SECONDS = 2)
        assert arms.arm == PLAIN and arms.incumbent == PLAIN

    trial(1.0)  # even with PLAIN, not a win: no switch, but close
    assert auto.wants_draft()
    trial(0.9)
    assert not auto.wants_draft()
    trial(1.05, 0.7)  # one window won, the second lost: the trial came close
    assert auto.wants_draft()
    arms.baseline, arms.arm, arms.trial = 100.0, SPEC, 0
    for _ in range(WINDOW_ROUNDS // 2):  # under a third of PLAIN's rate: cut at half a window
        arms.record(6, 0.25)
    assert arms.arm == PLAIN and not auto.wants_draft()
    arms.incumbent = SPEC  # once SPEC holds, the ruler alone decides
    assert auto.wants_draft()
    dear = policy_with({w: 0.2 * (1 + 0.5 * (w - 1)) for w in range(1, 7)}, 0.05, 0.05)
    dear.observe(report(8, "", 0, 0.2))
    auto.spec = dear
    assert not dear.wants_draft() and not auto.wants_draft()


def test_draft_prefills_during_plain_are_charged_to_spec_not_plain():
    """A PLAIN round's wall clock loses the draft prefills made before it; SPEC's next round carries them."""
    auto = Auto(5)
    seen = []
    auto.arms.record = lambda tokens, seconds, *told, **named: seen.append(seconds)
    plain = dataclasses.replace(report(8, "", 0, 0.2), draft_prefill_s=0.05)
    auto.observe(plain)
    auto.observe(plain)
    auto.arms.arm = SPEC
    auto.observe(dataclasses.replace(report(8, "", 0, 0.2), draft_prefill_s=0.0))
    auto.observe(report(8, "", 0, 0.2))
    assert seen == pytest.approx([0.15, 0.15, 0.3, 0.2])


def test_a_calibration_is_told_to_the_arms_as_paid_once():
    """The round that calibrated hands its calibration to the arms apart (``once_s``): in the round's wall clock,
    out of the window's seconds."""
    auto = Auto(5)
    auto.arms.arm = SPEC
    told = []
    auto.arms.record = lambda tokens, seconds, tokens_left=None, admit_s=0.0, worth=None, once_s=0.0: told.append(
        (seconds, once_s))
    auto.observe(dataclasses.replace(report(8, "", 0, 0.2), calibrate_s=0.7, elapsed_s=0.9))
    auto.observe(report(8, "", 0, 0.2))
    assert told == [pytest.approx((0.9, 0.7)), pytest.approx((0.2, 0.0))]
    policy = Auto(5)
    policy.observe(dataclasses.replace(report(8, "", 0, 0.2), calibrate_s=0.7, elapsed_s=0.9))
    assert policy.arms.window.seconds == pytest.approx([0.2])


def test_spec_fills_the_pool_only_while_most_of_its_rounds_speculate():
    """The pool beyond one batch serves rows speculation left at different lengths: SPEC holds it while most of
    its recent rounds speculate; plain steps under SPEC close it within a window, speculating rounds reopen it;
    PLAIN's rounds and a SPEC trial never fill it."""
    auto = Auto(5)
    auto.arms.record = lambda tokens, seconds, *told, **named: None
    assert not auto.wants_pool()  # PLAIN holds
    auto.arms.arm = SPEC
    assert not auto.wants_pool()  # a SPEC trial runs on the batch in flight
    auto.arms.incumbent = SPEC
    assert auto.wants_pool()
    open_for = []
    for _ in range(WINDOW_ROUNDS):
        auto.observe(report(8, "", 0, 0.2, arm=SPEC))
        open_for.append(auto.wants_pool())
    assert open_for[0] and not open_for[-1] and open_for == sorted(open_for, reverse=True)
    auto.arms.arm = PLAIN
    for _ in range(3 * WINDOW_ROUNDS):
        auto.observe(report(8, "", 0, 0.2))
    auto.arms.arm = SPEC
    assert not auto.wants_pool(), "PLAIN's rounds say nothing of SPEC's"
    for _ in range(WINDOW_ROUNDS):
        auto.observe(report(8, "model", 3, 0.3, arm=SPEC))
    assert auto.wants_pool()


def test_policy_follows_each_row_and_the_drafts_it_has():
    policy = policy_with({w: 0.1 * (1 + 0.1 * (w - 1)) for w in range(1, 7)}, 0.0, 0.0, group=2)
    good, bad = ("suffix", 0), ("suffix", 1)
    for _ in range(30):
        policy.acceptance.observe(good, 5, 5)
        policy.acceptance.observe(bad, 5, 0)
    assert policy.acceptance.row(good) > 0.9 and policy.acceptance.row(bad) < 0.3
    # Model-free drafts: k is bounded by the longest proposal, and no proposal means a plain step.
    for k in (1, 2, 3):
        policy.observe(report(2, "lookup", k, 0.1))
    choice = policy.choose(rows(2), {"suffix": Offer([3, 0])})
    assert (choice.k, choice.source, choice.drafters) == (3, "lookup", ["suffix", ""])
    assert policy.choose(rows(2), {}).k == 0


def test_each_row_verifies_the_proposal_with_the_most_expected_accepted_tokens():
    """sum_j a^(j+1) over the proposal: a long draft of a poor drafter loses to a short one of a good drafter."""
    policy = FixedK(4)
    for _ in range(30):
        policy.acceptance.observe(("ngram", 0), 4, 4)  # ngram is right on row 0, suffix on row 1
        policy.acceptance.observe(("suffix", 0), 4, 0)
        policy.acceptance.observe(("ngram", 1), 4, 0)
        policy.acceptance.observe(("suffix", 1), 4, 4)
    sources = {"ngram": Offer([2, 4, 0]), "suffix": Offer([4, 1, 0])}
    names, lengths = policy.rank(rows(3), sources)
    assert names == ["ngram", "suffix", ""] and lengths == [2, 1, 0]
    choice = policy.choose(rows(3), sources)
    assert (choice.k, choice.source, choice.drafters) == (4, "lookup", ["ngram", "suffix", ""])


def test_a_grammar_s_forced_run_outranks_a_longer_unmeasured_suffix_draft():
    """Before any evidence a grammar's forced tokens are expected to be accepted (they are the only tokens the row's
    mask allows): its 3 forced tokens outrank suffix's 5 at the general prior; evidence still decides later."""
    policy = FixedK(5)
    sources = {"grammar": Offer([3, 0]), "suffix": Offer([5, 5])}
    assert policy.rank(rows(2), sources) == (["grammar", "suffix"], [3, 5])
    for _ in range(30):  # a model that keeps writing another tokenization of the forced text
        policy.acceptance.observe(("grammar", 0), 3, 0)
    assert policy.rank(rows(2), sources)[0] == ["suffix", "suffix"]


def plain_auto(step_s: float = 0.2, group: int = 8) -> Auto:
    """Auto in its PLAIN arm, with plain steps of ``group`` rows measured at ``step_s`` seconds."""
    policy = Auto(5)
    for _ in range(3):
        policy.observe(report(group, "", 0, step_s, arm=PLAIN))
    assert policy.arms.arm == PLAIN
    return policy


def test_plain_asks_only_the_grammar_and_spec_asks_every_drafter():
    policy = Auto(5)
    assert policy.proposing(("suffix", "grammar")) == ("grammar",)
    assert policy.proposing(("suffix", "ngram")) == ()
    policy.arms.arm = SPEC
    assert policy.proposing(("suffix", "grammar")) == ("suffix", "grammar")
    assert FixedK(0).proposing(("grammar",)) == () and FixedK(3).proposing(("grammar",)) == ("grammar",)


def test_plain_verifies_forced_runs_only_where_they_pay_for_the_width():
    policy = plain_auto()
    everyone = policy.choose(rows(8), {"grammar": Offer([4] * 8)})  # every row forced: one forward serves 4 tokens
    assert everyone.arm == PLAIN and everyone.k >= 1 and everyone.source == "lookup"
    assert everyone.drafters == ["grammar"] * 8
    policy = plain_auto()
    one = policy.choose(rows(8), {"grammar": Offer([4] + [0] * 7)})  # one row in 8: the width costs the other 7
    assert one.k == 0 and one.arm == PLAIN
    assert policy.choose(rows(8), {"suffix": Offer([5] * 8)}).k == 0  # a guess is SPEC's to take, never PLAIN's
    assert plain_auto().choose(rows(8), {}).k == 0


def test_plain_prices_a_forced_width_by_its_measured_rounds_once_it_has_them():
    policy = plain_auto()
    offers = {"grammar": Offer([1] * 8)}
    assert policy.choose(rows(8), offers).k == 1  # the prior: 2 tokens a row for 1.5 steps
    for _ in range(5):  # measured: a 2-token verify costs 2.5 plain steps here
        policy.observe(report(8, "lookup", 1, 0.5, tokens=16, arm=PLAIN))
    assert policy.choose(rows(8), offers).k == 0


def measured_model_policy(feed_per_column: float) -> Goodput:
    """SPEC with a flat 0.1 s round at any k, rows that accept 3 of 5 model drafts, every model k measured once;
    calibrated so that each column a lagging draft is fed costs ``feed_per_column`` x 8 rows (s)."""
    policy = policy_with({w: 0.1 for w in range(1, 7)}, 0.01, 0.012, feed_longest=0.012 + 4 * feed_per_column)
    for r in range(8):
        for _ in range(20):
            policy.acceptance.observe(("model", r), 5, 3)
    for k in range(1, 6):
        policy.observe(report(8, "model", k, 0.1))
    return policy


def test_policy_charges_a_lagging_draft_its_catch_up():
    # each fed column costs 0.05 s (a dear draft prefill)
    policy = measured_model_policy(0.05)
    assert policy.choose(rows(8), model()).k > 0
    assert policy.choose(rows(8, 2.0), model(catch_up=400)).k == 0  # 400 columns to feed for 2 tokens left
    assert policy.choose(rows(8, 10_000.0), model(catch_up=400)).k > 0  # ... or spread over a long completion


def test_a_real_catch_up_prices_the_next_one():
    """Calibration prices a fed column from two short forwards; a long catch-up costs more per column (measured
    here: 6.7 s where 3.4 s were modelled). The first real catch-up replaces that seed."""
    policy = measured_model_policy(0.0005)
    assert policy.choose(rows(8, 50.0), model(catch_up=400)).k > 0  # the seed: 400 columns look cheap
    caught_up = report(8, "model", 1, 5.0)
    caught_up.fed, caught_up.draft_s = 400, 4.0 + 0.01  # 4 s of catch-up beside one draft step
    policy.observe(caught_up)
    assert policy.feed_per_column == pytest.approx(4.0 / (398 * 8))
    assert policy.choose(rows(8, 50.0), model(catch_up=400)).k == 0  # now priced as measured


def test_a_spec_trial_charges_a_catch_up_over_its_own_rounds_not_the_rows_rest():
    """The draft left behind by PLAIN windows: a trial that loses leaves it behind again, so the catch-up serves
    the trial's rounds only; once SPEC has won, it serves the rows' rest."""
    policy = Auto(5)
    policy.spec = measured_model_policy(0.02)
    policy.arms.arm = SPEC  # on trial: PLAIN is the incumbent
    assert policy.choose(rows(8, 1000.0), model()).k > 0  # a current draft pays
    assert policy.choose(rows(8, 1000.0), model(catch_up=400)).k == 0  # 400 columns for one trial's rounds
    policy.arms.incumbent = SPEC
    assert policy.choose(rows(8, 1000.0), model(catch_up=400)).k > 0  # ... or for 1000 tokens of every row


def test_measured_rounds_overrule_the_calibration_and_exploration_remeasures():
    """Bare forwards said k = 1 pays; the rounds say it costs 1.6 plain steps (realignment, overhead): plain wins.
    Plain is then re-measured every so often, so a plain step that got dearer is found out."""
    policy = policy_with({w: 0.1 * (1 + 0.05 * (w - 1)) for w in range(1, 7)}, 0.0, 0.0)
    for r in range(8):
        for accepted in (0, 1) * 10:
            policy.acceptance.observe(("model", r), 5, accepted)
    assert policy.choose(rows(8), model()).k > 0
    for _ in range(20):
        for k in range(1, 6):
            policy.observe(report(8, "model", k, 0.16 + 0.02 * k))
    choices = [policy.choose(rows(8), model()).k for _ in range(100)]
    assert choices.count(0) >= 90, choices
    for _ in range(20):
        policy.observe(report(8, "", 0, 0.5))  # plain steps got dear
    assert policy.choose(rows(8), model()).k > 0
    for _ in range(3 * EXPLORE_EVERY):  # a model option keeps winning; plain is still measured now and then
        choice = policy.choose(rows(8), model())
        policy.observe(report(8, choice.source, choice.k, 0.5 if choice.k == 0 else 0.2))
    assert any(g == 8 and option == ("", 0) for g, option in policy.measured)


def test_the_realignment_speculation_causes_is_charged_to_it():
    """A plain step that first realigns rows a speculative round left apart does not pay for that move."""
    policy = policy_with({w: 0.1 for w in range(1, 7)}, 0.0, 0.0)
    policy.observe(report(8, "model", 2, 0.12))
    policy.observe(report(8, "", 0, 0.10, prepare_s=0.05))  # this plain round's 0.05 s of realignment: k = 2's
    policy.observe(report(8, "", 0, 0.10))
    policy.observe(report(8, "model", 1, 0.11))
    assert policy.rounds.get(8, CONTEXT, ("model", 2)) == pytest.approx(0.17)
    assert policy.rounds.get(8, CONTEXT, ("", 0)) == pytest.approx(0.10)


def test_a_first_measurement_is_capped_like_any_other():
    """A stall in an option's first real round replaces its seed by at most OUTLIER x the seed."""
    policy = policy_with({w: 0.1 for w in range(1, 7)}, 0.0, 0.0)
    policy.observe(report(8, "model", 1, 9.0))  # a 90x stall
    assert policy.rounds.get(8, CONTEXT, ("model", 1)) == pytest.approx(OUTLIER * 0.1)


def test_a_long_catch_up_is_no_first_measurement_but_counts_once_the_option_is_measured():
    policy = policy_with({w: 0.1 for w in range(1, 7)}, 0.0, 0.0)
    caught_up = report(8, "model", 1, 0.25)
    caught_up.fed = 200  # the draft was left behind by a plain window
    policy.observe(caught_up)
    assert policy.rounds.get(8, CONTEXT, ("model", 1)) == pytest.approx(0.1)  # still the seed
    policy.observe(report(8, "model", 1, 0.12))
    policy.observe(caught_up)  # now a recurring cost in the moving average
    assert policy.rounds.get(8, CONTEXT, ("model", 1)) == pytest.approx(0.8 * 0.12 + 0.2 * 0.25)


def test_costs_are_kept_per_context_length():
    """A long context's rounds do not price a short context's, and an unmeasured band borrows the nearest."""
    timings = Timings()
    timings.observe(8, 100, ("", 0), 0.1)
    timings.observe(8, 1000, ("", 0), 0.3)
    assert timings.get(8, 90, ("", 0)) == pytest.approx(0.1) and timings.get(8, 900, ("", 0)) == pytest.approx(0.3)
    assert timings.get(8, 5000, ("", 0)) == pytest.approx(0.3) and timings.get(8, 10, ("", 0)) == pytest.approx(0.1)


def test_an_unmeasured_band_keeps_the_ratio_to_a_plain_step_not_the_seconds():
    """A verify measured at a short context, and plain steps at a short and a long one: at the long context the
    verify costs what it cost per plain step (at a short context its seconds flattered it 3x)."""
    timings = Timings()
    timings.observe(8, 100, ("", 0), 0.1)
    timings.observe(8, 100, ("lookup", 3), 0.15)
    timings.observe(8, 1000, ("", 0), 0.3)
    assert timings.get(8, 1000, ("lookup", 3)) == pytest.approx(0.45)
    assert timings.get(8, 100, ("lookup", 3)) == pytest.approx(0.15)
    assert timings.get(8, 5000, ("lookup", 3)) == pytest.approx(0.45)  # plain unmeasured there too: the nearest


def test_timings_interpolate_over_group_sizes():
    timings = Timings()
    timings.observe(4, CONTEXT, ("", 0), 0.1)
    timings.observe(16, CONTEXT, ("", 0), 0.3)
    assert timings.get(8, CONTEXT, ("", 0)) == pytest.approx(0.1 + 0.2 * 4 / 12)
    assert timings.get(2, CONTEXT, ("", 0)) == pytest.approx(0.05)
    assert timings.get(32, CONTEXT, ("", 0)) == pytest.approx(0.6)
    timings.observe(4, CONTEXT, ("", 0), 0.2)
    assert timings.get(4, CONTEXT, ("", 0)) == pytest.approx(0.8 * 0.1 + 0.2 * 0.2)


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


# ---------------------------------------------------------------------------- outputs under any k schedule

MAX_NEW = 13


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(TINY_VOCAB_SIZE, seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, scale=0.01, seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(4, TINY_VOCAB_SIZE) for _ in range(rng.randint(1, 24))] for _ in range(18)]


def run(target, draft, prompts, *, mode, k=4, batch_size=4, policy=None, settings=Sampling(), max_new=MAX_NEW,
        eos=(1,), window=None, lookups=None):
    cfg = EngineConfig(mode=mode, k=k, batch_size=batch_size, window=window or 4 * batch_size)
    return run_engine_rows(target, draft, prompts, cfg, settings=settings, max_new=max_new, eos=eos, policy=policy,
                           lookups=lookups)


SAMPLED = Sampling(temperature=0.8, top_k=30, top_p=0.9, seed=11)


@pytest.mark.parametrize("batch_size,k,mode,seed", [(1, 3, "exspec", 1), (2, 5, "auto", 2), (4, 2, "eqspec", 3),
                                                    (7, 4, "auto", 4), (11, 6, "exspec", 5), (16, 3, "auto", 6)])
def test_outputs_equal_ar_under_a_random_k_schedule(target, draft, prompts, batch_size, k, mode, seed):
    references = [greedy_reference(target, p, MAX_NEW, [1]) for p in prompts]
    results, stats = run(target, draft, prompts, mode=mode, k=k, batch_size=batch_size, policy=RandomK(k, seed))
    assert [results[i].token_ids for i in range(len(prompts))] == references
    assert len({s.k for s in stats if s.group_kind != "prefill"}) > 2, "the schedule varied k"
    sampled_ar, _ = run(target, None, prompts, mode="ar", batch_size=batch_size, settings=SAMPLED)
    sampled, _ = run(target, draft, prompts, mode=mode, k=k, batch_size=batch_size, policy=RandomK(k, seed + 50),
                     settings=SAMPLED)
    assert {r: e.token_ids for r, e in sampled.items()} == {r: e.token_ids for r, e in sampled_ar.items()}


def test_sampled_rows_identical_across_modes_drafts_and_schedules(target, draft, prompts):
    reference, _ = run(target, None, prompts, mode="ar", batch_size=1, settings=SAMPLED)
    other_draft = make_tiny_llama(TINY_VOCAB_SIZE, seed=9, layers=1)
    for mode, d, batch_size, policy in [("auto", draft, 8, None), ("exspec", draft, 3, None),
                                        ("eqspec", other_draft, 5, None), ("exspec", target, 16, RandomK(5, 7)),
                                        ("auto", other_draft, 4, RandomK(5, 8))]:
        results, _ = run(target, d, prompts, mode=mode, k=5, batch_size=batch_size, settings=SAMPLED, policy=policy)
        for row, ref in reference.items():
            assert results[row].token_ids == ref.token_ids, (mode, batch_size, row)
    assert any(len(r.token_ids) > 3 for r in reference.values())


@pytest.mark.parametrize("batch_size,k,names,with_model,seed", [(1, 3, [], True, 1), (4, 5, ["suffix"], True, 2),
                                                                 (7, 2, ["ngram", "suffix"], False, 3),
                                                                 (16, 4, ["ngram"], True, 4)])
def test_outputs_equal_ar_under_every_arm_schedule(target, draft, prompts, batch_size, k, names, with_model, seed):
    """Switching arms at any round (calibration mid-job, a draft left behind by plain windows and caught up,
    rows admitted without a draft prefill) changes no output, greedy or sampled."""
    d = draft if with_model else None
    references = [greedy_reference(target, p, MAX_NEW, [1]) for p in prompts]
    results, stats = run(target, d, prompts, mode="auto", k=k, batch_size=batch_size, policy=scheduled(k, seed),
                         lookups=drafters.make(names))
    assert [results[i].token_ids for i in range(len(prompts))] == references
    rounds = [s for s in stats if s.group_kind != "prefill"]
    assert {s.trace.arm for s in rounds} == {PLAIN, SPEC} and any(s.k for s in rounds), "both arms ran, and speculated"
    assert all(s.k == 0 for s in rounds if s.trace.arm == PLAIN)
    sampled_ar, _ = run(target, None, prompts, mode="ar", batch_size=batch_size, settings=SAMPLED)
    sampled, _ = run(target, d, prompts, mode="auto", k=k, batch_size=batch_size, policy=scheduled(k, seed + 50),
                     settings=SAMPLED, lookups=drafters.make(names))
    assert {r: e.token_ids for r, e in sampled.items()} == {r: e.token_ids for r, e in sampled_ar.items()}


def test_auto_equals_ar_and_records_its_arms_and_windows(target, draft, prompts, monkeypatch):
    """The shipped policy with windows short enough to switch inside a small job: outputs equal ar; every round
    records its arm, the rounds that closed a window its measured rate; SPEC's rounds are modelled."""
    monkeypatch.setattr(control, "WINDOW_ROUNDS", 3)
    monkeypatch.setattr(control, "WINDOW_SECONDS", 0.0)
    monkeypatch.setattr(control, "TRIAL_SHARE", None)  # no trial budget: a small job must reach SPEC
    references = [greedy_reference(target, p, MAX_NEW, [1]) for p in prompts]
    results, stats = run(target, draft, prompts, mode="auto", k=4, batch_size=4)
    assert [results[i].token_ids for i in range(len(prompts))] == references
    rounds = [s for s in stats if s.group_kind != "prefill"]
    assert rounds[0].trace.arm == PLAIN and {s.trace.arm for s in rounds} == {PLAIN, SPEC}
    assert all(s.k == 0 and s.trace.plain_ms == 0 for s in rounds if s.trace.arm == PLAIN)
    spec = [s for s in rounds if s.trace.arm == SPEC]
    assert all(s.trace.plain_ms > 0 for s in spec), "SPEC's costs are measured (calibration, then its rounds)"
    assert all(0 <= s.k <= 4 and s.trace.expected_tokens >= s.batch_size * (s.k > 0) for s in spec)
    assert all(s.drafter == ("model" if s.k else "") for s in rounds)
    closing = [s for s in rounds if s.trace.window_tokens_per_s > 0]
    assert len(closing) >= len(rounds) // 3 - 1 and {s.trace.arm for s in closing} == {PLAIN, SPEC}


@pytest.mark.parametrize("sized", [True, False])
def test_the_engine_tells_auto_the_work_left(target, draft, prompts, sized):
    """Rows run to their limits (no EOS): after every round the work left is every row's limit less what was
    committed so far, in flight and to come; for requests without a length only once none are left to come."""
    from batchspec_cli.engine.core import ModelHandle
    from batchspec_cli.engine.events import Request

    seen = []

    class Watching(Auto):
        def observe(self, report):
            seen.append((report.tokens, report.tokens_left))
            return super().observe(report)

    limits = [5 + i % 3 for i in range(len(prompts))]  # rows to come are counted at the mean limit in flight
    reqs = [Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=limits[i], sampling=Sampling())
            for i, p in enumerate(prompts)]
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [], EngineConfig(mode="auto", k=3,
                    batch_size=4), policy=Watching(3))
    list(engine.run(reqs if sized else iter(reqs)))
    committed, total = 0, sum(limits)
    exact = 0
    for tokens, left in seen:
        committed += tokens
        if left is None:
            assert not sized
            continue
        assert left >= 0 and abs(left - (total - committed)) <= 2 * len(prompts)  # mean limits: within 2 a row
        exact += left == total - committed
    assert seen[-1][1] == 0 and exact >= len(seen) // 4
    assert sized == (seen[0][1] is not None)


def watched_run(target, draft, prompts, arm: str) -> tuple[list, list[RoundReport], Auto]:
    """The prompts through the engine under ``auto`` held in ``arm`` throughout: (events, every round's report,
    the policy)."""
    from batchspec_cli.engine.core import ModelHandle
    from batchspec_cli.engine.events import Request

    reports = []

    class Watching(Auto):
        def observe(self, report):
            reports.append(report)
            return super().observe(report)

    policy = Watching(3)
    policy.arms.share = None
    policy.arms.incumbent = policy.arms.arm = arm
    policy.arms._decide = lambda rate: None  # no decision: the arm holds
    engine = Engine(ModelHandle(target, "cache"), ModelHandle(draft, "cache"), [], EngineConfig(mode="auto", k=3,
                    batch_size=4), policy=policy)
    events = list(engine.run(iter([Request(row=i, id=f"r{i}", prompt_ids=p, max_new_tokens=6, sampling=Sampling())
                                   for i, p in enumerate(prompts)])))
    return events, reports, policy


def test_the_engine_reports_the_targets_admission_prefills_apart(target, draft, prompts):
    """Every round's report says how much of its elapsed wall clock went on the target's prefills of rows admitted
    since the previous round: together, about what the prefill steps' own stats measured (PLAIN: no draft prefill
    rides along), never more than the round's elapsed time, nothing on rounds with no admission before them."""
    from batchspec_cli.engine.events import StepStats

    events, reports, _ = watched_run(target, draft, prompts, PLAIN)
    prefills = [e for e in events if isinstance(e, StepStats) and e.group_kind == "prefill"]
    assert len(prefills) >= 2 and all(r.admit_s <= r.elapsed_s for r in reports)
    assert reports[0].admit_s > 0 and sum(r.admit_s > 0 for r in reports) <= len(prefills)
    measured = sum(p.total_ms for p in prefills) / 1e3
    assert 0.5 * measured <= sum(r.admit_s for r in reports) <= measured


def test_the_engine_reports_a_calibration_once_within_its_rounds_wall_clock(target, draft, prompts):
    """SPEC from the start: the first round calibrates, and its report says for how long (within the round's
    elapsed wall clock, outside its own clock); no other round calibrates."""
    _, reports, policy = watched_run(target, draft, prompts, SPEC)
    calibrated = [r for r in reports if r.calibrate_s > 0]
    assert len(calibrated) == 1 and calibrated[0] is reports[0] and policy.spec.seeded
    assert calibrated[0].seconds + calibrated[0].calibrate_s <= calibrated[0].elapsed_s


def test_auto_on_a_short_job_stays_plain_and_never_calibrates_or_prefills_the_draft(target, draft, prompts,
                                                                                     monkeypatch):
    calls = []
    monkeypatch.setattr(Engine, "_calibrate", lambda self, *a: calls.append("calibrate"))
    monkeypatch.setattr(Engine, "_prefill_draft", lambda self, *a: calls.append("prefill"))
    results, stats = run(target, draft, prompts[:6], mode="auto", k=4, batch_size=4)
    assert all(s.k == 0 and s.trace.arm == PLAIN for s in stats if s.group_kind != "prefill") and not calls


# ---------------------------------------------------------------------------- the sampled distribution

V = 24


def sampled_tv(target, draft, settings: Sampling, n: int) -> tuple[float, float, float]:
    """(total variation of the first two tokens against the exact joint, its bound, draft acceptance)."""
    prompt = [3, 5, 2]
    exact = exact_first_two(target, prompt, settings, V)
    results, _ = run(target, draft, [prompt] * n, mode="exspec", k=2, batch_size=512, window=1024, settings=settings,
                     max_new=2, eos=())
    counts = Counter(tuple(r.token_ids) for r in results.values())
    support = [key for key, p in exact.items() if p > 0]
    tv = 0.5 * (sum(abs(counts.get(key, 0) / n - exact[key]) for key in support) +
                sum(c for key, c in counts.items() if exact.get(key, 0) == 0) / n)
    accepted = sum(r.accepted_tokens for r in results.values()) / sum(r.drafted_tokens for r in results.values())
    return tv, 3 * math.sqrt(len(support)) / math.sqrt(n), accepted


@pytest.fixture(scope="module")
def small_pair():
    target = make_tiny_llama(V, seed=2, layers=1, hidden=32, heads=2, kv_heads=1, eos_token_id=[], pad_token_id=0)
    draft = make_tiny_llama(V, seed=3, layers=1, hidden=32, heads=2, kv_heads=1, eos_token_id=[], pad_token_id=0)
    return target, draft


@pytest.mark.parametrize("settings", [Sampling(temperature=0.7, top_p=0.9, seed=5),
                                      Sampling(temperature=1.0, top_k=20, seed=6)])
def test_gumbel_sampling_through_the_engine_matches_the_warped_target(small_pair, settings):
    target, draft = small_pair
    tv, bound, accepted = sampled_tv(target, draft, settings, 2 ** 15)
    assert tv < bound, (tv, bound)
    assert 0.05 < accepted < 0.95, "both acceptances and corrections occur"


def _accept_everything(drafts, lengths, target_tokens):
    k = drafts.shape[1]
    return torch.full_like(drafts[:, 0], k), target_tokens[:, k]



@pytest.mark.parametrize("broken", ["accept_everything", "noise_without_positions"])
def test_a_broken_rule_fails_the_statistical_test(small_pair, monkeypatch, broken):
    target, draft = small_pair
    if broken == "accept_everything":
        monkeypatch.setattr(sampling, "coupled_accept", _accept_everything)
    else:
        real = sampling.noise_base
        monkeypatch.setattr(sampling, "noise_base", lambda keys, positions: real(keys, positions * 0))
    tv, bound, _ = sampled_tv(target, draft, Sampling(temperature=0.7, top_p=0.9, seed=5), 2 ** 15)
    assert tv > bound, (tv, bound)


def test_a_drafter_that_keeps_missing_on_a_row_is_dropped_there_within_four_rounds():
    """The job's other rows accept every draft (job-wide acceptance near 1). A row that refuses its first draft four
    rounds in a row is, by its own estimate, under 0.1 (the job-wide prior's weight halves at every miss in a row;
    a fixed weight of 4 kept it above 0.5), so a 2-token verify that costs 1.2 plain steps is no longer chosen for it;
    one accepted draft gives the prior its weight back."""
    policy = Goodput(1)
    policy.seed(Calibration(1, CONTEXT, {1: 0.1, 2: 0.12}, None))
    for r in range(1, 9):
        for _ in range(20):
            policy.acceptance.observe(("ngram", r), 4, 4)
    offer = {"ngram": Offer([4])}
    assert policy.choose(Group([0], CONTEXT, 100.0), offer).k == 1  # a new row: the job's estimate
    for miss in range(4):
        policy.acceptance.observe(("ngram", 0), 4, 0)
    assert policy.acceptance.row(("ngram", 0)) < 0.1
    assert policy.choose(Group([0], CONTEXT, 100.0), offer).k == 0
    policy.acceptance.observe(("ngram", 0), 4, 2)
    assert policy.acceptance.row(("ngram", 0)) > 0.5


def test_auto_judges_a_round_by_what_plain_steps_of_its_batch_at_its_context_take_for_its_tokens():
    auto = Auto(5)
    assert auto.worth(report(4, "", 0, 0.3, tokens=4)) == pytest.approx(0.3)  # nothing measured: its own seconds
    for _ in range(3):
        auto.observe(report(4, "", 0, 0.2, tokens=4, arm=PLAIN))  # PLAIN's batch of 4: 0.05 s a row
    assert auto.worth(report(4, "model", 3, 0.5, tokens=10)) == pytest.approx(10 * 0.2 / 4)
    for _ in range(3):
        auto.observe(report(2, "", 0, 0.16, tokens=2))  # a smaller group's plain step: dearer per row
    assert auto.worth(report(2, "model", 3, 0.5, tokens=10)) == pytest.approx(10 * 0.2 / 4)  # still PLAIN's ruler
    longer = report(4, "", 0, 0.4, tokens=4, context=8 * CONTEXT)
    for _ in range(40):
        auto.observe(longer)
    assert auto.worth(report(4, "lookup", 2, 0.6, tokens=7, context=8 * CONTEXT)) == pytest.approx(7 * 0.4 / 4, rel=0.01)
