"""What runs inside a worker process: jobs on threads, executed exactly as the thread runner does.

A worker is a fresh interpreter (not a fork: the supervisor has threads and open database
connections, neither of which survives a fork safely) started by ``launch`` with the
supervisor's ``sys.path``; it imports nothing of the program that started the supervisor (its
``__main__`` included). ``boot`` sets Django up from the supervisor's settings module, then runs
each job the supervisor sends on a thread of its own, through ``execute.execute``: the handler's
writes and the fenced completion commit in one transaction on this worker's connection, the one
code path for both executors.

The worker never outlives its supervisor: the kernel sends it SIGKILL when the supervisor dies
(``PR_SET_PDEATHSIG``, Linux), and the pipe reader exits the process when the pipe reaches EOF.
Only the standard library is imported at module level: Django is not set up yet when the
spawned interpreter imports this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .. import heap, syscalls
from . import protocol
from .channel import Reader, frame

PR_SET_PDEATHSIG = 1

logger = logging.getLogger("django_persistent_jobs.runner")
#: A job that returns this close to its timeout (seconds) may be being taken over for it right
#: now: its lane gets a fresh database session before its next job (``Worker._run``). At most
#: this share of a timeout under 2 s: with a 1 s timeout a margin of 1 s would open a
#: connection for every job, a few milliseconds each. (Half of it still leaves the supervisor
#: half a second to hear that the job returned, a report that may wait for a batch's commit.)
LATE_RETURN_MARGIN = 1.0
LATE_RETURN_SHARE = 0.5
#: At exit, how long completions still being written get (the supervisor kills a worker that
#: has not exited 2 s after being told to stop).
EXIT_COMPLETION_SECONDS = 1.5


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when the thread that started it exits.

    The supervisor starts workers from one long-lived thread (its worker manager), so that
    thread's exit means the supervisor is stopping or dead. If the parent already died before
    this call, nobody would send the signal: exit now.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(0)


def boot(conn: Any, start: dict[str, Any]) -> None:
    """The worker process's entry point, called by ``launch``'s bootstrap with the pipe to the
    supervisor and its start message."""
    # Its end of the pipe was inherited; a process a handler starts must not inherit it too.
    with contextlib.suppress(OSError):
        os.set_inheritable(conn.fileno(), False)
    start_log = start["start_log_fd"]
    with contextlib.suppress(OSError):
        os.set_inheritable(start_log, False)
    options = {**start["options"], "start_log_fd": start_log}
    if start.get("settings_module"):
        os.environ["DJANGO_SETTINGS_MODULE"] = start["settings_module"]
    worker_main(conn, start["parent_pid"], options)


def worker_main(conn: Any, parent_pid: int, options: dict[str, Any]) -> None:
    """Set Django up and serve the supervisor until it says stop or goes away."""
    die_with_parent(parent_pid)
    # Signals are the supervisor's business: a Ctrl-C reaches the whole process group, and the
    # supervisor decides what the workers do (finish within the grace, then stop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import django

    django.setup()
    for name, level in options.get("log_levels", {}).items():  # the supervisor's levels
        logging.getLogger(name).setLevel(level)
    package_logger = logging.getLogger("django_persistent_jobs")
    if options.get("log_to_stderr") or not package_logger.hasHandlers():
        # As runjobs does in the supervisor: a silent worker is worse than a plain one.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    expected = options.get("codec")
    if expected is not None and expected != protocol.codec_signature():
        # Exits before READY: the supervisor counts a failed start, and stops loudly rather
        # than hand jobs to a process that would read them wrongly.
        logger.critical(
            "worker %s: its code differs from its supervisor's (jobs travel as %s, the "
            "supervisor sends %s): the package on disk changed while runjobs was running. "
            "Restart runjobs.", options.get("number"), protocol.codec_signature(), expected,
            extra={"event": "worker_code_mismatch"})
        logging.shutdown()
        os._exit(3)
    worker = Worker(conn, options)
    with heap.settled():  # after start-up: see ``heap``
        worker.serve()



@dataclass(eq=False)
class Lane:
    """One thread of the worker: it takes the next job from the worker's queue, whichever job
    that is, and keeps its database connection from job to job. ``session`` is the one the
    supervisor was last told about (``SESSION``), ``raw`` the connection it belongs to. A
    lane whose job the supervisor took over is retired: its thread exits once that job
    returns (``Worker._run``), and a fresh lane takes its place (``Worker._interrupt``)."""

    number: int
    session: tuple[Any, Any] | None = None
    raw: Any = None
    #: The job it took from the queue to run next (see ``Worker._run``).
    next: tuple[tuple[Any, ...], bool, float] | None = None
    #: ``Worker._session_changed`` for this lane, made once: each job's ``on_session``.
    on_session: Any = None
    #: ``SESSION`` reports sent so far (each carries its number: see ``_session_report``).
    reports: int = 0


class Worker:
    """Receives jobs on the pipe, runs each on the thread of the lane the supervisor chose,
    reports back."""

    def __init__(self, conn: Any, options: dict[str, Any]) -> None:
        # Imported here, once Django is set up, rather than in the per-job methods.
        from django.db import connections

        from ...context import JobContext
        from .. import execute

        self._context = JobContext
        self._execute = execute
        self.conn = conn
        self.fd: int = conn.fileno()
        self.start_log: int = options["start_log_fd"]
        # Non-blocking, because ``syscalls.write_whole`` holds the GIL through its write: on a
        # blocking pipe, a full log would stop every thread of this process, not just the
        # lane writing to it, until the supervisor read it.
        os.set_blocking(self.start_log, False)
        self.alias: str = options["alias"]
        self.runner_id: str = options["runner_id"]
        self.number: int = options["number"]
        self.connections = connections
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        #: Jobs sent and not started yet, taken by whichever lane is free first.
        self.queue: queue.SimpleQueue[tuple[tuple[Any, ...], bool, float]] = queue.SimpleQueue()
        self.concurrency: int = options.get("concurrency", 1)
        self.next_lane = 0
        self.running: dict[Any, Any] = {}  # wire id -> InFlight, while its handler runs
        #: Sent to a lane and not started yet; of those, the ones the supervisor took back,
        #: and the ones an operator asked to cancel.
        self.queued: set[Any] = set()
        self.skip: set[Any] = set()
        self.cancelled: set[Any] = set()
        #: ``(tag, wire id)`` not yet reported; whether a thread is reporting now.
        self.finished: list[tuple[str, Any]] = []
        self.reporting = False
        self.never = threading.Event()  # settling retries until done: the supervisor kills us
        from ..completer import Completer
        from ..progress import ProgressWriter

        self.progress = ProgressWriter(self.alias)  # ``ctx.report_progress``'s connection

        self.completer = Completer()  # batches the completions of handlers that ran no SQL
        # The jobs of one batch are settled one after the other on the completer's thread:
        # their ``DONE``s wait (``_settled``) and go in one message once the batch is through.
        self.completer.after_batch = self._flush_reports
        from ..starts import StartGate

        self.gate = StartGate(self.alias, self.never)  # records waiting jobs' starts first

    def send(self, message: tuple[Any, ...]) -> None:
        self.send_many([message])

    def send_many(self, messages: list[tuple[Any, ...]]) -> None:
        """Write ``messages`` in one system call. ``Connection``'s framing (the supervisor
        reads it with ``channel.Reader``) without ``Connection.send``'s pickler object and
        second copy: this runs about once per job."""
        data = b"".join(frame(message) for message in messages)
        with self.send_lock:
            try:
                while data:
                    data = data[os.write(self.fd, data):]
            except OSError:
                os._exit(0)  # the supervisor is gone

    def serve(self) -> None:
        for _ in range(self.concurrency):
            self._add_lane()
        self.send((protocol.READY, os.getpid()))
        reader = Reader(self.fd)
        while True:
            try:
                messages = reader.read()
            except (EOFError, OSError):
                self._exit()  # the supervisor is gone
                return
            for message in messages:
                tag = message[0]
                if tag == protocol.RUN:
                    self._start(message[1], message[2])
                elif tag == protocol.CANCEL:
                    self._cancel(message[1])
                elif tag == protocol.INTERRUPT:
                    self._interrupt(message[1])
                elif tag == protocol.RECALL:
                    self._recall(message[1])
                elif tag == protocol.STOP:
                    self._exit()
                    return

    def _exit(self) -> None:
        """Leave at once (after the completions handed over are written): whatever still runs
        here was settled by the supervisor already."""
        with contextlib.suppress(Exception):
            self.progress.close()
        with contextlib.suppress(Exception):
            self.completer.close(EXIT_COMPLETION_SECONDS)
        logging.shutdown()
        os._exit(0)

    # ------------------------------------------------------------------ lanes
    def _start(self, batch: list[tuple[tuple[Any, ...], bool]], fresh_until: float) -> None:
        with self.lock:
            self.queued.update(packed[protocol.TOKEN] for packed, _ in batch)
        for packed, cancel in batch:
            self.queue.put((packed, cancel, fresh_until))

    def _add_lane(self) -> None:
        with self.lock:
            lane = Lane(self.next_lane)
            self.next_lane += 1
        lane.on_session = functools.partial(self._session_changed, lane)
        threading.Thread(target=self._lane_main, args=(lane,),
                         name=f"pj-w{self.number}-lane{lane.number}", daemon=True).start()

    def _lane_main(self, lane: Lane) -> None:
        try:
            self._execute.warm_connection(self.alias)  # before its first job, not during it
            while True:
                entry, lane.next = lane.next, None
                packed, cancel, fresh_until = entry if entry is not None else self.queue.get()
                if not self._run(lane, packed, cancel, fresh_until):
                    return  # retired; an interrupted thread may hold a pending async exception
        except self._execute.JobInterrupted:
            pass
        finally:
            with contextlib.suppress(Exception):
                self.connections.close_all()

    def _run(self, lane: Lane, packed: tuple[Any, ...], cancel: bool, fresh_until: float
             ) -> bool:
        """Run one job; False if the supervisor took it over (the lane is then retired).

        A job that waited for a worker starts on the fast path if the runner's lease was
        fresh until now (``fresh_until``, ``starts.Lease``): the supervisor notes its start
        from the ``STARTED`` report. Otherwise it passes the gate, which records the start
        before the handler runs."""
        execute = self._execute
        wire_id = packed[protocol.TOKEN]
        job = protocol.unpack_job(packed)
        fast = job.waiting and time.monotonic() < fresh_until
        if fast:
            job.waiting = False
            # Its start is written by the supervisor's next claim, or by the statement that
            # settles it here if that comes first (``ClaimedJob.began``).
            job.began = datetime.now(UTC)
        ctx = self._context(
            job_id=job.id, job_type=job.job_type, attempt=job.attempt,
            max_retries=job.max_retries, runner_id=self.runner_id, queue=job.queue,
            priority=job.priority, timeout=job.timeout, tenant=job.tenant,
            _progress_sink=self._report_progress, _token=job.token,
        )
        if cancel:
            ctx._cancel_event.set()
        # No ``thread_ident`` yet: ``_interrupt`` injects nothing into this thread until the
        # reports below are written (an exception landing inside a write would drop other
        # jobs' reports, or cut a message in half).
        item = execute.InFlight(job=job, ctx=ctx, deadline=None, completer=self.completer,
                                gate=self.gate)
        with self.lock:
            self.queued.discard(wire_id)
            if self.cancelled and wire_id in self.cancelled:
                self.cancelled.discard(wire_id)
                ctx._cancel_event.set()
            skipped = wire_id in self.skip
            if skipped:
                self.skip.discard(wire_id)
            else:
                self.running[wire_id] = item
        if skipped:  # taken back before it started (answered ``UNSTARTED``): never runs here
            return True
        deferred = False
        # Not a closure over ``item``: stored on it, that would make every job a reference
        # cycle, freed only by the garbage collector (see ``execute.InFlight.on_settled``).
        item.on_settled = functools.partial(self._settled, wire_id=wire_id)
        item.on_admitted = self._report_admitted
        item.on_session = lane.on_session
        try:
            self._report_session(lane, item)
            self._report_started(lane, wire_id, fast)
            with self.lock:
                # Taken over while its start was being reported (an ``INTERRUPT`` that crossed
                # the ``STARTED``): it does not start; else it may be interrupted from now on.
                armed = not item.taken_over.is_set()
                if armed:
                    item.thread_ident = threading.get_ident()
            if armed:
                deferred = execute.execute(self.alias, item, self.runner_id, self.never)
        except execute.JobInterrupted:
            pass
        except BaseException as exc:
            if not item.taken_over.is_set():
                self.send((protocol.CRASHED, wire_id, f"{type(exc).__name__}: {exc}"))
        finally:
            interrupted = self._leave(wire_id, item)
        if interrupted and item.thread_ident is not None:
            # Operators want to know whether timed-out code ever returns (one blocked in C
            # does not: its worker is recycled instead).
            logger.info("abandoned worker for job %s exited", job.id,
                        extra={"event": "abandoned_worker_exited", "job_id": str(job.id)})
        if not interrupted and job.timeout and time.monotonic() - ctx.started_monotonic >= (
                job.timeout - min(LATE_RETURN_MARGIN, job.timeout * LATE_RETURN_SHARE)):
            # It returned about when the supervisor may be taking it over for its timeout,
            # which terminates the session it ran on (whether it completed in its own
            # transaction or handed its completion over): the next job must not be on that
            # session. A fresh connection (and ``SESSION``) for the next job.
            self._drop_connection(lane)
        if not deferred:
            # (Also when a timeout's interrupt reached this thread just after the completion
            # was handed over: the completer's report then finds it reported.)
            self._done_once(item, wire_id)
        elif not interrupted:
            # Its completion is being written (``on_settled`` reports it done): the lane is
            # free for the next job meanwhile. If one is waiting here, this lane takes it now:
            # its ``RETURNED`` goes with the batch's ``DONE`` (and the supervisor, reading the
            # next job's ``STARTED`` on this lane, knows that this one returned); if none is,
            # the lane is idle and the supervisor must know now, to send more.
            with self.lock:
                if not item.done_reported:  # (its batch may be settled and reported already)
                    self.finished.append((protocol.RETURNED, wire_id))
            try:
                lane.next = self.queue.get_nowait()
            except queue.Empty:
                self._flush_reports()
        return not interrupted

    def _drop_connection(self, lane: Lane) -> None:
        with contextlib.suppress(Exception):
            self.connections[self.alias].close()
        lane.raw = None

    def _leave(self, wire_id: Any, item: Any) -> bool:
        """Forget a job whose handler returned; True if the supervisor had taken it over.

        ``_interrupt`` injects its exception only while the job is in ``running``, under the
        lock taken here: an exception injected just as the handler returned fires as this
        thread takes the lock, once. Then it is simply done again.
        """
        for _ in range(2):
            try:
                with self.lock:
                    self.running.pop(wire_id, None)
                    return bool(item.taken_over.is_set())
            except self._execute.JobInterrupted:
                continue
        return True

    def _report_session(self, lane: Lane, item: Any) -> None:
        """Before the handler starts, tell the supervisor which database session it runs on,
        if that is not the session the lane's last job ran on (once per connection): a handler
        may hold this process's GIL from its first instruction, and the supervisor must still
        be able to terminate its session at the timeout.

        Only a connection the lane has not reported is looked at here: ``execute`` checks the
        connection again anyway, and every check costs a system call, so a release of this
        process's GIL, which a thread running a CPU-bound handler then makes the job wait
        for. (A connection the server dropped while idle is replaced inside ``execute``, which
        then calls ``_session_changed``: the job carries the session reported, to compare.)
        """
        raw = self.connections[self.alias].connection
        if raw is not None and raw is lane.raw:
            if lane.session is not None:
                item.backend_pid, item.backend_start = lane.session
            return
        try:
            self._execute.prepare_connection(self.alias, item)
        except Exception:
            return  # ``execute`` meets the same error and settles the job
        lane.raw = self.connections[self.alias].connection
        session = (item.backend_pid, item.backend_start)
        if session != lane.session:
            lane.session = session
            # Reports still waiting (this lane's last job's ``RETURNED``) go first: the
            # supervisor gives a lane's new session to the jobs it believes run on the lane.
            self._send_after_reports(self._session_report(lane))

    def _session_changed(self, lane: Lane, item: Any) -> None:
        """``execute`` found the lane's connection dropped by the server (a restart, an
        operator's ``pg_terminate_backend``, a gate's wait through an outage) and opened
        another for this job: report the new session now, or a timeout of this job would
        terminate the old one and leave this one running until the worker is recycled. On the
        start log, after the job's ``STARTED``, in one system call that keeps the GIL: the job
        may be interrupted from here on, and an interrupt lands before or after the write,
        never inside it."""
        lane.raw = self.connections[self.alias].connection
        lane.session = (item.backend_pid, item.backend_start)
        self._write_start_log(self._session_report(lane))

    @staticmethod
    def _session_report(lane: Lane) -> tuple[Any, ...]:
        """The ``SESSION`` message for the lane's current session, numbered: one sent on the
        message pipe before a job may be read by the supervisor after a newer one from the
        start log (it reads the pipe, then the log, then handles the pipe's messages), and
        must not win."""
        lane.reports += 1
        pid, started = lane.session or (None, None)
        return (protocol.SESSION, lane.number, lane.reports, pid, started)

    def _report_started(self, lane: Lane, wire_id: Any, fast: bool) -> None:
        """Tell the supervisor, before the handler starts, that this job started on ``lane``
        (and when: its timeout clock starts then), so that if this process dies from here on
        the attempt is charged (a job still waiting in the queue is handed on uncharged).
        Written here, not queued: a handler that kills the process must find its start
        already reported.

        Written to the start log, which the supervisor reads without being woken for it: a
        message per job start on the message pipe would wake its manager thread once per
        job. One frame is far below ``PIPE_BUF``, so the write is all or nothing. A full log
        (the supervisor has not read it lately) holds this lane until it has room: the
        supervisor reads it at every housekeeping tick. (Sent on the message pipe instead, a
        start could be handled after a newer one of the same lane from the log.)"""
        self._write_start_log((protocol.STARTED, lane.number, wire_id, fast, time.monotonic()))

    def _report_admitted(self, item: Any) -> None:
        """A waiting job that started through the gate (not on the fast path) has its start
        on record and its handler starts now: the supervisor starts its timeout clock from
        this, not from the ``STARTED`` before the gate (``execute``'s ``on_admitted``).
        Written to the start log, after that ``STARTED``, in one system call that keeps the
        GIL: an interrupt lands before or after it, never inside (an interrupt means the
        supervisor took the job over, and its clock no longer matters)."""
        self._write_start_log(
            (protocol.ADMITTED, protocol.wire_id(item.job), item.ctx.started_monotonic))

    def _write_start_log(self, message: tuple[Any, ...]) -> None:
        """One frame on the start log, in one system call that keeps the GIL (all or
        nothing: a frame is far below ``PIPE_BUF``; a full log waits for room with the GIL
        released). A supervisor gone (its end closed) ends this worker."""
        try:
            syscalls.write_whole(self.start_log, frame(message))
        except OSError:
            os._exit(0)  # the supervisor is gone

    def _send_after_reports(self, message: tuple[Any, ...]) -> None:
        """Write the reports waiting to be written, then ``message``, in one write."""
        with self.lock:
            batch, self.finished = self.finished, []
        self.send_many([*self._report_messages(batch), message])

    def _settled(self, item: Any, failure: BaseException | None, wire_id: Any) -> None:
        """A job whose completion was batched is settled (``execute``'s ``on_settled``)."""
        if failure is not None:
            self.send((protocol.CRASHED, wire_id, f"{type(failure).__name__}: {failure}"))
        # Written by ``_flush_reports`` once the completer has settled the whole batch.
        self._done_once(item, wire_id, flush=False)

    def _done_once(self, item: Any, wire_id: Any, flush: bool = True) -> None:
        """``DONE`` for this run of the job, at most once: a second one could arrive after the
        job was claimed again and handed to this worker, and end the new run's tracking."""
        with self.lock:
            if item.done_reported:
                return
            item.done_reported = True
        self._report(protocol.DONE, wire_id, flush)

    def _report(self, tag: str, wire_id: Any, flush: bool = True) -> None:
        """Report a job that returned (``RETURNED``) or is settled (``DONE``). Reports
        coalesce: while one thread writes, jobs that finish meanwhile wait for its next
        write, instead of a message each. A job's ``RETURNED`` is written before its ``DONE``
        when both wait together; a ``DONE`` that overtook it makes the supervisor ignore it.
        ``flush=False`` only queues the report, for a caller that calls ``_flush_reports``
        soon (the completer's thread, after each batch)."""
        with self.lock:
            self.finished.append((tag, wire_id))
            if self.reporting or not flush:
                return
            self.reporting = True
        self._write_reports()

    def _flush_reports(self) -> None:
        """Write the reports queued so far (unless another thread is writing: it takes them)."""
        with self.lock:
            if self.reporting or not self.finished:
                return
            self.reporting = True
        self._write_reports()

    def _write_reports(self) -> None:
        """The writing thread's loop (``reporting`` is set): until nothing is queued."""
        while True:
            with self.lock:
                batch, self.finished = self.finished, []
                if not batch:
                    self.reporting = False
                    return
            self.send_many(self._report_messages(batch))

    @staticmethod
    def _report_messages(batch: list[tuple[str, Any]]) -> list[tuple[Any, ...]]:
        returned = [w for t, w in batch if t == protocol.RETURNED]
        done = [w for t, w in batch if t == protocol.DONE]
        return ([(protocol.RETURNED, returned)] if returned else []) + (
            [(protocol.DONE, done)] if done else [])

    def _cancel(self, wire_id: Any) -> None:
        with self.lock:
            item = self.running.get(wire_id)
            if item is None and wire_id in self.queued:
                self.cancelled.add(wire_id)  # seen when it starts
        if item is not None:
            item.ctx._cancel_event.set()

    def _interrupt(self, wire_id: Any) -> None:
        """Stop a handler the supervisor has settled, and retire its lane: a pure-Python loop
        ends at its next bytecode; a thread blocked in C does not, and the supervisor recycles
        this worker. A fresh lane takes the retired one's place. A job that has not started
        yet never starts."""
        from ..execute import JobInterrupted
        from ..pool import inject_exception

        with self.lock:
            item = self.running.get(wire_id)
            if item is None:
                if wire_id in self.queued and wire_id not in self.skip:
                    self.skip.add(wire_id)
                    self.send((protocol.UNSTARTED, [wire_id]))
                return
            first = not item.taken_over.is_set()  # (its lane is retired once)
            item.taken_over.set()
            if item.thread_ident is not None:
                inject_exception(item.thread_ident, JobInterrupted)
        if first:
            self._add_lane()

    def _recall(self, wire_ids: list[Any]) -> None:
        """Give back the jobs of ``wire_ids`` that no lane has taken yet (answered
        ``UNSTARTED``, under the lock a lane takes them with, so each job either starts here
        or is answered, never both). The rest started: they run on as usual."""
        with self.lock:
            given = [w for w in wire_ids if w in self.queued and w not in self.skip]
            self.skip.update(given)
            if given:
                self.send((protocol.UNSTARTED, given))

    # ------------------------------------------------------------------ progress
    def _report_progress(self, ctx: Any, progress: Any) -> None:
        """Progress goes through a connection of its own, outside the job's transaction, fenced
        by the attempt's own token (see the supervisor's)."""
        if ctx._token is not None:
            self.progress.write(ctx.job_id, ctx._token, progress)
