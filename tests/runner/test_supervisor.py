"""Runner end to end, in process: real runner threads against real PostgreSQL.

Covers the fenced, atomic completion (invariant 3), the attempt counted at claim (invariant 5),
the retry / dead-letter rules and their error codes, and the embeddable API.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction

from django_persistent_jobs import (
    JobContext,
    PermanentJobError,
    Runner,
    TransientJobError,
    job_handler,
)
from django_persistent_jobs.backoff import constant
from django_persistent_jobs.enqueuing import enqueue, enqueue_many
from django_persistent_jobs.errors import ConfigurationError
from django_persistent_jobs.handlers import Registry
from django_persistent_jobs.models import JobAttempt, JobRunnerRecord, JobStatus, PersistentJob
from django_persistent_jobs.runner import store
from tests.core_support import raw_connection
from tests.runner_support import (
    Gate,
    attempts_of,
    get_job,
    isolated_registry,
    wait_for,
    wait_status,
)
from tests.testapp.models import LedgerEntry, SideEffect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

StartRunner = Callable[..., Runner]

__all__ = ["isolated_registry"]  # a fixture, used by name


def test_runner_processes_jobs_end_to_end(start_runner: StartRunner) -> None:
    jobs = [enqueue("test.ledger", {"note": f"n{i}"}) for i in range(5)]
    runner = start_runner(concurrency=2)
    assert JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()
    for job in jobs:
        done = wait_status(job.id, JobStatus.COMPLETED)
        assert done.attempts == 1
        assert done.locked_by is None and done.lock_token is None
        assert done.finished_at is not None
    assert sorted(LedgerEntry.objects.values_list("note", flat=True)) == [f"n{i}" for i in range(5)]
    assert set(LedgerEntry.objects.values_list("job_id", flat=True)) == {j.id for j in jobs}
    for attempt in JobAttempt.objects.all():
        assert attempt.outcome == "completed"
        assert attempt.runner_id == runner.runner_id
        assert attempt.duration is not None and attempt.duration >= timedelta(0)
        assert attempt.finished_at is not None and attempt.error_code == ""
    assert JobAttempt.objects.count() == 5
    assert runner.stop(timeout=30) == 0
    assert runner.finished.is_set()
    assert not JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()


def test_attempt_is_counted_and_fenced_at_claim(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    gate = Gate()
    seen: dict[str, Any] = {}

    @job_handler("rt.claim_probe", timeout=60)
    def probe(payload: Any, ctx: JobContext) -> None:
        seen.update(attempt=ctx.attempt, runner_id=ctx.runner_id, job_id=ctx.job_id,
                    max_retries=ctx.max_retries, job_type=ctx.job_type)
        gate.wait()

    job = enqueue("rt.claim_probe", {}, max_retries=4)
    runner = start_runner(concurrency=1)
    running = wait_status(job.id, JobStatus.RUNNING)
    # Counted at claim, before the handler finishes (a poison pill still uses up its retries).
    assert running.attempts == 1
    assert running.locked_by == runner.runner_id
    [attempt] = attempts_of(job.id)
    assert attempt.outcome == "running" and attempt.attempt == 1
    assert running.lock_token == attempt.id  # the fencing token is the attempt row
    wait_for(lambda: "attempt" in seen, message="handler to start")
    assert seen == {"attempt": 1, "runner_id": runner.runner_id, "job_id": job.id,
                    "max_retries": 4, "job_type": "rt.claim_probe"}
    gate.open()
    done = wait_status(job.id, JobStatus.COMPLETED)
    assert done.attempts == 1 and done.lock_token is None


def test_failed_attempt_rolls_back_handler_writes_and_is_recorded(
    start_runner: StartRunner,
) -> None:
    # test.ledger writes a SideEffect row, then (attempt 1) raises TransientJobError.
    job = enqueue("test.ledger", {"fail_times": 1})
    start_runner(concurrency=1)
    done = wait_status(job.id, JobStatus.COMPLETED)
    assert done.attempts == 2
    # Only the successful attempt's writes exist: attempt 1's SideEffect rolled back with it.
    assert list(SideEffect.objects.values_list("attempt", flat=True)) == [2]
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1
    first, second = attempts_of(job.id)
    assert (first.attempt, first.outcome, first.error_code) == (1, "failed", "PLANNED")
    assert "planned failure 1" in first.error_message
    assert "TransientJobError" in first.traceback and "planned failure 1" in first.traceback
    assert first.duration is not None and first.finished_at is not None
    assert (second.attempt, second.outcome, second.error_code) == (2, "completed", "")
    assert second.duration is not None and second.traceback == ""


def test_handler_writes_and_completion_commit_in_one_transaction(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    """While the handler runs, neither its writes nor the completion are visible; then both are."""
    gate = Gate()

    @job_handler("rt.atomic", timeout=60)
    def atomic(payload: Any, ctx: JobContext) -> None:
        LedgerEntry.objects.create(job_id=ctx.job_id, note="atomic")
        gate.wait()

    job = enqueue("rt.atomic", {})
    start_runner(concurrency=1)
    wait_status(job.id, JobStatus.RUNNING)
    # The handler has had time to write only once it is running; wait for its row lock to prove
    # the insert happened (its transaction is open), then check the row is not visible.
    wait_for(lambda: _open_transactions_writing("testapp_ledgerentry"),
             message="handler's insert to be in flight")
    assert not LedgerEntry.objects.filter(job_id=job.id).exists()
    gate.open()
    wait_status(job.id, JobStatus.COMPLETED)
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1


def test_jobs_enqueued_by_a_failed_attempt_roll_back_with_it(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    @job_handler("rt.parent", max_retries=2, backoff=constant(0))
    def parent(payload: Any, ctx: JobContext) -> None:
        enqueue("rt.child", {"from_attempt": ctx.attempt})
        if ctx.attempt == 1:
            raise TransientJobError("first attempt fails after enqueueing")

    @job_handler("rt.child")
    def child(payload: Any) -> None:
        return None

    job = enqueue("rt.parent", {})
    start_runner(concurrency=2)
    wait_status(job.id, JobStatus.COMPLETED)
    children = wait_for(lambda: list(PersistentJob.objects.filter(
        job_type="rt.child", status=JobStatus.COMPLETED)), message="the child job to complete")
    assert [c.payload for c in children] == [{"from_attempt": 2}]
    assert PersistentJob.objects.filter(job_type="rt.child").count() == 1


def test_handler_that_swallows_a_database_error_cannot_complete(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    """The handler's transaction is broken; returning normally must not count as success."""
    from django.db import DatabaseError

    @job_handler("rt.swallows_db_error", max_retries=0)
    def swallow(payload: Any, ctx: JobContext) -> None:
        LedgerEntry.objects.create(job_id=ctx.job_id, note="before the error")
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT * FROM no_such_table_here")
        except DatabaseError:
            pass  # the transaction is now aborted

    job = enqueue("rt.swallows_db_error", {})
    start_runner(concurrency=1)
    dead = wait_status(job.id, JobStatus.DEAD_LETTERED)
    assert dead.last_error_code == "HANDLER_ERROR"
    assert not LedgerEntry.objects.exists()
    [attempt] = attempts_of(job.id)
    assert attempt.outcome == "dead_lettered" and attempt.error_code == "HANDLER_ERROR"


