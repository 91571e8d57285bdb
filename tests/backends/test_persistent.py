"""``PersistentJobsBackend`` through Django's public task API, run by real ``runjobs`` processes.

The tasks live in ``tests/testapp/tasks.py``; runner subprocesses know them because the app
config imports every installed app's ``tasks`` module when TASKS uses our backend.
"""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.utils import timezone

from django_persistent_jobs import enqueue
from django_persistent_jobs.backends.compat import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)
from django_persistent_jobs.errors import PayloadError
from django_persistent_jobs.runner import Runner
from tests.core_support import wait_for
from tests.testapp import tasks
from tests.testapp.models import LedgerEntry, SideEffect
from tests.testapp.tasks_compat import task

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

Spawn = Callable[..., "subprocess.Popen[bytes]"]
StartRunner = Callable[..., Runner]


def finished(result: Any, timeout: float = 30.0) -> Any:
    """Refresh ``result`` until it is finished (SUCCESSFUL or FAILED)."""

    def check() -> bool:
        result.refresh()
        return bool(result.is_finished)

    wait_for(check, timeout=timeout, interval=0.05, message=f"task {result.id} to finish")
    return result


def status_is(result: Any, status: Any, timeout: float = 30.0) -> Any:
    def check() -> bool:
        result.refresh()
        return bool(result.status == status)

    wait_for(check, timeout=timeout, interval=0.05, message=f"task {result.id} to be {status}")
    return result


def burst(spawn_runner: Spawn, *args: str) -> None:
    proc = spawn_runner("--burst", *args)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output.decode()


@pytest.fixture
def signals_seen() -> Iterator[list[tuple[str, str, str]]]:
    """(signal, task result id, status) for every task signal this process sends."""
    seen: list[tuple[str, str, str]] = []

    def receiver(name: str) -> Callable[..., None]:
        def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
            seen.append((name, task_result.id, str(task_result.status)))
        return receive

    receivers = {name: receiver(name) for name in ("enqueued", "started", "finished")}
    task_enqueued.connect(receivers["enqueued"])
    task_started.connect(receivers["started"])
    task_finished.connect(receivers["finished"])
    yield seen
    task_enqueued.disconnect(receivers["enqueued"])
    task_started.disconnect(receivers["started"])
    task_finished.disconnect(receivers["finished"])


def _burst_while_connected(signal: Any, receiver: Callable[..., None]) -> None:
    """Drain what is due with an embedded ``--burst`` runner while ``receiver`` listens."""
    signal.connect(receiver)
    try:
        assert Runner(burst=True, cleanup=False, concurrency=1).run() == 0
    finally:
        signal.disconnect(receiver)


def test_backend_capabilities() -> None:
    backend = task_backends["default"]
    assert type(backend).__name__ == "PersistentJobsBackend"
    assert backend.supports_defer and backend.supports_async_task
    assert backend.supports_get_result and backend.supports_priority
    assert list(backend.check()) == []


