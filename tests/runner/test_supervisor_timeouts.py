"""Timeouts: a hung handler loses its job, gives back its slot and can never complete it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from django_persistent_jobs import JobContext, enqueue, job_handler
from django_persistent_jobs.backoff import constant
from django_persistent_jobs.handlers import Registry
from django_persistent_jobs.models import JobStatus
from django_persistent_jobs.runner import Runner
from tests.runner_support import (
    Gate,
    attempts_of,
    isolated_registry,
    wait_for,
    wait_status,
)
from tests.testapp.models import LedgerEntry, SideEffect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

__all__ = ["isolated_registry"]  # a fixture, used by name


def _assert_timed_out(attempt: Any, timeout: float) -> None:
    assert attempt.outcome == "timed_out"
    assert attempt.error_code == "TIMEOUT"
    assert f"timeout of {timeout:g}s" in attempt.error_message
    assert attempt.duration is not None and attempt.duration.total_seconds() >= timeout * 0.9


def test_sleeping_handler_times_out_is_retried_and_frees_its_slot(
    isolated_registry: Registry, start_runner: Any
) -> None:
    calls: list[int] = []

    @job_handler("rt.sleeper", timeout=1, max_retries=1, backoff=constant(0), priority=10)
    def sleeper(payload: Any, ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
        if ctx.attempt == 1:
            time.sleep(3600)  # stuck in C: cannot be interrupted, only abandoned

    @job_handler("rt.bystander")
    def bystander(payload: Any, ctx: JobContext) -> None:
        LedgerEntry.objects.create(job_id=ctx.job_id, note="bystander")

    hung = enqueue("rt.sleeper", {})
    other = enqueue("rt.bystander", {})  # lower priority: claimed after the sleeper
    start_runner(concurrency=1)
    # With one slot, the bystander can only run once the timed-out sleeper gave its slot back.
    wait_status(other.id, JobStatus.COMPLETED, timeout=20)
    done = wait_status(hung.id, JobStatus.COMPLETED, timeout=20)
    assert done.attempts == 2 and calls == [1, 2]
    first, second = attempts_of(hung.id)
    _assert_timed_out(first, 1)
    assert second.outcome == "completed"
    [bystander_attempt] = attempts_of(other.id)
    # (The slot is handed back as the timeout fires, a moment before the timeout is recorded.)
    assert bystander_attempt.started_at >= first.started_at + timedelta(seconds=0.9)
    # The stuck attempt's write rolled back (its connection was terminated); only attempt 2's.
    assert list(SideEffect.objects.values_list("attempt", flat=True)) == [2]


def test_spinning_handler_times_out_and_dead_letters_without_retries(
    isolated_registry: Registry, start_runner: Any
) -> None:
    exited = threading.Event()

    @job_handler("rt.spinner", timeout=1, max_retries=0)
    def spinner(payload: Any, ctx: JobContext) -> None:
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
        try:
            while True:
                pass
        finally:
            exited.set()

    @job_handler("rt.after_spinner")
    def after(payload: Any, ctx: JobContext) -> None:
        LedgerEntry.objects.create(job_id=ctx.job_id, note="after")

    spinning = enqueue("rt.spinner", {}, priority=5)
    other = enqueue("rt.after_spinner", {})
    runner = start_runner(concurrency=1)
    dead = wait_status(spinning.id, JobStatus.DEAD_LETTERED, timeout=20)
    assert dead.attempts == 1 and dead.last_error_code == "TIMEOUT"
    [attempt] = attempts_of(spinning.id)
    _assert_timed_out(attempt, 1)
    # The busy loop itself was stopped (not just abandoned): the thread left the handler.
    assert exited.wait(10), "the spinning handler was never interrupted"
    wait_status(other.id, JobStatus.COMPLETED, timeout=20)
    assert not SideEffect.objects.exists()
    assert runner.pool.busy == 0
    wait_for(lambda: len(runner.pool.workers) == 1, message="a replacement worker")
    assert all(w.thread.is_alive() for w in runner.pool.workers)


def test_timed_out_handler_that_carries_on_can_never_complete(
    isolated_registry: Registry, start_runner: Any
) -> None:
    """A handler that swallows the interrupt, writes and returns still leaves nothing behind."""
    finished = threading.Event()
    report: dict[str, Any] = {}

    @job_handler("rt.stubborn", timeout=1, max_retries=0)
    def stubborn(payload: Any, ctx: JobContext) -> None:
        try:
            time.sleep(2.5)  # past its timeout
        except BaseException as exc:  # the worst case: it ignores the runner's interrupt
            report["swallowed"] = type(exc).__name__
        try:
            LedgerEntry.objects.create(job_id=ctx.job_id, note="too late")
            report["wrote"] = True
        except BaseException as exc:
            report["write_error"] = type(exc).__name__
            raise
        finally:
            finished.set()

    job = enqueue("rt.stubborn", {})
    start_runner(concurrency=1)
    dead = wait_status(job.id, JobStatus.DEAD_LETTERED, timeout=20)
    assert dead.last_error_code == "TIMEOUT"
    assert finished.wait(15), "the stubborn handler never got to its write"
    # Either its write failed on the terminated connection, or it went through and rolled back;
    # in no case may it commit or change the job.
    assert report.get("swallowed") == "JobInterrupted" or "write_error" in report
    assert not LedgerEntry.objects.filter(job_id=job.id).exists()
    again = wait_status(job.id, JobStatus.DEAD_LETTERED)
    assert again.attempts == 1
    [attempt] = attempts_of(job.id)
    assert attempt.outcome == "timed_out"


def test_handler_released_after_its_timeout_cannot_complete(
    isolated_registry: Registry, start_runner: Any
) -> None:
    """A handler blocked past its timeout is abandoned; when it wakes it changes nothing."""
    gate = Gate()
    woke = threading.Event()

    @job_handler("rt.blocked", timeout=0.5, max_retries=2, backoff=constant(3600))
    def blocked(payload: Any, ctx: JobContext) -> None:
        try:
            gate.wait()
            LedgerEntry.objects.create(job_id=ctx.job_id, note="late")
        finally:
            woke.set()

    job = enqueue("rt.blocked", {})
    runner = start_runner(concurrency=1)
    failed = wait_status(job.id, JobStatus.FAILED, timeout=20)
    assert failed.attempts == 1 and failed.last_error_code == "TIMEOUT"
    assert runner.pool.busy == 0  # the slot is free while the old thread is still blocked
    gate.open()
    assert woke.wait(10)
    assert not LedgerEntry.objects.exists()
    after = wait_status(job.id, JobStatus.FAILED)
    assert after.attempts == 1 and after.lock_token is None
    [attempt] = attempts_of(job.id)
    _assert_timed_out(attempt, 0.5)


def test_timeout_given_at_enqueue_overrides_the_handler(
    isolated_registry: Registry, start_runner: Any
) -> None:
    gate = Gate()

    @job_handler("rt.enqueue_timeout", timeout=600, max_retries=0)
    def slow(payload: Any) -> None:
        gate.wait()

    job = enqueue("rt.enqueue_timeout", {}, timeout=0.5)
    runner: Runner = start_runner(concurrency=1)
    dead = wait_status(job.id, JobStatus.DEAD_LETTERED, timeout=20)
    gate.open()
    assert dead.timeout_seconds == 0.5 and dead.last_error_code == "TIMEOUT"
    assert runner.exit_code == 0


@pytest.mark.parametrize("processes", [0, 1])
def test_a_batched_completion_that_lands_as_its_timeout_is_settled_is_reported_once(
    start_runner: Any, finished_log: Path, monkeypatch: pytest.MonkeyPatch, processes: int,
) -> None:
    """A handler that ran no SQL returns just at its deadline: its completion goes to the
    batch writer, and the timeout enforcer takes the job over before the runner knows it
    returned. The batch commits first; the enforcer's ``TIMEOUT`` then finds the attempt
    completed. The job is completed once, and its attempt is reported once: by the batch
    writer, not a second time by the enforcer (which reported it ``completed`` too).

    The window is widened, not faked: with threads the handler's thread waits, once it has
    handed its completion over, until the enforcer took the job (as a thread descheduled
    there would); with a worker process the supervisor reads the worker's report that the
    handler returned only once the enforcer took the job (as a busy manager thread would).
    The worker sends ``job_finished`` in its own process: every process appends the ones it
    sends to one file."""
    from django_persistent_jobs.runner.workers import protocol
    from django_persistent_jobs.runner.workers.manager import ProcessExecutor

    job = enqueue("test.noop", {}, timeout=1, max_retries=0)
    held: list[Any] = []

    if processes:
        real_handle = ProcessExecutor._handle

        def handle(self: ProcessExecutor, worker: Any, message: tuple[Any, ...]) -> None:
            if message[0] in (protocol.RETURNED, protocol.DONE):
                item = next((item for item in list(self.in_flight.values())
                             if item.job.id == job.id), None)
                if item is not None and protocol.wire_id(item.job) in message[1]:
                    held.append(item)
                    item.taken_over.wait(30)
            real_handle(self, worker, message)

        monkeypatch.setattr(ProcessExecutor, "_handle", handle)
    else:
        real_execute = Runner._execute

        def execute(self: Runner, item: Any) -> None:
            real_execute(self, item)
            if item.job.id == job.id:
                held.append(item)
                item.taken_over.wait(30)

        monkeypatch.setattr(Runner, "_execute", execute)
    runner: Runner = start_runner(concurrency=1, processes=processes)
    done = wait_status(job.id, JobStatus.COMPLETED, timeout=30)
    wait_for(lambda: held and held[0].taken_over.is_set(), timeout=30,
             message="the enforcer to take the job over")
    wait_for(lambda: not runner.timeouts.settling, timeout=30,
             message="the enforcer to settle it")
    assert runner.stop(timeout=30) == 0  # every signal of the attempt has been sent now
    # (The completion landed first: the race was run.)
    _assert_completed_and_reported_once(done, finished_log)


@pytest.mark.parametrize("processes", [0, 1])
def test_an_on_commit_callback_past_the_timeout_is_interrupted_and_its_completion_reported_once(
    start_runner: Any, tmp_path: Path, finished_log: Path, processes: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The handler returns at once, its completion commits, and an ``on_commit`` callback of
    its own (user code, run after the commit) spins past the job's timeout. The timeout still
    stops that code (its thread is interrupted as any hung handler's; a worker process stops
    it too, rather than being recycled because a lane never returns), and the attempt, which
    did complete, is reported completed exactly once: by its thread or by the enforcer that
    found it completed, not by both and not by neither (that is what happened when a returned
    handler's thread was never interrupted: no report at all)."""
    mark = tmp_path / "mark"
    job = enqueue("test.commit_spin", {"mark": str(mark)}, timeout=1)
    runner: Runner = start_runner(concurrency=1, processes=processes)
    wait_for(lambda: mark.exists() and mark.read_text() == "interrupted", timeout=15,
             message="the timeout to interrupt the on_commit callback")
    done = wait_status(job.id, JobStatus.COMPLETED, timeout=10)
    wait_for(lambda: not runner.timeouts.settling, timeout=30,
             message="the enforcer to settle it")
    wait_for(lambda: finished_log.exists() and finished_log.read_text().strip() != "",
             timeout=10, message="the attempt to be reported")
    assert runner.stop(timeout=30) == 0  # every signal of the attempt has been sent now
    _assert_completed_and_reported_once(done, finished_log)
    # (A worker process stopped the callback itself: not recycled for a lane that never came
    # back.)
    assert [r for r in caplog.records if getattr(r, "event", None) == "worker_recycled"] == []


@pytest.fixture
def finished_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A file to which this process and the worker processes started from now on append each
    ``job_finished`` they send (a worker sends the signals of the jobs it runs)."""
    from django_persistent_jobs.signals import job_finished
    from tests.core_support import subprocess_env
    from tests.testapp.jobs import FINISHED_LOG_ENV, record_finished

    log = tmp_path / "finished"
    for name, value in subprocess_env().items():  # worker processes use the test database
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(FINISHED_LOG_ENV, str(log))  # ... and log what they send there
    record_finished(str(log))  # (this process: the supervisor, and the threads' runner)
    yield log
    job_finished.disconnect(dispatch_uid=f"tests-finished-log-{log}")


def _assert_completed_and_reported_once(done: Any, log: Path) -> None:
    """The job completed on its first attempt, and that attempt was reported completed once,
    by one process."""
    assert done.attempts == 1 and done.last_error_code == ""
    [attempt] = attempts_of(done.id)
    assert attempt.outcome == "completed"
    reports = [line.split()[1:] for line in log.read_text().splitlines()]
    assert reports == [[str(done.id), "1", "completed", "completed"]]
