"""Worker threads with a bounded number of slots, and the means to take a slot back.

A slot is a permit to have one job in flight. A hung handler cannot be stopped from outside a
thread in general, so when its time is up the supervisor *takes the job over*: it records the
timeout (fenced), kills the handler's database connection so nothing it does can commit, injects
an exception into the thread (which ends a pure-Python loop such as ``while True: pass``), frees
the slot and starts a fresh thread in place of the stuck one. The stuck thread exits whenever
it wakes up.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable

from django.db import connections

from .completer import Completer
from .execute import InFlight, JobInterrupted
from .executor import SlotWaits, held_back
from .starts import StartGate

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
        self.abandoned_job: object = None
        self.current: InFlight | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"pj-worker-{number}", daemon=True
        )

    def _run(self) -> None:
        try:
            if self.pool.warm is not None:
                self.pool.warm()
            while self._run_one():
                pass
        except JobInterrupted:
            pass  # injected into a taken-over job just as it left the handler
        finally:
            with contextlib.suppress(Exception):
                connections.close_all()
            self.pool.worker_exited(self)
            if self.abandoned:
                # Operators want to know whether timed-out code ever returns (a thread blocked
                # in C for an hour does not, and is leaked until then).
                logger.info("abandoned worker for job %s exited", self.abandoned_job,
                            extra={"event": "abandoned_worker_exited",
                                   "job_id": str(self.abandoned_job)})

    def _run_one(self) -> bool:
        """Run the next job; False when this worker must exit (pool closed, or abandoned)."""
        pool = self.pool
        item = pool.queue.get()
        if item is None:
            return False
        with pool.lock:
            if item.taken_over.is_set():
                return True  # settled by the supervisor before it started
            if pool._sealed:
                # Stopping: a prefetched job that has not started is not started now; the
                # supervisor hands it back at once (``unstarted()``).
                pool.changed.notify_all()
                return True
            self.current = item
            item.thread_ident = threading.get_ident()
        if item.job.waiting and pool.on_start is not None:
            pool.on_start(item)
        try:
            pool.execute(item)
        except JobInterrupted:
            pass
        except BaseException as exc:
            # ``execute`` settles every outcome itself; reaching here means the job's state
            # could not be recorded. It must not stay claimed by a live runner.
            if not self.abandoned:
                pool.crashed(item, exc)
        finally:
            with pool.lock:
                self.current = None
                if not self.abandoned:
                    pool.release_slot(item)
        return not self.abandoned


class WorkerPool(SlotWaits):
    """``size`` worker threads, and room for ``prefetch`` claimed jobs waiting for one.

    Prefetching lets the claim loop take jobs in batches instead of one per freed slot, which
    for short jobs is the difference between one claim transaction per job and one per batch.
    A waiting job's timeout starts only when a worker starts it. The workers hand the
    completions of handlers that ran no SQL to one ``Completer``, which writes them in batches;
    the slot is free as soon as the handler returns (``completing`` counts those jobs until
    their completion is written, and a stopping runner waits for them).
    """

    #: Payloads are decoded by the claim loop, all of a claim at once: decoded on the handler
    #: threads instead, a drain of jobs with 900-byte payloads ran 15-25% slower (three
    #: interleaved pairs).
    decode_at_claim = True
    shares_items = True

    def __init__(
        self, size: int, execute: Callable[[InFlight], None],
        on_crash: Callable[[InFlight, BaseException], None] | None = None,
        prefetch: int = 0,
    ) -> None:
        self.size = size
        #: Claimed jobs that may wait for a worker right now (the claim loop adjusts it
        #: when ``PREFETCH`` is adaptive); ``finished`` counts jobs that left a slot.
        self.waiting_room = max(0, prefetch)
        self.finished = 0
        self.execute = execute
        self.on_crash = on_crash
        self.queue: queue.SimpleQueue[InFlight | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.in_flight: dict[int, InFlight] = {}  # by attempt token (``Executor``)
        self.workers: list[_Worker] = []
        self._numbers = 0
        self._closed = False
        self._sealed = False
        self.completer = Completer()
        #: Records the starts of waiting jobs before they run (set by the runner).
        self.gate: StartGate | None = None
        #: Called by each worker thread as it starts, before its first job (set by the
        #: runner: opens the thread's database connection, ``execute.warm_connection``).
        self.warm: Callable[[], None] | None = None
        self.on_start: Callable[[InFlight], None] | None = None

    def start(self) -> None:
        with self.lock:
            for _ in range(self.size):
                self._spawn_locked()

    def _spawn_locked(self) -> None:
        self._numbers += 1
        worker = _Worker(self, self._numbers)
        # Started before it is listed: a start that fails (no more threads) must not leave an
        # unstarted thread for ``join`` to wait on. (A worker that exits at once takes the
        # lock to say so, which is held here.)
        worker.thread.start()
        self.workers.append(worker)

    @property
    def busy(self) -> int:
        return len(self.in_flight)

    @property
    def completing(self) -> int:
        return self.completer.pending()

    def _free_locked(self) -> int:
        return (self.size + self.waiting_room - len(self.in_flight)
                - held_back(self.completer.pending(), self.size))

    def free_slots(self) -> int:
        with self.lock:
            return self._free_locked()

    def unstarted(self) -> list[InFlight]:
        """Claimed jobs no worker has started (after ``seal()`` none will start)."""
        with self.lock:
            return [item for item in self.in_flight.values() if item.thread_ident is None]

    def await_recalls(self, timeout: float) -> None:
        """Nothing to wait for: a thread decides under ``lock`` whether a job starts."""

    def _idle_locked(self) -> int:
        return max(0, self.size - len(self.in_flight))

    def idle(self) -> int:
        with self.lock:
            return self._idle_locked()

    @property
    def running(self) -> int:
        with self.lock:
            return sum(1 for item in self.in_flight.values() if item.thread_ident is not None)

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.changed.wait(remaining)
            return True

    def submit_many(self, items: list[InFlight]) -> int:
        """Queue a whole claim: all of it, or none once the pool is sealed (the runner is
        stopping; the caller still owns the jobs and hands them back). One acquisition of
        ``lock`` for the claim, not one per job: the worker threads take that lock as each job
        starts and ends, and in a drain of short jobs the claim thread waited for it (a GIL
        hand-off each time) more than it did anything else."""
        with self.lock:
            if self._sealed:
                return 0
            for item in items:
                self.in_flight[item.job.token] = item
        for item in items:
            item.completer = self.completer
            item.gate = self.gate
            item.on_settled = self._settled
            self.queue.put(item)
        return len(items)

    def _settled(self, item: InFlight, failure: BaseException | None) -> None:
        """A job whose completion was batched is settled; as for a job whose thread could not
        record its outcome, a failure to record it stops the runner (``crashed``)."""
        if failure is not None:
            self.crashed(item, failure)
        if held_back(self.completer.pending() + 1, self.size):
            # It was held back until now (see ``held_back``): the claim loop may go on. Only
            # then, so that the claim loop is not woken once per completed job.
            with self.lock:
                self.changed.notify_all()

    def seal(self) -> None:
        """Accept no more jobs. After this, ``snapshot()`` is final but for jobs finishing."""
        with self.lock:
            self._sealed = True

    def crashed(self, item: InFlight, exc: BaseException) -> None:
        logger.critical("worker could not settle job %s: %r", item.job.id, exc, exc_info=exc,
                        extra={"event": "worker_crashed", "job_id": str(item.job.id)})
        if self.on_crash is not None:
            self.on_crash(item, exc)

    def release_slot(self, item: InFlight) -> None:
        """Called with ``lock`` held when a job leaves the runner's hands."""
        if self.in_flight.get(item.job.token) is item:
            del self.in_flight[item.job.token]
            self.finished += 1
            if self._worth_waking_locked():
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
            if self.in_flight.get(item.job.token) is not item:
                return False
            item.taken_over.set()
            owner = next((w for w in self.workers if w.current is item), None)
            if owner is not None:
                owner.abandoned = True
                owner.abandoned_job = item.job.id
                item.owner = owner
                self.workers.remove(owner)
                if not self._closed:
                    self._spawn_locked()
            del self.in_flight[item.job.token]
            self.changed.notify_all()
            return True

    def interrupt(self, item: InFlight, exc_type: type[BaseException]) -> bool:
        """Raise ``exc_type`` in the thread still running ``item`` (taken over before).

        Only while that worker is still inside this job: once it has moved on (the job finished
        just as it was taken over) its thread id may even belong to a new thread by now, and an
        exception injected there would kill an innocent job. The check and the injection happen
        under the lock the worker takes to leave the job, so they cannot race.
        """
        with self.lock:
            owner = item.owner
            if owner is None or owner.current is not item or not owner.thread.is_alive():
                return False
            ident = owner.thread.ident
            return ident is not None and inject_exception(ident, exc_type)

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

    def join(self, timeout: float, settle: float = 5.0) -> None:
        """Wait for the workers, then for the completions still being written (the supervisor
        waited for the jobs already, so normally none are)."""
        deadline = time.monotonic() + timeout
        for worker in list(self.workers):
            worker.thread.join(max(0.0, deadline - time.monotonic()))
        self.completer.close(max(0.0, deadline - time.monotonic()), settle)
        if self.gate is not None:
            self.gate.close(max(0.0, deadline - time.monotonic()))