def test_runjobs_runs_tasks_with_results_errors_and_attempts(spawn_runner: Spawn) -> None:
    added = tasks.add.enqueue(2, 3)
    echoed = tasks.echo.enqueue(1, (2, 3), name="x", nested={"k": [1.5, None]})
    flaky = tasks.flaky.enqueue(fail_until=2, note="second time lucky")
    failing = tasks.always_fails.enqueue()
    bad_result = tasks.returns_datetime.enqueue()
    async_result = tasks.async_sleep_add.enqueue(20, 22)
    assert added.status == TaskResultStatus.READY and added.enqueued_at is not None
    assert echoed.args == [1, [2, 3]]  # Django's JSON normalisation, before the task runs

    runner = spawn_runner("--concurrency", "4")
    try:
        for result in (added, echoed, flaky, failing, bad_result, async_result):
            finished(result)
    finally:
        runner.send_signal(signal.SIGTERM)
        runner.wait(30)

    assert added.status == TaskResultStatus.SUCCESSFUL and added.return_value == 5
    assert added.errors == [] and added.attempts == 1 and len(added.worker_ids) == 1
    assert added.enqueued_at <= added.started_at <= added.last_attempted_at <= added.finished_at
    assert echoed.return_value == {"args": [1, [2, 3]], "kwargs": {"name": "x",
                                                                   "nested": {"k": [1.5, None]}}}
    assert async_result.return_value == 42
    assert LedgerEntry.objects.filter(note="async 20+22").count() == 1

    # A failed attempt is retried; its writes rolled back with it, its error is kept.
    assert flaky.status == TaskResultStatus.SUCCESSFUL
    assert flaky.return_value == {"attempt": 2, "note": "second time lucky"}
    assert flaky.attempts == 2 and len(flaky.errors) == 1
    assert flaky.errors[0].exception_class is ValueError
    assert "planned failure on attempt 1" in flaky.errors[0].traceback
    assert flaky.started_at < flaky.last_attempted_at
    assert list(SideEffect.objects.filter(job_id=flaky.id).values_list("attempt", flat=True)) == [2]

    # Retries used up: FAILED with every attempt's exception class and traceback.
    assert failing.status == TaskResultStatus.FAILED and failing.attempts == 2
    assert [e.exception_class_path for e in failing.errors] == ["builtins.KeyError"] * 2
    assert "nope 2" in failing.errors[1].traceback and "Traceback" in failing.errors[1].traceback
    assert not SideEffect.objects.filter(job_id=failing.id).exists()
    with pytest.raises(ValueError, match="failed"):
        failing.return_value  # noqa: B018

    # A return value that would not round-trip fails the task with a clear error, at once.
    assert bad_result.status == TaskResultStatus.FAILED and bad_result.attempts == 1
    [error] = bad_result.errors
    assert error.exception_class_path == "django_persistent_jobs.backends.tasks.ResultError"
    assert "cannot be stored as JSON" in error.traceback


def test_timeout_fails_the_attempt_and_the_task_after_retries(spawn_runner: Spawn) -> None:
    slow = tasks.too_slow.enqueue(30)  # timeout=1, max_retries=1
    runner = spawn_runner("--concurrency", "2")
    try:
        finished(slow, timeout=60)
    finally:
        runner.kill()
        runner.wait(10)
    assert slow.status == TaskResultStatus.FAILED and slow.attempts == 2
    assert [e.exception_class for e in slow.errors] == [TimeoutError, TimeoutError]
    assert all("TIMEOUT" in e.traceback for e in slow.errors)


def test_priority_run_after_and_queues(spawn_runner: Spawn) -> None:
    low = tasks.record.using(priority=-50).enqueue("low")
    high = tasks.record.using(priority=100).enqueue("high")
    mid = tasks.record.enqueue("mid")
    later = tasks.record.using(run_after=timezone.now() + timedelta(hours=1)).enqueue("later")
    elsewhere = tasks.record.using(queue_name="tasks-other").enqueue("elsewhere")
    assert later.task.run_after is not None

    burst(spawn_runner, "--concurrency", "1", "--queues", "default")
    notes = list(LedgerEntry.objects.order_by("id").values_list("note", flat=True))
    assert notes == ["high", "mid", "low"]
    for result in (low, high, mid):
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL
    high.refresh()
    assert high.task.priority == 100
    later.refresh()
    elsewhere.refresh()
    assert later.status == elsewhere.status == TaskResultStatus.READY

    burst(spawn_runner, "--queues", "tasks-other")
    elsewhere.refresh()
    assert elsewhere.status == TaskResultStatus.SUCCESSFUL
    assert elsewhere.task.queue_name == "tasks-other"
    later.refresh()
    assert later.status == TaskResultStatus.READY


