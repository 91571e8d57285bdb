"""The runner: starts the loops, enforces timeouts, and shuts down gracefully.

``runjobs`` calls ``Runner.run()`` in the foreground with signal handlers; a web process can embed
the same runner with ``Runner.start()`` / ``Runner.stop()``. The supervisor watches the named loops
and stops the runner loudly if one dies, instead of limping on without, say, its heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from django.db import ProgrammingError, connections

from .. import conf
from ..context import JobContext
from ..errors import ConfigurationError
from ..handlers import registry
from . import store
from .claimer import claim_loop
from .cleanup import cleanup_loop
from .db import Backoff, is_connection_error, reset_connection, run_with_retry
from .execute import InFlight, JobInterrupted, Outcome, _backoff_for, execute, record_outcome
from .executor import Executor
from .heartbeat import heartbeat_loop
from .listener import listen_loop
from .loop import Loop
from .threads import ThreadExecutor

logger = logging.getLogger("django_persistent_jobs.runner")

VERSION = "0.1.0"
SUPERVISOR_TICK = 0.05

EXIT_OK = 0
EXIT_FORCED = 1
EXIT_LOOP_DIED = 2


def make_runner_id() -> str:
    """Host, pid and a random suffix: a restarted runner that reuses a pid is still a new runner,
    so its predecessor's jobs are rescued rather than mistaken for its own."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Runner:
    """A job runner. Construct, then ``run()`` (blocking) or ``start()``/``stop()`` (embedded)."""

    def __init__(
        self, *, concurrency: int | None = None, queues: list[str] | tuple[str, ...] | None = None,
        poll_interval: float | None = None, burst: bool = False,
        shutdown_grace: float | None = None, runner_id: str | None = None,
        scheduler: bool = True, cleanup: bool = True, processes: int = 0,
    ) -> None:
        problems = [msg for spec in registry for msg in spec.errors]
        if problems:
            raise ConfigurationError("Invalid job handlers: " + "; ".join(problems))
        if concurrency is not None and (isinstance(concurrency, bool) or concurrency < 1):
            raise ConfigurationError(f"concurrency must be >= 1, got {concurrency!r}.")
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ConfigurationError(f"processes must be >= 0, got {processes!r}.")
        if poll_interval is not None and poll_interval <= 0:
            raise ConfigurationError(f"poll_interval must be > 0, got {poll_interval!r}.")
        self.settings = conf.RunnerSettings.load(
            concurrency=concurrency, queues=tuple(queues) if queues else None,
            poll_interval=poll_interval, shutdown_grace=shutdown_grace,
        )
        self.alias = self.settings.database
        self.runner_id = runner_id or make_runner_id()
        self.burst = burst
        self.enable_scheduler = scheduler
        self.enable_cleanup = cleanup
        self.stopping = threading.Event()  # stop claiming
        self.halt = threading.Event()  # stop every loop
        self.forced = threading.Event()  # stop now: give up the grace period
        self.wake = threading.Event()
        self.listening = threading.Event()
        self.started = threading.Event()
        self.finished = threading.Event()
        self.cleanup_due_now = True
        self.exit_code = EXIT_OK
        self.processes = processes
        self._lost: queue.SimpleQueue[tuple[InFlight, str]] = queue.SimpleQueue()
        self.pool: Executor = self._make_executor()
        # Liveness as this runner itself knows it (monotonic, maintained by the heartbeat loop):
        # the last successful heartbeat, and since when beats have come without a gap.
        self.last_beat: float | None = None
        self.healthy_since: float | None = None
        self.beaten = threading.Condition()
        self.loops: list[Loop] = []
        self._supervisor: threading.Thread | None = None
        self._launched = False  # run() or start() was called: stop() has something to wait for
        self.failure: BaseException | None = None  # why run() raised (boot failure), if it did
        self._side_lock = threading.Lock()
        self._side: Any = None
        self._stop_requested_at: float | None = None
        self._extra_loops: list[tuple[str, Callable[[Runner], None]]] = []

    # ---------------------------------------------------------------- public API
    def run(self, install_signal_handlers: bool = False) -> int:
        """Run in the current thread until stopped (or, in burst mode, until nothing is due)."""
        self._launched = True
        if install_signal_handlers:
            self._install_signal_handlers()
        try:
            self._boot()
            self._supervise()
        except BaseException as exc:
            self.failure = exc
            if self.exit_code == EXIT_OK:
                self.exit_code = EXIT_LOOP_DIED
            if not self.started.is_set():
                connections.close_all()  # _shutdown, which would close it, never runs
            raise
        finally:
            self.finished.set()
        return self.exit_code

    def start(self) -> Runner:
        """Start in background threads (for embedding in another process); returns at once.

        If the runner cannot boot (tables missing, bad settings), ``failure`` holds the error,
        ``exit_code`` is non-zero and ``wait_until_started`` returns False at once.
        """
        self._launched = True
        self._supervisor = threading.Thread(target=self._run_in_background, name="pj-supervisor",
                                            daemon=True)
        self._supervisor.start()
        return self

    def _run_in_background(self) -> None:
        try:
            self.run()
        except BaseException as exc:
            logger.critical("runner %s failed: %s", self.runner_id, exc, exc_info=exc,
                            extra={"event": "runner_failed", "runner_id": self.runner_id})

    def stop(self, wait: bool = True, timeout: float | None = None) -> int:
        """Stop claiming, let in-flight jobs finish within the grace period, then exit."""
        self.request_stop()
        if wait and self._launched:
            self.finished.wait(timeout)
        return self.exit_code

    def request_stop(self) -> None:
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
            logger.info("runner %s stopping: no new claims; waiting up to %.0fs for %d job(s)",
                        self.runner_id, self.settings.shutdown_grace, self.pool.busy,
                        extra={"event": "stopping", "runner_id": self.runner_id})
        self.stopping.set()
        self.wake.set()

    def force_stop(self) -> None:
        self.forced.set()
        self.request_stop()

    def wait_until_started(self, timeout: float | None = None) -> bool:
        """Wait until the loops run; False on timeout, or at once if the runner ended first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.started.wait(SUPERVISOR_TICK):
            if self.finished.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return self.started.is_set()
        return True

    def __enter__(self) -> Runner:
        self.start()
        if not self.wait_until_started(30) and self.failure is not None:
            raise self.failure
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_loop(self, name: str, body: Callable[[Runner], None]) -> None:
        """Register an extra supervised loop (before ``start``)."""
        self._extra_loops.append((name, body))

    # ---------------------------------------------------------------- internals
    def _make_executor(self) -> Executor:
        """The composition root's one choice: where job code runs.

        With ``processes`` the runner is a supervisor that runs no job code: handlers run in
        worker processes, so nothing they do (hold the GIL, block in C, crash the interpreter)
        can starve its heartbeat or its timeouts. Without, they run on threads here.
        """
        settings = self.settings
        if not self.processes:
            return ThreadExecutor(settings.concurrency, self._execute, self._worker_crashed,
                                  prefetch=settings.prefetch or 0)
        from .workers.manager import ProcessExecutor

        return ProcessExecutor(
            self.processes, settings.concurrency, alias=self.alias, runner_id=self.runner_id,
            on_lost=self._settle_lost, on_crash=self._worker_crashed,
            on_failure=self._executor_failed,
            max_jobs=settings.max_jobs_per_worker,
            max_memory_mib=settings.max_memory_per_worker, grace=settings.timeout_grace,
            log_level=logging.getLogger("django_persistent_jobs").level or None,
        )

    def _executor_failed(self, exc: BaseException) -> None:
        """The executor cannot run jobs any more: stop loudly, like a runner whose loop died."""
        logger.critical("stopping runner %s: its executor failed: %r", self.runner_id, exc,
                        extra={"event": "runner_failed", "runner_id": self.runner_id})
        self.exit_code = EXIT_LOOP_DIED
        self.request_stop()

    def _settle_lost(self, item: InFlight, why: str) -> None:
        """A worker process died under this job (called by the executor's thread): the
        supervisor settles it on its next tick, like a timeout."""
        self._lost.put((item, why))

    def _settle_lost_jobs(self) -> None:
        """The attempt is charged (``WORKER_LOST``), so a job that kills its worker every time
        ends dead-lettered after its retries, like any poison pill."""
        while not self._lost.empty():
            item, why = self._lost.get()
            self._take_over(item, Outcome(
                "retry", "WORKER_LOST", why,
                delay=_backoff_for(registry.get(item.job.job_type), item.job.attempt),
            ), None)

    def _install_signal_handlers(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            # ``_stop_requested_at`` is set first thing by the first signal's handler, which a
            # second signal can interrupt before ``stopping`` is set.
            if self.stopping.is_set() or self._stop_requested_at is not None:
                logger.warning("second signal: stopping now; handing running jobs back",
                               extra={"event": "force_stop"})
                self.force_stop()
            else:
                self.request_stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _boot(self) -> None:
        self._wait_for_database()
        if self.stopping.is_set():
            return
        # Worker processes take a moment to set Django up: start them before the runner
        # registers, so that a registered runner is one that can run jobs.
        self.pool.start()
        try:
            run_with_retry(self.alias, self.register, what="registering the runner",
                           interrupt=self.stopping)
        except ProgrammingError as exc:
            raise ConfigurationError(
                "The persistent_jobs tables are missing; run `python manage.py migrate` first "
                f"({exc})."
            ) from exc
        from .heartbeat import note_beat, rescue_predecessor

        note_beat(self)
        rescue_predecessor(self)
        bodies: list[tuple[str, Callable[[Runner], None]]] = [
            ("listener", listen_loop), ("claimer", claim_loop), ("heartbeat", heartbeat_loop),
        ]
        if self.enable_cleanup and not self.burst:
            bodies.append(("cleanup", cleanup_loop))
        if self.enable_scheduler:
            from .scheduler import scheduler_loop

            if self.burst:
                # Fire what is due before the claimer starts, so a burst runs those jobs too
                # instead of stopping before the scheduler has inserted them.
                scheduler_loop(self)
            else:
                bodies.append(("scheduler", scheduler_loop))
        bodies.extend(self._extra_loops)
        for name, body in bodies:
            loop = Loop(name, lambda body=body: body(self))  # type: ignore[misc]
            self.loops.append(loop)
            loop.start()
        self.started.set()
        logger.info(
            "runner %s started: %sconcurrency=%d queues=%s poll=%.2fs handlers=%d%s",
            self.runner_id,
            f"processes={self.processes} " if self.processes else "", self.settings.concurrency,
            ",".join(self.settings.queues) if self.settings.queues else "*",
            self.settings.poll_interval, len(registry), " (burst)" if self.burst else "",
            extra={"event": "runner_started", "runner_id": self.runner_id},
        )

    def register(self, cursor: Any) -> None:
        store.register_runner(
            cursor, self.runner_id, socket.gethostname(), os.getpid(), self.settings.queues,
            self.settings.concurrency, VERSION,
        )

    def _wait_for_database(self) -> None:
        backoff = Backoff(first=0.5, cap=5.0)
        while not self.stopping.is_set():
            try:
                connections[self.alias].ensure_connection()
                return
            except Exception as exc:
                if not is_connection_error(exc):
                    raise
                reset_connection(self.alias)
                text = str(exc)
                if "does not exist" in text or "authentication failed" in text:
                    # A wrong name or password will not fix itself by waiting: say so now.
                    raise ConfigurationError(
                        f"Cannot connect to database {self.alias!r}: "
                        f"{text.strip().splitlines()[-1] if text.strip() else exc}. "
                        "Check settings.DATABASES (or DATABASE_URL)."
                    ) from exc
                delay = backoff.next()
                logger.warning("database not reachable (%s); retrying in %.1fs",
                               str(exc).strip().splitlines()[0] if str(exc) else exc, delay,
                               extra={"event": "db_wait"})
                self.stopping.wait(delay)

    def dispatch(self, job: store.ClaimedJob) -> bool:
        """Hand a claimed job to the workers; False if the runner is stopping (the caller then
        hands it back)."""
        ctx = JobContext(
            job_id=job.id, job_type=job.job_type, attempt=job.attempt,
            max_retries=job.max_retries, runner_id=self.runner_id, queue=job.queue,
            priority=job.priority, timeout=job.timeout, tenant=job.tenant,
            _progress_sink=self._report_progress,
        )
        if job.cancel_requested:
            ctx._cancel_event.set()
        deadline = ctx.started_monotonic + job.timeout if job.timeout else None
        return self.pool.submit(InFlight(job=job, ctx=ctx, deadline=deadline))

    def hand_back_unstarted(self, jobs: list[store.ClaimedJob]) -> None:
        for job in jobs:
            record_outcome(self.alias, job, Outcome(
                "release", "SHUTDOWN", "runner stopping; claimed job handed back unstarted",
            ), self.runner_id, self.forced, attempt_outcome="interrupted")

    def _worker_crashed(self, item: InFlight, exc: BaseException) -> None:
        """A job's outcome could not be recorded (not a transient database condition: those
        are retried). Stop like a runner whose loop died: this runner's row goes, and another
        runner rescues the job, instead of it staying claimed by a live runner forever."""
        logger.critical(
            "stopping runner %s: could not record the outcome of job %s; it will be rescued "
            "by another runner", self.runner_id, item.job.id,
            extra={"event": "runner_failed", "runner_id": self.runner_id,
                   "job_id": str(item.job.id)},
        )
        self.exit_code = EXIT_LOOP_DIED
        self.request_stop()

    def burst_done(self) -> None:
        logger.info("burst: nothing more is due; stopping", extra={"event": "burst_done"})
        self.request_stop()

    def _execute(self, item: InFlight) -> None:
        item.ctx.started_monotonic = time.monotonic()
        if item.deadline is not None and item.job.timeout:
            item.deadline = item.ctx.started_monotonic + item.job.timeout
        execute(self.alias, item, self.runner_id, self.forced)

    def _report_progress(self, ctx: JobContext, progress: Any) -> None:
        item = self.pool.in_flight.get(ctx.job_id)
        if item is None:
            return
        with self._side_lock:
            for _ in range(2):
                try:
                    if self._side is None:
                        self._side = connections.create_connection(self.alias)
                        self._side.inc_thread_sharing()
                    with self._side.cursor() as cursor:
                        store.report_progress(cursor, ctx.job_id, item.job.token, progress)
                    return
                except Exception as exc:
                    if not is_connection_error(exc):
                        raise
                    self._close_side()
            logger.warning("could not record progress of job %s", ctx.job_id)

    def _close_side(self) -> None:
        if self._side is not None:
            with contextlib.suppress(Exception):
                self._side.close()
            self._side = None

    def _supervise(self) -> None:
        while True:
            self._enforce_timeouts()
            dead = [loop for loop in self.loops if loop.failure is not None]
            if dead and not self.halt.is_set():
                logger.critical("stopping runner %s: loop %s died", self.runner_id,
                                ", ".join(loop.name for loop in dead),
                                extra={"event": "runner_failed", "runner_id": self.runner_id})
                self.exit_code = EXIT_LOOP_DIED
                self.request_stop()
            if self.stopping.is_set():
                break
            self.stopping.wait(SUPERVISOR_TICK)
        self._shutdown()

    def _enforce_timeouts(self) -> None:
        self._settle_lost_jobs()
        now = time.monotonic()
        for item in self.pool.snapshot():
            if item.deadline is not None and now >= item.deadline:
                self._take_over(item, Outcome(
                    "retry", "TIMEOUT",
                    f"attempt {item.job.attempt} exceeded its timeout of {item.job.timeout:g}s",
                    delay=_backoff_for(registry.get(item.job.job_type), item.job.attempt),
                ), "timed_out")

    def _take_over(self, item: InFlight, outcome: Outcome, attempt_outcome: str | None) -> None:
        """Settle a job its worker still holds: kill its connection, record, interrupt."""
        if not self.pool.take_over(item):
            return  # it finished on its own
        pid, started = item.backend_pid, item.backend_start
        if pid:
            run_with_retry(self.alias, lambda c: store.terminate_backend(c, pid, started),
                           what="terminating a timed-out handler's connection",
                           interrupt=self.forced)
        status = record_outcome(self.alias, item.job, outcome, self.runner_id, self.forced,
                                attempt_outcome=attempt_outcome)
        self.pool.interrupt(item, JobInterrupted)
        if status is None:
            logger.info("job %s finished just as it was taken over", item.job.id)

    def _shutdown(self) -> None:
        grace = self.settings.shutdown_grace
        started = self._stop_requested_at or time.monotonic()
        # From here on the claim loop cannot start jobs: whatever it claims late (a claim that
        # was in flight when the signal came) it hands straight back, so the hand-back below
        # sees every job this runner will ever run.
        self.pool.seal()
        for item in self.pool.unstarted():
            # Prefetched but never started: hand back at once, uncharged, rather than start
            # new work after the signal.
            self._take_over(item, Outcome(
                "release", "SHUTDOWN",
                f"runner {self.runner_id} stopped before starting attempt {item.job.attempt}; "
                "handed back unstarted",
            ), "interrupted")
        while self.pool.busy and not self.forced.is_set():
            if time.monotonic() - started >= grace:
                break
            self._enforce_timeouts()
            with self.pool.changed:
                self.pool.changed.wait(SUPERVISOR_TICK)
        for item in self.pool.snapshot():
            self._take_over(item, Outcome(
                "handback", "SHUTDOWN",
                f"runner {self.runner_id} stopped before attempt {item.job.attempt} finished "
                f"(grace period {grace:g}s); handed back for retry",
            ), "interrupted")
        self.halt.set()
        self.pool.close()
        for loop in self.loops:
            loop.join(timeout=5)
        self.pool.join(timeout=2)
        if self.started.is_set():
            run_with_retry(self.alias, lambda c: store.unregister_runner(c, self.runner_id),
                           what="unregistering the runner", interrupt=self._unregister_interrupt())
        self._close_side()
        connections.close_all()
        if self.forced.is_set() and self.exit_code == EXIT_OK:
            self.exit_code = EXIT_FORCED
        logger.info("runner %s stopped", self.runner_id,
                    extra={"event": "runner_stopped", "runner_id": self.runner_id})

    def _unregister_interrupt(self) -> threading.Event:
        """Try for a few seconds; if the database stays away, rescue will clean up after us."""
        event = threading.Event()
        timer = threading.Timer(3.0, event.set)
        timer.daemon = True
        timer.start()
        return event
