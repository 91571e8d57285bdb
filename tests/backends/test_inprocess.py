"""``InProcessBackend``: the same task API, run on a thread pool in this process after commit."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
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


def test_a_task_waiting_for_the_thread_a_hung_task_holds_is_not_timed_out() -> None:
    """The only thread is held by a task past its timeout (hung code keeps its thread): the
    task behind it waits for the thread, its own timeout not yet running, and then runs."""
    it.GATE.clear()
    hung = it.hangs_serial.enqueue()
    behind = it.quick_serial.enqueue("behind")  # (its own timeout: 0.5 s)
    finished(hung)
    assert [e.exception_class for e in hung.errors] == [TimeoutError]
    time.sleep(0.8)  # (past the waiting task's own timeout: an absence, nothing to wait for)
    behind.refresh()
    assert behind.status == TaskResultStatus.READY and behind.errors == []
    it.GATE.set()
    finished(behind)
    assert behind.status == TaskResultStatus.SUCCESSFUL and ("quick", "behind") in it.CALLS


def test_the_dispatcher_survives_a_far_due_time_and_a_failing_receiver() -> None:
    """A ``run_after`` centuries ahead, and a ``task_finished`` receiver that raises for a task
    the dispatcher timed out: later tasks still run (the dispatcher is one thread per
    process; if it died, no in-process task would run again)."""
    from django_persistent_jobs.backends.compat import task_finished

    far = it.double.using(run_after=datetime(2500, 1, 1, tzinfo=UTC)).enqueue(1)
    finished(it.double.enqueue(3))

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("a receiver's bug")

    it.GATE.clear()
    task_finished.connect(broken)
    try:
        timed_out = it.hangs.enqueue()
        finished(timed_out)
    finally:
        task_finished.disconnect(broken)
        it.GATE.set()
    assert finished(it.double.enqueue(4)).return_value == 8
    far.refresh()
    assert far.status == TaskResultStatus.READY


def test_max_results_drops_the_oldest_finished_past_an_unfinished_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = task_backends["serial"]
    monkeypatch.setattr(backend, "max_results", 3)
    deferred = it.note.using(run_after=timezone.now() + timedelta(hours=1)).enqueue("later")
    done = [finished(it.note.enqueue(str(i))) for i in range(5)]
    for gone in done[:2]:
        with pytest.raises(TaskResultDoesNotExist):
            it.note.get_result(gone.id)
    assert [it.note.get_result(r.id).return_value for r in done[2:]] == ["2", "3", "4"]
    assert it.note.get_result(deferred.id).status == TaskResultStatus.READY


def test_max_results_applies_as_tasks_finish_not_only_at_the_next_enqueue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst enqueued while the pool is busy, then nothing more: the finished results beyond
    ``MAX_RESULTS`` go as the tasks finish (they used to stay until some later enqueue)."""
    backend = task_backends["serial"]
    monkeypatch.setattr(backend, "max_results", 2)
    it.GATE.clear()
    try:
        blocker = it.block_serial.enqueue()
        burst = [it.note.enqueue(str(i)) for i in range(4)]
    finally:
        it.GATE.set()
    for result in [blocker, *burst]:
        wait_for(lambda r=result: _finished_or_gone(r), message="the burst to finish")
    kept = [r for r in [blocker, *burst] if _known(r)]
    assert [r.id for r in kept] == [r.id for r in burst[2:]]


def _known(result: Any) -> bool:
    try:
        result.refresh()
    except TaskResultDoesNotExist:
        return False
    return True


def _finished_or_gone(result: Any) -> bool:
    return not _known(result) or result.is_finished


def test_an_in_process_task_cannot_be_sent_to_the_durable_backend_by_using() -> None:
    """``using(backend="default")`` on a task declared for the in-process backend: a runner
    imports the task from its module, finds it on the in-process backend, and has no handler
    for it, so the job would wait for ever. Refused at once, saying what to do."""
    with pytest.raises(InvalidTask, match=r"declared for backend 'inprocess'.*never run"):
        it.double.using(backend="default").enqueue(1)


def test_a_call_the_task_cannot_take_is_refused_at_enqueue() -> None:
    """As with the durable backend: the call failed on the pool thread instead, retried to
    its end, after ``enqueue`` had returned a result."""
    from django_persistent_jobs.backends.tasks import TaskArgumentsError

    with pytest.raises(TaskArgumentsError, match="missing a required argument: 'value'"):
        it.double.enqueue()
    with pytest.raises(TaskArgumentsError, match="too many positional arguments"):
        it.fails_twice.enqueue("a", "b")
    with pytest.raises(TypeError, match="multiple values for argument 'value'"):
        it.double.enqueue(1, value=2)
    assert it.CALLS == []
    assert finished(it.double.enqueue(value=3)).return_value == 6


def test_a_backoffs_answer_is_read_as_the_runner_reads_it() -> None:
    """A ``timedelta`` is its seconds (it used to fall back to 60 s); NaN is no delay at all,
    so the 60 s fallback, not a retry at once."""
    spaced = it.spaced_by_timedelta.enqueue()
    finished(spaced)
    assert spaced.status == TaskResultStatus.FAILED and spaced.attempts == 2
    unusable = it.unusable_backoff.enqueue()

    def failed_once() -> bool:
        unusable.refresh()
        return len(unusable.errors) == 1

    wait_for(failed_once, message="the first attempt to fail")
    time.sleep(0.3)  # a retry at once would have run by now
    unusable.refresh()
    assert len(unusable.errors) == 1 and not unusable.is_finished