def test_a_result_read_back_by_id_keeps_the_tasks_run_after() -> None:
    when = (timezone.now() + timedelta(hours=2)).replace(microsecond=123456)
    later = tasks.record.using(run_after=when).enqueue("later")
    now = tasks.record.enqueue("now")
    backend = tasks.record.get_backend()
    assert backend.get_result(later.id).task.run_after == when
    assert async_to_sync(backend.aget_result)(later.id).task.run_after == when
    assert backend.get_result(now.id).task.run_after is None
    # The arguments the task gets are still only its own.
    assert backend.get_result(later.id).args == ["later"]


def test_a_run_after_with_an_offset_postgresql_cannot_read_is_stored_as_its_instant() -> None:
    """``run_after`` at UTC+16:00 (or with seconds in its offset) failed in PostgreSQL ("time
    zone displacement out of range") and broke the caller's transaction."""
    from datetime import timezone as tz

    from django_persistent_jobs.models import PersistentJob

    when = (timezone.now() + timedelta(hours=2)).astimezone(tz(timedelta(hours=16)))
    with transaction.atomic():
        later = tasks.record.using(run_after=when).enqueue("later")
        assert PersistentJob.objects.filter(id=later.id).count() == 1  # still usable
    assert PersistentJob.objects.get(id=later.id).next_run_at == when
    assert tasks.record.get_backend().get_result(later.id).task.run_after == when


def test_enqueue_joins_the_callers_transaction(signals_seen: list[Any]) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        doomed = tasks.add.enqueue(1, 1)
        assert tasks.add.get_result(doomed.id).status == TaskResultStatus.READY  # same txn
        raise Boom
    with pytest.raises(TaskResultDoesNotExist):
        tasks.add.get_result(doomed.id)
    assert signals_seen == []  # no task, no task_enqueued

    with transaction.atomic():
        kept = tasks.add.enqueue(1, 2)
        assert signals_seen == []  # not before the commit
    assert signals_seen == [("enqueued", kept.id, "READY")]
    assert tasks.add.get_result(kept.id).args == [1, 2]


def test_get_result_of_unknown_or_foreign_ids() -> None:
    for bad in (str(uuid.uuid4()), "not-a-uuid", ""):
        with pytest.raises(TaskResultDoesNotExist):
            task_backends["default"].get_result(bad)
    plain_job = enqueue("test.noop", {})
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(str(plain_job.id))
    result = tasks.add.enqueue(1, 2)
    from django_persistent_jobs.backends.compat import TASKS_PACKAGE

    mismatch = __import__(f"{TASKS_PACKAGE}.exceptions", fromlist=["x"]).TaskResultMismatch
    with pytest.raises(mismatch):
        tasks.echo.get_result(result.id)


def test_aenqueue_and_aget_result() -> None:
    result = async_to_sync(tasks.add.aenqueue)(20, 1)
    fetched = async_to_sync(tasks.add.aget_result)(result.id)
    assert fetched.id == result.id and fetched.status == TaskResultStatus.READY
    assert fetched.args == [20, 1]
    async_to_sync(fetched.arefresh)()
    assert fetched.status == TaskResultStatus.READY


def test_signals_context_and_atomic_completion_in_a_runner(
    start_runner: StartRunner, signals_seen: list[Any],
) -> None:
    """The runner sends task_started per attempt and task_finished once, after the outcome."""
    flaky = tasks.flaky.enqueue(fail_until=3, note="third")
    failing = tasks.always_fails.enqueue()
    start_runner(concurrency=2)
    finished(flaky)
    finished(failing)
    wait_for(lambda: sum(1 for s in signals_seen if s[0] == "finished") == 2, timeout=10,
             message="both task_finished signals")
    of_flaky = [(name, status) for name, rid, status in signals_seen if rid == flaky.id]
    assert of_flaky == [("enqueued", "READY"), ("started", "RUNNING"), ("started", "RUNNING"),
                        ("started", "RUNNING"), ("finished", "SUCCESSFUL")]
    of_failing = [(name, status) for name, rid, status in signals_seen if rid == failing.id]
    assert of_failing == [("enqueued", "READY"), ("started", "RUNNING"), ("started", "RUNNING"),
                          ("finished", "FAILED")]
    assert flaky.return_value == {"attempt": 3, "note": "third"}
    assert LedgerEntry.objects.filter(job_id=flaky.id).count() == 1


