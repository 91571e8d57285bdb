"""The supervisor's side of the worker processes: ``ProcessExecutor``.

One manager thread owns the workers: it starts them (``launch``: a fresh interpreter that never
imports the caller's ``__main__``; from this thread, so the kernel's parent-death signal is tied
to a thread that lives as long as the executor), reads every message they send, and waits on
their process sentinels, so a worker that dies by any means (segfault, ``os._exit``, the OOM
killer, SIGKILL) is noticed the moment it exits. Its in-flight jobs are then settled
``WORKER_LOST`` (charged: a poison pill still ends dead-lettered after its retries) through the
``on_lost`` callback (the supervisor settles them on its next tick), and a replacement starts.

Slots are counted here, per worker: a job taken over by the supervisor (timeout, shutdown) frees
its slot at once, whatever its thread does. A thread that has not returned ``grace`` seconds
after being interrupted (blocked in C, where no exception reaches it) gets its worker recycled:
no new jobs, the others get ``grace`` to finish, then the process is killed and replaced. The
same graceful recycling (without the kill) serves ``MAX_JOBS_PER_WORKER`` and
``MAX_MEMORY_PER_WORKER``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..execute import InFlight
from . import protocol
from .launch import WorkerProcess, settings_module

logger = logging.getLogger("django_persistent_jobs.runner")

#: How often the manager looks at worker memory and overdue threads when nothing happens.
HOUSEKEEPING_SECONDS = 0.25
#: How long ``start()`` waits for the first workers (a worker imports Django and the handlers).
START_TIMEOUT = 120.0
#: Replacement workers in a row that die before they are ready (a deploy that broke an import,
#: settings a fresh interpreter cannot load) before the executor gives up instead of starting
#: processes forever.
MAX_FAILED_STARTS = 3
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process (Linux ``/proc``); None where unknown."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


@dataclass(eq=False)
class WorkerHandle:
    """The supervisor's view of one worker process."""

    number: int
    process: WorkerProcess
    conn: Any
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    pid: int | None = None
    ready: bool = False
    #: Takes no new jobs (recycling). ``kill_at``: killed then even if jobs still run.
    draining: bool = False
    kill_at: float | None = None
    stop_sent: bool = False
    gone: bool = False
    jobs_run: int = 0
    in_flight: dict[Any, InFlight] = field(default_factory=dict)
    #: Jobs taken over from it whose thread has not returned yet: job id -> recycle deadline.
    abandoned: dict[Any, float] = field(default_factory=dict)

    def send(self, message: tuple[Any, ...]) -> bool:
        with self.send_lock:
            try:
                self.conn.send(message)
                return True
            except (OSError, EOFError, ValueError):
                return False  # it died: the manager settles its jobs


class _RelayedCancel(threading.Event):
    """The supervisor-side cancel flag of a job that runs in a worker: setting it tells the
    worker, so the cancel relay works unchanged whichever executor runs the job."""

    def __init__(self, forward: Callable[[], None]) -> None:
        super().__init__()
        self._forward = forward

    def set(self) -> None:
        super().set()
        self._forward()


