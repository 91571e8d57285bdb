"""``PersistentJobsBackend``: ``django.tasks`` on our jobs table, run by ``runjobs``.

A task is a job whose type is the task's module path and whose payload is
``{"args": [...], "kwargs": {...}}`` (plus ``run_after`` when given). The backend registers an
adapter handler for each task when the task is defined (``@task`` validates it with the
backend), so the runner executes tasks
through the same path as every other job: the task's database writes and the fenced completion
commit together, failures retry with backoff, timeouts and rescue apply, and exhausted tasks are
dead-lettered. Nothing here writes SQL: enqueueing goes through ``enqueue()``, results are read
with the ORM.
"""

from __future__ import annotations

import logging
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.core import checks
from django.db import connections, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from .. import bounds, conf
from ..context import JobContext
from ..errors import ConfigurationError, DuplicateHandlerError, JobCancelledError, JobError
from ..handlers import OPTION_INVALID, HandlerSpec, check_options, code_location, registry
from ..signals import job_finished
from .compat import (
    TASK_MAX_PRIORITY,
    TASK_MIN_PRIORITY,
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)
from .tasks import (
    PersistentTask,
    dedup_key_for,
    encode_arguments,
    encode_result,
    refuse_generators,
    required_parameters,
    task_options,
)

logger = logging.getLogger("django_persistent_jobs.tasks")

#: Final failures a task's own code raised, waiting for the runner to record the job's ending:
#: (job id, attempt) -> (the backend's class, the result to announce). ``task_finished`` is
#: sent from ``_relay_final_ending`` once that ending has committed, not inside the task's
#: transaction, which the failure rolls back with whatever a receiver wrote. Bounded: an
#: attempt whose claim was lost meanwhile never hears of its ending here.
_pending_failures: dict[tuple[uuid.UUID, int], tuple[Any, Any]] = {}
_pending_lock = threading.Lock()
_PENDING_LIMIT = 1000

if TYPE_CHECKING:
    from .compat import AnyTask, AnyTaskResult

#: Job status -> TaskResult status. A failed attempt awaiting its retry is READY again.
STATUS_MAP: dict[str, Any] = {
    "pending": TaskResultStatus.READY,
    "failed": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "completed": TaskResultStatus.SUCCESSFUL,
    "dead_lettered": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}

#: Attempts that ended without an exception in the task's own code carry no exception class;
#: ``TaskError.exception_class`` must still import, so they name one by their error code.
_CODE_CLASSES = {
    "TIMEOUT": "builtins.TimeoutError",
    "RUNNER_LOST": "django_persistent_jobs.errors.TransientJobError",
    "CANCELLED": "django_persistent_jobs.errors.JobCancelledError",
}
_NOT_ERRORS = ("completed", "running", "interrupted")

#: job type -> the Task it runs, filled when tasks are validated.
_tasks: dict[str, AnyTask] = {}


def _alias() -> str:
    return conf.settings.DATABASE


def job_type_of(task: AnyTask) -> str:
    return str(task.module_path)


def task_for_job_type(job_type: str) -> AnyTask | None:
    """The Task behind a job type: registered, or found by importing its module path."""
    known = _tasks.get(job_type)
    if known is not None:
        return known
    try:
        found = import_string(job_type)
    except (ImportError, ValueError):
        return None
    return found if isinstance(found, Task) else None


def _declared_backend_elsewhere(task: AnyTask) -> str | None:
    """The backend the module-level task behind ``task`` is declared for, if that one is not
    a durable backend: a ``using(backend=...)`` copy sent here would be a job whose type no
    runner registers (a runner registers what importing the module declares)."""
    module, _, name = str(task.module_path).rpartition(".")
    declared = getattr(sys.modules.get(module), name, None)
    if not isinstance(declared, Task) or declared.func is not task.func:
        return None  # (not a module-level task, or being declared right now)
    if declared.backend == task.backend:
        return None
    try:
        if isinstance(task_backends[declared.backend], PersistentJobsBackend):
            return None
    except Exception:
        return None  # (a misconfigured alias: Django's own checks say so)
    return str(declared.backend)


