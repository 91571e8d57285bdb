"""Helpers shared by the runner test modules (this module holds no tests itself)."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
from django.db import connection

from django_persistent_jobs import signals
from django_persistent_jobs.handlers import Registry, registry
from django_persistent_jobs.models import JobAttempt, PersistentJob
from tests.core_support import db_now, wait_for

__all__ = [
    "Gate",
    "OutputReader",
    "Tracker",
    "attempts_of",
    "db_now",
    "get_job",
    "isolated_registry",
    "wait_for",
    "wait_handler_inside",
    "wait_status",
]


@pytest.fixture
def isolated_registry() -> Iterator[Registry]:
    """Handlers registered during the test are dropped afterwards.

    Request it *before* ``start_runner`` so it is torn down after the runners stop: the runner
    looks handlers up in the global registry each time it executes a job.
    """
    with registry.isolated() as reg:
        yield reg


def get_job(job_id: Any) -> PersistentJob:
    return PersistentJob.objects.get(pk=job_id)


def attempts_of(job_id: Any) -> list[JobAttempt]:
    return list(JobAttempt.objects.filter(job_id=job_id).order_by("attempt", "id"))


def wait_status(job_id: Any, *statuses: str, timeout: float = 15.0) -> PersistentJob:
    """Wait until the job is in one of ``statuses`` and return it."""
    seen: dict[str, str] = {}

    def check() -> PersistentJob | None:
        job = get_job(job_id)
        seen["status"] = job.status
        return job if job.status in statuses else None

    try:
        result: PersistentJob = wait_for(check, timeout=timeout,
                                         message=f"job {job_id} to reach {statuses}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last status {seen.get('status')!r}") from None
    return result


class Gate:
    """An event a handler waits on; tests open it. Never waits forever."""

    def __init__(self, limit: float = 20.0) -> None:
        self.event = threading.Event()
        self.limit = limit

    def wait(self) -> bool:
        return self.event.wait(self.limit)

    def open(self) -> None:
        self.event.set()


class Tracker:
    """Thread-safe record of what handlers did, with events tests can wait on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.order: list[Any] = []
        self.started: dict[uuid.UUID, float] = {}
        self.finished: dict[uuid.UUID, float] = {}
        self.changed = threading.Condition(self.lock)

    def enter(self, job_id: uuid.UUID, label: Any = None) -> int:
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self.order.append(label if label is not None else job_id)
            self.started[job_id] = time.monotonic()
            self.changed.notify_all()
            return self.running

    def leave(self, job_id: uuid.UUID) -> None:
        with self.lock:
            self.running -= 1
            self.finished[job_id] = time.monotonic()
            self.changed.notify_all()

    def wait_started(self, job_id: uuid.UUID, timeout: float = 15.0) -> float:
        """Wait until the handler for ``job_id`` has started; return its monotonic start."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while job_id not in self.started:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"handler for job {job_id} did not start in {timeout}s")
                self.changed.wait(remaining)
            return self.started[job_id]

    def wait_running(self, count: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.running < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"expected {count} handlers running, saw {self.running} after {timeout}s"
                    )
                self.changed.wait(remaining)


class OutputReader:
    """Drains a runner subprocess's stdout in a thread, so tests can wait for a log line."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self.changed:
                self.lines.append(raw.decode(errors="replace").rstrip())
                self.changed.notify_all()

    def wait_for_line(self, fragment: str, timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for line in self.lines:
                    if fragment in line:
                        return line
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"no output line containing {fragment!r} within "
                                         f"{timeout}s; output so far:\n{self.text()}")
                self.changed.wait(remaining)

    def text(self) -> str:
        return "\n".join(self.lines)

    def finish(self, timeout: float = 30.0) -> tuple[int, str]:
        """Wait for the process to exit; return its exit code and whole output."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"runner did not exit within {timeout}s; output:\n"
                                 f"{self.text()}") from None
        self.thread.join(5)
        return code, self.text()


def wait_handler_inside(since: datetime, timeout: float = 60.0, message: str = "a handler") -> None:
    """Wait until a runner process's handler is inside its job, past its first statement.

    A claimed job is ``running`` (with a ``running`` attempt) before a worker starts it, and a
    runner stopping hands back an unstarted job unlike one that started; tests about the
    latter must wait for the start. The handlers they use first insert a ``SideEffect`` row in
    their job's transaction: uncommitted, it shows only as a connection idle in a transaction
    whose last statement was that insert. ``since`` (``db_now(clock=True)`` before the runner
    was spawned) excludes connections of runners that were already gone.
    """

    def inside() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_start >= %s"
                " AND state = 'idle in transaction'"
                " AND query LIKE 'INSERT INTO \"testapp_sideeffect\"%%'", [since])
            return cursor.fetchone() is not None

    wait_for(inside, timeout, message=f"{message} to start")


@pytest.fixture
def finished() -> Iterator[list[tuple[Any, str | None]]]:
    """Every ``job_finished`` signal as ``(job_id, status)``, in the order sent."""
    seen: list[tuple[Any, str | None]] = []
    lock = threading.Lock()

    def receiver(*, job_id: Any, status: str | None, **kwargs: Any) -> None:
        with lock:
            seen.append((job_id, status))

    signals.job_finished.connect(receiver, weak=False, dispatch_uid="tests-finished")
    try:
        yield seen
    finally:
        signals.job_finished.disconnect(dispatch_uid="tests-finished")


def a_job_waiting_behind_another(
    start_runner: Callable[..., Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    settings: Any, processes: int, **options: Any,
) -> tuple[Any, Any, int, Any]:
    """A runner with one slot, busy with a job that runs until ``open_gate`` exists, and a
    second job (``test.noop`` unless ``options`` name a ``job_type`` and ``payload``; the rest
    of ``options`` for its ``enqueue``) claimed and waiting for that slot: the
    runner, the waiting job, its fencing token, and ``open_gate``."""
    from django_persistent_jobs import enqueue
    from django_persistent_jobs.models import JobStatus
    from tests.core_support import subprocess_env
    from tests.faults.batch_handlers import runs_of

    for name, value in subprocess_env().items():  # worker processes use the test database
        monkeypatch.setenv(name, value)
    settings.PERSISTENT_JOBS = {**settings.PERSISTENT_JOBS, "PREFETCH": 1}
    runs, open_gate = tmp_path / "runs", tmp_path / "gate"
    runner = start_runner(concurrency=1, processes=processes, poll_interval=0.1)
    wait_for(lambda: runner.lease.period() is not None, timeout=10,
             message="the runner to hold its lease (jobs claimed then may start fast)")
    enqueue("faults.solo", {"runs": str(runs), "gate": str(open_gate)}, priority=5)
    job_type, payload = options.pop("job_type", "test.noop"), options.pop("payload", {})
    waiting = enqueue(job_type, payload, **options)
    wait_for(lambda: len(runs_of(runs)) == 1, timeout=30, message="the first job to run")
    wait_status(waiting.id, JobStatus.RUNNING)  # claimed, waiting for the busy slot
    return runner, waiting, int(get_job(waiting.id).lock_token), open_gate
