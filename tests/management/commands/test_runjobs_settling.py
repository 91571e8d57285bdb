"""Settling with real ``runjobs`` processes: what a job raises or does to its runner never
kills the runner, hand-backs are counted, and a runner claims only types it can run."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from django_persistent_jobs.enqueuing import enqueue
from django_persistent_jobs.models import JobAttempt, JobStatus, PersistentJob
from tests.runner_support import (
    attempts_of,
    db_now,
    get_job,
    wait_for,
    wait_handler_inside,
    wait_status,
)
from tests.testapp.models import LedgerEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

Spawn = Callable[..., "subprocess.Popen[bytes]"]


def finish(proc: subprocess.Popen[bytes], timeout: float = 60) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode("utf-8", "replace")


def test_unstorable_error_text_does_not_kill_runjobs(spawn_runner: Spawn) -> None:
    job = enqueue("settle.bad_text", {})
    code, out = finish(spawn_runner("--burst"))
    assert code == 0, out
    dead = get_job(job.id)
    assert dead.status == JobStatus.DEAD_LETTERED, out
    assert dead.last_error == "cannot read upload-\\udcfe.bin: NUL at \\x00"
    assert dead.last_error_code == "BAD\\x00TEXT"
    [attempt] = attempts_of(job.id)
    assert (attempt.outcome, attempt.error_code) == ("dead_lettered", "BAD\\x00TEXT")


def test_sigterm_handbacks_are_counted_then_charged(spawn_runner: Spawn) -> None:
    """A job whose runner gets SIGTERMed every time it runs ends dead-lettered."""
    job = enqueue("settle.gets_runner_stopped", {})
    env = {"PJ_TEST_SETTINGS": json.dumps({"HANDBACK_LIMIT": 1, "SHUTDOWN_GRACE": 0.2})}
    seen: list[tuple[str, int, int, str]] = []
    for round_ in range(2):
        since = db_now(clock=True)
        proc = spawn_runner(env=env)
        wait_for(lambda round_=round_: JobAttempt.objects.filter(
            job_id=job.id, outcome="running").exists(), 60, message=f"run {round_ + 1}")
        # Claimed is not started: a job handed back unstarted is not counted as a hand-back.
        wait_handler_inside(since, message=f"run {round_ + 1}")
        proc.send_signal(signal.SIGTERM)
        code, out = finish(proc)
        assert code == 0, out
        stored = get_job(job.id)
        seen.append((stored.status, stored.attempts, stored.handbacks, stored.last_error_code))
    assert seen == [("pending", 0, 1, "SHUTDOWN"), ("dead_lettered", 1, 2, "INTERRUPTED")]


def test_rolling_deploy_new_job_type_waits_for_a_new_runner(
    spawn_runner: Spawn, settings: Any,
) -> None:
    """With ``ALLOW_UNREGISTERED`` (types other runners handle), a job type only the new
    release knows waits for a runner that has it."""
    settings.PERSISTENT_JOBS = {**settings.PERSISTENT_JOBS, "ALLOW_UNREGISTERED": True}
    newer = enqueue("settle.new_release", {}, priority=5)
    known = enqueue("test.ledger", {"note": "old release"})
    code, out = finish(spawn_runner(  # the previous release
        "--burst", env={"PJ_TEST_SETTINGS": json.dumps({"ALLOW_UNREGISTERED": True})}))
    assert code == 0, out
    assert get_job(known.id).status == JobStatus.COMPLETED
    stored = get_job(newer.id)
    assert (stored.status, stored.attempts, stored.last_error_code) == ("pending", 0, ""), out
    code, out = finish(spawn_runner("--burst", env={"PJ_TEST_NEW_RELEASE": "1"}))
    assert code == 0, out
    done = wait_status(newer.id, JobStatus.COMPLETED)
    assert done.attempts == 1
    assert LedgerEntry.objects.get(job_id=newer.id).note == "new release"


@pytest.mark.parametrize("processes", ["0", "1"])
def test_a_burst_runner_dead_letters_a_due_job_no_runner_has_a_handler_for(
    spawn_runner: Spawn, processes: str,
) -> None:
    """A job of a type no live runner knows (a row written by hand, a handler a release
    removed) is dead-lettered ``UNKNOWN_JOB_TYPE``, charged, not left ``pending`` for ever;
    ``--burst`` processes every due job and still exits 0."""
    unknown = PersistentJob.objects.create(job_type="settle.nobody_has_it", payload={"a": 1})
    known = enqueue("test.ledger", {"note": "known"})
    code, out = finish(spawn_runner("--burst", "--processes", processes))
    assert code == 0, out
    assert get_job(known.id).status == JobStatus.COMPLETED
    dead = get_job(unknown.id)
    assert (dead.status, dead.attempts, dead.last_error_code) == (
        JobStatus.DEAD_LETTERED, 1, "UNKNOWN_JOB_TYPE"), out
    assert "settle.nobody_has_it" in dead.last_error


def test_burst_runs_alone_rescue_a_job_whose_runner_died(spawn_runner: Spawn) -> None:
    """A deployment that only runs ``runjobs --burst`` (cron): a burst runner killed inside a
    job leaves it ``running``; the next burst waits until it may rescue it (it must have
    beaten for a stale-lock timeout first) instead of exiting with the job stuck for ever."""
    job = enqueue("test.ledger", {"exit_on_attempts": 1})
    code, out = finish(spawn_runner("--burst", "--processes", "0"))
    assert code == 1, out  # the handler ended the whole runner process
    assert get_job(job.id).status == JobStatus.RUNNING
    code, out = finish(spawn_runner("--burst", "--processes", "0"), timeout=60)
    assert code == 0, out
    rescued = get_job(job.id)
    assert rescued.status in (JobStatus.FAILED, JobStatus.COMPLETED), out
    if rescued.status == JobStatus.FAILED:  # its retry was not due yet when the burst ended
        assert rescued.last_error_code == "RUNNER_LOST"
        code, out = finish(spawn_runner("--burst", "--processes", "0"), timeout=60)
        assert code == 0, out
    done = wait_status(job.id, JobStatus.COMPLETED, timeout=5)
    assert done.attempts == 2
    assert [a.outcome for a in JobAttempt.objects.filter(job_id=job.id).order_by("attempt")] == [
        "rescued", "completed"]
