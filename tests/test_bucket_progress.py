"""BucketProgress on invented rows: a bucket is reported once, when sealed and its last row finished."""

from __future__ import annotations

import random

from batchspec_cli.job.bucket_progress import BucketDone, BucketProgress


def test_the_docstring_example():
    progress = BucketProgress()
    progress.handed_out(row=0, bucket=3)
    progress.handed_out(row=1, bucket=3)
    progress.seal(3)
    progress.finished(0, error=False)
    assert progress.completed() == []  # row 1 still runs
    progress.finished(1, error=True)
    assert progress.completed() == [BucketDone(bucket=3, rows=2, errors=1)]
    assert progress.completed() == []  # reported once


def test_a_bucket_is_not_complete_before_it_is_sealed():
    progress = BucketProgress()
    progress.handed_out(row=0, bucket=0)
    progress.finished(0, error=False)
    assert progress.completed() == []  # more rows of bucket 0 may still be handed out
    progress.handed_out(row=1, bucket=0)
    progress.seal(0)
    assert progress.completed() == []
    progress.finished(1, error=False)
    assert progress.completed() == [BucketDone(bucket=0, rows=2, errors=0)]


def test_saved_rows_and_buckets_of_saved_rows_only_report_nothing():
    progress = BucketProgress()
    progress.seal(5)  # every row of bucket 5 was saved by an interrupted run: none handed out
    progress.finished(7, error=True)  # a row never handed out (a prompt error announced before the run)
    assert progress.completed() == []
    progress.handed_out(row=8, bucket=6)
    progress.seal(6)
    progress.finished(8, error=False)
    assert progress.completed() == [BucketDone(bucket=6, rows=1, errors=0)]


def test_random_schedules_against_a_brute_force_count():
    for seed in range(50):
        rng = random.Random(seed)
        buckets = {row: rng.randrange(5) for row in range(rng.randint(1, 40))}
        errors = {row for row in buckets if rng.random() < 0.3}
        order = sorted(buckets, key=lambda row: buckets[row])  # handed out bucket by bucket
        progress, running, finished, reported = BucketProgress(), [], set(), []
        sealed: set[int] = set()
        for i, row in enumerate(order):
            progress.handed_out(row, buckets[row])
            running.append(row)
            if i + 1 == len(order) or buckets[order[i + 1]] != buckets[row]:
                progress.seal(buckets[row])
                sealed.add(buckets[row])
            while running and rng.random() < 0.5:  # rows finish in any order
                done = running.pop(rng.randrange(len(running)))
                progress.finished(done, error=done in errors)
                finished.add(done)
                reported += progress.completed()
            for event in reported:  # never early: sealed, and every row of it finished
                assert event.bucket in sealed
                assert all(r in finished for r, b in buckets.items() if b == event.bucket)
        for done in running:
            progress.finished(done, error=done in errors)
        reported += progress.completed()
        expected = [BucketDone(bucket=b, rows=sum(v == b for v in buckets.values()),
                               errors=sum(buckets[r] == b for r in errors)) for b in sorted(set(buckets.values()))]
        assert sorted(reported, key=lambda e: e.bucket) == expected  # each bucket once, with its counts
