"""``InProcessBackend``: the same task API, run on a thread pool in this process after commit."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from django_persistent_jobs.backends.compat import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
)
from tests.core_support import wait_for
from tests.testapp import inprocess_tasks as it
from tests.testapp.tasks_compat import task

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def finished(result: Any, timeout: float = 15.0) -> Any:
    def check() -> bool:
        result.refresh()
        return bool(result.is_finished)

    wait_for(check, timeout=timeout, message=f"task {result.id} to finish")
    return result


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    it.CALLS.clear()
    yield


def test_capabilities_and_check() -> None:
    backend = task_backends["inprocess"]
    assert type(backend).__name__ == "InProcessBackend"
    assert backend.supports_defer and backend.supports_async_task
    assert backend.supports_priority
    assert not backend.supports_get_result  # results live in this process only
    assert list(backend.check()) == []


def test_runs_after_commit_only_and_keeps_the_result() -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        doomed = it.double.enqueue(21)
        raise Boom
    with transaction.atomic():
        kept = it.double.enqueue(4)
        time.sleep(0.2)  # the pool would have run it by now if it did not wait for the commit
        assert it.CALLS == []
    finished(kept)
    assert kept.status == TaskResultStatus.SUCCESSFUL and kept.return_value == 8
    assert kept.enqueued_at <= kept.started_at <= kept.finished_at
    assert it.CALLS == [("double", 4)]
    with pytest.raises(TaskResultDoesNotExist):
        it.double.get_result(doomed.id)
    assert it.double.get_result(kept.id) is kept or it.double.get_result(kept.id).id == kept.id


def test_retries_with_backoff_then_fails_with_every_error() -> None:
    result = it.fails_twice.enqueue("x")
    finished(result)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == "x on 3"
    assert [e.exception_class for e in result.errors] == [ValueError, ValueError]
    hopeless = it.never_works.enqueue()
    finished(hopeless)
    assert hopeless.status == TaskResultStatus.FAILED and hopeless.attempts == 2
    assert all("RuntimeError: never" in e.traceback for e in hopeless.errors)


def test_timeout_fails_the_attempt_and_ignores_the_late_result() -> None:
    release = it.GATE
    release.clear()
    result = it.hangs.enqueue()
    finished(result)
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in result.errors] == [TimeoutError]
    release.set()
    time.sleep(0.2)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED  # the late return changed nothing


def test_async_task_context_and_run_after() -> None:
    async_result = it.async_triple.enqueue(5)
    delayed = it.double.using(run_after=timezone.now() + timedelta(seconds=0.6)).enqueue(1)
    finished(async_result)
    assert async_result.return_value == {"value": 15, "attempt": 1}
    delayed.refresh()
    assert delayed.status == TaskResultStatus.READY
    finished(delayed)
    assert delayed.started_at >= delayed.enqueued_at + timedelta(seconds=0.5)


def test_priority_orders_waiting_tasks() -> None:
    it.GATE.clear()
    blocker = it.block_serial.enqueue()  # the backend's only thread is busy
    wait_for(lambda: blocker.status == TaskResultStatus.RUNNING, message="the worker busy")
    lowest = it.note.using(priority=-100).enqueue("lowest")
    low = it.note.using(priority=-10).enqueue("low")
    high = it.note.using(priority=90).enqueue("high")
    mid = it.note.enqueue("mid")
    it.GATE.set()
    for result in (lowest, low, high, mid, blocker):
        finished(result)
    notes = [value for name, value in it.CALLS if name == "note"]
    assert notes == ["high", "mid", "low", "lowest"]


def _plain() -> None: ...


def test_durable_only_options_are_refused() -> None:
    with pytest.raises(InvalidTask, match="durable"):
        task(backend="inprocess", cron="* * * * *")(_plain)
    with pytest.raises(InvalidTask, match="durable"):
        task(backend="inprocess", dedup_key="k")(_plain)


def test_a_thread_pool_bounds_concurrency() -> None:
    it.GATE.clear()
    started = [it.hangs_until_released.enqueue(i) for i in range(4)]
    wait_for(lambda: sum(r.status == TaskResultStatus.RUNNING for r in started) == 2,
             message="two running")
    time.sleep(0.2)
    assert sum(r.status == TaskResultStatus.RUNNING for r in started) == 2  # WORKERS = 2
    it.GATE.set()
    for result in started:
        finished(result)
    assert threading.active_count() < 50


def test_results_and_pool_are_shared_by_every_thread_of_the_process() -> None:
    """Django keeps one backend instance per thread; the results must not be per thread."""
    result = it.double.enqueue(10)
    finished(result)
    seen: list[Any] = []

    def other_thread() -> None:
        seen.append(it.double.get_result(result.id).return_value)
        seen.append(task_backends["inprocess"] is not task_backends_in_main)

    task_backends_in_main = task_backends["inprocess"]
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(10)
    assert seen == [20, True]


def test_a_hung_task_does_not_keep_the_process_from_exiting() -> None:
    """Work is lost on exit, as documented: the process exits although a task still runs."""
    import subprocess
    import sys

    from tests.core_support import ROOT, subprocess_env

    script = (
        "import django, sys, time; django.setup()\n"
        "from tests.testapp import inprocess_tasks as it\n"
        "r = it.hangs_until_released.enqueue(1)\n"
        "while r.status != 'RUNNING': time.sleep(0.01)\n"
        "print('running', flush=True)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "running"
    assert time.monotonic() - started < 8  # the task would hang for 10 s
