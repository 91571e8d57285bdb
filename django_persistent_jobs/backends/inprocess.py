"""``InProcessBackend``: tasks run on a bounded thread pool inside the enqueuing process.

For work that need not survive a restart (warming a cache, sending a best-effort ping): no
table, no runner, no latency beyond a thread hand-off. The task is handed to the pool when the
enqueuing transaction commits (never after a rollback); retries with backoff and timeouts are
kept in memory, and results can be read with ``get_result`` in this process only. Everything not
finished is **lost when the process exits**. Choose ``PersistentJobsBackend`` for work that must
happen.

A timed-out attempt is recorded as failed with ``TimeoutError`` and its late result ignored, but
Python cannot stop a thread: the hung code keeps its pool thread until it returns.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections, connections, transaction
from django.utils import timezone

from .. import backoff, bounds, conf
from ..errors import JobError, TransientJobError
from ..handlers import HandlerSpec, check_options, code_location, global_backoff
from ..ids import uuid7
from .compat import (
    BaseTaskBackend,
    InvalidTask,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_enqueued,
    task_finished,
    task_started,
)
from .tasks import PersistentTask, encode_arguments, encode_result, refuse_generators, task_options

logger = logging.getLogger("django_persistent_jobs.tasks")
#: The dispatcher's longest wait (seconds): it looks again at least this often.
MAX_WAIT = 3600.0

if TYPE_CHECKING:
    from .compat import AnyTask, AnyTaskResult


def _is_count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _count_option(options: dict[str, Any], key: str, default: int) -> int:
    value = options.get(key, default)
    return value if _is_count(value) else default


@dataclass(order=True)
class _Entry:
    """A task waiting for its time (``due``) or for a free thread (ordered by priority)."""

    sort_key: tuple[Any, ...]
    result: Any = field(compare=False)
    attempt: int = field(compare=False, default=0)


@dataclass
class _Running:
    result: Any
    attempt: int
    deadline: float | None
    done: bool = False


class _Engine:
    """The state of one in-process backend alias: queue, running attempts, results, threads."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}
        #: Finished results' ids, oldest finish first: the ones ``MAX_RESULTS`` drops.
        self.finished: deque[str] = deque()
        self.lock = threading.Condition()
        self.delayed: list[_Entry] = []  # by due time
        self.ready: list[_Entry] = []  # by priority, then arrival
        self.running: dict[int, _Running] = {}
        self.seq = itertools.count()
        self.tokens = itertools.count(1)
        #: Tokens of attempts to start, read by the worker threads.
        self.pool: queue.SimpleQueue[int] | None = None
        self.dispatcher: threading.Thread | None = None
        self.worker_id = f"inprocess:{uuid7().hex[:12]}"


_ENGINES: dict[tuple[Any, ...], _Engine] = {}
_ENGINES_LOCK = threading.Lock()


