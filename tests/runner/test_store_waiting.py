"""Claims that take more jobs than there are idle workers (``PREFETCH``), against real
PostgreSQL: the extra jobs are recorded as waiting; their starts are recorded with the next
claim (fast path) or, fenced, before they run (the gate); a lost runner's waiting job is handed
back uncharged, and a gated start and a hand-back exclude each other; a runner's lease is
visible to the others exactly while its session lives."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import psycopg
import pytest
from django.db import connection, transaction

from django_persistent_jobs import enqueue
from django_persistent_jobs.models import JobAttempt, PersistentJob
from django_persistent_jobs.runner import store
from tests.core_support import blocked_backends, claim_as, conninfo, raw_connection, wait_for


def started_flags() -> dict[int, bool]:
    return dict(JobAttempt.objects.values_list("id", "started"))


@pytest.mark.django_db(transaction=True)
def test_jobs_beyond_the_idle_workers_are_recorded_waiting_until_admitted() -> None:
    ids = [enqueue("test.noop", {"i": i}, priority=10 - i).id for i in range(3)]
    with connection.cursor() as cursor:
        jobs = claim_as(cursor, "wait-a", 3, None, direct=1)
    assert [j.id for j in jobs] == ids
    assert [j.waiting for j in jobs] == [False, True, True]  # claim order decides who waits
    assert started_flags() == {jobs[0].token: True, jobs[1].token: False, jobs[2].token: False}
    claimed_at = JobAttempt.objects.get(id=jobs[1].token).started_at

    # The fast path: the next claim carries a noted start, with the time it started.
    began = datetime.now(UTC)
    enqueue("test.noop", {"i": 3}, priority=0)
    with connection.cursor() as cursor:
        (more,) = claim_as(cursor, "wait-a", 1, None, direct=0,
                              started=[jobs[2].token], started_at=[began])
    assert more.waiting and started_flags()[jobs[2].token]
    assert JobAttempt.objects.get(id=jobs[2].token).started_at == began
    with connection.cursor() as cursor:
        store.mark_started(cursor, [more.token], [began])  # on its own, when no claim comes
    assert started_flags()[more.token]

    # The gate: fenced, once.
    with connection.cursor() as cursor:
        # Only waiting attempts still running under their claim are admitted, once.
        assert store.admit(cursor, [jobs[0].token, jobs[1].token]) == {jobs[1].token}
        assert store.admit(cursor, [jobs[1].token]) == set()
    assert started_flags()[jobs[1].token]
    assert JobAttempt.objects.get(id=jobs[1].token).started_at > claimed_at  # the real start


@pytest.mark.django_db(transaction=True)
def test_a_lost_runners_waiting_job_is_released_unless_a_worker_started_it() -> None:
    with connection.cursor() as cursor:
        store.register_runner(cursor, "wait-b", "host", 1, None, 4, "test")
    first, second, third = (enqueue("test.noop", {"i": i}, priority=5 - i).id for i in range(3))
    with connection.cursor() as cursor:
        _running, waiting, admitted = claim_as(cursor, "wait-b", 3, None, direct=1)
        held = {h.id: h for h in store.waiting_jobs_of(cursor, ["wait-b"])}
        assert set(held) == {second, third}
        assert store.admit(cursor, [admitted.token]) == {admitted.token}  # a worker got there
        cursor.execute("DELETE FROM persistent_jobs_runners WHERE id = 'wait-b'")
        orphans = {h.id: h.started for h in store.orphaned_jobs(cursor)}
        assert orphans == {first: True, second: False, third: True}
    with transaction.atomic(), connection.cursor() as cursor:
        assert store.release_waiting(cursor, held[second], "RUNNER_LOST", "never ran") == "pending"
    with transaction.atomic(), connection.cursor() as cursor:
        # Listed as waiting, but started since: not handed back.
        assert store.release_waiting(cursor, held[third], "RUNNER_LOST", "never ran") is None
    job = PersistentJob.objects.get(id=second)
    assert (job.status, job.attempts, job.handbacks, job.last_error_code) == (
        "pending", 0, 1, "RUNNER_LOST")  # not charged; counted against HANDBACK_LIMIT
    assert JobAttempt.objects.get(id=waiting.token).outcome == "interrupted"
    assert PersistentJob.objects.get(id=third).status == "running"
    with connection.cursor() as cursor:
        assert store.admit(cursor, [waiting.token]) == set()  # too late to start it


@pytest.mark.django_db(transaction=True)
def test_a_start_and_a_hand_back_exclude_each_other() -> None:
    """The hand-back holds the attempt row: a start that comes meanwhile waits for it, then
    finds the attempt handed back and does not run the job."""
    with connection.cursor() as cursor:
        store.register_runner(cursor, "wait-c", "host", 1, None, 4, "test")
    enqueue("test.noop", {})
    with connection.cursor() as cursor:
        (job,) = claim_as(cursor, "wait-c", 1, None, direct=0)
        (held,) = store.waiting_jobs_of(cursor, ["wait-c"])
    with raw_connection(autocommit=False) as rescuer, raw_connection() as worker:
        with rescuer.cursor() as cursor:
            assert store.release_waiting(cursor, held, "RUNNER_LOST", "never ran") == "pending"
        worker.execute("SET statement_timeout = '10s'")
        answer: list[set[int]] = []
        with worker.cursor() as worker_cursor:
            starter = threading.Thread(
                target=lambda: answer.append(store.admit(worker_cursor, [job.token])))
            starter.start()
            with raw_connection() as observer:
                wait_for(lambda: blocked_backends(observer) == 1, 10,
                         "the start to wait for the hand-back's row lock")
            rescuer.commit()
            starter.join(10)
    assert answer == [set()]


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
        holder.close()  # the session ends: the server drops the lock as its backend exits

        def lapsed() -> list[str]:
            with connection.cursor() as cursor:
                return store.lapsed_leases(cursor, "lease-a")

        # (The backend exits a moment after the client closes its socket, not before close()
        # returns: a CI flake asserted it at once.)
        wait_for(lambda: lapsed() == ["lease-b"], 10, "the closed session's lock to go")
        with second.cursor() as cursor:
            assert store.take_lease(cursor, "lease-b")
        with connection.cursor() as cursor:
            assert store.lapsed_leases(cursor, "lease-a") == []


@pytest.mark.django_db(transaction=True)
def test_a_lease_held_in_another_database_of_the_server_does_not_count() -> None:
    with connection.cursor() as cursor:
        for runner in ("lease-a", "lease-b"):
            store.register_runner(cursor, runner, "host", 1, None, 4, "test")
    elsewhere = {**conninfo(), "dbname": "postgres"}
    with psycopg.connect(**elsewhere, autocommit=True) as other, other.cursor() as cursor:
        assert store.take_lease(cursor, "lease-b")  # the same key, another database's lock
        with connection.cursor() as ours:
            assert store.lapsed_leases(ours, "lease-a") == ["lease-b"]


@pytest.mark.django_db(transaction=True)
def test_recording_starts_skips_an_attempt_another_transaction_holds() -> None:
    """A batched completion locks job rows, then attempt rows; the start records of the claim
    lock attempt rows. Waiting for one another they would deadlock (one statement aborted after
    ``deadlock_timeout``, a second lost per collision), so the record skips a locked attempt:
    it is being completed or settled, which makes the record moot."""
    for i in range(2):
        enqueue("test.noop", {"i": i}, priority=5 - i)
    with connection.cursor() as cursor:
        first, second = claim_as(cursor, "wait-d", 2, None, direct=0)
    with raw_connection(autocommit=False) as completing:
        completing.execute("SELECT 1 FROM persistent_jobs_attempts WHERE id = %s FOR UPDATE",
                           [first.token])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")  # a wait would fail the test, not hang it
            store.mark_started(cursor, [first.token, second.token],
                               [datetime.now(UTC)] * 2)
            cursor.execute("SET lock_timeout = 0")
        completing.rollback()
    flags = started_flags()
    assert flags[second.token] and not flags[first.token]


@pytest.mark.django_db(transaction=True)
def test_a_settling_statement_records_a_fast_path_start_no_claim_wrote() -> None:
    """A waiting job started on the fast path carries its start (``ClaimedJob.began``); the
    statement that settles it before any claim wrote that start records it: in the handler's
    transaction, in a batch, or as a failure. A start already on record is kept, and a job
    released unstarted (no ``began``) stays unstarted."""
    for i in range(5):
        enqueue("test.noop", {"i": i}, priority=10 - i)
    with connection.cursor() as cursor:
        jobs = claim_as(cursor, "wait-began", 5, None, direct=0)
    assert all(job.waiting for job in jobs)
    claimed_at = {job.token: JobAttempt.objects.get(id=job.token).started_at for job in jobs}
    in_transaction, batched, failed, on_record, released = jobs
    for job in (in_transaction, batched, failed, on_record):
        job.waiting, job.began = False, datetime.now(UTC)
    with connection.cursor() as cursor:
        # A claim got there first, with a start earlier than the one the job carries (between
        # its claim and that): the settling statement keeps the one on record.
        claimed = claimed_at[on_record.token]
        recorded = claimed + (on_record.began - claimed) / 2
        store.mark_started(cursor, [on_record.token], [recorded])
        with transaction.atomic():
            assert store.complete(cursor, in_transaction)
        assert store.complete_many(cursor, [(batched, None), (on_record, None)]) == {
            batched.token, on_record.token}
        for job, kind in ((failed, "retry"), (released, "release")):
            assert store.transition(cursor, job.id, job.token, kind=kind, code="X",
                                    message="settled", began=job.began) is not None
    attempts = {a.id: a for a in JobAttempt.objects.filter(id__in=[j.token for j in jobs])}
    for job, start in ((in_transaction, in_transaction.began), (batched, batched.began),
                       (failed, failed.began), (on_record, recorded)):
        attempt = attempts[job.token]
        assert attempt.started and attempt.started_at == start > claimed_at[job.token]
        assert attempt.duration == attempt.finished_at - start
    assert not attempts[released.token].started
    assert attempts[released.token].started_at == claimed_at[released.token]