def test_rescue_after_sigkill_finishes_successful(spawn_runner: Spawn) -> None:
    result = tasks.hang_first.enqueue(60)
    doomed = spawn_runner("--concurrency", "1")
    status_is(result, TaskResultStatus.RUNNING, timeout=30)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    survivor = spawn_runner("--concurrency", "1")
    try:
        finished(result, timeout=60)
    finally:
        survivor.send_signal(signal.SIGTERM)
        survivor.wait(30)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == "done on attempt 2"
    assert result.attempts == 2 and len(set(result.worker_ids)) == 2
    [lost] = result.errors
    assert "RUNNER_LOST" in lost.traceback


def test_dedup_option_returns_the_waiting_task() -> None:
    first = tasks.refresh_user.enqueue(7)
    again = tasks.refresh_user.enqueue(7)
    other = tasks.refresh_user.enqueue(8)
    assert first.id == again.id != other.id


def test_a_skipped_duplicate_returns_the_waiting_task_as_it_is_and_is_not_announced() -> None:
    """Skip dedup inserted nothing: the result is the waiting task's (its own arguments), and
    ``task_enqueued`` is not sent a second time for it."""
    heard: list[Any] = []

    def hear(task_result: Any, **kwargs: Any) -> None:
        heard.append((task_result.id, list(task_result.args)))

    task_enqueued.connect(hear)
    try:
        first = tasks.one_at_a_time.enqueue(1)
        again = tasks.one_at_a_time.enqueue(2)
    finally:
        task_enqueued.disconnect(hear)
    assert again.id == first.id
    assert list(again.args) == [1] and again.status == TaskResultStatus.READY
    assert heard == [(first.id, [1])]


def test_a_failing_receiver_does_not_hide_the_tasks_own_error() -> None:
    """A ``task_finished`` receiver that raises, for a task failing for good: the task's own
    exception is what its result records (the receiver's error is logged)."""

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("a receiver's bug")

    result = tasks.fails_for_good.enqueue()
    _burst_while_connected(task_finished, broken)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"]


def test_task_finished_for_a_failure_comes_after_the_failure_is_recorded() -> None:
    """The task fails for good: ``task_finished`` is sent once the runner has recorded the
    ending, outside the task's transaction (which the failure rolls back). A receiver sees
    the job's row ended, and what it writes stays written."""
    from django_persistent_jobs.models import PersistentJob

    seen: list[tuple[str, str]] = []

    def record(task_result: Any, **kwargs: Any) -> None:
        seen.append((str(task_result.status),
                     PersistentJob.objects.get(id=task_result.id).status))
        LedgerEntry.objects.create(job_id=task_result.id, note="told of the failure")

    result = tasks.fails_for_good.enqueue()
    _burst_while_connected(task_finished, record)
    assert seen == [("FAILED", "dead_lettered")]
    assert LedgerEntry.objects.filter(job_id=result.id, note="told of the failure").exists()


def _plain() -> None: ...


def _needs_args(x: int) -> None: ...


def _gen() -> Any:
    yield 1


