"""Stale-lock recovery at the runner level (invariant 6): a dead runner's jobs come back within
STALE_LOCK_TIMEOUT; a live runner's long job is never taken away from it."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from django_persistent_jobs import JobContext, enqueue, job_handler
from django_persistent_jobs.handlers import Registry
from django_persistent_jobs.models import JobRunnerRecord, JobStatus, PersistentJob
from django_persistent_jobs.runner import Runner, store
from tests.core_support import claim_as, refusing_updates
from tests.runner_support import (
    Gate,
    OutputReader,
    attempts_of,
    db_now,
    get_job,
    isolated_registry,
    wait_for,
    wait_status,
)
from tests.testapp.models import LedgerEntry, SideEffect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

__all__ = ["isolated_registry"]  # a fixture, used by name

StartRunner = Callable[..., Runner]
Spawn = Callable[..., "subprocess.Popen[bytes]"]
STALE = float(settings.PERSISTENT_JOBS["STALE_LOCK_TIMEOUT"])
HEARTBEAT = float(settings.PERSISTENT_JOBS["HEARTBEAT_INTERVAL"])


def _claim_as(runner_id: str, *, register: bool = True, heartbeat_age: float = 0.0) -> Any:
    """Claim the next due job as a runner that then stops doing anything (a frozen/dead one)."""
    with connection.cursor() as cursor:
        if register:
            store.register_runner(cursor, runner_id, "ghost-host", 99999, None, 1, "test")
            cursor.execute(
                "UPDATE persistent_jobs_runners SET heartbeat_at = now() - %s * interval "
                "'1 second' WHERE id = %s", [heartbeat_age, runner_id],
            )
        [claimed] = claim_as(cursor, runner_id, 1, None, ghost=not register)
    return claimed


def test_jobs_of_dead_runners_are_rescued_and_completed(start_runner: StartRunner) -> None:
    job = enqueue("test.ledger", {"note": "rescued"})
    claimed = _claim_as("ghost:1", heartbeat_age=60)  # heartbeat long stale
    assert claimed.id == job.id and get_job(job.id).status == JobStatus.RUNNING
    unregistered = enqueue("test.ledger", {"note": "no runner row"})
    _claim_as("never-registered", register=False)  # locked by a runner with no row at all
    live = start_runner(concurrency=1)
    done = wait_status(job.id, JobStatus.COMPLETED, timeout=15)
    assert done.attempts == 2  # the lost attempt counts
    first, second = attempts_of(job.id)
    assert (first.runner_id, first.outcome, first.error_code) == ("ghost:1", "rescued",
                                                                  "RUNNER_LOST")
    assert "ghost:1" in first.error_message and live.runner_id in first.error_message
    assert (second.runner_id, second.outcome) == (live.runner_id, "completed")
    assert not JobRunnerRecord.objects.filter(pk="ghost:1").exists()
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1
    other = wait_status(unregistered.id, JobStatus.COMPLETED, timeout=15)
    assert [a.outcome for a in attempts_of(unregistered.id)] == ["rescued", "completed"]
    assert other.attempts == 2


def test_a_job_the_database_refuses_to_rescue_does_not_stop_the_rescuer(
    start_runner: StartRunner, caplog: pytest.LogCaptureFixture,
) -> None:
    """A project trigger refuses every update of one lost job: its rescue fails, for ever.
    That job stays as it is (logged ``rescue_refused``, tried again each round); the others
    are rescued and the rescuer goes on. It used to stop the rescuer (its rescue loop died),
    then every runner that tried it in turn."""
    stuck = enqueue("test.ledger", {"note": "refused"}, priority=9)
    _claim_as("ghost:refused", register=False)
    rescued = enqueue("test.ledger", {"note": "rescued"})
    _claim_as("ghost:refused", register=False)
    with refusing_updates("pj_refuse_rescue", "persistent_jobs", f"OLD.id = '{stuck.id}'",
                          "refused by the project"):
        live = start_runner(concurrency=1)
        wait_status(rescued.id, JobStatus.COMPLETED, timeout=30)
        wait_for(lambda: any(getattr(r, "event", None) == "rescue_refused"
                             for r in caplog.records), 30, "the refused rescue to be logged")
        assert not live.finished.is_set(), "the rescuer stopped"
        assert get_job(stuck.id).status == JobStatus.RUNNING
    later = enqueue("test.ledger", {"note": "after"})
    wait_status(later.id, JobStatus.COMPLETED, timeout=30)
    wait_status(stuck.id, JobStatus.COMPLETED, timeout=30)  # rescued once the trigger went


def test_rescue_waits_for_the_stale_lock_timeout_then_acts_within_it(
    start_runner: StartRunner,
) -> None:
    job = enqueue("test.ledger", {}, max_retries=0)  # rescue uses up the only attempt
    _claim_as("ghost:fresh", heartbeat_age=0)
    last_beat = JobRunnerRecord.objects.get(pk="ghost:fresh").heartbeat_at
    start_runner(concurrency=1)
    dead = wait_status(job.id, JobStatus.DEAD_LETTERED, timeout=STALE + 10)
    [attempt] = attempts_of(job.id)
    assert (attempt.outcome, attempt.error_code) == ("rescued", "RUNNER_LOST")
    assert attempt.finished_at is not None
    waited = (attempt.finished_at - last_beat).total_seconds()  # both by the database clock
    assert STALE <= waited <= STALE + 4 * HEARTBEAT + 1.0, waited
    assert dead.last_error_code == "RUNNER_LOST"


def test_a_live_runners_long_job_is_never_rescued(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    gate, started = Gate(), Gate()

    @job_handler("rt.long", timeout=120, max_retries=3)
    def long_job(payload: Any, ctx: JobContext) -> None:
        started.open()
        gate.wait()
        LedgerEntry.objects.create(job_id=ctx.job_id, note="long")

    job = enqueue("rt.long", {})
    owner = start_runner(concurrency=1)
    assert started.wait()
    other = start_runner(concurrency=1)  # a second live runner that would rescue if it could
    assert get_job(job.id).locked_by == owner.runner_id

    def long_enough() -> bool:
        current = get_job(job.id)
        # At every look, the job is still the owner's first and only attempt.
        assert current.status == JobStatus.RUNNING and current.attempts == 1
        assert current.locked_by == owner.runner_id
        assert current.locked_at is not None
        return db_now(clock=True) - current.locked_at > timedelta(seconds=STALE + 4 * HEARTBEAT)

    wait_for(long_enough, timeout=STALE + 20, interval=0.1,
             message="the job to run longer than STALE_LOCK_TIMEOUT")
    assert JobRunnerRecord.objects.filter(pk__in=[owner.runner_id, other.runner_id]).count() == 2
    gate.open()
    done = wait_status(job.id, JobStatus.COMPLETED)
    assert done.attempts == 1
    [attempt] = attempts_of(job.id)
    assert attempt.outcome == "completed" and attempt.runner_id == owner.runner_id
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1


def test_killed_runner_process_job_is_rescued_and_completed(
    spawn_runner: Spawn, start_runner: StartRunner
) -> None:
    job = enqueue("test.hang_first", {"sleep": 120})
    victim_proc = OutputReader(spawn_runner("--concurrency", "1", env={"PJ_TEST_LOG": "INFO"}))
    proc = victim_proc.proc
    running = wait_status(job.id, JobStatus.RUNNING, timeout=30)
    victim = running.locked_by
    assert victim and JobRunnerRecord.objects.filter(pk=victim).exists()
    # A live runner that serves another queue: it rescues but does not run the job itself yet.
    start_runner(concurrency=1, queues=["elsewhere"])
    proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(10)
    rescued = wait_status(job.id, JobStatus.FAILED, timeout=STALE + 15)
    assert "started" in victim_proc.text()
    elapsed = time.monotonic() - killed_at
    assert STALE - 2 * HEARTBEAT - 0.5 <= elapsed <= STALE + 4 * HEARTBEAT + 2.0, elapsed
    assert rescued.last_error_code == "RUNNER_LOST" and rescued.attempts == 1
    assert not JobRunnerRecord.objects.filter(pk=victim).exists()
    # Back in play: a runner for its queue completes it (attempt 2 does not hang).
    start_runner(concurrency=1)
    done = wait_status(job.id, JobStatus.COMPLETED, timeout=15)
    assert done.attempts == 2
    assert [(a.outcome, a.error_code) for a in attempts_of(job.id)] == [
        ("rescued", "RUNNER_LOST"), ("completed", "")]
    # The killed attempt's writes never committed; the rescued run's did, once.
    assert list(SideEffect.objects.values_list("attempt", flat=True)) == [2]
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1
    assert PersistentJob.objects.count() == 1


@pytest.mark.parametrize("token", [None, 987654321], ids=["no token", "token without attempt"])
def test_a_running_row_made_by_hand_for_a_vanished_runner_is_rescued(
    start_runner: StartRunner, token: int | None
) -> None:
    """A crash simulated with the ORM (a test, a restored backup, a row an operator edited):
    ``running``, an attempt counted, locked by a runner that has no row, and no attempt record
    behind its token (or no token at all). The rescue still settles it, charged."""
    job = enqueue("test.ledger", {"note": "by hand"}, max_retries=1)
    PersistentJob.objects.filter(pk=job.pk).update(
        status=JobStatus.RUNNING, locked_by="ghost-by-hand", attempts=1, lock_token=token,
        locked_at=db_now() - timedelta(hours=1))
    start_runner(concurrency=1)
    done = wait_status(job.id, JobStatus.COMPLETED, timeout=STALE + 15)
    assert done.attempts == 2  # the lost attempt counts
    assert [a.outcome for a in attempts_of(job.id)] == ["completed"]
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1


def test_a_running_row_made_by_hand_that_used_its_last_attempt_is_dead_lettered(
    start_runner: StartRunner,
) -> None:
    job = enqueue("test.ledger", {}, max_retries=0)
    PersistentJob.objects.filter(pk=job.pk).update(
        status=JobStatus.RUNNING, locked_by="ghost-by-hand", attempts=1, lock_token=None,
        locked_at=db_now() - timedelta(hours=1))
    start_runner(concurrency=1)
    dead = wait_status(job.id, JobStatus.DEAD_LETTERED, timeout=STALE + 15)
    assert dead.last_error_code == "RUNNER_LOST" and dead.locked_by is None
    assert not LedgerEntry.objects.filter(job_id=job.id).exists()