def test_runner_heartbeats_while_idle(start_runner: StartRunner) -> None:
    runner = start_runner(concurrency=1)
    first = JobRunnerRecord.objects.get(pk=runner.runner_id).heartbeat_at
    record = wait_for(lambda: JobRunnerRecord.objects.filter(
        pk=runner.runner_id, heartbeat_at__gt=first).first(), message="a second heartbeat")
    assert record.concurrency == 1 and record.pid > 0


def test_a_runner_lists_the_job_types_it_claims_and_a_handler_added_later(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    """The runner's row says which types it claims (``job_types``), from its registration, and
    a handler registered while it runs (claimed from the next claim on) appears with a later
    heartbeat: the console tells "no runner handles this type" from "late"."""
    runner = start_runner(concurrency=1)
    listed = JobRunnerRecord.objects.get(pk=runner.runner_id).job_types
    assert listed == isolated_registry.job_types() and "test.ledger" in listed
    assert "rt.added_later" not in listed

    @job_handler("rt.added_later")
    def added_later(payload: Any) -> None:
        return None

    record = wait_for(lambda: JobRunnerRecord.objects.filter(
        pk=runner.runner_id, job_types__contains=["rt.added_later"]).first(),
        message="the new handler's type on the runner's row")
    assert set(record.job_types) == set(listed) | {"rt.added_later"}
    job = enqueue("rt.added_later", {})
    wait_status(job.id, JobStatus.COMPLETED)


def test_an_execution_that_lost_its_claim_cannot_commit(
    isolated_registry: Registry, start_runner: StartRunner, caplog: pytest.LogCaptureFixture
) -> None:
    """Fencing: once the job no longer carries the attempt's token (as after a rescue), the
    handler's completion matches nothing and its business writes roll back with it."""
    caplog.set_level(logging.WARNING, logger="django_persistent_jobs")
    gate, started = Gate(), Gate()

    @job_handler("rt.fenced", timeout=60, max_retries=3)
    def fenced(payload: Any, ctx: JobContext) -> None:
        LedgerEntry.objects.create(job_id=ctx.job_id, note=f"attempt {ctx.attempt}")
        started.open()
        gate.wait()

    job = enqueue("rt.fenced", {})
    start_runner(concurrency=1)
    assert started.wait()
    token = get_job(job.id).lock_token
    assert token is not None
    with connection.cursor() as cursor:  # someone else settles attempt 1 behind its back
        status = store.transition(cursor, job.id, token, kind="retry", code="RUNNER_LOST",
                                  message="taken away for the test", outcome="rescued")
    assert status == JobStatus.FAILED
    gate.open()  # attempt 1 now tries to complete with a stale token
    done = wait_status(job.id, JobStatus.COMPLETED)
    assert done.attempts == 2
    assert list(LedgerEntry.objects.values_list("note", flat=True)) == ["attempt 2"]
    assert [(a.attempt, a.outcome) for a in attempts_of(job.id)] == [(1, "rescued"),
                                                                      (2, "completed")]
    assert any(getattr(r, "event", None) == "claim_lost" and r.job_id == str(job.id)  # type: ignore[attr-defined]
               for r in caplog.records)


def _open_transactions_writing(table: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE c.relname = %s AND l.mode = 'RowExclusiveLock' AND l.pid <> pg_backend_pid() "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            [table],
        )
        return bool(cursor.fetchone()[0])


def test_transient_retry_waits_for_retry_after_by_the_database_clock(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    @job_handler("rt.flaky", max_retries=3, backoff=constant(600))
    def flaky(payload: Any, ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise TransientJobError("try later", code="UPSTREAM_DOWN", retry_after=1.5)

    job = enqueue("rt.flaky", {})
    start_runner(concurrency=1)
    failed = wait_status(job.id, JobStatus.FAILED)
    assert failed.attempts == 1
    assert failed.last_error_code == "UPSTREAM_DOWN" and failed.last_error == "try later"
    assert failed.locked_by is None and failed.finished_at is None
    [first] = attempts_of(job.id)
    assert first.outcome == "failed" and first.error_code == "UPSTREAM_DOWN"
    # retry_after (not the 600 s backoff) from the database's now() of the failing transition.
    assert first.finished_at is not None
    assert failed.next_run_at - first.finished_at == timedelta(seconds=1.5)
    done = wait_status(job.id, JobStatus.COMPLETED)
    assert done.attempts == 2
    second = attempts_of(job.id)[1]
    assert second.started_at >= failed.next_run_at  # not run before the retry was due


def test_backoff_schedules_the_retry(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    calls: list[int] = []

    @job_handler("rt.backoff", max_retries=3, backoff=lambda attempt: 100.0 * attempt)
    def failing(payload: Any, ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        raise TransientJobError("nope")

    job = enqueue("rt.backoff", {})
    start_runner(concurrency=1)
    failed = wait_status(job.id, JobStatus.FAILED)
    [first] = attempts_of(job.id)
    assert first.finished_at is not None
    assert failed.next_run_at - first.finished_at == timedelta(seconds=100)
    assert failed.last_error_code == "HANDLER_ERROR"  # TransientJobError without a code
    assert calls == [1]


def test_unexpected_exception_is_transient_handler_error(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    @job_handler("rt.crashy", max_retries=1, backoff=constant(0))
    def crashy(payload: Any, ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise ValueError("boom")

    job = enqueue("rt.crashy", {})
    start_runner(concurrency=1)
    done = wait_status(job.id, JobStatus.COMPLETED)
    assert done.attempts == 2
    first = attempts_of(job.id)[0]
    assert (first.outcome, first.error_code) == ("failed", "HANDLER_ERROR")
    assert "ValueError" in first.error_message and "boom" in first.error_message
    assert "ValueError: boom" in first.traceback


def test_permanent_error_dead_letters_at_once(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    calls: list[int] = []

    @job_handler("rt.permanent", max_retries=5, backoff=constant(0))
    def permanent(payload: Any, ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
        raise PermanentJobError("bad input", code="BAD_INPUT")

    job = enqueue("rt.permanent", {})
    start_runner(concurrency=1)
    dead = wait_status(job.id, JobStatus.DEAD_LETTERED)
    assert dead.attempts == 1 and calls == [1]
    assert (dead.last_error_code, dead.last_error) == ("BAD_INPUT", "bad input")
    assert dead.finished_at is not None and dead.locked_by is None
    [attempt] = attempts_of(job.id)
    assert (attempt.outcome, attempt.error_code) == ("dead_lettered", "BAD_INPUT")
    assert not SideEffect.objects.exists()


def test_dead_letters_after_one_plus_max_retries_attempts(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    calls: list[int] = []

    @job_handler("rt.always_fails", max_retries=2, backoff=constant(0))
    def always_fails(payload: Any, ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        raise TransientJobError(f"failure {ctx.attempt}", code="FLAKY")

    @job_handler("rt.once", max_retries=0, backoff=constant(0))
    def once(payload: Any) -> None:
        raise RuntimeError("only once")

    job = enqueue("rt.always_fails", {})
    single = enqueue("rt.once", {})
    start_runner(concurrency=1)
    dead = wait_status(job.id, JobStatus.DEAD_LETTERED)
    assert dead.attempts == 3 and calls == [1, 2, 3]
    assert dead.last_error_code == "FLAKY" and dead.last_error == "failure 3"
    outcomes = [(a.attempt, a.outcome, a.error_code) for a in attempts_of(job.id)]
    assert outcomes == [(1, "failed", "FLAKY"), (2, "failed", "FLAKY"),
                        (3, "dead_lettered", "FLAKY")]
    # max_retries=0: one run, then dead-lettered.
    dead_single = wait_status(single.id, JobStatus.DEAD_LETTERED)
    assert dead_single.attempts == 1 and dead_single.last_error_code == "HANDLER_ERROR"


def test_payload_invalid_at_run_time_dead_letters(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    calls: list[Any] = []

    def validate(payload: Any) -> None:
        if not isinstance(payload.get("n"), int):
            raise ValueError("n must be an integer")

    @job_handler("rt.validated", max_retries=5, validator=validate)
    def validated(payload: Any) -> None:
        calls.append(payload)

    good = enqueue("rt.validated", {"n": 1})
    bad = enqueue("rt.validated", {"n": 2})
    # The stored payload changed after enqueue (an old row, a manual edit, a newer validator).
    PersistentJob.objects.filter(pk=bad.id).update(payload={"n": "two"})
    start_runner(concurrency=1)
    dead = wait_status(bad.id, JobStatus.DEAD_LETTERED)
    wait_status(good.id, JobStatus.COMPLETED)
    assert dead.attempts == 1
    assert dead.last_error_code == "PAYLOAD_INVALID"
    assert "n must be an integer" in dead.last_error
    assert calls == [{"n": 1}]  # the handler never saw the invalid payload
    [attempt] = attempts_of(bad.id)
    assert (attempt.outcome, attempt.error_code) == ("dead_lettered", "PAYLOAD_INVALID")


def test_one_parameter_and_class_based_handlers_run(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    from django_persistent_jobs import JobHandler

    @job_handler("rt.one_param")
    def one_param(payload: Any) -> None:
        LedgerEntry.objects.create(job_id=payload["id"], note="one")

    @job_handler
    class ClassBased(JobHandler):
        job_type = "rt.class_based"

        def execute(self, payload: Any, ctx: JobContext) -> None:
            LedgerEntry.objects.create(job_id=ctx.job_id, note="class")

    import uuid

    marker = uuid.uuid4()
    a = enqueue("rt.one_param", {"id": str(marker)})
    b = enqueue("rt.class_based", {})
    start_runner(concurrency=2)
    wait_status(a.id, JobStatus.COMPLETED)
    wait_status(b.id, JobStatus.COMPLETED)
    assert LedgerEntry.objects.get(job_id=marker).note == "one"
    assert LedgerEntry.objects.get(job_id=b.id).note == "class"


# ------------------------------------------------------------------------ order, wake-ups, bound


def test_priority_first_then_fifo(isolated_registry: Registry, start_runner: StartRunner) -> None:
    order: list[str] = []

    @job_handler("rt.order")
    def record(payload: Any) -> None:
        order.append(payload["name"])

    for name, priority in [("low-1", 0), ("high-1", 5), ("low-2", 0), ("neg-1", -3),
                           ("high-2", 5), ("low-3", 0)]:
        enqueue("rt.order", {"name": name}, priority=priority)  # one transaction each
    start_runner(concurrency=1)
    wait_for(lambda: len(order) == 6, message="all six jobs to run")
    assert order == ["high-1", "high-2", "low-1", "low-2", "low-3", "neg-1"]


def test_fifo_within_one_enqueue_many_batch(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    """Jobs inserted by one statement share ``next_run_at``; they still run in insertion order."""
    order: list[int] = []

    @job_handler("rt.batch_order")
    def record(payload: Any) -> None:
        order.append(payload["i"])

    enqueue_many([("rt.batch_order", {"i": i}) for i in range(30)])
    start_runner(concurrency=1)
    wait_for(lambda: len(order) == 30, message="all thirty jobs to run")
    assert order == list(range(30))


def test_notify_wakes_an_idle_runner_despite_a_long_poll_interval(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    started: dict[str, float] = {}
    ran = threading.Event()

    @job_handler("rt.pickup")
    def pickup(payload: Any) -> None:
        started[payload["name"]] = time.monotonic()
        ran.set()

    runner = start_runner(concurrency=2, poll_interval=30)
    wait_for(runner.listening.is_set, message="runner to LISTEN")
    # A first job settles the runner into its idle wait (claims < free slots -> wake.wait(30)).
    first = enqueue("rt.pickup", {"name": "warmup"})
    wait_status(first.id, JobStatus.COMPLETED)
    ran.clear()
    with transaction.atomic():
        second = enqueue("rt.pickup", {"name": "probe"})
    committed = time.monotonic()
    assert ran.wait(15), "the NOTIFY did not wake the runner"
    latency = started["probe"] - committed
    assert latency < 2.0, f"pickup took {latency:.2f}s with a 30 s poll interval"
    wait_status(second.id, JobStatus.COMPLETED)


def test_rolled_back_enqueue_is_never_run(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    ran: list[str] = []

    @job_handler("rt.rollback")
    def handler(payload: Any) -> None:
        ran.append(payload["name"])

    runner = start_runner(concurrency=1, poll_interval=0.1)
    wait_for(runner.listening.is_set, message="runner to LISTEN")

    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        enqueue("rt.rollback", {"name": "ghost"})
        raise Boom
    sentinel = enqueue("rt.rollback", {"name": "real"})
    wait_status(sentinel.id, JobStatus.COMPLETED)
    assert ran == ["real"]
    assert PersistentJob.objects.count() == 1


def test_polling_finds_due_jobs_without_a_notify(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    @job_handler("rt.polled")
    def polled(payload: Any) -> None:
        return None

    runner = start_runner(concurrency=1, poll_interval=0.3)
    wait_for(runner.listening.is_set, message="runner to LISTEN")
    job = enqueue("rt.polled", {}, delay=3600)  # not due: no NOTIFY is sent
    assert get_job(job.id).status == JobStatus.PENDING
    # Made due by an UPDATE, which sends no NOTIFY: only polling can find it.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE persistent_jobs SET next_run_at = now() WHERE id = %s", [job.id])
    done = wait_status(job.id, JobStatus.COMPLETED, timeout=15)
    assert done.attempts == 1


def test_not_yet_due_jobs_wait_for_the_database_clock(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    @job_handler("rt.later")
    def later(payload: Any) -> None:
        return None

    job = enqueue("rt.later", {}, delay=1.0)
    start_runner(concurrency=1, poll_interval=0.1)
    done = wait_status(job.id, JobStatus.COMPLETED)
    [attempt] = attempts_of(job.id)
    assert attempt.started_at >= done.next_run_at
    # The delay counts from the inserting transaction's start (``now()``); ``created_at`` is
    # the statement's time, which a prepared insert takes a few microseconds later.
    assert abs(done.next_run_at - done.created_at - timedelta(seconds=1.0)) < timedelta(
        milliseconds=50)


def test_concurrency_is_bounded(isolated_registry: Registry, start_runner: StartRunner) -> None:
    lock = threading.Lock()
    state = {"running": 0, "max": 0, "done": 0}
    three_running = threading.Event()
    gate = Gate()

    @job_handler("rt.slow", timeout=60)
    def slow(payload: Any) -> None:
        with lock:
            state["running"] += 1
            state["max"] = max(state["max"], state["running"])
            if state["running"] == 3:
                three_running.set()
        try:
            gate.wait()
            time.sleep(0.02)  # keep handlers overlapping once the gate opens
        finally:
            with lock:
                state["running"] -= 1
                state["done"] += 1

    jobs = enqueue_many([("rt.slow", {"i": i}) for i in range(10)])
    runner = start_runner(concurrency=3, poll_interval=0.05)
    assert three_running.wait(15), "three handlers never ran at once"
    # While the slots are full the runner holds exactly three claims, all started: with the
    # adaptive PREFETCH, jobs wait for a worker only at the pace workers finish them, and none
    # has finished. Several poll intervals pass without a fourth claim (this window is the
    # observation, not a synchronisation).
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert PersistentJob.objects.filter(status=JobStatus.RUNNING).count() == 3
        assert JobAttempt.objects.filter(outcome="running", started=True).count() == 3
        assert runner.pool.busy == 3
        time.sleep(0.05)
    gate.open()
    for job in jobs:
        wait_status(job.id, JobStatus.COMPLETED)
    assert state == {"running": 0, "max": 3, "done": 10}


# ------------------------------------------------------------------------------- embedded API


def test_embedded_runner_context_manager(start_runner: StartRunner) -> None:
    job = enqueue("test.ledger", {"note": "embedded"})
    with Runner(concurrency=1, cleanup=False) as runner:
        assert runner.started.is_set()
        assert JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()
        wait_status(job.id, JobStatus.COMPLETED)
    assert runner.finished.is_set() and runner.exit_code == 0
    assert not JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()
    assert not any(loop.alive for loop in runner.loops)
    assert LedgerEntry.objects.get(job_id=job.id).note == "embedded"


def test_embedded_runner_start_stop() -> None:
    runner = Runner(concurrency=2, queues=["default"], cleanup=False).start()
    try:
        assert runner.wait_until_started(30)
        job = enqueue("test.ledger", {"note": "start-stop"})
        wait_status(job.id, JobStatus.COMPLETED)
    finally:
        code = runner.stop(timeout=30)
    assert code == 0 and runner.finished.is_set()
    # A stopped runner claims nothing more.
    later = enqueue("test.ledger", {"note": "after stop"})
    assert get_job(later.id).status == JobStatus.PENDING
    assert not JobRunnerRecord.objects.exists()


def test_burst_runner_runs_jobs_enqueued_by_jobs_then_stops(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    @job_handler("rt.chain")
    def chain(payload: Any) -> None:
        if payload["left"]:
            enqueue("rt.chain", {"left": payload["left"] - 1})

    enqueue("rt.chain", {"left": 3})
    later = enqueue("rt.chain", {"left": 0}, delay=3600)
    runner = start_runner(concurrency=2, burst=True)
    assert runner.finished.wait(30), "the burst runner did not stop by itself"
    assert runner.exit_code == 0
    assert PersistentJob.objects.filter(status=JobStatus.COMPLETED).count() == 4
    assert get_job(later.id).status == JobStatus.PENDING


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_embedded_runner_that_cannot_boot_says_so() -> None:
    with connection.cursor() as cursor:  # as if `migrate` had not been run
        cursor.execute("ALTER TABLE persistent_jobs_runners RENAME TO pj_runners_elsewhere")
    try:
        runner = Runner(concurrency=1, cleanup=False).start()
        began = time.monotonic()
        assert not runner.wait_until_started(20)
        assert time.monotonic() - began < 10, "wait_until_started waited out its timeout"
        assert runner.finished.is_set() and runner.exit_code != 0
        assert isinstance(runner.failure, ConfigurationError)
        assert "migrate" in str(runner.failure)
        with pytest.raises(ConfigurationError, match="migrate"), Runner(concurrency=1,
                                                                         cleanup=False):
            pytest.fail("the context manager entered a runner that never started")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE pj_runners_elsewhere RENAME TO persistent_jobs_runners")


@pytest.mark.parametrize("processes", [0, 1])
def test_a_runner_that_cannot_boot_leaves_no_thread_process_or_session_behind(
    processes: int,
) -> None:
    """An embedded runner whose boot fails after its handler threads (or worker processes)
    started: they stop, and their connections close. A web process that tries again must not
    gather a thread and a connection per slot per try."""
    def ours() -> set[int]:
        with raw_connection() as probe:
            rows = probe.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'").fetchall()
        return {row[0] for row in rows}

    def children() -> list[str]:
        found = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                               text=True, check=False)
        return found.stdout.split()

    sessions_before, threads_before, children_before = (ours(), set(threading.enumerate()),
                                                        children())
    with connection.cursor() as cursor:  # as if `migrate` had not been run
        cursor.execute("ALTER TABLE persistent_jobs_runners RENAME TO pj_runners_elsewhere")
    fds_before = set(os.listdir("/proc/self/fd"))  # (with this test's connection open)
    try:
        runner = Runner(concurrency=3, processes=processes, cleanup=False).start()
        assert not runner.wait_until_started(60)
        assert isinstance(runner.failure, ConfigurationError)
        runner.stop(timeout=30)
        assert runner._supervisor is not None
        runner._supervisor.join(10)  # (it logs the failure after ``finished`` is set)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE pj_runners_elsewhere RENAME TO persistent_jobs_runners")
    left = [t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert left == [], f"threads left running: {left}"
    assert set(children()) <= set(children_before)
    # (Its pipes and selector too: with worker processes, a wake-up pipe and an epoll.)
    wait_for(lambda: set(os.listdir("/proc/self/fd")) <= fds_before, timeout=5,
             message="the failed runner's file descriptors to close")
    wait_for(lambda: ours() <= sessions_before | {connection.connection.info.backend_pid},
             timeout=5, message="the failed runner's connections to close")


@pytest.mark.parametrize("processes", [0, 1])
def test_a_runner_stopped_before_its_boot_exits_cleanly(processes: int) -> None:
    """A stop requested before the executor started (its worker manager never ran): the
    shutdown has nothing to join, and says so with exit code 0."""
    runner = Runner(concurrency=1, processes=processes, cleanup=False)
    runner.request_stop()
    assert runner.run() == 0
    assert runner.failure is None


@pytest.mark.parametrize("processes", [0, 1])
def test_a_runner_whose_boot_fails_after_registering_removes_its_row(
    processes: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A boot that fails once the runner's row is written (here: the step right after it)
    deletes the row: left behind, it would count as a live runner, with capacity and a name,
    until another runner found it stale."""
    registered: list[str] = []
    real_register = Runner.register

    def register(self: Runner, cursor: Any) -> None:
        real_register(self, cursor)
        registered.append(self.runner_id)

    def fail(self: Runner) -> None:
        raise RuntimeError("the step after registering failed")

    monkeypatch.setattr(Runner, "register", register)
    monkeypatch.setattr(Runner, "_warn_about_namesakes", fail)
    runner = Runner(concurrency=1, processes=processes, cleanup=False).start()
    assert not runner.wait_until_started(60)
    assert isinstance(runner.failure, RuntimeError)
    assert registered == [runner.runner_id]
    assert not JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()


def test_a_stopped_runner_leaves_no_thread_behind() -> None:
    """Every thread a runner started has exited once ``stop()`` returns and its supervisor
    thread is joined: none of its loops, handler threads, gate or timers lingers in a
    process that embeds it."""
    before = set(threading.enumerate())
    runner = Runner(concurrency=2, cleanup=False).start()
    assert runner.wait_until_started(30)
    wait_status(enqueue("test.ledger", {"note": "threads"}).id, JobStatus.COMPLETED)
    assert runner.stop(timeout=30) == 0
    assert runner._supervisor is not None
    runner._supervisor.join(10)
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], f"threads left running: {left}"


def test_stop_on_a_runner_that_never_started_returns() -> None:
    runner = Runner(concurrency=1, cleanup=False)
    stopper = threading.Thread(target=runner.stop, daemon=True)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive(), "stop() blocked on a runner that was never started"
    assert runner.exit_code == 0


@pytest.mark.django_db
@pytest.mark.parametrize("kwargs", [
    {"concurrency": 0}, {"concurrency": -1}, {"concurrency": "x"}, {"concurrency": 2.5},
    {"poll_interval": 0}, {"poll_interval": -0.5}, {"poll_interval": float("nan")},
    {"poll_interval": "1"}, {"shutdown_grace": -1}, {"shutdown_grace": float("inf")},
    {"queues": "abc"}, {"queues": [""]}, {"queues": ["q" * 300]}, {"queues": [3]},
])
def test_embedded_runner_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        Runner(**kwargs)


@pytest.mark.django_db
def test_runner_refuses_invalid_handlers(isolated_registry: Registry) -> None:
    @job_handler("rt.invalid", max_retries=-1)
    def invalid(payload: Any) -> None:
        return None

    with pytest.raises(ConfigurationError, match="max_retries"):
        Runner(concurrency=1)


def test_queues_restrict_claiming(start_runner: StartRunner) -> None:
    mine = enqueue("test.ledger", {"note": "mine"}, queue="emails")
    other = enqueue("test.ledger", {"note": "other"}, queue="reports")
    start_runner(concurrency=2, queues=["emails"])
    wait_status(mine.id, JobStatus.COMPLETED)
    # A second runner for "reports" shows the first had its chance and left the job alone.
    assert get_job(other.id).status == JobStatus.PENDING
    start_runner(concurrency=1, queues=["reports"])
    wait_status(other.id, JobStatus.COMPLETED)
    runner_of = dict(JobAttempt.objects.values_list("job_id", "runner_id"))
    assert runner_of[mine.id] != runner_of[other.id]


# ------------------------------------------------------------------------- cancel, progress


def test_cancel_running_job_and_progress(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    from django_persistent_jobs import cancel_job

    progressed = threading.Event()
    noticed: dict[str, float] = {}

    @job_handler("rt.cancellable", timeout=60, max_retries=5)
    def cancellable(payload: Any, ctx: JobContext) -> None:
        ctx.report_progress({"done": 3, "of": 9})
        progressed.set()
        if ctx.wait_for_cancel(20):
            noticed["at"] = time.monotonic()
        ctx.raise_if_cancelled()

    job = enqueue("rt.cancellable", {})
    start_runner(concurrency=1)
    assert progressed.wait(15)
    # Progress is visible while the job's own transaction is still open.
    running = wait_for(lambda: _job_if(job.id, progress={"done": 3, "of": 9}),
                       message="progress to be visible")
    assert running.status == JobStatus.RUNNING
    requested = time.monotonic()
    assert cancel_job(job.id).status == JobStatus.RUNNING
    cancelled = wait_status(job.id, JobStatus.CANCELLED)
    assert noticed["at"] - requested < 2.0
    assert cancelled.last_error_code == "CANCELLED" and cancelled.attempts == 1
    [attempt] = attempts_of(job.id)
    assert (attempt.outcome, attempt.error_code) == ("cancelled", "CANCELLED")


def test_cancel_requested_job_that_then_fails_is_not_retried(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    from django_persistent_jobs import cancel_job

    started = threading.Event()

    @job_handler("rt.ignores_cancel", timeout=60, max_retries=5, backoff=constant(0))
    def ignores(payload: Any, ctx: JobContext) -> None:
        started.set()
        ctx.wait_for_cancel(20)
        raise TransientJobError("failed anyway")

    job = enqueue("rt.ignores_cancel", {})
    start_runner(concurrency=1)
    assert started.wait(15)
    wait_status(job.id, JobStatus.RUNNING)
    cancel_job(job.id)
    done = wait_status(job.id, JobStatus.CANCELLED)
    assert done.attempts == 1


def _job_if(job_id: Any, **expected: Any) -> PersistentJob | None:
    job = get_job(job_id)
    return job if all(getattr(job, k) == v for k, v in expected.items()) else None


# --------------------------------------------------------------------------------- cleanup


def test_cleanup_deletes_old_finished_jobs_but_keeps_dead_letters(
    start_runner: StartRunner, settings: Any
) -> None:
    settings.PERSISTENT_JOBS = {**settings.PERSISTENT_JOBS,
                                "RETENTION": {"completed": 60, "cancelled": 60}}
    old_done, old_cancelled, old_dead, fresh_done, waiting = (
        enqueue("test.noop", {}, delay=3600) for _ in range(5)
    )
    with connection.cursor() as cursor:
        for job, status, age in [(old_done, "completed", 3600), (old_cancelled, "cancelled", 3600),
                                 (old_dead, "dead_lettered", 10**6), (fresh_done, "completed", 5)]:
            cursor.execute(
                "UPDATE persistent_jobs SET status = %s, "
                "finished_at = now() - %s * interval '1 second' WHERE id = %s",
                [status, age, job.id],
            )
    start_runner(concurrency=1, cleanup=True)
    wait_for(lambda: not PersistentJob.objects.filter(pk__in=[old_done.id, old_cancelled.id])
             .exists(), message="cleanup to delete the old finished jobs")
    remaining = set(PersistentJob.objects.values_list("id", flat=True))
    assert remaining == {old_dead.id, fresh_done.id, waiting.id}


def test_on_commit_callbacks_of_a_handler_run_after_its_completion_commits(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    """A handler that runs no SQL but registers on_commit work must not see the job still
    running: the completion commits first, then the callbacks run."""
    seen: list[str] = []
    done = threading.Event()

    @job_handler("rt.on_commit")
    def handler(payload: Any, ctx: JobContext) -> None:
        def after() -> None:
            seen.append(PersistentJob.objects.get(id=ctx.job_id).status)
            done.set()

        transaction.on_commit(after)

    job = enqueue("rt.on_commit", {})
    start_runner(concurrency=1)
    assert done.wait(15)
    assert seen == [JobStatus.COMPLETED]
    assert wait_status(job.id, JobStatus.COMPLETED).status == JobStatus.COMPLETED


def test_a_backlog_of_short_jobs_is_claimed_in_batches(
        isolated_registry: Registry, start_runner: StartRunner,
        caplog: pytest.LogCaptureFixture) -> None:
    # A busy runner refills its waiting room when it is half empty instead of claiming for
    # every slot that frees (each claim is logged at DEBUG with its size).
    @job_handler("rt.tiny")
    def tiny(payload: Any) -> None:
        pass

    caplog.set_level(logging.DEBUG, logger="django_persistent_jobs.runner")
    enqueue_many([("rt.tiny", {"i": i}) for i in range(1500)])
    start_runner(concurrency=2, poll_interval=0.05)
    wait_for(lambda: PersistentJob.objects.filter(status=JobStatus.COMPLETED).count() == 1500,
             timeout=60, message="the backlog drained")
    claims = [r.count for r in caplog.records if getattr(r, "event", None) == "claim"]
    assert sum(claims) == 1500
    assert len(claims) <= 1500 / 8, f"{len(claims)} claim statements for 1500 jobs"


def test_a_failure_of_the_supervisors_own_work_stops_the_runner_through_its_shutdown(
    start_runner: StartRunner, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timeout enforcer raises (as when a job's outcome can be neither recorded nor handed
    back): the runner stops with exit code 2 through its usual shutdown, so it unregisters and
    its loops end, instead of the error skipping all of that."""
    from django_persistent_jobs.runner.supervisor import EXIT_LOOP_DIED

    runner = start_runner(concurrency=1)
    assert JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()

    def broken() -> None:
        raise RuntimeError("could not record the outcome nor hand the job back")

    monkeypatch.setattr(runner.timeouts, "enforce", broken)
    assert runner.finished.wait(30), "the runner did not stop"
    assert runner.exit_code == EXIT_LOOP_DIED
    assert not JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()
    assert runner.halt.is_set()  # its loops were told to end


def test_a_beat_that_ends_after_the_runner_unregistered_does_not_register_it_again(
    start_runner: StartRunner,
) -> None:
    """A heartbeat slow enough to outlive the runner's stop (its loop is joined for a few
    seconds only) finds the runner's row gone: the runner has unregistered, not been presumed
    dead, so the beat must not put the row back for a runner that has exited."""
    runner = start_runner(concurrency=1)
    runner.request_stop()
    assert runner.finished.wait(30)
    assert not JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()
    runner.liveness.beat(runner.halt)  # (the late beat, as the stopped runner's loop made it)
    assert not JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()