def test_bad_definitions_and_arguments_fail_early() -> None:
    with pytest.raises(TypeError, match=r"Unknown @task option.*'max_retry'.*max_retries"):
        task(max_retry=3)(_plain)
    with pytest.raises(InvalidTask, match="max_retries must be an integer"):
        task(max_retries=-1)(_plain)
    with pytest.raises(InvalidTask, match=r"backoff is called as backoff\(attempt\)"):
        task(backoff=lambda: 5)(_plain)
    with pytest.raises(InvalidTask, match="timezone is the zone a cron expression is read in"):
        task(timezone="Europe/Berlin")(_plain)
    # A fixed dedup_key every enqueue would refuse is refused with the definition.
    with pytest.raises(InvalidTask, match=r"dedup_key must be a string of 1\.\.255 characters"):
        task(dedup_key="k" * 300)(_plain)
    with pytest.raises(InvalidTask, match="dedup_key 'a\\\\x00' contains a NUL character"):
        task(dedup_key="a\x00")(_plain)
    with pytest.raises(InvalidTask, match=r"dedup_key must be a string of 1\.\.255 characters"):
        task(dedup_key="")(_plain)
    with pytest.raises(InvalidTask, match="unknown time zone"):
        task(cron="0 * * * *", timezone="Mars/Olympus")(_plain)
    with pytest.raises(InvalidTask, match="takes required arguments"):
        task(cron="*/5 * * * *")(_needs_args)
    with pytest.raises(InvalidTask, match="generator"):
        task()(_gen)
    with pytest.raises(InvalidTask, match="Queue 'nope'"):
        tasks.add.using(queue_name="nope")

    with pytest.raises(PayloadError, match="args"):
        tasks.echo.enqueue(timezone.now())
    with pytest.raises(PayloadError, match="NaN"):
        tasks.echo.enqueue(float("nan"))


def test_a_call_the_task_cannot_take_is_refused_at_enqueue_writing_nothing() -> None:
    """Arguments the function cannot bind were accepted, then every attempt failed with a
    ``TypeError`` (HANDLER_ERROR, retried) until the task was dead-lettered."""
    from django_persistent_jobs.backends.tasks import TaskArgumentsError
    from django_persistent_jobs.errors import EnqueueError
    from django_persistent_jobs.models import PersistentJob

    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
        (tasks.add, (1,), {}),  # missing b
        (tasks.add, (1, 2, 3), {}),  # extra positional
        (tasks.add, (1, 2), {"a": 3}),  # a given twice
        (tasks.add, (1,), {"c": 2}),  # unknown keyword
        (tasks.record, (), {}),  # a context task: the context is not the caller's to pass
        (tasks.record, ("x",), {"context": None}),
        (tasks.refresh_user, (), {}),  # before its dedup_key callable is called
    ]
    for declared, args, kwargs in calls:
        with pytest.raises(TaskArgumentsError) as info:
            declared.enqueue(*args, **kwargs)
        message = str(info.value)
        assert message.startswith(f"task {declared.module_path} cannot be called with these "
                                  "arguments: "), message
        assert isinstance(info.value, TypeError) and isinstance(info.value, EnqueueError)
    assert "missing a required argument: 'b'" in _refusal(tasks.add, 1)
    assert "multiple values for argument 'a'" in _refusal(tasks.add, 1, 2, a=3)
    assert "too many positional arguments" in _refusal(tasks.add, 1, 2, 3)
    assert PersistentJob.objects.count() == 0
    # What the function can take still goes in.
    assert tasks.add.enqueue(1, b=2).kwargs == {"b": 2}
    assert tasks.echo.enqueue(1, 2, x=3).args == [1, 2]
    assert tasks.record.enqueue(label="y").kwargs == {"label": "y"}


def _refusal(declared: Any, *args: Any, **kwargs: Any) -> str:
    from django_persistent_jobs.backends.tasks import TaskArgumentsError

    with pytest.raises(TaskArgumentsError) as info:
        declared.enqueue(*args, **kwargs)
    return str(info.value)


def test_a_recurring_task_is_a_schedule_run_by_the_runner(start_runner: StartRunner) -> None:
    from django_persistent_jobs import run_schedule_now
    from django_persistent_jobs.handlers import registry
    from django_persistent_jobs.models import JobSchedule
    from django_persistent_jobs.schedules.firing import sync_code_schedules

    with registry.isolated():
        from tests.testapp import recurring_tasks

        name = recurring_tasks.nightly.module_path
        sync_code_schedules()
        schedule = JobSchedule.objects.get(name=name)
        assert (schedule.cron, schedule.timezone) == ("0 3 * * *", "Europe/Paris")
        job = run_schedule_now(name)
        result = recurring_tasks.nightly.get_result(str(job.id))
        assert result.args == [] and result.kwargs == {}
        runner = start_runner(concurrency=1)
        finished(result)
        assert result.return_value == "tick"
        runner.request_stop()
        runner.finished.wait(30)


