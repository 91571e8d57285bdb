"""The runner: the composition root that builds the supervisor's services, starts the loops,
enforces timeouts, and shuts down gracefully.

``runjobs`` calls ``Runner.run()`` in the foreground with signal handlers; a web process can embed
the same runner with ``Runner.start()`` / ``Runner.stop()``. The supervisor watches the named loops
and stops the runner loudly if one dies, instead of limping on without, say, its heartbeat.

Each loop is given only what it uses (the settings it reads, the ``lifecycle`` events, the
``liveness`` object, the executor) and none imports this module: see ``_loop_bodies``. The claim
loop gets a ``claimer.Claiming`` with its few services, the three runner callbacks it needs
(hand a claim to the executor, hand late claims back, end a burst) and the count of take-overs
not yet settled, built in ``_claiming``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from types import FrameType
from typing import TYPE_CHECKING, Any

from django.db import ProgrammingError, connections

from .. import bounds, conf
from ..context import JobContext
from ..errors import ConfigurationError
from ..handlers import registry
from . import budget, store
from .claimer import ADAPTIVE_PREFETCH_FACTOR, ADAPTIVE_PREFETCH_FLOOR, Claiming, claim_loop
from .cleanup import cleanup_loop
from .db import (
    Backoff,
    DatabaseUnreachable,
    error_line,
    is_connection_error,
    reset_connection,
    run_with_retry,
)
from .execute import (
    RUNJOBS_LOGGERS,
    InFlight,
    Outcome,
    execute,
    record_outcome,
    warm_connection,
)
from .executor import Executor
from .heartbeat import Liveness, heartbeat_loop, rescue_loop
from .lifecycle import Lifecycle
from .listener import listen_loop
from .loop import Loop
from .progress import ProgressWriter
from .starts import Lease, StartGate, StartLog
from .threads import ThreadExecutor
from .timeouts import TimeoutEnforcer

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper as Cursor

logger = logging.getLogger("django_persistent_jobs.runner")

VERSION = "0.1.0"
SUPERVISOR_TICK = 0.05
#: How often the signal relay looks at the signal count (a stop request waits at most this).
SIGNAL_POLL = 0.02
#: How often the supervisor tells the liveness sidecar that this process still runs Python code
#: and enforces its deadlines (see ``sidecar.py``); the sidecar steps in only when that stops.
VOUCH_SECONDS = 0.25

EXIT_OK = 0
EXIT_FORCED = 1
EXIT_LOOP_DIED = 2
#: Stopped (a signal, ``stop()``) before the database was ever reached: nothing was run.
EXIT_NEVER_CONNECTED = 3

#: At shutdown, how long to wait for worker processes to answer the recall of their queued jobs
#: (normally a round trip; longer only while a handler holds a worker's GIL).
RECALL_ANSWER_SECONDS = 1.0
#: How long a ``--burst`` run waits for an unreachable database before it gives up.
BURST_DATABASE_WAIT = 30.0
#: The least time the first connection attempt gets, whatever is left of ``database_wait``:
#: ``--database-wait 0`` means one attempt and no waiting, and an attempt needs a moment (a
#: connection takes milliseconds; a host that drops packets is given up on after this).
FIRST_CONNECT_SECONDS = 1.0
#: A job without a timeout lets the liveness sidecar vouch for an unresponsive runner for this
#: many stale-lock timeouts (one with a timeout: until its deadline).
NO_TIMEOUT_VOUCH_FACTOR = 10
#: At shutdown, how long the supervisor keeps trying to record outcomes whose row stays locked
#: before it leaves those jobs to be rescued once this runner's row is gone (while the database
#: is unreachable it keeps trying until it is back or a second signal forces the stop).
SETTLE_AT_EXIT_SECONDS = 5.0
#: After a second signal, how long the executor's threads (its completion writer) or worker
#: processes are waited for, and again once told to stop or killed: a forced stop exits within
#: about a second whatever a statement of theirs waits for.
FORCED_JOIN_SECONDS = 0.5
#: The longest runner name: the id adds a separator and 8 hex digits within 200 characters.
MAX_NAME_LENGTH = 180


def default_runner_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def make_runner_id(name: str | None = None) -> str:
    """The runner's fencing identity: its name (``host:pid`` unless the operator gave one) and a
    random suffix, so it is unique per process lifetime. Two runners given the same name, or a
    restarted runner that reuses its predecessor's host name and pid, are still distinct
    runners: each one's jobs are its own, and a dead one's jobs are rescued."""
    return f"{name or default_runner_name()}:{secrets.token_hex(4)}"


class Runner:
    """A job runner. Construct, then ``run()`` (blocking) or ``start()``/``stop()`` (embedded)."""

    def __init__(
        self, *, concurrency: int | None = None, queues: list[str] | tuple[str, ...] | None = None,
        poll_interval: float | None = None, burst: bool = False,
        shutdown_grace: float | None = None, runner_id: str | None = None,
        scheduler: bool = True, cleanup: bool = True, name: str | None = None,
        database_wait: float | None = None, liveness_sidecar: bool = True, processes: int = 0,
    ) -> None:
        problems = [msg for spec in registry for msg in spec.errors]
        if scheduler and not problems:
            from ..schedules.firing import payload_problem

            problems = [msg for spec in registry if spec.is_recurring
                        if (msg := payload_problem(spec)) is not None]
        if problems:
            raise ConfigurationError("Invalid job handlers: " + "; ".join(problems))
        if concurrency is not None and (isinstance(concurrency, bool)
                                        or not isinstance(concurrency, int) or concurrency < 1):
            raise ConfigurationError(f"concurrency must be an integer >= 1, got {concurrency!r}.")
        if queues is not None:
            if isinstance(queues, str | bytes) or not isinstance(queues, list | tuple):
                raise ConfigurationError(
                    f"queues must be a list of queue names, got {queues!r}.")
            for queue in queues:
                problem = bounds.queue_problem(queue)
                if problem:
                    raise ConfigurationError(f"queues: {problem}")
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ConfigurationError(f"processes must be >= 0, got {processes!r}.")
        # Capped like the settings of the same names (``bounds.MAX_SECONDS``): a longer wait
        # overflows the thread waits it feeds (``threading.TIMEOUT_MAX``), which would surface
        # as a traceback at start-up or a loop that dies once the runner runs.
        # ``poll_interval`` has the setting's minimum (``conf.MIN_LOOP_INTERVAL``): a tinier
        # one makes an idle runner busy-loop.
        for option, value, least in (("poll_interval", poll_interval, conf.MIN_LOOP_INTERVAL),
                                     ("shutdown_grace", shutdown_grace, 0.0),
                                     ("database_wait", database_wait, 0.0)):
            if value is None:
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value > bounds.MAX_SECONDS or (
                    value < least):
                raise ConfigurationError(
                    f"{option} must be a finite number of seconds >= {least:g} (at most "
                    f"{bounds.MAX_SECONDS:.0f}), got {value!r}.")
        # ``runner_id`` is an alias of ``name``: an operator-chosen label, never the fencing
        # identity itself (see ``make_runner_id``).
        configured = name if name is not None else runner_id
        if configured is not None and not (
            isinstance(configured, str) and configured.strip()
            and len(configured) <= MAX_NAME_LENGTH and configured.isprintable()
        ):
            raise ConfigurationError(
                f"A runner name must be 1 to {MAX_NAME_LENGTH} printable characters, "
                f"got {configured!r}."
            )
        self.settings = conf.RunnerSettings.load(
            concurrency=concurrency, queues=tuple(queues) if queues else None,
            poll_interval=poll_interval, shutdown_grace=shutdown_grace,
        )
        self.alias = self.settings.database
        # How much longer than its timeout a job may wait at the start gate (a stuck gate
        # must not hold a slot for ever, ``InFlight.start_clock``). ``STALE_LOCK_TIMEOUT`` is
        # the scale: a database away that long has also kept this runner from heartbeating,
        # and other runners may have taken its jobs already.
        self._gate_allowance = self.settings.stale_lock_timeout
        self.name = configured or default_runner_name()
        self.runner_id = make_runner_id(self.name)
        self.burst = burst
        self.database_wait = (BURST_DATABASE_WAIT if database_wait is None and burst
                              else database_wait)
        self.use_sidecar = liveness_sidecar
        self.sidecar: Any = None
        self._connected_once = False
        #: Whether this runner's row was written: a boot that fails after that removes it.
        self._registered = False
        self._vouched_at = 0.0
        #: The supervisor's own work (``_tick``) failed: said once, and the runner stops.
        self._duty_failed = False
        self._vouched_until = 0.0  # monotonic time the sidecar's current horizon runs out
        self._vouch_lock = threading.Lock()
        self.enable_scheduler = scheduler
        #: When this runner first registered (the database clock); kept when it registers again.
        self._started_at: datetime | None = None
        self.enable_cleanup = cleanup
        # The lifecycle events, shared with the loops (the runner's attributes of the same
        # names are the same objects, for embedding code and the claim loop).
        self.lifecycle = Lifecycle()
        self.stopping = self.lifecycle.stopping  # stop claiming
        self.halt = self.lifecycle.halt  # stop every loop
        self.forced = self.lifecycle.forced  # stop now: give up the grace period
        self.wake = self.lifecycle.wake
        self.listening = self.lifecycle.listening
        self.started = threading.Event()
        self.finished = threading.Event()
        self.exit_code = EXIT_OK
        self.processes = processes
        #: How the starts of waiting jobs are recorded (see ``starts``).
        self.lease = Lease()
        self.starts = StartLog()
        self.pool: Executor = self._make_executor()
        self.pool.on_start = self._starting
        self.timeouts = TimeoutEnforcer(self.alias, self.runner_id, self.pool, self.forced)
        # Liveness as this runner itself knows it (maintained by the heartbeat loop).
        self.liveness = Liveness(self.alias, self.runner_id, self.settings, self.register,
                                 self.lease, job_types=registry.job_types)
        self.loops: list[Loop] = []
        self._supervisor: threading.Thread | None = None
        self._launched = False  # run() or start() was called: stop() has something to wait for
        self.failure: BaseException | None = None  # why run() raised (boot failure), if it did
        self._progress = ProgressWriter(self.alias)
        self._stop_requested_at: float | None = None
        self._signals_received = 0  # written only by the signal handler (see below)
        self._extra_loops: list[tuple[str, Callable[[Runner], None]]] = []

    @property
    def last_beat(self) -> float | None:
        """Monotonic time of the last successful heartbeat."""
        return self.liveness.last_beat

    @property
    def healthy_since(self) -> float | None:
        return self.liveness.healthy_since

    @property
    def beaten(self) -> threading.Condition:
        """Notified after every successful heartbeat."""
        return self.liveness.beaten

    # ---------------------------------------------------------------- public API
    def run(self, install_signal_handlers: bool = False) -> int:
        """Run in the current thread until stopped (or, in burst mode, until nothing is due)."""
        self._launched = True
        if install_signal_handlers:
            self._install_signal_handlers()
        try:
            self._boot()
            if not self.started.is_set() and not self._connected_once:
                self._never_connected()
                return self.exit_code
            self._supervise()
        except BaseException as exc:
            self.failure = exc
            if self.exit_code == EXIT_OK:
                self.exit_code = EXIT_LOOP_DIED
            if not self.started.is_set():
                self._abandon_boot()
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
        # Seal here rather than when the supervisor thread wakes: a job waiting for a worker
        # must not start in between (a worker freed a moment after the request would take it).
        self.pool.seal()
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
            threads = ThreadExecutor(settings.concurrency, self._execute, self._worker_crashed,
                                     prefetch=self._prefetch(settings.concurrency))
            # Worker processes have a gate each; here the threads share the runner's.
            threads.gate = StartGate(self.alias, self.forced)
            # Batched completions carry the starts of their jobs that are still noted.
            threads.completer.starts = self.starts
            threads.warm = functools.partial(warm_connection, self.alias)
            return threads
        from .workers.manager import ProcessExecutor

        return ProcessExecutor(
            self.processes, settings.concurrency, alias=self.alias, runner_id=self.runner_id,
            on_lost=self._settle_lost, on_crash=self._worker_crashed,
            on_failure=self._executor_failed,
            max_jobs=settings.max_jobs_per_worker,
            max_memory_mib=settings.max_memory_per_worker, grace=settings.timeout_grace,
            gate_allowance=self._gate_allowance,
            prefetch=self._prefetch(settings.concurrency * self.processes),
            lease=self.lease, starts=self.starts,
            log_levels={name: level for name in RUNJOBS_LOGGERS
                        if (level := logging.getLogger(name).level)},
        )

    def _prefetch(self, slots: int) -> int:
        """The most claimed jobs that may wait for a worker: ``PREFETCH``, or with the adaptive
        default the cap the claim loop works under (``claimer.WaitingRoom``)."""
        if self.settings.prefetch is not None:
            return self.settings.prefetch
        return max(ADAPTIVE_PREFETCH_FACTOR * slots, ADAPTIVE_PREFETCH_FLOOR)

    def _executor_failed(self, exc: BaseException) -> None:
        """The executor cannot run jobs any more: stop loudly, like a runner whose loop died."""
        logger.critical("stopping runner %s: its executor failed: %r", self.runner_id, exc,
                        extra={"event": "runner_failed", "runner_id": self.runner_id})
        self.exit_code = EXIT_LOOP_DIED
        self.request_stop()

    def _settle_lost(self, item: InFlight, why: str) -> None:
        """A worker process died under this job (called by the executor's thread): the
        supervisor settles it on its next tick, like a timeout."""
        self.timeouts.lost(item, why)

    def _install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT ask for a graceful stop; a second one forces it.

        A Python signal handler runs in the main thread between two bytecodes, possibly while
        that thread holds the internal lock of an ``Event`` (inside ``wait`` or ``set``, or
        inside the first signal's handler): setting an ``Event`` from the handler can then
        deadlock the main thread for good. So the handler only counts, and a relay thread turns
        the count into ``request_stop`` / ``force_stop`` from ordinary thread context.
        """
        def handler(signum: int, frame: FrameType | None) -> None:
            self._signals_received += 1

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        threading.Thread(target=self._relay_signals, name="pj-signals", daemon=True).start()

    def _relay_signals(self) -> None:
        handled = 0
        while not self.finished.wait(SIGNAL_POLL):
            while handled < self._signals_received:
                handled += 1
                if self.stopping.is_set() or self._stop_requested_at is not None:
                    logger.warning("second signal: stopping now; handing running jobs back",
                                   extra={"event": "force_stop"})
                    self.force_stop()
                else:
                    self.request_stop()

    def _abandon_boot(self) -> None:
        """Undo what a boot that failed had started (``_shutdown``, which would, never runs):
        the handler threads or worker processes, each thread's connection, the sidecar. An
        embedded runner whose boot fails (tables missing, the database refusing) must not
        leave them behind: a web process that tries again would gather a thread and a
        connection per slot per try."""
        self.stopping.set()
        try:
            self.pool.seal()
            self._stop_services()
        except Exception:
            # The boot's own error is the one to raise; this one is only logged.
            logger.exception("runner %s: stopping what a failed start began failed",
                             self.runner_id, extra={"event": "boot_cleanup_failed"})
        finally:
            if self._registered:
                # A row with no runner behind it would stand for live capacity (and hold the
                # name) until another runner found it stale.
                self._unregister()
            self._close_connections()

    def _unregister(self) -> None:
        """Remove this runner's row, trying for a few seconds: if the database stays away,
        another runner's rescue removes it once it is stale."""
        try:
            run_with_retry(self.alias, lambda c: store.unregister_runner(c, self.runner_id),
                           what="unregistering the runner", interrupt=_Deadline(3.0))
        except Exception:
            logger.exception("runner %s: could not remove its row; it goes once stale",
                             self.runner_id, extra={"event": "unregister_failed"})

    def _stop_services(self) -> None:
        """Stop what ``_boot`` started: no new work (``halt``, the executor closed), the loops,
        then the executor's threads or processes. ``_shutdown`` calls it once the jobs in
        flight are settled, a failed boot at once. An executor that never started (a boot that
        failed or was stopped before it) has nothing to wait for."""
        self.halt.set()
        self.pool.close()
        for loop in self.loops:
            loop.join(timeout=5)
        if self.forced.is_set():
            # Stop now means now: a completion statement stuck behind a row lock (or a worker
            # that does not exit) is not waited for. The statement is fenced and may still
            # commit on the server after we are gone; otherwise the job is rescued.
            self.pool.join(timeout=FORCED_JOIN_SECONDS, settle=FORCED_JOIN_SECONDS)
        else:
            self.pool.join(timeout=2)

    def _close_connections(self) -> None:
        """The runner's last step: its side connection, the liveness sidecar, and this
        thread's connections."""
        self._progress.close()
        self._stop_sidecar()
        connections.close_all()

    def _boot(self) -> None:
        self._wait_for_database()
        if self.stopping.is_set():
            return
        # Before any lane, thread or worker exists: a runner the server can never hold stops
        # here, saying what to change, instead of taking every free connection and hanging.
        budget.check(self.alias, self.processes, self.settings.concurrency, self.runner_id)
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
        self.liveness.note_beat()
        self._warn_about_namesakes()
        self._start_sidecar()
        for name, body in self._loop_bodies():
            loop = Loop(name, body)
            self.loops.append(loop)
            loop.start()
        self.started.set()
        logger.info(
            "runner %s started: name=%s %sconcurrency=%d queues=%s poll=%.2fs handlers=%d%s",
            self.runner_id, self.name,
            f"processes={self.processes} " if self.processes else "", self.settings.concurrency,
            ",".join(self.settings.queues) if self.settings.queues else "*",
            self.settings.poll_interval, len(registry), " (burst)" if self.burst else "",
            extra={"event": "runner_started", "runner_id": self.runner_id},
        )
        if not len(registry):
            logger.warning(
                "runner %s has no handlers: it claims nothing (check DJANGO_SETTINGS_MODULE, "
                "INSTALLED_APPS, and that handlers live in an installed app's jobs.py or in a "
                "module the app imports)", self.runner_id,
                extra={"event": "no_handlers", "runner_id": self.runner_id})

    def _claiming(self) -> Claiming:
        """What the claim loop is given."""
        return Claiming(
            alias=self.alias, runner_id=self.runner_id, settings=self.settings, pool=self.pool,
            starts=self.starts, lease=self.lease, liveness=self.liveness,
            stopping=self.stopping, wake=self.wake, forced=self.forced, burst=self.burst,
            dispatch_many=self.dispatch_many, hand_back_unstarted=self.hand_back_unstarted,
            burst_done=self.burst_done, settling=lambda: self.timeouts.settling,
        )

    def _loop_bodies(self) -> list[tuple[str, Callable[[], None]]]:
        """The supervisor's loops, each bound to exactly what it uses."""
        settings, alias, lifecycle = self.settings, self.alias, self.lifecycle
        bodies: list[tuple[str, Callable[[], None]]] = [
            ("listener", lambda: listen_loop(alias, lifecycle, runner_id=self.runner_id,
                                             poll_interval=settings.poll_interval,
                                             lease=self.lease)),
            ("claimer", lambda: claim_loop(self._claiming())),
            ("heartbeat", lambda: heartbeat_loop(self.liveness, lifecycle.halt)),
            ("rescue", lambda: rescue_loop(self.liveness, self.pool, lifecycle.halt)),
        ]
        if self.enable_cleanup and not self.burst:
            bodies.append(("cleanup", lambda: cleanup_loop(alias, settings.cleanup_interval,
                                                           lifecycle.halt)))
        if self.enable_scheduler:
            from .scheduler import scheduler_loop

            def schedule() -> None:
                scheduler_loop(alias, self.runner_id, settings.scheduler_interval, lifecycle,
                               burst=self.burst, resync_interval=settings.stale_lock_timeout)

            if self.burst:
                # Fire what is due before the claimer starts, so a burst runs those jobs too
                # instead of stopping before the scheduler has inserted them.
                schedule()
            else:
                bodies.append(("scheduler", schedule))
        bodies.extend((name, lambda body=body: body(self))  # type: ignore[misc]
                      for name, body in self._extra_loops)
        return bodies

    def register(self, cursor: Cursor) -> None:
        types = registry.job_types()
        # Declared from the first moment (also when registering again after being presumed
        # dead), so no other runner's sync takes a schedule only this one declares for gone.
        schedules = [spec.job_type for spec in registry
                     if spec.is_recurring] if self.enable_scheduler else None
        self._started_at = store.register_runner(
            cursor, self.runner_id, socket.gethostname(), os.getpid(), self.settings.queues,
            self.settings.concurrency, VERSION, self.name, types, schedules,
            started_at=self._started_at,
        )
        self._registered = True
        self.liveness.note_listed(types)  # (the next beat need not write them again)

    def _warn_about_namesakes(self) -> None:
        """Say so when another live runner carries this runner's name: legitimate for replicas
        started from one configuration, a mistake if the name was meant to single one out.
        Either way each has its own identity, so neither can take the other's jobs."""
        twins = run_with_retry(
            self.alias, lambda c: store.live_namesakes(c, self.runner_id, self.name,
                                                       self.settings.stale_lock_timeout),
            what="looking for runners with the same name", interrupt=self.stopping,
        ) or []
        for twin_id, host, pid in twins:
            logger.warning(
                "runner %s: another live runner named %r (%s, host %s pid %s) is running; "
                "both run jobs, each under its own identity", self.runner_id, self.name,
                twin_id, host, pid,
                extra={"event": "runner_namesake", "runner_id": self.runner_id,
                       "other_runner_id": twin_id},
            )

    def _start_sidecar(self) -> None:
        from . import sidecar

        if not self.use_sidecar or self.processes or not sidecar.supported():
            return  # with worker processes no handler shares this interpreter: nothing to cover
        try:
            self.sidecar = sidecar.LivenessSidecar.for_alias(
                self.alias, self.runner_id, self.settings.heartbeat_interval)
            self.sidecar.start()
        except Exception as exc:  # the runner works without it, minus GIL-holder protection
            logger.warning("could not start the liveness sidecar (%s); a handler that holds "
                           "the GIL for longer than the stale-lock timeout will get this runner "
                           "declared dead", exc, extra={"event": "sidecar_failed"})
            self.sidecar = None

    def _stop_sidecar(self) -> None:
        self.use_sidecar = False  # a heartbeat thread still running must not start a new one
        side, self.sidecar = self.sidecar, None
        if side is not None:
            side.stop()

    def vouch(self) -> None:
        """Tell the liveness sidecar this process runs Python code, and for how long from now
        it may legitimately be too busy to say so (restarting the sidecar if it died). Sent by
        the supervisor: while it ticks, the runner enforces its deadlines."""
        with self._vouch_lock:
            side = self.sidecar
            if side is None:
                return
            if not side.alive and self.use_sidecar:
                logger.warning("liveness sidecar of runner %s exited; starting a new one",
                               self.runner_id, extra={"event": "sidecar_restart"})
                side.stop()
                self._start_sidecar()
                side = self.sidecar
                if side is None:
                    return
            horizon = self.vouch_horizon()
            if side.vouch(horizon):
                self._vouched_until = time.monotonic() + horizon

    def vouch_horizon(self) -> float:
        """The stale-lock timeout plus the time left until the last in-flight job's deadline:
        past that, a runner too busy to beat could not enforce its jobs' timeouts either."""
        stale = self.settings.stale_lock_timeout
        now = time.monotonic()
        left = 0.0
        for item in self.pool.snapshot():
            if item.deadline is not None:
                left = max(left, item.deadline - now)
            elif item.job.timeout:  # not started yet: it may start now
                left = max(left, item.job.timeout)
            else:
                left = max(left, NO_TIMEOUT_VOUCH_FACTOR * stale)
        return stale + left

    def _never_connected(self) -> None:
        self.exit_code = EXIT_NEVER_CONNECTED
        logger.error("runner %s stopped before it could reach database %r; nothing was run",
                     self.runner_id, self.alias,
                     extra={"event": "never_connected", "runner_id": self.runner_id})
        connections.close_all()

    def _connect(self, remaining: float | None) -> None:
        """Open this thread's connection; with a time limit, give up after ``remaining``
        seconds even if connecting hangs (a host that drops packets)."""
        if remaining is None:
            connections[self.alias].ensure_connection()
            return
        failure: list[BaseException] = []

        def probe() -> None:
            try:
                connections[self.alias].ensure_connection()
            except BaseException as exc:
                failure.append(exc)
            finally:
                with contextlib.suppress(Exception):
                    connections[self.alias].close()

        thread = threading.Thread(target=probe, name="pj-db-probe", daemon=True)
        thread.start()
        thread.join(max(0.0, remaining))
        if thread.is_alive():
            raise TimeoutError("connecting timed out")
        if failure:
            raise failure[0]
        connections[self.alias].ensure_connection()

    def _wait_for_database(self) -> None:
        limit = self.database_wait
        deadline = None if limit is None else time.monotonic() + limit
        backoff = Backoff(first=0.5, cap=5.0)
        last_error = ""
        tried = False
        while True:  # one attempt even if a stop came first: "stopped" then means "connected"
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and not tried:
                # One attempt even with no time left (``--database-wait 0``): giving up on a
                # database that was never tried would fail every start, reachable or not.
                remaining = max(remaining, FIRST_CONNECT_SECONDS)
            tried = True
            if remaining is not None and remaining <= 0:
                raise DatabaseUnreachable(
                    f"could not reach database {self.alias!r} within {limit:g}s"
                    f"{f' ({last_error})' if last_error else ''}; giving up. Check that "
                    "PostgreSQL is running and reachable with settings.DATABASES (or "
                    "DATABASE_URL), or allow longer with --database-wait."
                )
            try:
                self._connect(remaining)
                self._connected_once = True
                return
            except TimeoutError as exc:
                last_error = str(exc)
                if self.stopping.is_set():
                    return
                continue
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
                if self.stopping.is_set():
                    return
                delay = backoff.next()
                last_error = error_line(exc, repr(exc))
                left = ""
                if deadline is not None:
                    remaining = max(0.0, deadline - time.monotonic())
                    delay = min(delay, remaining)
                    # Say when it gives up: an operator watching a burst should not have to
                    # know the default --database-wait.
                    left = f", giving up in {remaining:.0f}s"
                logger.warning("database not reachable (%s); retrying in %.1fs%s", last_error,
                               delay, left, extra={"event": "db_wait"})
                self.stopping.wait(delay)

    def dispatch_many(self, jobs: list[store.ClaimedJob]) -> int:
        """Hand a whole claim to the workers (with worker processes: one message per worker
        instead of one per job); returns how many were accepted, the caller hands the rest
        back (the runner is stopping)."""
        return self.pool.submit_many([self._in_flight(job) for job in jobs])

    def _in_flight(self, job: store.ClaimedJob) -> InFlight:
        ctx = JobContext(
            job_id=job.id, job_type=job.job_type, attempt=job.attempt,
            max_retries=job.max_retries, runner_id=self.runner_id, queue=job.queue,
            priority=job.priority, timeout=job.timeout, tenant=job.tenant,
            _progress_sink=self._report_progress, _token=job.token,
        )
        if job.cancel_requested:
            ctx._cancel_event.set()
        # No deadline yet: the timeout clock starts when the executor starts the job (a job
        # waiting for a free slot is not running out of time).
        return InFlight(job=job, ctx=ctx, deadline=None)

    def hand_back_unstarted(self, jobs: list[store.ClaimedJob]) -> None:
        for job in jobs:
            record_outcome(self.alias, job, Outcome(
                "release", "SHUTDOWN", "runner stopping; claimed job handed back unstarted",
            ), self.runner_id, self.forced, attempt_outcome="interrupted")

    def _starting(self, item: InFlight) -> None:
        """A waiting job is about to start: on the fast path (its start noted, written with
        the next claim) while this runner's lease is fresh and has been held since the job
        was claimed, else through the gate."""
        if self.lease.fresh(item.job.lease_period):
            item.job.waiting = False
            item.job.began = self.starts.note(item.job.token)

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
        if item.job.waiting and item.gate is not None:
            # Its start goes on record through the gate first: its timeout clock starts once
            # it is (``_admitted``), not while the gate waits for the database. Bounded all
            # the same (``InFlight.start_clock``): a gate stuck for good must not hold the slot.
            item.on_admitted = self._admitted
            item.start_clock(time.monotonic(), self._gate_allowance)
        else:
            self._admitted(item)
        execute(self.alias, item, self.runner_id, self.forced)

    def _admitted(self, item: InFlight) -> None:
        """``item``'s handler starts now: its timeout clock starts."""
        item.start_clock(time.monotonic())
        if self.sidecar is not None:
            # A handler may hold the GIL from its first line: the sidecar must already know
            # this job's deadline, not learn it at the supervisor's next tick.
            stale = self.settings.stale_lock_timeout
            end = stale + (item.deadline if item.deadline is not None
                           else item.ctx.started_monotonic + NO_TIMEOUT_VOUCH_FACTOR * stale)
            if end > self._vouched_until + VOUCH_SECONDS:
                self.vouch()

    def _report_progress(self, ctx: JobContext, progress: Any) -> None:
        """Fenced by the attempt's own token (``ctx._token``), not the job's current one: a
        timed-out attempt whose code goes on (a ``finally``, a thread of its own) while its
        retry runs must not write over the retry's progress."""
        if ctx._token is not None:
            self._progress.write(ctx.job_id, ctx._token, progress)

    def _supervise(self) -> None:
        while True:
            self._tick()
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

    def _release_unstarted(self) -> None:
        """Prefetched but never started: hand back at once, uncharged, rather than start new
        work after the signal."""
        for item in self.pool.unstarted():
            self.timeouts.take_over(item, Outcome(
                "release", "SHUTDOWN",
                f"runner {self.runner_id} stopped before starting attempt {item.job.attempt}; "
                "handed back unstarted",
            ), "interrupted")

    def _tick(self) -> None:
        """One round of the supervisor's own duties: vouch to the sidecar, enforce timeouts.

        An error here (a job whose outcome could not be recorded nor handed back, say) stops
        the runner like a dead loop, through the usual shutdown: raised out of the supervisor,
        it skipped the shutdown, so the jobs left were not handed back, the runner's row stayed
        (its jobs waited for the stale-lock timeout) and an embedded runner's loops ran on."""
        try:
            now = time.monotonic()
            if now - self._vouched_at >= VOUCH_SECONDS:
                self._vouched_at = now
                self.vouch()
            self.timeouts.enforce()
        except Exception:
            if self._duty_failed:
                return  # (said already; the shutdown goes on, ticking as it waits)
            self._duty_failed = True
            logger.critical("stopping runner %s: the supervisor's own work failed",
                            self.runner_id, exc_info=True,
                            extra={"event": "runner_failed", "runner_id": self.runner_id})
            self.exit_code = EXIT_LOOP_DIED
            self.request_stop()

    def _shutdown(self) -> None:
        grace = self.settings.shutdown_grace
        started = self._stop_requested_at or time.monotonic()
        # From here on the claim loop cannot start jobs: whatever it claims late (a claim that
        # was in flight when the signal came) it hands straight back, so the hand-back below
        # sees every job this runner will ever run.
        self.pool.seal()
        self._release_unstarted()
        # Completions still being written count too: their handlers returned, and the runner
        # must not unregister (or its workers exit) before they are recorded.
        while (self.pool.busy or self.pool.completing) and not self.forced.is_set():
            if time.monotonic() - started >= grace:
                break
            self._tick()
            # (Jobs a worker process gave back unstarted, or left in its queue as it died.)
            self._release_unstarted()
            with self.pool.changed:
                self.pool.changed.wait(SUPERVISOR_TICK)
        # Jobs a worker process was asked to give back are unaccounted for until it answers
        # (a round trip): wait for that briefly even when forced or with no grace, so that the
        # hand-back below does not charge a job that never started.
        self.pool.await_recalls(RECALL_ANSWER_SECONDS)
        self._release_unstarted()  # (unstarted ones still uncharged, whatever is left)
        for item in self.pool.snapshot():
            self.timeouts.take_over(item, Outcome(
                "handback", "SHUTDOWN",
                f"runner {self.runner_id} stopped before attempt {item.job.attempt} finished "
                f"(grace period {grace:g}s); handed back for retry",
            ), "interrupted")
        # Ride out a database outage as long as it lasts (a second signal cuts it short), but
        # give up on rows that stay locked after a while: their holder may never let go.
        settle_until = time.monotonic() + SETTLE_AT_EXIT_SECONDS
        unsettled = self.timeouts.unsettled
        while unsettled and not self.forced.is_set() and not (
            time.monotonic() >= settle_until and all(e.locked for e in unsettled)
        ):
            self.forced.wait(SUPERVISOR_TICK)
            self.timeouts.settle_pending()
        for entry in unsettled:
            logger.error(
                "job %s: could not record its outcome (%s) before exiting; it will be rescued "
                "once this runner's row is gone", entry.item.job.id, entry.outcome.code,
                extra={"event": "unsettled_at_exit", "job_id": str(entry.item.job.id)})
        self._stop_services()
        if self.started.is_set():
            self._unregister()
        self._close_connections()
        if self.forced.is_set() and self.exit_code == EXIT_OK:
            self.exit_code = EXIT_FORCED
        logger.info("runner %s stopped", self.runner_id,
                    extra={"event": "runner_stopped", "runner_id": self.runner_id})


class _Deadline(threading.Event):
    """An event that sets itself after ``seconds``, for ``run_with_retry``'s ``interrupt``:
    a bounded retry that leaves no timer thread behind once the runner has stopped."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self._until = time.monotonic() + seconds

    def is_set(self) -> bool:
        return super().is_set() or time.monotonic() >= self._until

    def wait(self, timeout: float | None = None) -> bool:
        left = max(0.0, self._until - time.monotonic())
        super().wait(left if timeout is None else min(timeout, left))
        return self.is_set()
