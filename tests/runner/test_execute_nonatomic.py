"""``atomic=False`` handlers: run in autocommit, their writes commit as they run (at least once,
none fenced), and their completion is batched with others. What is still promised: the job is
never marked completed by an attempt that lost its claim, and is completed once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from django_persistent_jobs import JobContext, TransientJobError, enqueue, job_handler
from django_persistent_jobs.backoff import constant
from django_persistent_jobs.handlers import Registry
from django_persistent_jobs.models import JobAttempt, PersistentJob
from django_persistent_jobs.runner import Runner, store
from tests.core_support import raw_connection, wait_for
from tests.runner_support import Gate, finished, isolated_registry, wait_status
from tests.testapp.models import SideEffect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

__all__ = ["finished", "isolated_registry"]  # fixtures, used by name

StartRunner = Callable[..., Runner]



def writes_seen_elsewhere(job_id: Any) -> int:
    """Rows the handler wrote for ``job_id`` that another session can see (i.e. committed)."""
    with raw_connection() as conn:
        row = conn.execute("SELECT count(*) FROM testapp_sideeffect WHERE job_id = %s",
                           [job_id]).fetchone()
    assert row is not None
    return int(row[0])


def test_writes_commit_as_they_run_and_the_completion_is_batched(
    isolated_registry: Registry, start_runner: StartRunner,
    finished: list[tuple[Any, str | None]],
) -> None:
    wrote, go = Gate(), Gate()

    @job_handler("nonatomic.write", atomic=False, timeout=60)
    def write(payload: Any, ctx: JobContext) -> None:
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
        wrote.open()
        go.wait()
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)

    job = enqueue("nonatomic.write", {})
    runner = start_runner(concurrency=2)
    assert wrote.wait()
    # No transaction held for the length of the handler: the first write is visible already.
    assert writes_seen_elsewhere(job.id) == 1
    assert PersistentJob.objects.get(id=job.id).status == "running"
    go.open()
    wait_for(lambda: finished, message="the job to finish")
    assert finished == [(job.id, "completed")]
    assert runner.pool.completer.statements == 1  # it wrote, yet its completion was batched
    assert writes_seen_elsewhere(job.id) == 2
    assert JobAttempt.objects.get(job_id=job.id).outcome == "completed"


def test_a_failed_attempt_keeps_its_writes(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    @job_handler("nonatomic.flaky", atomic=False, timeout=60, backoff=constant(0))
    def flaky(payload: Any, ctx: JobContext) -> None:
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
        if ctx.attempt == 1:
            raise TransientJobError("once", code="ONCE")

    job = enqueue("nonatomic.flaky", {})
    start_runner(concurrency=1)
    done = wait_status(job.id, "completed")
    assert done.attempts == 2
    assert sorted(SideEffect.objects.filter(job_id=job.id).values_list("attempt", flat=True)) == [
        1, 2]
    assert [a.outcome for a in JobAttempt.objects.filter(job_id=job.id).order_by("attempt")] == [
        "failed", "completed"]


def test_a_lost_claim_is_not_completed_and_its_writes_stay(
    isolated_registry: Registry, start_runner: StartRunner,
    finished: list[tuple[Any, str | None]], caplog: pytest.LogCaptureFixture,
) -> None:
    wrote, go = Gate(), Gate()

    @job_handler("nonatomic.fenced", atomic=False, timeout=60, max_retries=0)
    def fenced(payload: Any, ctx: JobContext) -> None:
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
        wrote.open()
        go.wait()

    job = enqueue("nonatomic.fenced", {})
    runner = start_runner(concurrency=1)
    assert wrote.wait()
    token = PersistentJob.objects.get(id=job.id).lock_token
    with connection.cursor() as cursor:  # rescued meanwhile (as if its runner were presumed dead)
        assert store.transition(cursor, job.id, token, kind="dead", code="RUNNER_LOST",
                                message="rescued") == "dead_lettered"
    go.open()
    # The slot is free once the handler returns; its completion is written after that.
    wait_for(lambda: runner.pool.busy == 0 and runner.pool.completing == 0,
             message="the runner to give the job up")
    assert runner.pool.completer.statements == 1 and runner.pool.completer.completed == 0
    assert finished == []  # the attempt was settled by its rescuer, which signals it
    row = PersistentJob.objects.get(id=job.id)
    assert (row.status, row.last_error_code) == ("dead_lettered", "RUNNER_LOST")
    assert JobAttempt.objects.get(job_id=job.id).outcome == "dead_lettered"
    assert writes_seen_elsewhere(job.id) == 1  # committed as it ran: not rolled back
    lost = [r for r in caplog.records if getattr(r, "event", None) == "claim_lost"]
    assert lost and "committed as they ran" in lost[0].getMessage()


def test_a_transaction_left_open_is_rolled_back_and_fails_the_attempt(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    @job_handler("nonatomic.open", atomic=False, timeout=60, max_retries=0)
    def left_open(payload: Any, ctx: JobContext) -> None:
        connection.set_autocommit(False)
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)

    @job_handler("nonatomic.next", atomic=False, timeout=60)
    def next_one(payload: Any, ctx: JobContext) -> None:
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)

    bad = enqueue("nonatomic.open", {})
    start_runner(concurrency=1)
    row = wait_status(bad.id, "dead_lettered")
    assert row.last_error_code == "HANDLER_ERROR"
    assert "transaction open" in row.last_error
    assert writes_seen_elsewhere(bad.id) == 0
    good = enqueue("nonatomic.next", {})  # runs on the same thread and connection, in autocommit
    wait_status(good.id, "completed")
    assert writes_seen_elsewhere(good.id) == 1