def test_a_cancelled_task_is_failed() -> None:
    from django_persistent_jobs import cancel_job

    result = tasks.add.enqueue(1, 1)
    cancel_job(result.id)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.errors == []
    with pytest.raises(ValueError, match="failed"):
        result.return_value  # noqa: B018


def test_check_reports_bad_backend_options() -> None:
    from django_persistent_jobs.backends import InProcessBackend, PersistentJobsBackend

    durable = PersistentJobsBackend("bad", {"OPTIONS": {"BOGUS": 1, "MODULES": "myapp.tasks"}})
    assert sorted(m.id for m in durable.check()) == ["persistent_jobs.E203",
                                                     "persistent_jobs.E204"]
    local = InProcessBackend("bad", {"OPTIONS": {"WORKERS": 0}})
    assert [m.id for m in local.check()] == ["persistent_jobs.E205"]


@pytest.mark.parametrize("change", [{"priority": 5.0}, {"priority": True},
                                    {"queue_name": "q" * 101}, {"queue_name": "bad\x00"}],
                         ids=["float-priority", "bool-priority", "long-queue", "nul-queue"])
def test_a_using_copy_with_an_unstorable_option_is_an_invalid_task(
    change: dict[str, Any], settings: Any,
) -> None:
    """The copy of a registered task skips the handler checks; what a copy can change is still
    refused as InvalidTask at ``using()``, not as an EnqueueError at enqueue."""
    settings.TASKS = {**settings.TASKS, "default": {**settings.TASKS["default"], "QUEUES": []}}
    with pytest.raises(InvalidTask, match=r"priority|queue_name"):
        tasks.add.using(**change)
    assert tasks.add.using(priority=5, queue_name="q" * 100).priority == 5


def test_misconfigured_backend_options_are_check_errors_not_tracebacks(settings: Any) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from django_persistent_jobs.backends import InProcessBackend, PersistentJobsBackend
    from django_persistent_jobs.backends.discovery import discover_tasks

    durable = {"BACKEND": "django_persistent_jobs.backends.PersistentJobsBackend"}
    settings.TASKS = {"default": {**durable, "OPTIONS": {"MODULES": [1, "no_such_pkg.tasks",
                                                                     "tests.testapp.tasks"]}}}
    discover_tasks()  # imports what exists, skips what the check reports
    ids = [m.id for m in task_backends["default"].check()]
    assert ids == ["persistent_jobs.E204"]
    listed = PersistentJobsBackend("d", {"OPTIONS": {"MODULES": ["no_such_pkg.tasks"]}})
    [missing] = listed.check()
    assert missing.id == "persistent_jobs.E206" and "no_such_pkg.tasks" in missing.msg

    local = InProcessBackend("bad", {"OPTIONS": {"WORKERS": "x", "MAX_RESULTS": 2.5,
                                                 "DATABASE": "nope"}})
    assert (local.workers, local.max_results) == (4, 10_000)
    assert sorted(m.id for m in local.check()) == ["persistent_jobs.E205", "persistent_jobs.E205",
                                                   "persistent_jobs.E207"]
    with pytest.raises(ImproperlyConfigured, match="'nope'"):
        local._alias()


def test_the_task_api_comes_from_django_or_the_backport() -> None:
    """Django 6+: django.tasks; Django 5.2: the django-tasks backport (same backend classes)."""
    import django

    from django_persistent_jobs.backends.compat import TASKS_PACKAGE

    expected = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
    assert expected == TASKS_PACKAGE
    assert type(tasks.add).__mro__[1].__module__ == f"{expected}.base"


