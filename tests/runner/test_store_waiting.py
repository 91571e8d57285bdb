"""Claims that take more jobs than there are idle workers (``PREFETCH``), against real
PostgreSQL: the extra jobs are recorded as waiting, their starts are recorded later (with the
next claim, or on their own), a lost runner's waiting jobs are handed back uncharged, and a
runner's lease is visible to the others exactly while its session lives."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from django_persistent_jobs import enqueue
from django_persistent_jobs.models import JobAttempt, PersistentJob
from django_persistent_jobs.runner import store
from tests.core_support import raw_connection


def started_flags() -> dict[int, bool]:
    return dict(JobAttempt.objects.values_list("id", "started"))


@pytest.mark.django_db(transaction=True)
def test_jobs_beyond_the_idle_workers_are_recorded_waiting_until_a_start_is_written() -> None:
    ids = [enqueue("test.noop", {"i": i}, priority=10 - i).id for i in range(5)]
    with connection.cursor() as cursor:
        jobs = store.claim(cursor, "wait-a", 3, None, direct=1)
    assert [j.id for j in jobs] == ids[:3]
    assert [j.waiting for j in jobs] == [False, True, True]  # claim order decides who waits
    assert started_flags() == {jobs[0].token: True, jobs[1].token: False, jobs[2].token: False}

    # The next claim carries the start of job 1, with the time it started.
    began = datetime.now(UTC) - timedelta(seconds=7)
    with connection.cursor() as cursor:
        more = store.claim(cursor, "wait-a", 2, None, direct=0,
                           started=[jobs[1].token], started_at=[began])
    assert [j.waiting for j in more] == [True, True]
    flags = started_flags()
    assert flags[jobs[1].token] and not flags[jobs[2].token]
    assert JobAttempt.objects.get(id=jobs[1].token).started_at == began

    # A completion records the start the worker noted (a waiting job's start may not have been
    # written while it ran); a start written later leaves a finished attempt as it is.
    ran_from = datetime.now(UTC) - timedelta(seconds=3)
    more[0].started_at = ran_from
    with connection.cursor() as cursor:
        assert store.complete(cursor, more[0])
        store.mark_started(cursor, [jobs[2].token, more[0].token], [began, began])
    flags = started_flags()
    assert flags[jobs[2].token] and flags[more[0].token] and not flags[more[1].token]
    done = JobAttempt.objects.get(id=more[0].token)
    assert done.started_at == ran_from and done.duration is not None
    assert done.duration.total_seconds() >= 3


@pytest.mark.django_db(transaction=True)
def test_a_lost_runners_waiting_job_is_found_as_not_started() -> None:
    with connection.cursor() as cursor:
        store.register_runner(cursor, "wait-b", "host", 1, None, 4, "test")
    first, second = (enqueue("test.noop", {"i": i}, priority=5 - i).id for i in range(2))
    with connection.cursor() as cursor:
        _running, waiting = store.claim(cursor, "wait-b", 2, None, direct=1)
        assert store.waiting_jobs_of(cursor, ["wait-b"]) == [
            (second, waiting.token, "test.noop", 1, "wait-b", False)]
        cursor.execute("DELETE FROM persistent_jobs_runners WHERE id = 'wait-b'")
        orphans = {held.id: held.started for held in store.orphaned_jobs(cursor)}
        assert orphans == {first: True, second: False}
        # Handed back: the attempt is not charged, the hand-back is counted.
        assert store.transition(cursor, second, waiting.token, kind="handback",
                                code="RUNNER_LOST", message="never started") == "pending"
    job = PersistentJob.objects.get(id=second)
    assert (job.attempts, job.handbacks, job.last_error_code) == (0, 1, "RUNNER_LOST")
    assert JobAttempt.objects.get(id=waiting.token).outcome == "interrupted"


@pytest.mark.django_db(transaction=True)
def test_a_lease_is_lapsed_exactly_while_no_session_holds_it() -> None:
    with connection.cursor() as cursor:
        for runner in ("lease-a", "lease-b"):
            store.register_runner(cursor, runner, "host", 1, None, 4, "test")
        assert store.lapsed_leases(cursor, "lease-a") == ["lease-b"]
    with raw_connection() as holder, raw_connection() as second:
        with holder.cursor() as cursor:
            assert store.take_lease(cursor, "lease-b")
        with second.cursor() as cursor:
            assert not store.take_lease(cursor, "lease-b")  # one session at a time
        with connection.cursor() as cursor:
            assert store.lapsed_leases(cursor, "lease-a") == []
        holder.close()  # the session ends: the server drops the lock at once
        with connection.cursor() as cursor:
            assert store.lapsed_leases(cursor, "lease-a") == ["lease-b"]
        with second.cursor() as cursor:
            assert store.take_lease(cursor, "lease-b")
        with connection.cursor() as cursor:
            assert store.lapsed_leases(cursor, "lease-a") == []