def _clamp_priority(value: int) -> int:
    return max(TASK_MIN_PRIORITY, min(TASK_MAX_PRIORITY, int(value)))


def _is_final_failure(exc: BaseException, ctx: JobContext) -> bool:
    """Whether the runner will end the job on this exception (so ``task_finished`` is due)."""
    from ..runner.execute import JobInterrupted

    if isinstance(exc, JobInterrupted):  # a timeout or hand-back: recorded by the supervisor
        return False
    if isinstance(exc, JobCancelledError) or ctx.cancel_requested:
        return True
    if isinstance(exc, JobError) and not exc.transient:
        return True
    return ctx.is_last_attempt


class PersistentJobsBackend(BaseTaskBackend):
    """The durable ``django.tasks`` backend: tasks are jobs, run by ``runjobs``.

    ``OPTIONS``: ``MODULES``, modules to import when the app is ready besides every installed
    app's ``tasks`` module (a runner must have imported a task to claim it).
    """

    task_class = PersistentTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    #: Keys accepted in OPTIONS.
    option_keys: tuple[str, ...] = ("MODULES",)

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.options = dict(self.options or {})

    # --- validation and registration ---------------------------------------------------------
    def validate_task(self, task: AnyTask) -> None:
        """Django's checks, then ours; registers the task's handler so runners can claim it."""
        super().validate_task(task)
        elsewhere = _declared_backend_elsewhere(task)
        if elsewhere is not None:
            raise InvalidTask(
                f"Task {task.module_path} is declared for backend {elsewhere!r}: runners import "
                f"it from there and have no handler for it, so enqueued on {self.alias!r} it "
                f"would never run. Declare it with @task(backend={self.alias!r}), or define a "
                "second task for this backend.")
        # What a ``using()`` copy may change, checked before the shortcut below (which skips
        # the handler checks for a copy of a registered task): refused here as InvalidTask,
        # the error Django's API promises, not as an EnqueueError at enqueue time.
        problems = [p for p in (bounds.queue_problem(task.queue_name, "queue_name"),
                                bounds.priority_problem(task.priority)) if p is not None]
        if problems:
            raise InvalidTask(f"Task {task.module_path}: {' '.join(problems)}")
        known = _tasks.get(job_type_of(task))
        if known is not None and known.func is task.func and (
            task_options(known) == task_options(task) and job_type_of(task) in registry
        ):
            return  # this task (or a ``using()`` copy of it) was validated and registered
        refuse_generators(task)
        spec = self._handler_spec(task)
        if spec.errors:
            raise InvalidTask("; ".join(spec.errors))
        if spec.is_recurring and required_parameters(task):
            raise InvalidTask(
                f"Recurring task {task.module_path} (cron/interval) takes required arguments "
                f"{required_parameters(task)}; a scheduled run passes none."
            )
        self._register(task, spec)

    def _handler_spec(self, task: AnyTask) -> HandlerSpec:
        options = task_options(task)
        dedup = options["dedup"]
        spec = HandlerSpec(
            job_type=job_type_of(task), func=_adapter(task), origin=task.module_path,
            max_retries=options["max_retries"], timeout=options["timeout"],
            dedup=str(getattr(dedup, "value", dedup)) if dedup is not None else None,
            backoff=options["backoff"], queue=task.queue_name, priority=task.priority,
            cron=options["cron"], interval=options["interval"],
            schedule_payload={"args": [], "kwargs": {}} if (
                options["cron"] or options["interval"]) else None,
            timezone=options["timezone"], location=code_location(task.func), returns_json=True,
        )
        problems = check_options(spec, subject=f"task {task.module_path}")
        if options["dedup_key"] is not None and not (
            isinstance(options["dedup_key"], str) or callable(options["dedup_key"])
        ):
            problems.append((OPTION_INVALID, f"task {task.module_path}: dedup_key must be a "
                             "string or a callable (*args, **kwargs) -> str."))
        elif isinstance(options["dedup_key"], str):
            # A fixed key is checked now, not refused by every enqueue of the task.
            problem = bounds.dedup_key_problem(options["dedup_key"])
            if problem is not None:
                problems.append((OPTION_INVALID, f"task {task.module_path}: {problem}"))
        spec.problems = problems
        return spec

    def _register(self, task: AnyTask, spec: HandlerSpec) -> None:
        existing = registry.get(spec.job_type)
        if existing is not None and existing.origin == spec.origin and (
            existing.location == spec.location and spec.job_type in _tasks
        ):
            return  # already registered (``using()`` copies share the defined task's handler)
        try:
            registry.register(spec)
        except DuplicateHandlerError as exc:
            raise InvalidTask(str(exc)) from exc
        _tasks[spec.job_type] = task
        # Connected with the first task, not at import: the module is imported whenever
        # settings.TASKS is looked at, and a connected receiver makes every job of every
        # runner pay for ``job_started``/``job_finished`` (timing, dispatch).
        job_finished.connect(_relay_final_ending, weak=False, dispatch_uid=_RELAY_UID)

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        from django.apps import apps

        messages: list[checks.CheckMessage] = []
        if not apps.is_installed("django_persistent_jobs"):
            messages.append(checks.Error(
                f"Task backend {self.alias!r} needs 'django_persistent_jobs' in INSTALLED_APPS.",
                hint="Add 'django_persistent_jobs' to INSTALLED_APPS and run migrate.",
                id="persistent_jobs.E201",
            ))
        try:
            alias = _alias()
        except ConfigurationError:
            alias = None  # the settings check reports it (E001, E012) with its hint
        vendor = None if alias is None else connections[alias].vendor
        if vendor is not None and vendor != "postgresql":
            messages.append(checks.Error(
                f"Task backend {self.alias!r} needs PostgreSQL; database "
                f"{alias!r} is {vendor}.",
                hint="Point PERSISTENT_JOBS['DATABASE'] at a PostgreSQL database.",
                id="persistent_jobs.E202",
            ))
        unknown = sorted(set(self.options) - set(self.option_keys))
        if unknown:
            messages.append(checks.Error(
                f"Task backend {self.alias!r} has unknown OPTIONS {unknown}.",
                hint=f"Accepted: {list(self.option_keys)}.", id="persistent_jobs.E203",
            ))
        modules = self.options.get("MODULES", [])
        if not isinstance(modules, list | tuple) or not all(isinstance(m, str) for m in modules):
            messages.append(checks.Error(
                f"Task backend {self.alias!r}: OPTIONS['MODULES'] must be a list of module "
                "paths.", hint="For example ['myapp.tasks'].", id="persistent_jobs.E204",
            ))
        else:
            from .discovery import missing_modules

            for module in modules:
                if module in missing_modules:
                    messages.append(checks.Error(
                        f"Task backend {self.alias!r}: OPTIONS['MODULES'] names {module!r}, "
                        f"which cannot be imported ({missing_modules[module]}).",
                        hint="Fix the module path, or remove it from MODULES.",
                        id="persistent_jobs.E206",
                    ))
        return messages

    # --- enqueue -----------------------------------------------------------------------------
    def enqueue(self, task: AnyTask, args: Any, kwargs: Any) -> AnyTaskResult:
        """Insert the task's job in the caller's transaction (rollback: no task, no wake-up)."""
        from ..enqueuing import enqueue

        self.validate_task(task)
        payload = encode_arguments(task, args, kwargs)
        if task.run_after is not None:
            # Kept beside the arguments: ``next_run_at`` moves with each retry, and a result
            # read back by id (another process, a later request) must show the task as enqueued.
            payload[RUN_AFTER_KEY] = task.run_after.isoformat()
        job = enqueue(
            job_type_of(task), payload, run_at=task.run_after, queue=task.queue_name,
            priority=task.priority,
            dedup_key=dedup_key_for(task, payload["args"], payload["kwargs"]),
        )
        if not getattr(job, "_pj_created", True):
            # Skip dedup: an active task holds the key and nothing was inserted. Its result,
            # with its own arguments; ``task_enqueued`` was sent for it when it was enqueued.
            return build_result(self, task, job, list(job.attempt_set.all()))
        result: AnyTaskResult = TaskResult(
            task=task, id=str(job.id), status=STATUS_MAP.get(job.status, TaskResultStatus.READY),
            enqueued_at=job.__dict__.get("created_at"), started_at=None, finished_at=None,
            last_attempted_at=None, args=payload["args"], kwargs=payload["kwargs"],
            backend=self.alias, errors=[], worker_ids=[],
        )
        # Receivers hear of the task once it exists for everyone: after the enqueuing
        # transaction commits (at once in autocommit), never after a rollback.
        transaction.on_commit(
            lambda: task_enqueued.send(sender=type(self), task_result=result), using=_alias(),
        )
        return result

    # --- results -----------------------------------------------------------------------------
    def get_result(self, result_id: str) -> AnyTaskResult:
        from ..models import PersistentJob

        try:
            key = uuid.UUID(str(result_id))
        except (ValueError, TypeError, AttributeError):
            raise TaskResultDoesNotExist(result_id) from None
        job = PersistentJob.objects.using(_alias()).filter(pk=key).first()
        if job is None:
            raise TaskResultDoesNotExist(result_id)
        task = task_for_job_type(job.job_type)
        if task is None or not isinstance(job.payload, dict) or "args" not in job.payload:
            raise TaskResultDoesNotExist(result_id)
        return build_result(self, task, job, list(job.attempt_set.all()))