class InProcessBackend(BaseTaskBackend):
    """``django.tasks`` on a bounded thread pool in this process; not durable.

    ``OPTIONS``: ``WORKERS`` (threads, default 4), ``MAX_RESULTS`` (finished results kept for
    ``get_result``, oldest dropped first, default 10,000), ``DATABASE`` (the alias whose commit
    releases a task, default ``PERSISTENT_JOBS["DATABASE"]``). ``max_retries``, ``timeout`` and
    ``backoff`` task options and their PERSISTENT_JOBS defaults apply; ``dedup``, ``dedup_key``,
    ``cron`` and ``interval`` need the durable backend and are refused.
    """

    task_class = PersistentTask
    supports_defer = True
    supports_async_task = True
    # Django defines this flag as "results can be retrieved from any thread or process"; ours
    # live in this process only, so it stays False although get_result works here.
    supports_get_result = False
    supports_priority = True

    option_keys: tuple[str, ...] = ("WORKERS", "MAX_RESULTS", "DATABASE")
    _durable_only = ("dedup", "dedup_key", "cron", "interval", "timezone")

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.options = dict(self.options or {})
        # A bad value falls back to the default here and is reported by ``check`` (E205): a
        # task module declares tasks of this backend at import, where an exception would be a
        # traceback about the app registry instead of a message about the setting.
        self.workers = _count_option(self.options, "WORKERS", 4)
        self.max_results = _count_option(self.options, "MAX_RESULTS", 10_000)
        # Django keeps one backend instance per thread; the pool, the queue and the results
        # must be one per process, so every instance of this alias shares one engine.
        with _ENGINES_LOCK:
            key = (alias, self.workers, self.max_results)
            engine = _ENGINES.get(key)
            if engine is None:
                engine = _ENGINES[key] = _Engine()
        self._e = engine

    # --- validation ----------------------------------------------------------------------------
    def validate_task(self, task: AnyTask) -> None:
        super().validate_task(task)
        refuse_generators(task)
        options = task_options(task)
        given = [name for name in self._durable_only if options[name] is not None]
        if given:
            raise InvalidTask(
                f"Task {task.module_path}: {', '.join(given)} need(s) the durable "
                "PersistentJobsBackend; InProcessBackend keeps nothing across processes."
            )
        spec = self._spec(task)
        problems = check_options(spec, subject=f"task {task.module_path}")
        if problems:
            raise InvalidTask("; ".join(message for _, message in problems))

    def _spec(self, task: AnyTask) -> HandlerSpec:
        options = task_options(task)
        return HandlerSpec(
            job_type=str(task.module_path), func=lambda payload, ctx: None,
            origin=task.module_path, max_retries=options["max_retries"],
            timeout=options["timeout"], backoff=options["backoff"],
            location=code_location(task.func),
        )

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        messages: list[checks.CheckMessage] = []
        unknown = sorted(set(self.options) - set(self.option_keys))
        if unknown:
            messages.append(checks.Error(
                f"Task backend {self.alias!r} has unknown OPTIONS {unknown}.",
                hint=f"Accepted: {list(self.option_keys)}.", id="persistent_jobs.E203",
            ))
        for key in ("WORKERS", "MAX_RESULTS"):
            value = self.options.get(key, 1)
            if not _is_count(value):
                messages.append(checks.Error(
                    f"Task backend {self.alias!r}: OPTIONS[{key!r}] must be an integer >= 1, "
                    f"got {value!r}.", hint=f"For example {{{key!r}: 4}}.",
                    id="persistent_jobs.E205",
                ))
        problem = self._database_problem()
        if problem is not None:
            messages.append(checks.Error(problem, hint="Name a key of settings.DATABASES, or "
                                         "leave DATABASE out to use PERSISTENT_JOBS['DATABASE'].",
                                         id="persistent_jobs.E207"))
        return messages

    def _database_problem(self) -> str | None:
        given = self.options.get("DATABASE")
        if given is None or (isinstance(given, str) and given in settings.DATABASES):
            return None
        return (f"Task backend {self.alias!r}: OPTIONS['DATABASE'] is {given!r}, which is not "
                "a database in settings.DATABASES.")

    # --- enqueue and results --------------------------------------------------------------
    def _alias(self) -> str:
        problem = self._database_problem()
        if problem is not None:
            raise ImproperlyConfigured(problem)
        return str(self.options.get("DATABASE") or conf.settings.DATABASE)

    def enqueue(self, task: AnyTask, args: Any, kwargs: Any) -> AnyTaskResult:
        self.validate_task(task)
        payload = encode_arguments(task, args, kwargs)
        result: AnyTaskResult = TaskResult(
            task=task, id=str(uuid7()), status=TaskResultStatus.READY, enqueued_at=None,
            started_at=None, finished_at=None, last_attempted_at=None, args=payload["args"],
            kwargs=payload["kwargs"], backend=self.alias, errors=[], worker_ids=[],
        )

        def release() -> None:
            object.__setattr__(result, "enqueued_at", timezone.now())
            with self._e.lock:
                self._e.results[result.id] = result
            task_enqueued.send(sender=type(self), task_result=result)
            self._schedule(result, attempt=1, not_before=task.run_after)

        # Like the durable backend: nothing runs, and nothing is known, unless the enqueuing
        # transaction commits.
        transaction.on_commit(release, using=self._alias())
        return result

    def get_result(self, result_id: str) -> AnyTaskResult:
        with self._e.lock:
            result = self._e.results.get(str(result_id))
        if result is None:
            raise TaskResultDoesNotExist(result_id)
        found: AnyTaskResult = result
        return found

    def _finished(self, result: Any) -> None:
        """Note that ``result`` finished (lock held) and forget the oldest finished results
        beyond ``MAX_RESULTS``, as tasks finish: trimmed only at the next enqueue, a burst
        of tasks would stay in memory as long as the process enqueues nothing more. A task
        that has not finished is never forgotten, and one deferred for hours does not stop
        the finished ones behind it going."""
        finished = self._e.finished
        finished.append(result.id)
        while len(finished) > self.max_results:
            self._e.results.pop(finished.popleft(), None)

    # --- scheduling ------------------------------------------------------------------------
    def _start(self) -> None:
        if self._e.pool is None:
            # Daemon threads, not a ThreadPoolExecutor: the executor's threads are joined at
            # interpreter exit, so one hung task would keep the process from exiting. Work here
            # is documented as lost on exit.
            self._e.pool = queue.SimpleQueue()
            for index in range(self.workers):
                threading.Thread(target=self._work, args=(self._e.pool,), daemon=True,
                                 name=f"tasks-{self.alias}-{index}").start()
            self._e.dispatcher = threading.Thread(
                target=self._dispatch, name=f"tasks-{self.alias}-dispatch", daemon=True)
            self._e.dispatcher.start()

    def _schedule(self, result: Any, attempt: int, not_before: Any = None,
                  delay: float = 0.0) -> None:
        due = time.monotonic() + delay
        if not_before is not None:
            due = max(due, time.monotonic() + (not_before - timezone.now()).total_seconds())
        with self._e.lock:
            self._start()
            heapq.heappush(self._e.delayed, _Entry((due, next(self._e.seq)), result, attempt))
            self._e.lock.notify_all()

    def _dispatch(self) -> None:
        """The dispatcher thread: it must outlive anything one task brings (a receiver that
        raises, a delay out of the clock's range), or no task of this process runs again."""
        while True:
            try:
                self._dispatch_round()
            except Exception:
                logger.exception("in-process task dispatcher (%s): a round failed; going on",
                                 self.alias)
                time.sleep(0.1)  # (a fault that repeats must not spin a core)

    def _dispatch_round(self) -> None:
        """Move due tasks to the ready heap, start the highest priority ones on free threads,
        and time out attempts past their deadline (from their start, not from the hand-off:
        a task waiting for a thread that a hung task still holds has not started)."""
        finished: list[Any] = []
        with self._e.lock:
            now = time.monotonic()
            while self._e.delayed and self._e.delayed[0].sort_key[0] <= now:
                entry = heapq.heappop(self._e.delayed)
                heapq.heappush(self._e.ready, _Entry(
                    (-entry.result.task.priority, next(self._e.seq)), entry.result,
                    entry.attempt))
            for token, running in list(self._e.running.items()):
                if running.deadline is not None and now >= running.deadline:
                    del self._e.running[token]
                    if self._fail(running.result, running.attempt, TimeoutError(
                            f"attempt {running.attempt} timed out"), ""):
                        finished.append(running.result)
            busy = len(self._e.running)
            while self._e.ready and busy < self.workers:
                entry = heapq.heappop(self._e.ready)
                token = next(self._e.tokens)
                self._e.running[token] = _Running(entry.result, entry.attempt, None)
                busy += 1
                assert self._e.pool is not None
                self._e.pool.put(token)
            waits = [e.sort_key[0] for e in self._e.delayed[:1]]
            waits += [r.deadline for r in self._e.running.values() if r.deadline is not None]
            # Bounded: a due time centuries ahead is beyond what a wait accepts.
            timeout = min(max(0.0, min(waits) - now), MAX_WAIT) if waits else MAX_WAIT
            if not finished:
                self._e.lock.wait(timeout)
        for result in finished:
            try:
                task_finished.send(sender=type(self), task_result=result)
            except Exception:
                logger.exception("task_finished receiver failed for task %s", result.id)

    # --- execution -------------------------------------------------------------------------
    def _work(self, tokens: queue.SimpleQueue[int]) -> None:
        while True:
            token = tokens.get()
            try:
                self._run(token)
            except Exception:  # a worker thread must outlive any one task
                logger.exception("in-process task attempt %s could not be run", token)

    def _run(self, token: int) -> None:
        with self._e.lock:
            running = self._e.running.get(token)
            if running is None:
                return
            # Its timeout runs from now: it may have waited for a thread a hung task held.
            limit = self._spec(running.result.task).effective_timeout()
            running.deadline = time.monotonic() + limit
            self._e.lock.notify_all()
        result, attempt = running.result, running.attempt
        task = result.task
        now = timezone.now()
        object.__setattr__(result, "status", TaskResultStatus.RUNNING)
        if result.started_at is None:
            object.__setattr__(result, "started_at", now)
        object.__setattr__(result, "last_attempted_at", now)
        result.worker_ids.append(self._e.worker_id)
        close_old_connections()
        try:
            task_started.send(sender=type(self), task_result=result)
            if task.takes_context:
                value = task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
            else:
                value = task.call(*result.args, **result.kwargs)
            stored, _ = encode_result(task, value)
        except BaseException as exc:
            with self._e.lock:
                if self._e.running.pop(token, None) is None:
                    return  # timed out meanwhile: that outcome is already recorded
                finished = self._fail(
                    result, attempt, exc, "".join(traceback.format_exception(exc)))
                self._e.lock.notify_all()
            if finished:
                task_finished.send(sender=type(self), task_result=result)
            return
        finally:
            for connection in connections.all(initialized_only=True):
                connection.close()
        with self._e.lock:
            if self._e.running.pop(token, None) is None:
                return  # finished after its timeout: the late result is ignored
            object.__setattr__(result, "_return_value", stored)
            object.__setattr__(result, "finished_at", timezone.now())
            object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
            self._finished(result)
            self._e.lock.notify_all()
        task_finished.send(sender=type(self), task_result=result)

    def _fail(self, result: Any, attempt: int, exc: BaseException, trace: str) -> bool:
        """Record a failed attempt (lock held): retry after the backoff, or finish FAILED.

        True when the task finished, so the caller sends ``task_finished`` (outside the lock).
        """
        cls = type(exc)
        result.errors.append(TaskError(
            exception_class_path=f"{cls.__module__}.{cls.__qualname__}",
            traceback=trace or f"{cls.__name__}: {exc}",
        ))
        spec = self._spec(result.task)
        permanent = isinstance(exc, JobError) and not exc.transient
        if not permanent and attempt < spec.effective_max_retries() + 1:
            if isinstance(exc, TransientJobError) and exc.retry_after is not None:
                delay = float(exc.retry_after)
            else:
                delay = min(backoff.delay_after(spec.backoff or global_backoff(), attempt),
                            bounds.MAX_SECONDS)
            object.__setattr__(result, "status", TaskResultStatus.READY)
            heapq.heappush(self._e.delayed, _Entry(
                (time.monotonic() + delay, next(self._e.seq)), result, attempt + 1))
            return False
        object.__setattr__(result, "finished_at", timezone.now())
        object.__setattr__(result, "status", TaskResultStatus.FAILED)
        self._finished(result)
        return True
