"""Worker threads with a bounded number of slots, and the means to take a slot back.

A slot is a permit to have one job in flight. A hung handler cannot be stopped from outside a
thread in general, so when its time is up the supervisor *takes the job over*: it records the
timeout (fenced), kills the handler's database connection so nothing it does can commit, injects
an exception into the thread (which ends a pure-Python loop such as ``while True: pass``), frees
the slot and starts a fresh thread in place of the stuck one. The stuck thread exits whenever
it wakes up.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable

from django.db import connections

from .execute import InFlight, JobInterrupted

logger = logging.getLogger("django_persistent_jobs.runner")


def inject_exception(thread_ident: int, exc_type: type[BaseException]) -> bool:
    """Raise ``exc_type`` asynchronously in another thread (at its next bytecode)."""
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_ident), ctypes.py_object(exc_type)
    )
    if done > 1:  # pragma: no cover - would mean several thread states matched; undo
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident), None)
        return False
    return bool(done)


class _Worker:
    def __init__(self, pool: WorkerPool, number: int) -> None:
        self.pool = pool
        self.abandoned = False
        self.current: InFlight | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"pj-worker-{number}", daemon=True
        )

    def _run(self) -> None:
        pool = self.pool
        try:
            while True:
                item = pool.queue.get()
                if item is None:
                    return
                with pool.lock:
                    if item.taken_over.is_set():
                        continue  # settled by the supervisor before it started
                    self.current = item
                    item.thread_ident = threading.get_ident()
                try:
                    pool.execute(item)
                except JobInterrupted:
                    pass
                except BaseException:
                    logger.exception("worker crashed while running job %s", item.job.id)
                finally:
                    with pool.lock:
                        self.current = None
                        if not self.abandoned:
                            pool.release_slot(item)
                        if self.abandoned:
                            return
        except JobInterrupted:
            return
        finally:
            try:
                connections.close_all()
            except Exception:
                pass
            pool.worker_exited(self)


class WorkerPool:
    """``size`` slots served by worker threads pulling from an in-memory queue."""

    def __init__(self, size: int, execute: Callable[[InFlight], None]) -> None:
        self.size = size
        self.execute = execute
        self.queue: queue.SimpleQueue[InFlight | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.in_flight: dict[object, InFlight] = {}
        self.workers: list[_Worker] = []
        self._numbers = 0
        self._closed = False

    def start(self) -> None:
        with self.lock:
            for _ in range(self.size):
                self._spawn_locked()

    def _spawn_locked(self) -> None:
        self._numbers += 1
        worker = _Worker(self, self._numbers)
        self.workers.append(worker)
        worker.thread.start()

    @property
    def busy(self) -> int:
        return len(self.in_flight)

    def free_slots(self) -> int:
        with self.lock:
            return self.size - len(self.in_flight)

    def wait_for_free_slot(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        with self.changed:
            while len(self.in_flight) >= self.size and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.changed.wait(remaining)
            return self.size - len(self.in_flight)

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.changed.wait(remaining)
            return True

    def submit(self, item: InFlight) -> None:
        with self.lock:
            self.in_flight[item.job.id] = item
        self.queue.put(item)

    def release_slot(self, item: InFlight) -> None:
        """Called with ``lock`` held when a job leaves the runner's hands."""
        if self.in_flight.get(item.job.id) is item:
            del self.in_flight[item.job.id]
            self.changed.notify_all()

    def snapshot(self) -> list[InFlight]:
        with self.lock:
            return list(self.in_flight.values())

    def take_over(self, item: InFlight) -> bool:
        """Detach a job from its worker so the supervisor can settle it; False if it finished.

        The worker (if the job had started) is marked abandoned: it will exit instead of taking
        more work. The slot is freed and a replacement worker starts at once.
        """
        with self.lock:
            if self.in_flight.get(item.job.id) is not item:
                return False
            item.taken_over.set()
            owner = next((w for w in self.workers if w.current is item), None)
            if owner is not None:
                owner.abandoned = True
                self.workers.remove(owner)
                if not self._closed:
                    self._spawn_locked()
            del self.in_flight[item.job.id]
            self.changed.notify_all()
            return True

    def worker_exited(self, worker: _Worker) -> None:
        with self.lock:
            if worker in self.workers:
                self.workers.remove(worker)
            self.changed.notify_all()

    def close(self) -> None:
        with self.lock:
            self._closed = True
            count = len(self.workers)
            self.changed.notify_all()
        for _ in range(count):
            self.queue.put(None)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for worker in list(self.workers):
            worker.thread.join(max(0.0, deadline - time.monotonic()))
