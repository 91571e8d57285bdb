"""Graceful shutdown: stop claiming, let in-flight jobs finish within the grace period, hand the
rest back uncharged; a second signal stops at once. In process and as a ``runjobs`` process."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_persistent_jobs import JobContext, enqueue, job_handler
from django_persistent_jobs.handlers import Registry
from django_persistent_jobs.models import JobRunnerRecord, JobStatus
from django_persistent_jobs.runner import Runner
from tests.runner_support import (
    Gate,
    OutputReader,
    attempts_of,
    db_now,
    get_job,
    isolated_registry,
    wait_handler_inside,
    wait_status,
)
from tests.testapp.models import LedgerEntry, SideEffect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

__all__ = ["isolated_registry"]  # a fixture, used by name

StartRunner = Callable[..., Runner]
Spawn = Callable[..., "subprocess.Popen[bytes]"]


def _register_gated(job_type: str, gate: Gate, started: Gate) -> None:
    @job_handler(job_type, timeout=120, max_retries=3)
    def gated(payload: Any, ctx: JobContext) -> None:
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
        started.open()
        gate.wait()
        LedgerEntry.objects.create(job_id=ctx.job_id, note=job_type)


def test_stop_lets_an_in_flight_job_finish_within_the_grace_period(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    gate, started = Gate(), Gate()
    _register_gated("rt.graceful", gate, started)
    job = enqueue("rt.graceful", {})
    runner = start_runner(concurrency=2, shutdown_grace=20)
    assert started.wait()
    runner.request_stop()
    assert runner.stopping.is_set()
    # Stopped claiming: a job enqueued now is left for another runner.
    late = enqueue("rt.graceful", {})
    assert not runner.finished.is_set()
    gate.open()
    assert runner.finished.wait(15)
    assert runner.exit_code == 0
    done = get_job(job.id)
    assert done.status == JobStatus.COMPLETED and done.attempts == 1
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1
    left = get_job(late.id)
    assert left.status == JobStatus.PENDING and left.attempts == 0
    assert not LedgerEntry.objects.filter(job_id=late.id).exists()
    assert not JobRunnerRecord.objects.filter(pk=runner.runner_id).exists()


def test_job_outliving_the_grace_period_is_handed_back_uncharged(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    gate, started = Gate(), Gate()
    _register_gated("rt.too_long", gate, started)
    job = enqueue("rt.too_long", {})
    runner = start_runner(concurrency=1, shutdown_grace=0.5)
    assert started.wait()
    began = time.monotonic()
    assert runner.stop(timeout=15) == 0
    assert time.monotonic() - began < 10
    back = get_job(job.id)
    assert back.status == JobStatus.PENDING
    assert back.attempts == 0  # a hand-back does not use up a retry
    assert back.locked_by is None and back.lock_token is None
    assert back.last_error_code == "SHUTDOWN"
    [attempt] = attempts_of(job.id)
    assert (attempt.outcome, attempt.error_code) == ("interrupted", "SHUTDOWN")
    assert not SideEffect.objects.exists()
    # The abandoned handler wakes up later and still cannot complete the job.
    gate.open()
    assert not LedgerEntry.objects.exists()
    assert get_job(job.id).status == JobStatus.PENDING
    # Back in play: the next runner runs it as attempt 1 again.
    start_runner(concurrency=1)
    done = wait_status(job.id, JobStatus.COMPLETED)
    assert done.attempts == 1
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1


def test_force_stop_hands_back_at_once(
    isolated_registry: Registry, start_runner: StartRunner
) -> None:
    gate, started = Gate(), Gate()
    _register_gated("rt.forced", gate, started)
    job = enqueue("rt.forced", {})
    runner = start_runner(concurrency=1, shutdown_grace=60)
    assert started.wait()
    runner.request_stop()
    runner.force_stop()
    assert runner.finished.wait(15), "force_stop waited for the grace period"
    assert runner.exit_code == 1
    back = get_job(job.id)
    assert back.status == JobStatus.PENDING and back.attempts == 0
    gate.open()


# --------------------------------------------------------------------------- runjobs process


LOG_ENV = {"PJ_TEST_LOG": "INFO"}  # the runner logs to stdout: tests wait for what it says
STOPPING = "stopping: no new claims"


def test_sigterm_lets_in_flight_job_finish_and_exits_zero(spawn_runner: Spawn) -> None:
    job = enqueue("test.ledger", {"sleep": 3, "note": "in flight"})
    since = db_now(clock=True)
    runner = OutputReader(spawn_runner("--concurrency", "2", env=LOG_ENV))
    wait_handler_inside(since)  # claimed is not started: an unstarted job is handed back
    runner.proc.send_signal(signal.SIGTERM)
    runner.wait_for_line(STOPPING)
    # Stopped claiming: a job enqueued after the signal stays pending, though a slot is free.
    late = enqueue("test.ledger", {"note": "late"})
    code, output = runner.finish(20)
    assert code == 0, output
    done = get_job(job.id)
    assert done.status == JobStatus.COMPLETED and done.attempts == 1, output
    assert LedgerEntry.objects.get(job_id=job.id).note == "in flight"
    left = get_job(late.id)
    assert left.status == JobStatus.PENDING and left.attempts == 0, output
    assert not JobRunnerRecord.objects.exists()


def test_second_signal_forces_exit_and_hands_the_job_back(spawn_runner: Spawn) -> None:
    """SIGINT (Ctrl-C) starts the graceful stop like SIGTERM; a SIGTERM after it forces."""
    job = enqueue("test.hang_first", {"sleep": 120})
    since = db_now(clock=True)
    runner = OutputReader(spawn_runner("--concurrency", "1", "--grace", "60", env=LOG_ENV))
    wait_handler_inside(since)  # claimed is not started: an unstarted job is handed back
    runner.proc.send_signal(signal.SIGINT)
    runner.wait_for_line(STOPPING)  # the first signal was handled: a graceful stop began
    late = enqueue("test.ledger", {"note": "late"})
    assert runner.proc.poll() is None, "the first signal did not wait for the in-flight job"
    assert get_job(job.id).status == JobStatus.RUNNING
    forced_at = time.monotonic()
    runner.proc.send_signal(signal.SIGTERM)
    code, output = runner.finish(20)
    assert time.monotonic() - forced_at < 20
    assert code == 1, output
    back = get_job(job.id)
    assert back.status == JobStatus.PENDING and back.attempts == 0, output
    assert back.last_error_code == "SHUTDOWN"
    [attempt] = attempts_of(job.id)
    assert (attempt.outcome, attempt.error_code) == ("interrupted", "SHUTDOWN")
    assert not SideEffect.objects.exists() and not LedgerEntry.objects.exists()
    late_now = get_job(late.id)
    assert late_now.status == JobStatus.PENDING and late_now.attempts == 0, output
    assert not JobRunnerRecord.objects.exists()