def test_task_finished_is_sent_when_the_last_attempt_times_out(
    start_runner: StartRunner, signals_seen: list[Any],
) -> None:
    """A timeout is recorded by the supervisor, not by the task's code: task_finished still
    arrives, once, with the FAILED result."""
    slow = tasks.too_slow.enqueue(30)  # timeout=1, max_retries=1: two timeouts, then FAILED
    start_runner(concurrency=1)
    finished(slow, timeout=60)
    wait_for(lambda: any(s[0] == "finished" and s[1] == slow.id for s in signals_seen),
             timeout=10, message="task_finished for the timed-out task")
    of_slow = [(name, status) for name, rid, status in signals_seen if rid == slow.id]
    assert of_slow == [("enqueued", "READY"), ("started", "RUNNING"), ("started", "RUNNING"),
                       ("finished", "FAILED")]


def test_task_finished_is_sent_when_a_cancelled_task_then_times_out(
    start_runner: StartRunner, signals_seen: list[Any],
) -> None:
    """An operator cancels a running task that ignores the request and times out: the job
    ends ``cancelled`` (a cancel request wins over the retry), outside the task's code, and
    ``task_finished`` still arrives, once, with the FAILED result."""
    from django_persistent_jobs import cancel_job
    from django_persistent_jobs.models import PersistentJob

    slow = tasks.too_slow.enqueue(30)  # timeout=1: times out unless it ends first
    start_runner(concurrency=1)
    status_is(slow, TaskResultStatus.RUNNING, timeout=30)
    cancel_job(slow.id)
    finished(slow, timeout=30)
    job = PersistentJob.objects.get(id=slow.id)
    assert (job.status, job.last_error_code) == ("cancelled", "TIMEOUT")
    wait_for(lambda: any(s[0] == "finished" and s[1] == slow.id for s in signals_seen),
             timeout=10, message="task_finished for the cancelled, timed-out task")
    assert [(name, status) for name, rid, status in signals_seen if rid == slow.id] == [
        ("enqueued", "READY"), ("started", "RUNNING"), ("finished", "FAILED")]


@pytest.mark.parametrize(("bad", "reported"), [
    ({"DATABASE": "nope"}, "persistent_jobs.E012"),
    ("not a dict", "persistent_jobs.E001"),
])
def test_check_with_a_bad_database_setting_reports_it_instead_of_crashing(
    bad: Any, reported: str,
) -> None:
    from django.core import checks
    from django.test import override_settings

    from django_persistent_jobs.backends import PersistentJobsBackend

    with override_settings(PERSISTENT_JOBS=bad):
        assert PersistentJobsBackend("default", {}).check() == []
        ids = {m.id for m in checks.run_checks()}
    assert reported in ids


def test_every_backend_check_has_a_hint() -> None:
    from django_persistent_jobs.backends import InProcessBackend, PersistentJobsBackend

    messages = [
        *PersistentJobsBackend("bad", {"OPTIONS": {"BOGUS": 1, "MODULES": "x"}}).check(),
        *InProcessBackend("bad", {"OPTIONS": {"WORKERS": 0}}).check(),
    ]
    assert messages and all(m.hint for m in messages)


def test_a_keyboard_interrupt_from_a_task_fails_it_and_the_runner_goes_on(
    start_runner: StartRunner, signals_seen: list[Any],
) -> None:
    """``KeyboardInterrupt`` raised by a task is the task's failure, like any exception (no
    signal raises it on a worker thread): its one attempt ends FAILED, announced once, and the
    runner runs the next task. It used to stop the runner, the attempt left unsettled."""
    stopped = tasks.interrupted.enqueue()
    after = tasks.one_try.enqueue(5)
    runner = start_runner(concurrency=1)
    wait_for(lambda: stopped.refresh() is None and stopped.status == TaskResultStatus.FAILED,
             message="the interrupted task to fail")
    assert [e.exception_class_path for e in stopped.errors] == ["builtins.KeyboardInterrupt"]
    wait_for(lambda: after.refresh() is None and after.status == TaskResultStatus.SUCCESSFUL,
             message="the next task to run")
    assert [s[0] for s in signals_seen if s[1] == stopped.id] == [
        "enqueued", "started", "finished"]
    assert not runner.finished.is_set()


