"""PREFETCH: a runner may hold claimed jobs waiting for a worker; at shutdown those are handed
back unstarted and uncharged, while the job a worker is running still finishes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
from django.conf import settings
from django.test import override_settings

from django_persistent_jobs import enqueue_many, job_handler
from django_persistent_jobs.handlers import Registry
from django_persistent_jobs.models import JobStatus, PersistentJob
from django_persistent_jobs.runner import Runner
from django_persistent_jobs.runner.execute import InFlight
from django_persistent_jobs.runner.threads import ThreadExecutor
from tests.runner_support import Gate, attempts_of, isolated_registry, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]
__all__ = ["isolated_registry"]  # the fixture, re-exported for pytest


def test_prefetched_jobs_wait_and_are_handed_back_unstarted_at_shutdown(
    isolated_registry: Registry, start_runner: Callable[..., Runner],
) -> None:
    started: list[Any] = []
    first_started = threading.Event()
    gate = Gate()

    @job_handler("rt.prefetch", timeout=60)
    def slow(payload: Any) -> None:
        started.append(payload["i"])
        first_started.set()
        gate.wait()

    jobs = enqueue_many([("rt.prefetch", {"i": i}) for i in range(5)])
    with override_settings(PERSISTENT_JOBS={**settings.PERSISTENT_JOBS, "PREFETCH": 2}):
        runner = start_runner(concurrency=1, poll_interval=0.05)
    assert first_started.wait(15)
    # One job runs, two more are claimed into the buffer, the other two stay in the table.
    wait_for(lambda: PersistentJob.objects.filter(status=JobStatus.RUNNING).count() == 3,
             message="one running and two prefetched claims")
    assert PersistentJob.objects.filter(status=JobStatus.PENDING).count() == 2
    assert runner.pool.running == 1 and runner.pool.busy == 3

    runner.request_stop()
    # The waiting ones go back at once, before the running one is let finish.
    waiting = [j.id for j in jobs if j.payload["i"] != started[0]]
    wait_for(lambda: PersistentJob.objects.filter(
        id__in=waiting, status=JobStatus.PENDING).count() == 4,
        message="the prefetched jobs handed back")
    gate.open()
    assert runner.finished.wait(30)

    assert started == [started[0]], "a prefetched job was started after the stop"
    by_id = {j.id: PersistentJob.objects.get(id=j.id) for j in jobs}
    running_one = next(j for j in jobs if j.payload["i"] == started[0])
    assert by_id[running_one.id].status == JobStatus.COMPLETED
    handed_back = [job_id for job_id in waiting if attempts_of(job_id)]
    assert len(handed_back) == 2
    for job_id in handed_back:
        job = by_id[job_id]
        assert (job.status, job.attempts, job.last_error_code) == ("pending", 0, "SHUTDOWN")
        assert [(a.outcome, a.error_code) for a in attempts_of(job_id)] == [
            ("interrupted", "SHUTDOWN")]


def test_handler_threads_open_their_connections_before_their_first_job(
    isolated_registry: Registry, start_runner: Callable[..., Runner],
) -> None:
    """An idle runner's first jobs do not wait for connections to open: each handler thread
    opens its own as it starts (the first job on each thread used to pay 6-9 ms for it). Six
    jobs due three seconds after the runner started, on three threads: every session they ran
    on was opened before they were due."""
    from django.db import connection
    from django.db.models import Min

    seen: list[Any] = []
    lock = threading.Lock()

    @job_handler("rt.session_probe")
    def probe(payload: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT backend_start FROM pg_stat_activity "
                           "WHERE pid = pg_backend_pid()")
            (opened,) = cursor.fetchone()
        with lock:
            seen.append(opened)

    start_runner(concurrency=3, poll_interval=0.05)
    jobs = enqueue_many([("rt.session_probe", {"i": i}) for i in range(6)], delay=3)
    due = PersistentJob.objects.filter(id__in=[j.id for j in jobs]).aggregate(
        due=Min("next_run_at"))["due"]
    wait_for(lambda: len(seen) == 6, timeout=30, message="the six jobs to run")
    assert all(opened < due for opened in seen), (seen, due)


def _item(number: int) -> InFlight:
    job = SimpleNamespace(id=f"job-{number}", token=number, waiting=False)
    return InFlight(job=cast(Any, job), ctx=cast(Any, None), deadline=None)


def test_the_claim_loop_is_woken_once_enough_room_is_free_not_before() -> None:
    """The claim loop waits for half of the waiting room (``refill_at``); jobs leaving the
    pool wake it only once that much is free (a wake-up per job cost drains a GIL hand-off
    each), and never leave it asleep once it is."""
    release = {f"job-{number}": threading.Event() for number in range(6)}

    def run(item: InFlight) -> None:
        release[cast(str, item.job.id)].wait(30)

    pool = ThreadExecutor(2, run, prefetch=4)
    pool.start()
    try:
        assert pool.submit_many([_item(number) for number in range(6)]) == 6
        assert pool.free_slots() == 0
        answer: list[int] = []
        waiter = threading.Thread(
            target=lambda: answer.append(pool.wait_for_free_slot(timeout=30, at_least=3)))
        waiter.start()
        for number in (0, 1):
            release[f"job-{number}"].set()
        wait_for(lambda: pool.free_slots() == 2, timeout=10, message="two jobs to leave")
        waiter.join(0.3)
        assert waiter.is_alive() and not answer  # two free: not enough yet
        release["job-2"].set()
        waiter.join(10)
        assert answer == [3]
    finally:
        for event in release.values():
            event.set()
        pool.close()
        pool.join(10)


def test_a_sealed_pool_accepts_no_part_of_a_claim() -> None:
    pool = ThreadExecutor(1, lambda item: None)
    pool.seal()
    assert pool.submit_many([_item(0), _item(1)]) == 0
    assert pool.busy == 0


def test_two_attempts_of_one_job_are_both_held_and_both_can_be_taken_over() -> None:
    """A runner presumed dead (frozen past the stale-lock timeout) and reaped may claim a job's
    retry while the old attempt's handler still runs here: the pool holds both, by token, so
    the old one can still be timed out and the new one is not hidden by it (nor the reverse)."""
    release = threading.Event()
    pool = ThreadExecutor(2, lambda item: release.wait(30))
    pool.start()
    old, retry = _item(1), _item(2)
    retry.job.id = old.job.id  # the same job, a new attempt (token)
    try:
        assert pool.submit_many([old]) == 1
        assert pool.submit_many([retry]) == 1
        assert pool.busy == 2
        assert {id(item) for item in pool.snapshot()} == {id(old), id(retry)}
        assert pool.take_over(old) and not pool.take_over(old)
        assert [id(item) for item in pool.snapshot()] == [id(retry)]
    finally:
        release.set()
        pool.close()
        pool.join(10)
