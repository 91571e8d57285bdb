"""The runner's repository layer (runner/store.py) against real PostgreSQL: claiming with SKIP
LOCKED seen from two connections, fenced completion and transitions, stale-lock recovery."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from django_persistent_jobs import enqueue
from django_persistent_jobs.models import JobAttempt, JobRunnerRecord, PersistentJob
from django_persistent_jobs.runner import store
from tests.core_support import claim_as, conninfo, db_now, raw_connection


def claim(runner: str = "r1", limit: int = 10,
          queues: tuple[str, ...] | None = None) -> list[store.ClaimedJob]:
    with connection.cursor() as cursor:
        return claim_as(cursor, runner, limit, queues)


def transition(job: store.ClaimedJob, token: int | None = None, **kwargs: Any) -> str | None:
    kwargs.setdefault("code", "E")
    kwargs.setdefault("message", "m")
    with connection.cursor() as cursor:
        return store.transition(cursor, job.id, job.token if token is None else token, **kwargs)


def complete(job: store.ClaimedJob) -> bool:
    with connection.cursor() as cursor:
        return store.complete(cursor, job)


def register(runner_id: str, heartbeat_age: timedelta = timedelta(0)) -> None:
    with connection.cursor() as cursor:
        store.register_runner(cursor, runner_id, "host", 1, None, 4, "test")
        cursor.execute("UPDATE persistent_jobs_runners SET heartbeat_at = now() - %s "
                       "WHERE id = %s", [heartbeat_age, runner_id])


# ------------------------------------------------------------------ claiming

@pytest.mark.django_db(transaction=True)
def test_second_connection_skips_locked_rows_and_never_blocks() -> None:
    jobs = [enqueue("test.noop", {"i": i}, priority=p) for i, p in enumerate((5, 3, 1))]
    with raw_connection() as other:
        other.execute("SET lock_timeout = '2s'")  # a blocked claim would fail, not hang
        with transaction.atomic():
            mine = claim("runner-a", limit=2)
            assert [j.id for j in mine] == [jobs[0].id, jobs[1].id]  # highest priority first
            with other.cursor() as cursor:  # returns at once: a wait would hit lock_timeout
                theirs = claim_as(cursor, "runner-b", 10, None)
                again = claim_as(cursor, "runner-b", 10, None)
            assert [j.id for j in theirs] == [jobs[2].id]
            assert again == []
            assert theirs[0].payload == {"i": 2} and theirs[0].attempt == 1
        # runner-a's claim committed: the rows are running, nothing is left for runner-b.
        with other.cursor() as cursor:
            assert claim_as(cursor, "runner-b", 10, None) == []
        statuses = dict(PersistentJob.objects.values_list("id", "locked_by"))
        assert statuses == {jobs[0].id: "runner-a", jobs[1].id: "runner-a",
                            jobs[2].id: "runner-b"}


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_claim_leaves_the_jobs_for_others() -> None:
    job = enqueue("test.noop")

    class Abort(Exception):
        pass

    with raw_connection() as other:
        with pytest.raises(Abort), transaction.atomic():
            assert [j.id for j in claim("runner-a")] == [job.id]
            with other.cursor() as cursor:
                assert claim_as(cursor, "runner-b", 10, None) == []
            raise Abort
        with other.cursor() as cursor:
            (taken,) = claim_as(cursor, "runner-b", 10, None)
    assert taken.id == job.id and taken.attempt == 1  # the aborted claim left no trace
    assert list(JobAttempt.objects.values_list("runner_id", flat=True)) == ["runner-b"]


@pytest.mark.django_db
def test_claim_marks_the_job_running_and_opens_an_attempt() -> None:
    job = enqueue("test.ledger", {"x": 1}, max_retries=2, timeout=9)
    (claimed,) = claim("runner-a")
    assert (claimed.id, claimed.job_type, claimed.payload, claimed.attempt, claimed.max_retries,
            claimed.timeout, claimed.queue, claimed.priority, claimed.cancel_requested) == (
        job.id, "test.ledger", {"x": 1}, 1, 2, 9.0, "default", 0, False)
    stored = PersistentJob.objects.get(id=job.id)
    assert (stored.status, stored.attempts, stored.locked_by, stored.lock_token) == (
        "running", 1, "runner-a", claimed.token)
    assert stored.locked_at == db_now()
    attempt = JobAttempt.objects.get(id=claimed.token)  # the fencing token is the attempt id
    assert (attempt.job_id, attempt.attempt, attempt.runner_id, attempt.outcome) == (
        job.id, 1, "runner-a", "running")


@pytest.mark.django_db
def test_claim_order_due_time_queues_and_limit() -> None:
    now = db_now()
    later = enqueue("test.noop", run_at=now + timedelta(seconds=1))  # not due: DB clock decides
    old = enqueue("test.noop", run_at=now - timedelta(minutes=5))
    new = enqueue("test.noop", run_at=now - timedelta(minutes=1))
    urgent = enqueue("test.noop", priority=10)
    other_queue = enqueue("test.noop", queue="reports", run_at=now - timedelta(hours=1))
    assert [j.id for j in claim(queues=("reports",))] == [other_queue.id]
    assert [j.id for j in claim(limit=2)] == [urgent.id, old.id]
    assert [j.id for j in claim()] == [new.id]
    assert claim() == [] and later.id not in {j.id for j in claim()}


# ------------------------------------------------------------------ completion and fencing

@pytest.mark.django_db
def test_complete_finishes_the_job_and_its_attempt() -> None:
    job = enqueue("test.noop")
    (claimed,) = claim()
    assert complete(claimed)
    stored = PersistentJob.objects.get(id=job.id)
    assert stored.status == "completed" and stored.finished_at is not None
    assert (stored.locked_by, stored.locked_at, stored.lock_token) == (None, None, None)
    attempt = JobAttempt.objects.get(id=claimed.token)
    assert attempt.outcome == "completed" and attempt.duration is not None
    assert not complete(claimed)  # a second completion finds nothing to complete


@pytest.mark.django_db
def test_completion_with_a_stale_token_updates_nothing() -> None:
    job = enqueue("test.noop", max_retries=3)
    (first,) = claim("runner-a")
    assert transition(first, kind="retry", code="RUNNER_LOST", message="rescued",
                      outcome="rescued") == "failed"
    (second,) = claim("runner-b")
    assert second.token != first.token and second.attempt == 2
    assert not complete(first)  # the zombie's completion is fenced off
    assert transition(first, kind="retry") is None
    with connection.cursor() as cursor:
        assert not store.report_progress(cursor, job.id, first.token, {"done": 1})
        assert store.report_progress(cursor, job.id, second.token, {"done": 2})
    stored = PersistentJob.objects.get(id=job.id)
    assert (stored.status, stored.lock_token, stored.locked_by, stored.progress) == (
        "running", second.token, "runner-b", {"done": 2})
    assert JobAttempt.objects.get(id=first.token).outcome == "rescued"
    assert complete(second)


# ------------------------------------------------------------------ failure transitions

@pytest.mark.django_db
def test_retry_schedules_the_next_attempt_then_dead_letters() -> None:
    job = enqueue("test.noop", max_retries=1)
    (first,) = claim()
    assert transition(first, kind="retry", code="PLANNED", message="try again",
                      traceback="tb", delay=30) == "failed"
    stored = PersistentJob.objects.get(id=job.id)
    assert (stored.status, stored.last_error_code, stored.last_error) == (
        "failed", "PLANNED", "try again")
    assert stored.next_run_at == db_now() + timedelta(seconds=30)
    assert stored.finished_at is None and stored.lock_token is None
    attempt = JobAttempt.objects.get(id=first.token)
    assert (attempt.outcome, attempt.error_code, attempt.error_message, attempt.traceback) == (
        "failed", "PLANNED", "try again", "tb")
    assert claim() == []  # not due yet
    PersistentJob.objects.filter(id=job.id).update(next_run_at=db_now())
    (second,) = claim()
    assert second.attempt == 2 and second.max_retries == 1
    assert transition(second, kind="retry", code="PLANNED") == "dead_lettered"
    stored = PersistentJob.objects.get(id=job.id)
    assert stored.status == "dead_lettered" and stored.finished_at is not None
    assert JobAttempt.objects.get(id=second.token).outcome == "dead_lettered"


@pytest.mark.django_db
@pytest.mark.parametrize(("kind", "status", "outcome", "attempts"), [
    ("dead", "dead_lettered", "dead_lettered", 1),
    ("cancel", "cancelled", "cancelled", 1),
    ("handback", "pending", "interrupted", 0),
])
def test_other_transitions(kind: str, status: str, outcome: str, attempts: int) -> None:
    job = enqueue("test.noop", max_retries=5)
    (claimed,) = claim()
    assert transition(claimed, kind=kind, code="C", message="why") == status
    stored = PersistentJob.objects.get(id=job.id)
    assert (stored.status, stored.attempts, stored.last_error_code) == (status, attempts, "C")
    assert JobAttempt.objects.get(id=claimed.token).outcome == outcome


# ------------------------------------------------------------------ stale lock recovery

@pytest.mark.django_db
def test_dead_runners_are_reaped_and_their_jobs_rescued() -> None:
    register("alive")
    register("dead", heartbeat_age=timedelta(minutes=5))
    alive_job = enqueue("test.noop", {"who": "alive"}, priority=1)
    dead_job = enqueue("test.noop", {"who": "dead"}, max_retries=1)
    (held_by_alive,) = claim("alive", limit=1)
    (held_by_dead,) = claim("dead", limit=1)
    assert (held_by_alive.id, held_by_dead.id) == (alive_job.id, dead_job.id)
    with connection.cursor() as cursor:
        assert store.orphaned_jobs(cursor) == []  # both runners still have rows
        reaped = store.reap_dead_runners(cursor, 30, reaper=None)
        assert [runner_id for runner_id, _ in reaped] == ["dead"]
        assert store.reap_dead_runners(cursor, 30, reaper=None) == []
        orphans = store.orphaned_jobs(cursor)
        assert orphans == [(dead_job.id, held_by_dead.token, "test.noop", 1, "dead", True,
                            "default", None)]
        assert store.transition(cursor, dead_job.id, held_by_dead.token, kind="retry",
                                code="RUNNER_LOST", message="rescued", outcome="rescued",
                                delay=0) == "failed"
        assert store.orphaned_jobs(cursor) == []
    assert list(JobRunnerRecord.objects.values_list("id", flat=True)) == ["alive"]
    assert PersistentJob.objects.get(id=alive_job.id).status == "running"  # a live runner's job
    assert JobAttempt.objects.get(id=held_by_dead.token).outcome == "rescued"

    # Back in play; the attempt was counted at claim, so a poison pill runs out of retries.
    (retaken,) = claim("alive")
    assert retaken.id == dead_job.id and retaken.attempt == 2
    assert not complete(held_by_dead)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM persistent_jobs_runners WHERE id = 'alive'")
        orphans = store.orphaned_jobs(cursor)
        assert {o[0] for o in orphans} == {alive_job.id, dead_job.id}
        assert store.transition(cursor, dead_job.id, retaken.token, kind="retry",
                                code="RUNNER_LOST", message="again", outcome="rescued") == (
            "dead_lettered")


@pytest.mark.django_db
def test_heartbeat_keeps_a_runner_alive_and_reports_its_removal() -> None:
    register("r", heartbeat_age=timedelta(minutes=5))
    with connection.cursor() as cursor:
        assert store.heartbeat(cursor, "r")
        # Fresh heartbeat, by the DB clock:
        assert store.reap_dead_runners(cursor, 30, reaper=None) == []
        store.unregister_runner(cursor, "r")
        assert not store.heartbeat(cursor, "r")


@pytest.mark.django_db(transaction=True)
def test_claim_sql_runs_on_a_plain_psycopg_connection() -> None:
    """The store takes any DB-API cursor: the second-connection tests rely on it."""
    job = enqueue("test.noop", {"k": [1, 2]})
    with psycopg.connect(**conninfo(), autocommit=True) as conn, conn.cursor() as cursor:
        (claimed,) = claim_as(cursor, "raw", 1, None)
        assert claimed.payload == {"k": [1, 2]}
        assert store.complete(cursor, claimed)
    assert PersistentJob.objects.get(id=job.id).status == "completed"


@pytest.mark.django_db(transaction=True)
def test_the_claim_loop_s_claim_leaves_payloads_for_the_handler_side_to_decode() -> None:
    """``decode=False`` (what the claim loop asks for): the payload stays the stored text, for
    ``execute`` to decode where the handler runs (in a worker process, with ``--processes``);
    decoding it then gives what a decoding claim gives, once."""
    payload = {"k": [1, 2.5, None], "s": "ünïcode", "big": 2**70}
    enqueue("test.noop", payload)
    with raw_connection() as conn, conn.cursor() as cursor:
        (raw,) = claim_as(cursor, "raw", 1, None, decode=False)
        assert raw.payload is None and isinstance(raw.payload_text, str)
        raw.decode_payload()
        assert (raw.payload, raw.payload_error, raw.payload_text) == (payload, None, None)
        raw.decode_payload()  # once: nothing left to decode
        assert raw.payload == payload


@pytest.mark.django_db(transaction=True)
def test_the_claim_is_prepared_and_the_completion_planned_each_time() -> None:
    """Django opens connections with psycopg's preparation turned off; the store must turn it
    back on for the claim, or every claim pays for planning it again. The completion is not
    prepared: a generic plan of it made while the tables were small would scan them whole."""
    jobs = [enqueue("test.noop", {"i": i}) for i in range(2)]
    with connection.cursor() as cursor:
        for _ in jobs:
            (claimed,) = claim_as(cursor, "prep", 1, None)
            assert store.complete(cursor, claimed)
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        statements = [row[0] for row in cursor.fetchall()]
    assert any("FOR UPDATE SKIP LOCKED" in s for s in statements), statements
    assert not any("status = 'completed'" in s for s in statements), statements