def test_tasks_and_results_pickle_with_callable_options() -> None:
    """Django 6.1 pickles Task and TaskResult; ours carry options pickle cannot (a backoff
    closure, a dedup_key lambda), which ``using()`` cannot change: they come back from the
    module-level task, and Django's per-call options travel with the copy."""
    import pickle

    when = timezone.now() + timedelta(hours=1)
    copy = tasks.flaky.using(priority=7, queue_name="tasks-other", run_after=when)
    back = pickle.loads(pickle.dumps(copy))
    assert back == copy and back.backoff is tasks.flaky.backoff
    assert (back.priority, back.queue_name, back.run_after) == (7, "tasks-other", when)
    assert pickle.loads(pickle.dumps(tasks.refresh_user)) == tasks.refresh_user

    result = tasks.refresh_user.enqueue(41)
    fetched = tasks.refresh_user.get_result(result.id)
    for original in (result, fetched):
        again = pickle.loads(pickle.dumps(original))
        assert (again.id, again.task, again.args, again.status) == (
            original.id, tasks.refresh_user, [41], TaskResultStatus.READY)


def test_a_failing_task_started_receiver_still_ends_with_task_finished(
    signals_seen: list[Any],
) -> None:
    """A ``task_started`` receiver that raises fails the attempt like the task's own error
    would (as in ``InProcessBackend``); on the last attempt ``task_finished`` still follows,
    FAILED, with the receiver's exception as the error."""
    result = tasks.one_try.enqueue(5)

    def broken(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if task_result.id == result.id:
            raise RuntimeError("a task_started receiver's bug")

    _burst_while_connected(task_started, broken)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["builtins.RuntimeError"]
    assert [(name, status) for name, rid, status in signals_seen if rid == result.id] == [
        ("enqueued", "READY"), ("started", "RUNNING"), ("finished", "FAILED")]


_CHECKS_WITHOUT_THE_BACKPORT_APP = """
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django_persistent_jobs"],
    DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "unused"}},
    TASKS={"default": {"BACKEND": "django_persistent_jobs.backends.PersistentJobsBackend",
                       "OPTIONS": {"BOGUS": 1}}},
)
django.setup()
from django.core import checks
print(sorted(m.id for m in checks.run_checks()))
"""


def test_django_52_without_the_backport_app_is_a_check_error() -> None:
    """On Django 5.2 the check that runs each task backend's own checks (E201-E207) is
    registered by the ``django_tasks`` app: without it in INSTALLED_APPS a misconfigured
    backend passed ``check`` silently. Our own check says the app is missing."""
    import subprocess
    import sys

    import django

    if django.VERSION >= (6, 0):
        pytest.skip("Django 6 has django.tasks built in")
    done = subprocess.run([sys.executable, "-c", _CHECKS_WITHOUT_THE_BACKPORT_APP],
                          capture_output=True, text=True, timeout=60, check=True)
    assert "persistent_jobs.E208" in done.stdout, done.stdout + done.stderr


def test_django_52_without_the_backport_installed_says_to_install_it() -> None:
    """Without the ``django-tasks`` package at all, the check says to install the extra (the
    first import of a task module would only say ``No module named 'django.tasks'``)."""
    import subprocess
    import sys

    import django

    if django.VERSION >= (6, 0):
        pytest.skip("Django 6 has django.tasks built in")
    script = _CHECKS_WITHOUT_THE_BACKPORT_APP.replace(
        "from django.core import checks\nprint(sorted(m.id for m in checks.run_checks()))",
        "from django.core import checks\n"
        "print([m.hint for m in checks.run_checks() if m.id == 'persistent_jobs.E208'])")
    blocked = "import sys\nsys.modules['django_tasks'] = None  # not installed\n" + script
    done = subprocess.run([sys.executable, "-c", blocked],
                          capture_output=True, text=True, timeout=60, check=True)
    assert "pip install 'django-persistent-jobs[tasks]'" in done.stdout, (
        done.stdout + done.stderr)
