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
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

from . import protocol

PR_SET_PDEATHSIG = 1

logger = logging.getLogger("django_persistent_jobs.runner")
#: A job running longer than this has its database session reported to the supervisor.
SESSION_REPORT_SECONDS = 0.1
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
    if start.get("settings_module"):
        os.environ["DJANGO_SETTINGS_MODULE"] = start["settings_module"]
    worker_main(conn, start["parent_pid"], start["options"])


def worker_main(conn: Any, parent_pid: int, options: dict[str, Any]) -> None:
    """Set Django up and serve the supervisor until it says stop or goes away."""
    die_with_parent(parent_pid)
    # Signals are the supervisor's business: a Ctrl-C reaches the whole process group, and the
    # supervisor decides what the workers do (finish within the grace, then stop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import django

    django.setup()
    package_logger = logging.getLogger("django_persistent_jobs")
    if options.get("log_level") is not None:
        package_logger.setLevel(options["log_level"])
    if options.get("log_to_stderr") or not package_logger.hasHandlers():
        # As runjobs does in the supervisor: a silent worker is worse than a plain one.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    Worker(conn, options).serve()



class Worker:
    """Receives jobs on the pipe, runs each on a thread, reports back."""

    def __init__(self, conn: Any, options: dict[str, Any]) -> None:
        from django.db import connections

        self.conn = conn
        self.alias: str = options["alias"]
        self.runner_id: str = options["runner_id"]
        self.number: int = options["number"]
        self.connections = connections
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.idle = 0  # threads waiting for a job (not reserved for one already sent)
        self.running: dict[Any, Any] = {}  # job id -> InFlight, while its handler runs
        self.tokens: dict[Any, int] = {}
        self.never = threading.Event()  # settling retries until done: the supervisor kills us
        self.side: Any = None
        self.side_lock = threading.Lock()
        from ..completer import Completer

        self.completer = Completer()  # batches the completions of handlers that ran no SQL

    def send(self, message: tuple[Any, ...]) -> None:
        with self.send_lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError):
                os._exit(0)  # the supervisor is gone

    def serve(self) -> None:
        threading.Thread(target=self._report_sessions, name=f"pj-w{self.number}-sessions",
                         daemon=True).start()
        self.send((protocol.READY, os.getpid()))
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._exit()  # the supervisor is gone
                return
            tag = message[0]
            if tag == protocol.RUN:
                self._start(message[1], message[2])
            elif tag == protocol.CANCEL:
                item = self.running.get(message[1])
                if item is not None:
                    item.ctx._cancel_event.set()
            elif tag == protocol.INTERRUPT:
                self._interrupt(message[1])
            elif tag == protocol.STOP:
                self._exit()
                return

    def _exit(self) -> None:
        """Leave at once (after the completions handed over are written): whatever still runs
        here was settled by the supervisor already."""
        with contextlib.suppress(Exception):
            self._close_side()
        with contextlib.suppress(Exception):
            self.completer.close(EXIT_COMPLETION_SECONDS)
        logging.shutdown()
        os._exit(0)

    # ------------------------------------------------------------------ threads
    def _start(self, job: Any, cancel: bool) -> None:
        with self.lock:
            if self.idle > 0:
                self.idle -= 1
                spawn = False
            else:
                spawn = True
        self.jobs.put((job, cancel))
        if spawn:
            threading.Thread(target=self._thread_main, name=f"pj-w{self.number}-job",
                             daemon=True).start()

    def _thread_main(self) -> None:
        from ..execute import JobInterrupted

        try:
            while True:
                job, cancel = self.jobs.get()
                if not self._run(job, cancel):
                    return  # interrupted: this thread may hold a pending async exception
                with self.lock:
                    self.idle += 1
        except JobInterrupted:
            pass
        finally:
            with contextlib.suppress(Exception):
                self.connections.close_all()

    def _run(self, job: Any, cancel: bool) -> bool:
        """Run one job; False if it was interrupted (the thread then exits)."""
        from ...context import JobContext
        from ..execute import InFlight, JobInterrupted, execute

        ctx = JobContext(
            job_id=job.id, job_type=job.job_type, attempt=job.attempt,
            max_retries=job.max_retries, runner_id=self.runner_id, queue=job.queue,
            priority=job.priority, timeout=job.timeout, tenant=job.tenant,
            _progress_sink=self._report_progress,
        )
        if cancel:
            ctx._cancel_event.set()
        item = InFlight(job=job, ctx=ctx, deadline=None, thread_ident=threading.get_ident(),
                        completer=self.completer)
        item.ctx.started_monotonic = time.monotonic()
        with self.lock:
            self.running[job.id] = item
            self.tokens[job.id] = job.token
        try:
            execute(self.alias, item, self.runner_id, self.never)
        except JobInterrupted:
            pass
        except BaseException as exc:
            if not item.taken_over.is_set():
                self.send((protocol.CRASHED, job.id, f"{type(exc).__name__}: {exc}"))
        finally:
            with self.lock:
                self.running.pop(job.id, None)
                self.tokens.pop(job.id, None)
                interrupted = item.taken_over.is_set()
        if interrupted:
            # Operators want to know whether timed-out code ever returns (one blocked in C
            # does not: its worker is recycled instead).
            logger.info("abandoned worker for job %s exited", job.id,
                        extra={"event": "abandoned_worker_exited", "job_id": str(job.id)})
        self.send((protocol.DONE, job.id))
        return not interrupted

    def _report_sessions(self) -> None:
        """Tell the supervisor which database session runs each job that has run for a while,
        so that at its timeout the supervisor can terminate that session.

        Not per job: most jobs finish long before any timeout, and a message each way per job
        is the whole cost of the hand-off. If a handler holds this process's GIL so long that
        the report never goes out, the job's session ends with the worker, which is recycled
        when the handler does not return after its timeout.
        """
        reported: set[Any] = set()
        while True:
            time.sleep(SESSION_REPORT_SECONDS)
            now = time.monotonic()
            with self.lock:
                due = [item for job_id, item in self.running.items()
                       if job_id not in reported and item.backend_pid is not None
                       and now - item.ctx.started_monotonic >= SESSION_REPORT_SECONDS]
                reported &= set(self.running)
            for item in due:
                reported.add(item.job.id)
                self.send((protocol.STARTED, item.job.id, item.backend_pid, item.backend_start))

    def _interrupt(self, job_id: Any) -> None:
        """Stop a handler the supervisor has settled: a pure-Python loop ends at its next
        bytecode; a thread blocked in C does not, and the supervisor recycles this worker."""
        from ..execute import JobInterrupted
        from ..pool import inject_exception

        with self.lock:
            item = self.running.get(job_id)
            if item is None:
                return
            item.taken_over.set()
            if item.thread_ident is not None:
                inject_exception(item.thread_ident, JobInterrupted)

    # ------------------------------------------------------------------ progress
    def _report_progress(self, ctx: Any, progress: Any) -> None:
        """Progress goes through a connection of its own, outside the job's transaction."""
        from .. import store
        from ..db import is_connection_error

        token = self.tokens.get(ctx.job_id)
        if token is None:
            return
        with self.side_lock:
            for _ in range(2):
                try:
                    if self.side is None:
                        self.side = self.connections.create_connection(self.alias)
                        self.side.inc_thread_sharing()
                    with self.side.cursor() as cursor:
                        store.report_progress(cursor, ctx.job_id, token, progress)
                    return
                except Exception as exc:
                    if not is_connection_error(exc):
                        raise
                    self._close_side()

    def _close_side(self) -> None:
        if self.side is not None:
            with contextlib.suppress(Exception):
                self.side.close()
            self.side = None
