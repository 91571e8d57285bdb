"""The supervisor's side of the worker processes: ``ProcessExecutor``.

One manager thread owns the workers: it starts them (``launch``: a fresh interpreter that never
imports the caller's ``__main__``; from this thread, so the kernel's parent-death signal is tied
to a thread that lives as long as the executor), reads every message they send, and waits on
their process sentinels, so a worker that dies by any means (segfault, ``os._exit``, the OOM
killer, SIGKILL) is noticed the moment it exits. Its in-flight jobs are then settled
``WORKER_LOST`` (charged: a poison pill still ends dead-lettered after its retries) through the
``on_lost`` callback (the supervisor settles them on its next tick), and a replacement starts.

Slots are counted here, per worker, as *lanes* (see ``protocol``): a worker's lanes take jobs
from its queue, and each lane reports the job it starts, so the supervisor knows which database
session each running job is on and when its timeout clock starts. A job taken over by the
supervisor (timeout, shutdown) frees its slot at once, whatever its thread does: the worker
retires its lane and starts a fresh one. A thread that has not returned ``grace`` seconds
after being interrupted (blocked in C, where no exception reaches it) gets its worker recycled:
no new jobs, the others get ``grace`` to finish, then the process is killed and replaced. The
same graceful recycling (without the kill) serves ``MAX_JOBS_PER_WORKER`` and
``MAX_MEMORY_PER_WORKER``.

The thread that hands a job over writes it to the worker itself: waking the manager thread to
write it would cost a thread switch per claim, more than the write. Jobs handed over together
(``submit_many``, or the waiting jobs several freed lanes take) go as one ``RUN`` message per
worker, and a worker's reader takes every message waiting on its pipe in one read. Writes never
block (``channel.Writer``): a worker whose handler holds its GIL reads nothing, and the
supervisor must not wait for it. ``PREFETCH`` claimed jobs wait for a lane: while jobs are fast,
up to ``AHEAD_PER_LANE`` per lane of them in each worker's queue (``_ahead_locked``), the rest
here. A worker that dies takes none of them with it: the ones in its queue had not started, and
go to another worker.
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
from datetime import UTC, datetime, timedelta
from typing import Any

from ..execute import InFlight
from ..executor import SlotWaits, held_back
from ..starts import Lease, StartLog
from . import protocol
from .channel import Reader, Writer
from .launch import WorkerProcess, settings_module

logger = logging.getLogger("django_persistent_jobs.runner")

#: How often the manager looks at worker memory and overdue threads when nothing happens.
HOUSEKEEPING_SECONDS = 0.25
#: Fast jobs a worker's queue may hold per lane beyond its idle lanes (``_ahead_locked``). A
#: worker reports the jobs it finished with its batch writer's ``DONE``, every few jobs, not one
#: by one: the queue must hold enough to keep its lanes busy until this process, woken by that
#: report, sends more. Measured (``bench/processes.py``, 4 lanes): 16 per lane against 4, no-op
#: drains with one worker from 0.65-0.70x to 0.83-0.85x the thread runner's rate, with a quarter
#: less CPU per job (lanes that find the queue empty sleep, wake and report); 48 gained nothing.
AHEAD_PER_LANE = 16
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
    #: Killed by the supervisor itself (a recycled worker whose grace ran out): its death is
    #: planned, not a crash.
    killed: bool = False
    gone: bool = False
    jobs_run: int = 0
    #: Its running jobs by wire id (``protocol.wire_id``), and the lane each one runs on.
    in_flight: dict[Any, InFlight] = field(default_factory=dict)
    lane_of: dict[Any, int] = field(default_factory=dict)
    #: The job each lane started last, while it is in ``in_flight``: a lane runs one job at a
    #: time, so the next ``STARTED`` on a lane says that its previous job returned.
    on_lane: dict[int, Any] = field(default_factory=dict)
    #: Jobs sent to it that have not started (no ``STARTED`` yet): they wait in its queue for
    #: a lane. And jobs taken back from that queue (shutdown): wire id -> job id.
    queued: dict[Any, InFlight] = field(default_factory=dict)
    recalled: dict[Any, Any] = field(default_factory=dict)
    #: The database session each lane last reported, and that report's number: a lane's
    #: ``SESSION`` goes on the message pipe before a job and on the start log during one, so
    #: an older one can be read after a newer (``Manager._session_locked``).
    sessions: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    session_numbers: dict[int, int] = field(default_factory=dict)
    #: Jobs taken over from it whose thread has not returned yet:
    #: wire id -> (recycle deadline, job id).
    abandoned: dict[Any, tuple[float, Any]] = field(default_factory=dict)
    #: Jobs whose handler returned and whose completion the worker is still writing
    #: (``RETURNED``, not ``DONE`` yet): no lane, no timeout, but settled if the worker dies.
    completing: dict[Any, InFlight] = field(default_factory=dict)
    reader: Reader | None = None
    writer: Writer | None = None
    #: Reads the worker's start log (``protocol``), from the manager thread only.
    starts: Reader | None = None

    def channel(self) -> Writer:
        """The non-blocking end of its pipe (set up on first use), on a descriptor of its own:
        closed by ``close_channel`` under the writer's lock, so no thread still writing to a
        worker that just died can write into a descriptor number reused meanwhile."""
        with self.send_lock:
            if self.writer is None:
                fd = os.dup(self.conn.fileno())
                os.set_blocking(fd, False)
                self.reader = Reader(fd)
                self.writer = Writer(fd)
            return self.writer

    def close_channel(self) -> None:
        with self.send_lock:
            if self.writer is not None:
                self.writer.close()

    def send(self, message: tuple[Any, ...]) -> bool:
        """Write ``message``, or queue it if the pipe is full; False if it died (the manager
        then settles its jobs) or part of the message waits for the pipe (``blocked``)."""
        try:
            return self.channel().send(message)
        except (OSError, ValueError):
            return False

    @property
    def blocked(self) -> bool:
        return self.writer is not None and bool(self.writer.pending)


def _only_stuck(worker: WorkerHandle, now: float) -> bool:
    """Whether all a recycled worker still holds is handler threads past their grace: no job
    of its own still running or being completed, so the grace its other jobs get is of no use
    and it is killed now (a handler stuck in C costs its slot for timeout + grace, not a second
    grace). Jobs still in its queue go to other workers, uncharged, as at any worker's death (a
    worker whose stuck handler holds the GIL cannot even answer for them)."""
    return bool(worker.abandoned) and not (worker.in_flight or worker.completing) and all(
        now >= at for at, _ in worker.abandoned.values())


class ProcessExecutor(SlotWaits):
    """``Executor`` over ``processes`` worker processes of ``concurrency`` threads each."""

    kind = "processes"
    #: Payloads travel as claimed (text) and each worker decodes its own: the supervisor does
    #: no per-payload work. With 900-byte payloads: half the supervisor's CPU per job (about
    #: 110 to 55 µs), the drain about a sixth faster.
    decode_at_claim = False
    shares_items = False

    def __init__(
        self, processes: int, concurrency: int, *, alias: str, runner_id: str,
        on_lost: Callable[[InFlight, str], None],
        on_crash: Callable[[InFlight, BaseException], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        max_jobs: int | None = None, max_memory_mib: float | None = None, grace: float = 5.0,
        gate_allowance: float = 0.0,
        log_levels: dict[str, int] | None = None, log_to_stderr: bool = False,
        prefetch: int = 0, lease: Lease | None = None,
        starts: StartLog | None = None,
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
        #: How much longer than its timeout a job may wait at a worker's start gate
        #: (``InFlight.start_clock``) before its deadline passes all the same.
        self.gate_allowance = gate_allowance
        #: Claimed jobs that may wait here for a lane right now (see the thread pool's);
        #: ``finished`` counts jobs that left a lane.
        self.waiting_room = max(0, prefetch)
        self.finished = 0
        self.log_levels = dict(log_levels or {})  # logger name -> level, set in each worker
        self.log_to_stderr = log_to_stderr
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.in_flight: dict[int, InFlight] = {}  # by attempt token (``Executor``)
        self.owner: dict[object, WorkerHandle] = {}  # by wire id, once given to a worker
        #: Accepted while no lane was free (``PREFETCH``, or no worker ready yet).
        self.pending: deque[InFlight] = deque()
        #: Waiting jobs (``job.waiting``) start on the fast path when a lane starts them while
        #: the runner's lease is fresh (``starts``): each ``RUN`` carries until when it is,
        #: and a lane's ``STARTED`` says whether it took the fast path, to be noted here as
        #: carried (the worker's settling statement writes it too: ``StartLog.note``) until
        #: the job's ``DONE``. (``on_start`` is the thread executor's way; a worker decides
        #: where the job starts.)
        self.lease = lease
        self.starts = starts
        self.on_start: Callable[[InFlight], None] | None = None
        #: Assigned to a lane, not written yet (only while ``lock`` is held: ``_flush_locked``).
        self._outbox: list[tuple[WorkerHandle, InFlight]] = []
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
        self._wake_lock = threading.Lock()
        #: Workers to start: only the manager thread starts them (see ``_manage``).
        self._to_spawn = 0
        self._thread = threading.Thread(target=self._manage, name="pj-workers", daemon=True)
        self._last_housekeeping = 0.0
        self._memory_warned = False
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
    def completing(self) -> int:
        with self.lock:
            return sum(len(worker.completing) for worker in self.workers)

    @property
    def running(self) -> int:
        with self.lock:
            return sum(len(w.in_flight) for w in self.workers)

    def _room(self, worker: WorkerHandle) -> int:
        """Lanes of ``worker`` that no job sent to it will take (negative: jobs wait there)."""
        return self.concurrency - len(worker.in_flight) - len(worker.queued)

    def _free_locked(self) -> int:
        room = sum(self._room(w) for w in self.workers if w.ready and not w.draining)
        # Per worker: one worker whose completions stopped landing must not borrow another's
        # allowance (its jobs would be charged ``WORKER_LOST`` if it then died).
        held = sum(held_back(len(w.completing), self.concurrency) for w in self.workers)
        return max(0, room + self.waiting_room - len(self.pending) - held)

    def free_slots(self) -> int:
        with self.lock:
            return self._free_locked()

    def _idle_locked(self) -> int:
        idle = sum(max(0, self._room(w)) for w in self.workers if w.ready and not w.draining)
        return max(0, idle - len(self.pending))

    def idle(self) -> int:
        with self.lock:
            return self._idle_locked()

    def submit_many(self, items: list[InFlight]) -> int:
        """Accept claimed jobs (all of them, or none once sealed: returns how many), writing
        each worker its share as one message."""
        with self.lock:
            if self._sealed:
                return 0
            ahead = self._ahead_locked()
            for item in items:
                self.in_flight[item.job.token] = item
                worker = None if self.pending else self._pick_locked(ahead)
                if worker is None:
                    self.pending.append(item)
                else:
                    self._assign_locked(item, worker)
            self._flush_locked()
        return len(items)

    def seal(self) -> None:
        """Accept no more jobs, and ask every worker for the jobs still in its queue.

        A job in a worker's queue is not released here: a lane may be starting it this very
        moment. Each one comes back ``UNSTARTED`` (to ``pending``, which ``unstarted()``
        lists, so the supervisor hands it back uncharged) or reports ``STARTED`` and runs on
        within the grace period like any running job. Until one of the two arrives it counts
        as running: at the end of the grace it is handed back as an interrupted attempt, never
        released as one that did not start.
        """
        with self.lock:
            self._sealed = True
            for worker in self.workers:
                self._recall_locked(worker)

    def unstarted(self) -> list[InFlight]:
        """Jobs no worker has (after ``seal()``: the ones whose worker gave them back, or
        never got them): none of them ever started."""
        with self.lock:
            return list(self.pending)

    def await_recalls(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for the workers' answers to ``seal()``'s recall: until no
        live worker holds a job that has neither started nor been given back."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while any(w.queued for w in self.workers if not w.gone):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self.changed.wait(remaining)

    def snapshot(self) -> list[InFlight]:
        with self.lock:
            return list(self.in_flight.values())

    def take_over(self, item: InFlight) -> bool:
        """Take a job back and free its slot. A running job has its lane retired (its thread
        may never return) and the worker starts a fresh lane in its place; one waiting in a
        worker's queue is told not to start (``INTERRUPT``); one still waiting here simply
        never goes."""
        with self.lock:
            if self.in_flight.get(item.job.token) is not item:
                return False
            item.taken_over.set()
            del self.in_flight[item.job.token]
            wire_id = protocol.wire_id(item.job)
            worker = self.owner.pop(wire_id, None)
            if worker is None:
                with contextlib.suppress(ValueError):
                    self.pending.remove(item)
            elif worker.queued.pop(wire_id, None) is not None:
                # Not started as far as we know: if its STARTED crosses the INTERRUPT, it is
                # watched like any job taken over while it ran (``_started_locked``).
                worker.recalled[wire_id] = item.job.id
                item.owner = (worker, None)
            else:
                worker.in_flight.pop(wire_id, None)
                lane = worker.lane_of.pop(wire_id, None)
                item.owner = (worker, lane)
                if lane is not None:
                    worker.sessions.pop(lane, None)  # the worker retires that lane
                    worker.on_lane.pop(lane, None)
                if worker in self.workers:
                    worker.abandoned[wire_id] = (time.monotonic() + self.grace, item.job.id)
                self._assign_pending_locked()
            self.changed.notify_all()
        self._wake()
        return True

    def interrupt(self, item: InFlight, exc_type: type[BaseException]) -> bool:
        """Tell the worker to stop the job's handler and retire its lane (or, if the job is
        still in its queue, never to start it)."""
        owner = item.owner
        if not isinstance(owner, tuple):
            return False
        return self._send(owner[0], (protocol.INTERRUPT, protocol.wire_id(item.job)))

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self._sealed = True
            workers = list(self.workers)
            self.changed.notify_all()
        for worker in workers:
            worker.stop_sent = True
            self._send(worker, (protocol.STOP,))
        self._wake()

    def join(self, timeout: float, settle: float = 5.0) -> None:
        """Wait for the workers to exit; kill those that do not within ``timeout``."""
        if self._thread.ident is None:
            self._close_wake_pipe()
            return  # never started (a stop before the boot got here): no worker exists
        self._thread.join(timeout)
        with self.lock:
            left = list(self.workers)
        for worker in left:
            self._kill(worker)
        if left:
            self._thread.join(max(0.0, settle))
        if not self._thread.is_alive():
            self._close_wake_pipe()

    # ------------------------------------------------------------------ placement
    def _ahead_locked(self) -> int:
        """How many jobs a worker may hold beyond its idle lanes: up to ``AHEAD_PER_LANE``
        per lane while jobs are fast (the adaptive waiting room is large: many finished in
        its lookahead), none while they are slow or ``PREFETCH`` is small. A job waiting in a
        worker's queue starts the moment any of its lanes is free, without a round trip
        through this process; but it cannot move to another worker that becomes idle first,
        so slow jobs wait here instead."""
        workers = sum(1 for w in self.workers if w.ready and not w.draining)
        return min(AHEAD_PER_LANE * self.concurrency,
                   self.waiting_room // (2 * max(1, workers)))

    def _pick_locked(self, ahead: int) -> WorkerHandle | None:
        """The worker with the most room (None if none has any)."""
        best: WorkerHandle | None = None
        best_room = 0
        for worker in self.workers:
            if not worker.ready or worker.draining:
                continue
            room = self._room(worker) + ahead
            if room > best_room:
                best, best_room = worker, room
        return best

    def _assign_locked(self, item: InFlight, worker: WorkerHandle) -> None:
        """Send ``item`` to ``worker``'s queue (written before the lock is released). Its
        timeout clock starts when a lane reports it ``STARTED``: a job that waited here or
        there for a lane lost no time."""
        wire_id = protocol.wire_id(item.job)
        worker.queued[wire_id] = item
        self.owner[wire_id] = worker
        self._outbox.append((worker, item))
        worker.jobs_run += 1
        if self.max_jobs is not None and worker.jobs_run >= self.max_jobs:
            self._recycle_locked(worker, f"it ran {worker.jobs_run} jobs (MAX_JOBS_PER_WORKER)")

    def _started_locked(self, worker: WorkerHandle, lane: int, wire_id: Any, fast: bool,
                        started_at: float) -> bool:
        """A lane of ``worker`` started the job at ``started_at`` (the worker's monotonic
        clock, the same clock as ours): its timeout clock starts then; a waiting job started
        on the fast path has its start noted, as carried by the job's settling in the worker
        (``StartLog.note``). The job the lane ran
        before, if its ``RETURNED`` or ``DONE`` is still on its way, returned: it is
        completing from now on. True if that freed a lane (more jobs may be sent)."""
        now = time.monotonic()
        started = min(started_at, now)
        freed = False
        previous = worker.on_lane.get(lane)
        if previous is not None and previous != wire_id:
            before = self._release_locked(worker, previous)
            if before is not None:
                worker.completing[previous] = before
                freed = True
        item = worker.queued.pop(wire_id, None)
        if item is None:
            job_id = worker.recalled.pop(wire_id, None)
            if job_id is not None:
                # Taken back as unstarted, but it started before our INTERRUPT arrived: the
                # worker stops it and retires its lane; watch it as any job taken over.
                worker.sessions.pop(lane, None)
                worker.abandoned[wire_id] = (now + self.grace, job_id)
            return freed
        worker.in_flight[wire_id] = item
        worker.lane_of[wire_id] = lane
        worker.on_lane[lane] = wire_id
        if fast and item.job.waiting:
            item.job.waiting = False
            if self.starts is not None:
                # When it started (the lane's clock is ours), not when we read of it: the
                # attempt's ``started_at`` is written from this if a claim comes first.
                item.job.began = self.starts.note(
                    item.job.token, datetime.now(UTC) - timedelta(seconds=now - started),
                    carried=True)
        session = worker.sessions.get(lane)
        if session is not None:
            item.backend_pid, item.backend_start = session
        # A job still waiting goes through the worker's gate first: its clock starts again at
        # its ``ADMITTED``, once its start is on record.
        item.start_clock(started, self.gate_allowance if item.job.waiting else 0.0)
        return freed

    def _admitted_locked(self, worker: WorkerHandle, wire_id: Any, started_at: float) -> None:
        """The waiting job ``wire_id`` passed ``worker``'s gate: its handler starts at
        ``started_at`` (the worker's monotonic clock, ours), and its timeout clock with it."""
        item = worker.in_flight.get(wire_id)
        if item is None:
            return  # finished or taken over meanwhile
        item.start_clock(min(started_at, time.monotonic()))

    def _session_locked(self, worker: WorkerHandle, lane: int, number: int, pid: int,
                        started: Any) -> None:
        """``lane`` of ``worker`` runs its jobs on this database session from now on: the
        job on it now, and the next ones (``_started_locked``). ``number`` orders a lane's
        reports: one read after a newer one (from the message pipe, read in the same pass as
        the start log) is out of date and ignored."""
        if number <= worker.session_numbers.get(lane, 0):
            return
        worker.session_numbers[lane] = number
        worker.sessions[lane] = (pid, started)
        for wire_id, its_lane in worker.lane_of.items():
            if its_lane == lane:  # a lane runs one job at a time
                item = worker.in_flight[wire_id]
                item.backend_pid, item.backend_start = pid, started

    def _read_starts(self, worker: WorkerHandle) -> None:
        """Take in everything ``worker``'s start log holds (manager thread only): after its
        messages are read and before they are handled, so that a job's ``STARTED`` is known
        before its ``RETURNED`` or ``DONE``; at housekeeping, for jobs that started while
        the worker sent nothing else; and before its jobs are settled when it died."""
        reader = worker.starts
        if reader is None or worker.gone:
            return
        try:
            messages = reader.drain()  # (non-blocking: what is there, up to an end of file)
        except OSError:
            return  # its end closed: it is exiting, which the message pipe and pidfd tell
        if not messages:
            return
        with self.lock:
            freed = False
            for message in messages:
                if message[0] == protocol.STARTED:
                    freed = self._started_locked(worker, *message[1:]) or freed
                elif message[0] == protocol.ADMITTED:
                    self._admitted_locked(worker, *message[1:])
                elif message[0] == protocol.SESSION:
                    self._session_locked(worker, *message[1:])
            if freed:
                self._assign_pending_locked()
            # (``await_recalls`` waits for the queues to empty once sealed.)
            if self._sealed or (freed and self._worth_waking_locked()):
                self.changed.notify_all()

    def _recall_locked(self, worker: WorkerHandle) -> None:
        """Ask ``worker`` for the jobs in its queue (``RECALL``): the ones no lane has taken
        come back ``UNSTARTED`` (``_unstarted_locked``), the rest run there. Written under the
        lock, after any ``RUN`` still being assembled, so the worker knows every job named."""
        self._flush_locked()
        if worker.queued and not worker.gone:
            self._send(worker, (protocol.RECALL, list(worker.queued)))

    def _unstarted_locked(self, worker: WorkerHandle, wire_ids: list[Any]) -> None:
        """``worker`` will never start these: a job it was asked for goes back to ``pending``
        (to another worker, or handed back if the runner is stopping), uncharged; one that
        was taken over while queued (``recalled``) was settled already."""
        returned: list[InFlight] = []
        for wire_id in wire_ids:
            if worker.recalled.pop(wire_id, None) is not None:
                continue
            item = worker.queued.pop(wire_id, None)
            if item is None:
                continue
            self.owner.pop(wire_id, None)
            if self.in_flight.get(item.job.token) is item:
                returned.append(item)
        self.pending.extendleft(reversed(returned))
        self._assign_pending_locked()
        self.changed.notify_all()

    def _assign_pending_locked(self) -> None:
        """Send waiting jobs to workers with room (none once sealed: they are handed back)."""
        if not self._sealed:
            ahead = self._ahead_locked()
            while self.pending:
                worker = self._pick_locked(ahead)
                if worker is None:
                    break
                self._assign_locked(self.pending.popleft(), worker)
        self._flush_locked()

    def _flush_locked(self) -> None:
        """Write the jobs just assigned: one ``RUN`` message per worker.

        Written before the lock is released, so that whatever follows about one of these jobs
        (an ``INTERRUPT`` from whoever takes it over, a ``CANCEL``) is written after it.
        """
        if not self._outbox:
            return
        # One message per worker and fast-path deadline: a job claimed in an earlier period of
        # the lease (``starts.Lease``) goes with none.
        batches: dict[tuple[WorkerHandle, float], list[tuple[tuple[Any, ...], bool]]] = {}
        lease, deadlines = self.lease, {}
        for worker, item in self._outbox:
            period = item.job.lease_period
            if period not in deadlines:  # read once per flush: one message per worker
                deadlines[period] = lease.fresh_until(period) if lease is not None else 0.0
            fresh_until = deadlines[period]
            batches.setdefault((worker, fresh_until), []).append(
                (protocol.pack_job(item.job), item.ctx.cancel_requested))
        self._outbox.clear()
        for (worker, fresh_until), batch in batches.items():
            self._send(worker, (protocol.RUN, batch, fresh_until))

    def cancel(self, item: InFlight) -> None:
        """Set the job's cancel flag here (a job still waiting takes it along in its ``RUN``)
        and tell its worker. Under the lock ``RUN`` messages are written with, so a ``CANCEL``
        follows the job's ``RUN``."""
        with self.lock:
            item.ctx._cancel_event.set()
            wire_id = protocol.wire_id(item.job)
            worker = self.owner.get(wire_id)
            if worker is not None:
                self._send(worker, (protocol.CANCEL, wire_id))

    def _send(self, worker: WorkerHandle, message: tuple[Any, ...]) -> bool:
        """Send from any thread; if the pipe is full, the manager thread writes the rest."""
        if worker.send(message):
            return True
        self._wake()
        return False

    # ------------------------------------------------------------------ lifecycle
    def _spawn_locked(self) -> WorkerHandle:
        self._numbers += 1
        options = {"alias": self.alias, "runner_id": self.runner_id, "number": self._numbers,
                   "concurrency": self.concurrency, "codec": protocol.codec_signature(),
                   "log_levels": self.log_levels, "log_to_stderr": self.log_to_stderr}
        process = WorkerProcess(options, label=f"pj-worker:{self.runner_id}:{self._numbers}")
        worker = WorkerHandle(number=self._numbers, process=process, conn=process.conn,
                              pid=process.pid)
        if process.start_log is not None:
            worker.starts = Reader(process.start_log)
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
            if worker.kill_at is None:
                # It will be killed: jobs still in its queue go to other workers (uncharged)
                # instead of starting there and being charged for the kill. Asked once: a
                # draining worker is sent no new jobs.
                self._recall_locked(worker)
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

    def _fresh_worker_too_big_locked(self, rss: int) -> None:
        """A worker that has run nothing is over ``MAX_MEMORY_PER_WORKER``: it leaked nothing,
        and its replacement would be as big, so it stays (replacing it would start a process a
        second, forever). Said once, as a warning: the limit is set too low to mean anything."""
        if self._memory_warned or self.max_memory is None:
            return
        self._memory_warned = True
        logger.warning(
            "runner %s: MAX_MEMORY_PER_WORKER (%.0f MiB) is below the memory of a worker that "
            "has not run a job yet (%.0f MiB RSS): each worker is recycled after its first "
            "job. Set it well above a fresh worker's size.", self.runner_id,
            self.max_memory / 2**20, rss / 2**20,
            extra={"event": "worker_memory_limit_low", "runner_id": self.runner_id})

    def _kill(self, worker: WorkerHandle) -> None:
        with contextlib.suppress(Exception):
            worker.process.kill()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return  # joined: nobody is there to wake
            with contextlib.suppress(OSError):  # a full pipe already means "wake up"
                os.write(self._wake_w, b"w")

    def _close_wake_pipe(self) -> None:
        """Close the wake-up pipe once the manager thread is gone (a runner started again in
        this process must not gather two descriptors per executor). Under its lock, so a late
        ``_wake`` never writes to a descriptor number reused by something else."""
        with self._wake_lock:
            if self._wake_w < 0:
                return
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ the manager thread
    def _manage(self) -> None:
        selector = self._selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        watched: set[WorkerHandle] = set()
        writing: set[WorkerHandle] = set()  # watched for writability too (a full pipe)
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
                writing &= watched
                woken: dict[WorkerHandle, bool] = {}
                for key, mask in selector.select(timeout=HOUSEKEEPING_SECONDS):
                    if key.data is None:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                        continue
                    worker = key.data
                    exited = key.fd == worker.process.sentinel
                    if mask & selectors.EVENT_WRITE and worker.writer is not None:
                        with contextlib.suppress(OSError):
                            worker.writer.flush()
                    if mask & selectors.EVENT_READ:
                        woken[worker] = woken.get(worker, False) or exited
                for worker, exited in woken.items():
                    self._receive(worker, exited)
                for worker in watched:
                    if worker.blocked != (worker in writing) and not worker.gone:
                        events = selectors.EVENT_READ
                        if worker.blocked:
                            events |= selectors.EVENT_WRITE
                            writing.add(worker)
                        else:
                            writing.discard(worker)
                        selector.modify(worker.conn.fileno(), events, worker)
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
        finally:
            selector.close()

    def _receive(self, worker: WorkerHandle, exited: bool) -> None:
        """Handle what ``worker`` sent; once it has exited, settle its jobs and replace it."""
        if worker.gone:
            return
        worker.channel()
        reader = worker.reader
        assert reader is not None
        try:
            # One read per wake-up (the selector reports whatever is left); everything once
            # the process has exited.
            messages = reader.drain() if exited else reader.read()
        except (EOFError, OSError):
            messages, exited = [], True  # its end of the pipe closed: it is exiting
        # Then the start log: every ``STARTED`` a lane wrote before any of these messages
        # is in it by now (a job's start is known before its ``DONE``).
        self._read_starts(worker)
        try:
            for message in messages:
                self._handle(worker, message)
        except (EOFError, OSError):
            exited = True
        if exited:
            self._read_starts(worker)  # the last starts, before its jobs are settled
            self._lost(worker)
            worker.close_channel()

    def _handle(self, worker: WorkerHandle, message: tuple[Any, ...]) -> None:
        tag = message[0]
        if tag == protocol.RETURNED:
            # The handlers returned; their completions are being written in the worker. The
            # lanes take the next jobs now: waiting for a commit is not running a handler.
            with self.lock:
                for wire_id in message[1]:
                    item = self._release_locked(worker, wire_id)
                    if item is not None:  # (None: taken over, or its DONE came first)
                        worker.completing[wire_id] = item
                self._assign_pending_locked()
                if self._worth_waking_locked():  # (see ``SlotWaits``: not once per report)
                    self.changed.notify_all()
        elif tag == protocol.DONE:
            settled: list[int] = []
            with self.lock:
                for wire_id in message[1]:
                    item = worker.completing.pop(wire_id, None)
                    if item is None:
                        worker.abandoned.pop(wire_id, None)
                        worker.recalled.pop(wire_id, None)
                        # (None: taken over, lane retired)
                        item = self._release_locked(worker, wire_id)
                    if item is not None:
                        settled.append(item.job.token)
                self._assign_pending_locked()
                if self._worth_waking_locked():
                    self.changed.notify_all()
            if self.starts is not None:
                # Settled by the worker, its start with it (or the attempt is not ours any
                # more): no claim need write it.
                self.starts.carried_done(settled)
        elif tag == protocol.UNSTARTED:
            with self.lock:
                self._unstarted_locked(worker, message[1])
        elif tag == protocol.SESSION:
            with self.lock:
                self._session_locked(worker, *message[1:])
        elif tag == protocol.READY:
            with self.lock:
                worker.ready = True
                self._assign_pending_locked()
                self.changed.notify_all()
            logger.debug("worker %d ready", worker.number, extra={"event": "worker_ready"})
        elif tag == protocol.CRASHED:
            item = worker.in_flight.get(message[1]) or worker.completing.get(message[1])
            if item is not None and item.job.began is not None and self.starts is not None:
                # Its settling failed, so its start may not be on record: due now, and kept
                # past the ``DONE`` that follows.
                self.starts.restore({item.job.token: item.job.began})
            if item is not None and self.on_crash is not None:
                self.on_crash(item, RuntimeError(message[2]))

    def _release_locked(self, worker: WorkerHandle, wire_id: Any) -> InFlight | None:
        """The job ``worker`` ran on one of its lanes, now off it: the lane is free and the job
        no longer held (a ``RETURNED`` or ``DONE``). None if it was not on a lane any more."""
        item = worker.in_flight.pop(wire_id, None)
        if item is None:
            return None
        lane = worker.lane_of.pop(wire_id, None)
        if lane is not None and worker.on_lane.get(lane) == wire_id:
            del worker.on_lane[lane]
        self.owner.pop(wire_id, None)
        self.finished += 1
        if self.in_flight.get(item.job.token) is item:
            del self.in_flight[item.job.token]
        return item

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
                    if self.in_flight.get(item.job.token) is item]
            # Jobs still in its queue never started: another worker runs them, uncharged.
            requeued = [item for item in worker.queued.values()
                        if self.in_flight.get(item.job.token) is item]
            for wire_id in worker.queued:
                self.owner.pop(wire_id, None)
            worker.queued.clear()
            worker.recalled.clear()
            self.pending.extendleft(reversed(requeued))
            # Handlers that returned, completions not known to be written: whether they
            # committed is for the fenced settlement to find out (a written one is left alone).
            # Back in ``in_flight`` so that the settlement can take them over.
            for item in worker.completing.values():
                if item.job.token not in self.in_flight:
                    self.in_flight[item.job.token] = item
                    lost.append(item)
            worker.completing.clear()
            expected = (worker.stop_sent or worker.killed) and not lost
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
            self._assign_pending_locked()
            self.changed.notify_all()
        worker.process.close()
        if failure is not None and not self._starting:
            logger.critical("runner %s: %s", self.runner_id, failure,
                            extra={"event": "loop_died", "loop": "workers"})
            if self.on_failure is not None:
                self.on_failure(failure)
        if expected:
            if worker.killed:
                # Planned (its recycling's grace ran out), and it took no job down with it:
                # not a ``worker_lost``, which operators alert on.
                logger.info("runner %s: worker %d (pid %s) killed at the end of its recycling "
                            "grace (%s)", self.runner_id, worker.number, worker.pid, how,
                            extra={"event": "worker_killed", "worker_pid": worker.pid,
                                   "runner_id": self.runner_id})
            else:
                logger.debug("worker %d exited", worker.number,
                             extra={"event": "worker_exited"})
            return
        logger.warning(
            "runner %s: worker %d (pid %s) died (%s) with %d job(s) in flight%s", self.runner_id,
            worker.number, worker.pid, how, len(lost),
            f"; the {len(requeued)} waiting in its queue, not started, go to another worker "
            "uncharged" if requeued else "",
            extra={"event": "worker_lost", "worker_pid": worker.pid, "runner_id": self.runner_id,
                   "job_ids": [str(item.job.id) for item in lost]},
        )
        why = (f"worker process {worker.pid} of runner {self.runner_id} died ({how}) while "
               "running this attempt")
        for item in lost:
            self.on_lost(item, why)

    def _housekeeping(self) -> None:
        with self.lock:
            workers = list(self.workers)
        for worker in workers:
            # The starts of jobs that began while the worker sent nothing else (and anything
            # it did send).
            self._receive(worker, False)
        now = time.monotonic()
        kills: list[WorkerHandle] = []
        stops: list[WorkerHandle] = []
        with self.lock:
            check_memory = (self.max_memory is not None
                            and now - self._last_housekeeping >= 1.0)
            if check_memory:
                self._last_housekeeping = now
            for worker in list(self.workers):
                overdue = [job_id for at, job_id in worker.abandoned.values() if now >= at]
                if overdue:
                    self._recycle_locked(
                        worker, f"the handler of job {overdue[0]} did not return within "
                        f"{self.grace:g}s of being stopped", kill_after=self.grace)
                if (check_memory and worker.ready and not worker.draining
                        and worker.pid is not None):
                    rss = rss_bytes(worker.pid)
                    if rss is not None and self.max_memory is not None and rss > self.max_memory:
                        if worker.jobs_run:
                            self._recycle_locked(worker, f"its memory ({rss / 2**20:.0f} MiB "
                                                 "RSS) exceeds MAX_MEMORY_PER_WORKER")
                        else:
                            self._fresh_worker_too_big_locked(rss)
                if worker.draining and not worker.stop_sent:
                    if not (worker.in_flight or worker.queued or worker.abandoned
                            or worker.completing):
                        worker.stop_sent = True
                        stops.append(worker)
                    elif worker.kill_at is not None and (
                            now >= worker.kill_at or _only_stuck(worker, now)):
                        kills.append(worker)
                elif worker.stop_sent and worker.kill_at is not None and now >= worker.kill_at:
                    kills.append(worker)
            for worker in kills:
                worker.killed = True
        for worker in stops:
            self._send(worker, (protocol.STOP,))
        for worker in kills:
            self._kill(worker)