def _attempt_error(attempt: Any) -> TaskError:
    path = attempt.error_class or _CODE_CLASSES.get(
        attempt.error_code, "django_persistent_jobs.errors.JobError")
    trace = attempt.traceback or f"{attempt.error_code}: {attempt.error_message}"
    return TaskError(exception_class_path=path, traceback=trace)


#: The payload key that keeps a task's ``run_after`` (ISO 8601, aware) for results read by id.
RUN_AFTER_KEY = "run_after"


def _run_after(payload: Any) -> datetime | None:
    """The ``run_after`` the task was enqueued with, or None (none given, or a job enqueued
    before it was kept)."""
    text = payload.get(RUN_AFTER_KEY) if isinstance(payload, dict) else None
    if not isinstance(text, str):
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        return None
    return value if value.tzinfo is not None else None


def build_result(
    backend: BaseTaskBackend, task: AnyTask, job: Any, attempts: list[Any],
) -> AnyTaskResult:
    """A TaskResult from a job row and its attempt rows."""
    try:
        shown = task.using(priority=_clamp_priority(job.priority), queue_name=job.queue,
                           backend=backend.alias, run_after=_run_after(job.payload))
    except Exception:  # an operator moved the job to a queue this backend does not list
        shown = task
    counted = [a for a in attempts if a.outcome != "interrupted"]
    status = STATUS_MAP.get(job.status, TaskResultStatus.READY)
    result: AnyTaskResult = TaskResult(
        task=shown, id=str(job.id), status=status, enqueued_at=job.created_at,
        started_at=counted[0].started_at if counted else None,
        finished_at=job.finished_at if status in (
            TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED) else None,
        last_attempted_at=counted[-1].started_at if counted else None,
        args=job.payload.get("args", []), kwargs=job.payload.get("kwargs", {}),
        backend=backend.alias,
        errors=[_attempt_error(a) for a in counted if a.outcome not in _NOT_ERRORS],
        worker_ids=[a.runner_id for a in counted],
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", job.result)
    return result


def _adapter(task: AnyTask) -> Callable[[Any, JobContext], Any]:
    """The handler the runner calls for ``task``'s jobs: call the task, return JSON text."""

    def run_task(payload: Any, ctx: JobContext) -> str:
        from ..models import JobAttempt, PersistentJob

        backend = task.get_backend()
        alias = _alias()
        args = list(payload.get("args", [])) if isinstance(payload, dict) else []
        kwargs = dict(payload.get("kwargs", {})) if isinstance(payload, dict) else {}
        # The job's row as it is now (status running, this attempt included), read on the
        # handler's own connection and transaction.
        job = PersistentJob.objects.using(alias).get(pk=ctx.job_id)
        attempts = list(JobAttempt.objects.using(alias).filter(job_id=ctx.job_id))
        task_result = build_result(backend, task, job, attempts)
        try:
            # Inside the ``try``: a receiver that raises fails the attempt like the task's own
            # error (as in InProcessBackend), and a final failure still sends task_finished.
            task_started.send(sender=type(backend), task_result=task_result)
            if task.takes_context:
                value = task.call(TaskContext(task_result=task_result), *args, **kwargs)
            else:
                value = task.call(*args, **kwargs)
            stored, text = encode_result(task, value)
        except BaseException as exc:
            if _is_final_failure(exc, ctx):
                now = timezone.now()
                cls = type(exc)
                task_result.errors.append(TaskError(
                    exception_class_path=f"{cls.__module__}.{cls.__qualname__}",
                    traceback=_format(exc),
                ))
                object.__setattr__(task_result, "status", TaskResultStatus.FAILED)
                object.__setattr__(task_result, "finished_at", now)
                if task_finished.receivers:
                    with _pending_lock:
                        if len(_pending_failures) >= _PENDING_LIMIT:
                            del _pending_failures[next(iter(_pending_failures))]
                        _pending_failures[(ctx.job_id, ctx.attempt)] = (type(backend),
                                                                        task_result)
            raise
        object.__setattr__(task_result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(task_result, "_return_value", stored)

        def finished() -> None:
            object.__setattr__(task_result, "finished_at", timezone.now())
            task_finished.send(sender=type(backend), task_result=task_result)

        # Sent once the completion has committed; a lost claim rolls back and sends nothing.
        transaction.on_commit(finished, using=alias)
        return text

    run_task.__qualname__ = f"run_task[{task.module_path}]"
    return run_task


def _relay_final_ending(sender: Any, *, job_id: uuid.UUID, job_type: str, status: str | None,
                        outcome: str, **kwargs: Any) -> None:
    """Send ``task_finished`` for a task whose last attempt has ended, once it is on record.

    A failure the task's own code raised is prepared by the adapter (``_pending_failures``)
    and sent here, after the runner recorded it. A timeout, a lost runner or worker, or a
    charged hand-back is recorded by the runner's supervisor or by another runner instead, so
    this receiver of our ``job_finished`` sends it. It reads the rows and calls receivers on a
    short-lived thread of its own: users' receivers must never hold up the supervisor.
    """
    attempt = kwargs.get("attempt")
    with _pending_lock:
        pending = (_pending_failures.pop((job_id, attempt), None) if isinstance(attempt, int)
                   else None)
    if pending is not None:
        # A failure the task's code raised and the adapter judged final: announced now that
        # the runner has recorded it (on the thread that did, as the adapter would have), if
        # the job did end (a settling that failed hands it back instead).
        if status in ("dead_lettered", "cancelled"):
            backend_class, task_result = pending
            try:
                task_finished.send(sender=backend_class, task_result=task_result)
            except Exception:
                # The task's own error is the one recorded, not a receiver's.
                logger.exception("a task_finished receiver failed for task %s",
                                 task_result.id)
        return
    task = _tasks.get(job_type)
    if task is None or status not in ("dead_lettered", "cancelled"):
        return  # not a task, or not final
    if status == "dead_lettered" and outcome == "dead_lettered":
        return  # a failure the task raised: the adapter's (above)
    if status == "cancelled" and kwargs.get("error_code") == "CANCELLED":
        # The task's own ``JobCancelledError`` (the adapter's), or a cancel that came before
        # the task started (it never ran: nothing to announce). Other cancelled endings are a
        # failure outside the task's code after a cancel request (a timeout, a lost runner),
        # or a failed try superseded by a newer job with its dedup key (``REPLACED``).
        return
    if not task_finished.receivers:
        return

    def send() -> None:
        from ..models import JobAttempt, PersistentJob

        alias = _alias()
        try:
            backend = task.get_backend()
            job = PersistentJob.objects.using(alias).get(pk=job_id)
            attempts = list(JobAttempt.objects.using(alias).filter(job_id=job_id))
            task_finished.send(sender=type(backend),
                               task_result=build_result(backend, task, job, attempts))
        except Exception:
            logger.exception("could not send task_finished for job %s", job_id)
        finally:
            connections.close_all()

    threading.Thread(target=send, name=f"task-finished-{job_id}", daemon=True).start()


_RELAY_UID = "pj-task-final-ending"


def _format(exc: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(exc))