class ProcessExecutor:
    """``Executor`` over ``processes`` worker processes of ``concurrency`` threads each."""

    kind = "processes"

    def __init__(
        self, processes: int, concurrency: int, *, alias: str, runner_id: str,
        on_lost: Callable[[InFlight, str], None],
        on_crash: Callable[[InFlight, BaseException], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        max_jobs: int | None = None, max_memory_mib: float | None = None, grace: float = 5.0,
        log_level: int | None = None, log_to_stderr: bool = False,
    ) -> None:
        self.processes = processes
        self.concurrency = concurrency
        self.alias = alias
        self.runner_id = runner_id
        self.on_lost = on_lost
        self.on_crash = on_crash
        self.on_failure = on_failure
        self.max_jobs = max_jobs
        self.max_memory = None if max_memory_mib is None else max_memory_mib * 1024 * 1024
        self.grace = grace
        self.log_level = log_level
        self.log_to_stderr = log_to_stderr
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.in_flight: dict[object, InFlight] = {}
        self.owner: dict[object, WorkerHandle] = {}
        self.pending: deque[InFlight] = deque()  # accepted while no worker was ready
        self.workers: list[WorkerHandle] = []
        self._numbers = 0
        self._sealed = False
        self._closed = False
        self._starting = True
        self._failed_starts = 0
        # A byte on this pipe wakes the manager (os.write of one byte is atomic, whichever
        # thread writes it).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: Workers to start: only the manager thread starts them (see ``_manage``).
        self._to_spawn = 0
        self._thread = threading.Thread(target=self._manage, name="pj-workers", daemon=True)
        self._last_housekeeping = 0.0
        self._selector: selectors.BaseSelector | None = None
        self.failure: BaseException | None = None

    # ------------------------------------------------------------------ Executor
    def start(self) -> None:
        """Start the workers; return once every one of them has set Django up.

        A worker that dies before it is ready fails the start (its traceback is on the
        supervisor's stderr, which workers share): retrying would only fail again.
        """
        if settings_module() is None:
            raise RuntimeError(
                "worker processes need a settings module (DJANGO_SETTINGS_MODULE) to set Django "
                "up: settings.configure() exists only in this process. Run the jobs on threads "
                "(--processes 0) or use a settings module.")
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        try:
            with self.changed:
                while sum(1 for w in self.workers if w.ready) < self.processes:
                    if self.failure is not None:
                        raise self.failure
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise RuntimeError(
                            f"the worker processes were not ready after {START_TIMEOUT:g}s")
                    self.changed.wait(min(remaining, 0.1))
                self._starting = False
        except BaseException:
            self.close()  # no worker outlives a runner that failed to start
            self.join(5)
            raise

    @property
    def busy(self) -> int:
        return len(self.in_flight)

    @property
    def running(self) -> int:
        with self.lock:
            return len(self.in_flight) - len(self.pending)

    def _free_locked(self) -> int:
        free = sum(self.concurrency - len(w.in_flight) for w in self.workers
                   if w.ready and not w.draining)
        return max(0, free - len(self.pending))

    def free_slots(self) -> int:
        with self.lock:
            return self._free_locked()

    def wait_for_free_slot(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        with self.changed:
            while self._free_locked() <= 0 and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.changed.wait(remaining)
            return self._free_locked()

    def submit(self, item: InFlight) -> bool:
        with self.lock:
            if self._sealed:
                return False
            self.in_flight[item.job.id] = item
            item.ctx._cancel_event = _RelayedCancel(lambda: self._relay_cancel(item))
            if item.job.cancel_requested:
                threading.Event.set(item.ctx._cancel_event)
            worker = self._pick_locked()
            if worker is None:
                self.pending.append(item)
                return True
            self._assign_locked(item, worker)
        self._send_run(worker, item)
        return True

    def seal(self) -> None:
        with self.lock:
            self._sealed = True

    def unstarted(self) -> list[InFlight]:
        with self.lock:
            return list(self.pending)

    def snapshot(self) -> list[InFlight]:
        with self.lock:
            return list(self.in_flight.values())

    def take_over(self, item: InFlight) -> bool:
        with self.lock:
            if self.in_flight.get(item.job.id) is not item:
                return False
            item.taken_over.set()
            del self.in_flight[item.job.id]
            worker = self.owner.pop(item.job.id, None)
            if worker is None:
                with contextlib.suppress(ValueError):
                    self.pending.remove(item)
            else:
                worker.in_flight.pop(item.job.id, None)
                item.owner = worker
                if worker in self.workers:
                    worker.abandoned[item.job.id] = time.monotonic() + self.grace
            self.changed.notify_all()
        self._wake()
        return True

    def interrupt(self, item: InFlight, exc_type: type[BaseException]) -> bool:
        worker = item.owner
        if not isinstance(worker, WorkerHandle):
            return False
        return worker.send((protocol.INTERRUPT, item.job.id))

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self._sealed = True
            workers = list(self.workers)
            self.changed.notify_all()
        for worker in workers:
            worker.stop_sent = True
            worker.send((protocol.STOP,))
        self._wake()

    def join(self, timeout: float) -> None:
        """Wait for the workers to exit; kill those that do not within ``timeout``."""
        self._thread.join(timeout)
        with self.lock:
            left = list(self.workers)
        for worker in left:
            self._kill(worker)
        if left:
            self._thread.join(5)

    # ------------------------------------------------------------------ placement
    def _pick_locked(self) -> WorkerHandle | None:
        best: WorkerHandle | None = None
        for worker in self.workers:
            if not worker.ready or worker.draining:
                continue
            if best is None or len(worker.in_flight) < len(best.in_flight):
                best = worker
        return best

    def _assign_locked(self, item: InFlight, worker: WorkerHandle) -> None:
        worker.in_flight[item.job.id] = item
        self.owner[item.job.id] = worker
        worker.jobs_run += 1
        if self.max_jobs is not None and worker.jobs_run >= self.max_jobs:
            self._recycle_locked(worker, f"it ran {worker.jobs_run} jobs (MAX_JOBS_PER_WORKER)")

    def _send_run(self, worker: WorkerHandle, item: InFlight) -> None:
        worker.send((protocol.RUN, item.job, item.ctx.cancel_requested))

    def _relay_cancel(self, item: InFlight) -> None:
        worker = self.owner.get(item.job.id)
        if worker is not None:
            worker.send((protocol.CANCEL, item.job.id))

    def _assign_pending(self) -> None:
        sends: list[tuple[WorkerHandle, InFlight]] = []
        with self.lock:
            while self.pending:
                worker = self._pick_locked()
                if worker is None:
                    break
                item = self.pending.popleft()
                self._assign_locked(item, worker)
                sends.append((worker, item))
        for worker, item in sends:
            self._send_run(worker, item)

    # ------------------------------------------------------------------ lifecycle
    def _spawn_locked(self) -> WorkerHandle:
        self._numbers += 1
        options = {"alias": self.alias, "runner_id": self.runner_id, "number": self._numbers,
                   "log_level": self.log_level, "log_to_stderr": self.log_to_stderr}
        process = WorkerProcess(options, label=f"pj-worker:{self.runner_id}:{self._numbers}")
        worker = WorkerHandle(number=self._numbers, process=process, conn=process.conn,
                              pid=process.pid)
        self.workers.append(worker)
        logger.info("runner %s: worker %d started (pid %d)", self.runner_id, worker.number,
                    process.pid, extra={"event": "worker_started", "worker_pid": process.pid,
                                        "runner_id": self.runner_id})
        return worker

    def _recycle_locked(self, worker: WorkerHandle, why: str, kill_after: float | None = None
                        ) -> None:
        """Stop giving ``worker`` jobs and start its replacement; it exits once idle (or is
        killed at ``kill_after`` seconds from now)."""
        if kill_after is not None:
            kill_at = time.monotonic() + kill_after
            worker.kill_at = kill_at if worker.kill_at is None else min(worker.kill_at, kill_at)
        if worker.draining:
            return
        worker.draining = True
        self._to_spawn += 1
        logger.info("runner %s: recycling worker %d (pid %s): %s", self.runner_id,
                    worker.number, worker.pid, why,
                    extra={"event": "worker_recycled", "worker_pid": worker.pid,
                           "runner_id": self.runner_id})
        self._wake()

    def _kill(self, worker: WorkerHandle) -> None:
        with contextlib.suppress(Exception):
            worker.process.kill()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe already means "wake up"
            os.write(self._wake_w, b"w")

    # ------------------------------------------------------------------ the manager thread
    def _manage(self) -> None:
        selector = self._selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        watched: set[WorkerHandle] = set()
        try:
            with self.lock:
                self._to_spawn = self.processes
            next_housekeeping = 0.0
            while True:
                with self.lock:
                    # Started here and nowhere else: the kernel's parent-death signal follows
                    # the thread that started a process, and this one lives as long as the
                    # executor (a worker started by, say, the claim loop would be killed when
                    # that loop ends at the start of a shutdown).
                    while self._to_spawn > 0 and not self._closed:
                        self._to_spawn -= 1
                        self._spawn_locked()
                    workers = list(self.workers)
                    if self._closed and not workers:
                        return
                for worker in workers:
                    if worker not in watched:  # started since (by any thread): watch it
                        watched.add(worker)
                        selector.register(worker.conn.fileno(), selectors.EVENT_READ, worker)
                        if worker.process.sentinel is not None:
                            selector.register(worker.process.sentinel, selectors.EVENT_READ,
                                              worker)
                watched &= set(workers)
                woken: dict[WorkerHandle, bool] = {}
                for key, _ in selector.select(timeout=HOUSEKEEPING_SECONDS):
                    if key.data is None:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                    else:
                        exited = key.fd == key.data.process.sentinel
                        woken[key.data] = woken.get(key.data, False) or exited
                for worker, exited in woken.items():
                    self._receive(worker, exited)
                now = time.monotonic()
                if now >= next_housekeeping:
                    next_housekeeping = now + HOUSEKEEPING_SECONDS / 2
                    self._housekeeping()
        except BaseException as exc:
            self.failure = exc
            logger.critical("worker manager died: %r", exc, exc_info=exc,
                            extra={"event": "loop_died", "loop": "workers"})
            with self.lock:
                left = list(self.workers)
                self.changed.notify_all()
            for worker in left:
                self._kill(worker)
            if self.on_failure is not None:
                self.on_failure(exc)

    def _receive(self, worker: WorkerHandle, exited: bool) -> None:
        """Handle what ``worker`` sent; once it has exited, settle its jobs and replace it."""
        if worker.gone:
            return
        try:
            while worker.conn.poll():
                self._handle(worker, worker.conn.recv())
        except (EOFError, OSError):
            exited = True  # its end of the pipe closed: it is exiting, wait for that
        if exited:
            self._lost(worker)

    def _handle(self, worker: WorkerHandle, message: tuple[Any, ...]) -> None:
        tag = message[0]
        if tag == protocol.DONE:
            with self.lock:
                job_id = message[1]
                worker.abandoned.pop(job_id, None)
                item = worker.in_flight.pop(job_id, None)
                if item is not None and self.in_flight.get(job_id) is item:
                    del self.in_flight[job_id]
                    self.owner.pop(job_id, None)
                self.changed.notify_all()
            if self.pending:
                self._assign_pending()
        elif tag == protocol.STARTED:
            item = worker.in_flight.get(message[1])
            if item is not None:
                item.backend_pid, item.backend_start = message[2], message[3]
                item.thread_ident = -1  # started (the thread is in another process)
        elif tag == protocol.READY:
            with self.lock:
                worker.ready = True
                self.changed.notify_all()
            logger.debug("worker %d ready", worker.number, extra={"event": "worker_ready"})
            self._assign_pending()
        elif tag == protocol.CRASHED:
            item = worker.in_flight.get(message[1])
            if item is not None and self.on_crash is not None:
                self.on_crash(item, RuntimeError(message[2]))

    def _lost(self, worker: WorkerHandle) -> None:
        worker.gone = True
        if self._selector is not None:
            for fd in (worker.conn.fileno(), worker.process.sentinel):
                if fd is not None:
                    with contextlib.suppress(Exception):
                        self._selector.unregister(fd)
        with contextlib.suppress(Exception):
            worker.process.join(1)
            if worker.process.is_alive():  # its pipe closed but it lingers: it is no worker
                worker.process.kill()
                worker.process.join(1)
        code = worker.process.exitcode
        how = (f"killed by signal {-code}" if code is not None and code < 0
               else f"exit code {code}")
        failure: BaseException | None = None
        with self.lock:
            if worker not in self.workers:
                return
            self.workers.remove(worker)
            lost = [item for item in worker.in_flight.values()
                    if self.in_flight.get(item.job.id) is item]
            expected = worker.stop_sent and not lost
            if not worker.ready and not worker.stop_sent and not self._closed:
                self._failed_starts += 1
                if self._starting or self._failed_starts >= MAX_FAILED_STARTS:
                    failure = RuntimeError(
                        f"worker process {worker.pid} exited ({how}) before it was ready"
                        + ("" if self._starting else
                           f", {self._failed_starts} times in a row")
                        + ": see its output above")
                    self.failure = failure
            elif worker.ready:
                self._failed_starts = 0
            if (not expected and not worker.draining and not self._closed
                    and failure is None):
                self._to_spawn += 1
            self.changed.notify_all()
        worker.process.close()
        if failure is not None and not self._starting:
            logger.critical("runner %s: %s", self.runner_id, failure,
                            extra={"event": "loop_died", "loop": "workers"})
            if self.on_failure is not None:
                self.on_failure(failure)
        if expected:
            logger.debug("worker %d exited", worker.number, extra={"event": "worker_exited"})
            return
        logger.warning(
            "runner %s: worker %d (pid %s) died (%s) with %d job(s) in flight", self.runner_id,
            worker.number, worker.pid, how, len(lost),
            extra={"event": "worker_lost", "worker_pid": worker.pid, "runner_id": self.runner_id,
                   "job_ids": [str(item.job.id) for item in lost]},
        )
        why = (f"worker process {worker.pid} of runner {self.runner_id} died ({how}) while "
               "running this attempt")
        for item in lost:
            self.on_lost(item, why)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        kills: list[WorkerHandle] = []
        stops: list[WorkerHandle] = []
        with self.lock:
            check_memory = (self.max_memory is not None
                            and now - self._last_housekeeping >= 1.0)
            if check_memory:
                self._last_housekeeping = now
            for worker in list(self.workers):
                overdue = [job for job, at in worker.abandoned.items() if now >= at]
                if overdue and not worker.draining:
                    self._recycle_locked(
                        worker, f"the handler of job {overdue[0]} did not return within "
                        f"{self.grace:g}s of being stopped", kill_after=self.grace)
                elif overdue:
                    worker.kill_at = min(worker.kill_at or now + self.grace, now + self.grace)
                if (check_memory and worker.ready and not worker.draining
                        and worker.pid is not None):
                    rss = rss_bytes(worker.pid)
                    if rss is not None and self.max_memory is not None and rss > self.max_memory:
                        self._recycle_locked(worker, f"its memory ({rss / 2**20:.0f} MiB RSS) "
                                             "exceeds MAX_MEMORY_PER_WORKER")
                if worker.draining and not worker.stop_sent:
                    if not worker.in_flight and not worker.abandoned:
                        worker.stop_sent = True
                        stops.append(worker)
                    elif worker.kill_at is not None and now >= worker.kill_at:
                        kills.append(worker)
                elif worker.stop_sent and worker.kill_at is not None and now >= worker.kill_at:
                    kills.append(worker)
        for worker in stops:
            worker.send((protocol.STOP,))
        for worker in kills:
            self._kill(worker)
