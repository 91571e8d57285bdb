"""Running one claimed job: the handler and the fenced completion share one transaction.

If the handler raises, its transaction rolls back and the failure is recorded in a second, fenced
statement. If the completion finds the claim lost, it raises ``ClaimLost`` inside the transaction
so the handler's business writes roll back with it. A handler that ran no SQL has nothing to
commit with its completion: that is written by the executor's ``Completer``, batched with the
completions of other such jobs. So is the completion of a handler registered with
``atomic=False``, which runs in autocommit: its writes commit as they run, and none is fenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import threading
import time
import traceback as tb_module
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from django.db import connections, transaction
from psycopg.pq import TransactionStatus

from .. import backoff, signals
from .._flag import Flag
from ..context import JobContext
from ..errors import JobCancelledError, JobError, PermanentJobError, TransientJobError
from ..handlers import HandlerSpec, global_backoff, registry
from . import store, syscalls
from .db import (
    NotNow,
    is_connection_error,
    is_lost_prepared_statement,
    is_transient_error,
    reset_connection,
    run_bounded,
    run_with_retry,
)

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper as Cursor

    from .completer import Completer
    from .starts import StartGate
    from .store import ClaimedJob, TransitionKind

logger = logging.getLogger("django_persistent_jobs.runner")
#: One INFO line per completed job goes to this child logger, so that ``runjobs`` can leave
#: those lines out at its default verbosity (a line per job is a cost per job: about a fifth of
#: a no-op drain's rate) and still show failures, retries and dead letters.
COMPLETIONS_LOGGER = "django_persistent_jobs.runner.completions"
completions_logger = logging.getLogger(COMPLETIONS_LOGGER)
#: The loggers whose levels ``runjobs`` sets from its verbosity; a supervisor hands their levels
#: to its worker processes, which log what it would.
RUNJOBS_LOGGERS = ("django_persistent_jobs", COMPLETIONS_LOGGER)


class ClaimLost(Exception):
    """The job no longer carries our fencing token; our transaction must not commit."""


class JobInterrupted(BaseException):
    """Injected into a handler thread whose job timed out or was handed back at shutdown.

    A ``BaseException`` so that a handler's ``except Exception`` cannot swallow it.
    """


@dataclass
class InFlight:
    """A job being executed by a worker thread, as the supervisor sees it."""

    job: ClaimedJob
    ctx: JobContext
    deadline: float | None
    thread_ident: int | None = None
    backend_pid: int | None = None
    #: When that backend started: with the pid, it names the session unambiguously (pids are
    #: recycled), so a timeout never terminates somebody else's connection.
    backend_start: Any = None
    taken_over: Flag = field(default_factory=Flag)
    owner: Any = None  # the pool's worker, once the job is taken over from it
    #: Where the completion of a handler that ran no SQL goes (None: written by its thread).
    completer: Completer | None = None
    #: Records the start of a job that waited for a worker before it runs (None: no gate).
    gate: StartGate | None = None
    #: Called with this job once the gate has put its start on record, before its handler
    #: runs: its timeout clock starts then, not while the gate waited for the database (an
    #: outage longer than the job's timeout must not charge a ``TIMEOUT`` to a handler that
    #: never ran). A bound method of the runner or worker, not of the job (see ``on_settled``).
    on_admitted: Callable[[InFlight], None] | None = None
    #: Called with this job when ``execute`` found its thread's connection dropped by the
    #: server and gave the handler a new session (``backend_pid``, ``backend_start``): a
    #: worker process tells its supervisor, which terminates that session at the timeout.
    #: (The thread runner reads this object's fields itself: None there.)
    on_session: Callable[[InFlight], None] | None = None
    #: Called with this job once a completion handed to ``completer`` was written and logged
    #: (``execute`` returned True): the job has then left this runner's hands. Given the
    #: exception if its outcome could not be recorded (what ``execute`` raises when it settles
    #: a job itself). Given the job rather than bound to it: a callable on the job that refers
    #: back to it would make every job a reference cycle, which only the garbage collector
    #: frees (a pause of tens of milliseconds every few thousand jobs, every thread stopped).
    on_settled: Callable[[InFlight, BaseException | None], None] | None = None
    #: A worker process reported this job done (a job reaches ``DONE`` once, whichever of its
    #: lane and its completion gets there first).
    done_reported: bool = False
    #: The handler returned: what its thread runs from here on (the completion, its commit,
    #: the handler's ``on_commit`` callbacks, ``job_finished`` receivers) may already have
    #: committed the completion, so an interruption from here on reads the attempt back and
    #: reports it if it did (``_report_if_completed``).
    returned: bool = False
    #: ``job_finished(completed)`` for this attempt has been claimed by one sender
    #: (``claim_report``): the thread that wrote the completion, the completer, or the timeout
    #: enforcer that found it written. An attempt is reported once whichever gets there first.
    report_claimed: bool = False

    def start_clock(self, at: float, gate_allowance: float = 0.0) -> None:
        """The handler starts at ``at`` (``time.monotonic()``): its timeout clock starts
        then. ``gate_allowance``: for a job about to wait at the start gate, how much longer
        than its timeout that wait may last before its deadline passes all the same. The gate's
        wait is not the handler's time (the clock starts again at admission, ``on_admitted``),
        but a gate stuck for good (its write waiting on a row another transaction keeps locked,
        a connection hung on a dead server) must not hold the slot for ever."""
        self.ctx.started_monotonic = at
        if self.job.timeout:
            self.deadline = at + self.job.timeout + gate_allowance

    def claim_report(self) -> bool:
        """True for the first caller only: that caller sends the attempt's completion."""
        with _REPORT_LOCK:
            if self.report_claimed:
                return False
            self.report_claimed = True
            return True


#: Guards ``InFlight.claim_report`` (held for a flag's test and set: one lock for all jobs).
_REPORT_LOCK = threading.Lock()


@dataclass
class Outcome:
    kind: TransitionKind
    code: str
    message: str
    traceback: str = ""
    delay: float = 0.0
    #: Dotted path of the exception class that ended the attempt ("" when no exception did).
    error_class: str = ""


def _backoff_for(spec: HandlerSpec | None, attempt: int) -> float:
    """The delay before the next attempt (``backoff.delay_after``); bounded when stored
    (``store.storable_delay``)."""
    return backoff.delay_after(spec.effective_backoff() if spec is not None else global_backoff(),
                               attempt)


def _describe(exc: BaseException) -> str:
    """``str(exc)``, which is the handler's code and may itself raise."""
    try:
        return str(exc) or type(exc).__name__
    except Exception:
        return f"<{type(exc).__name__}: str() of this exception failed>"


def classify(exc: BaseException, spec: HandlerSpec | None, attempt: int) -> Outcome:
    """Map what a handler raised to the job's next state."""
    outcome = _classify(exc, spec, attempt)
    outcome.error_class = f"{type(exc).__module__}.{type(exc).__qualname__}"[:255]
    return outcome


def _classify(exc: BaseException, spec: HandlerSpec | None, attempt: int) -> Outcome:
    trace = "".join(tb_module.format_exception(exc))
    message = _describe(exc)
    if isinstance(exc, JobCancelledError):
        return Outcome("cancel", exc.code, message, trace)
    if isinstance(exc, PermanentJobError):
        return Outcome("dead", exc.code, message, trace)
    if isinstance(exc, TransientJobError):
        delay = exc.retry_after if exc.retry_after is not None else _backoff_for(spec, attempt)
        return Outcome("retry", exc.code, message, trace, delay)
    if isinstance(exc, JobError):
        kind: TransitionKind = "retry" if exc.transient else "dead"
        return Outcome(kind, exc.code, message, trace, _backoff_for(spec, attempt))
    if is_transient_error(exc) or is_lost_prepared_statement(exc):
        return Outcome("retry", "DB_ERROR", f"database error: {message}", trace,
                       _backoff_for(spec, attempt))
    return Outcome("retry", "HANDLER_ERROR", f"{type(exc).__name__}: {message}", trace,
                   _backoff_for(spec, attempt))


def _stored_code(outcome: Outcome) -> str:
    """The outcome's code as ``store.transition`` writes it, for log lines: a handler's code
    may hold a NUL or a lone surrogate, which a UTF-8 log handler cannot write."""
    return store.storable_text(outcome.code, store.CODE_MAX_LENGTH)


def log_transition(
    job: ClaimedJob, status: str | None, outcome: Outcome, runner_id: str,
    settled_as: str | None = None,
) -> None:
    # The text as it was stored: a NUL or a lone surrogate from the handler's error would make
    # a UTF-8 log handler fail to write the line ("--- Logging error ---"), losing the record.
    code = _stored_code(outcome)
    message = store.storable_text(outcome.message, store.MESSAGE_MAX_LENGTH)
    extra = {
        "event": {"failed": "retry", "dead_lettered": "dead_letter", "cancelled": "cancelled",
                  "pending": "handed_back"}.get(status or "", "claim_lost"),
        "job_id": str(job.id), "job_type": job.job_type, "attempt": job.attempt,
        "error_code": code, "runner_id": runner_id, "status": status,
    }
    if status in ("failed", "dead_lettered"):
        # One "failure" record per failed attempt, then what follows from it (retry or dead
        # letter), so a log query for failures does not depend on the verdict.
        logger.warning("job %s attempt %d failed (%s: %s)", job.id, job.attempt, code,
                       message, extra={**extra, "event": "failure"})
    if status == "failed":
        logger.warning("job %s: retry scheduled in %.1fs (after attempt %d, %s)", job.id,
                       outcome.delay, job.attempt, code, extra=extra)
    elif status == "dead_lettered":
        logger.error("job %s dead-lettered after attempt %d (%s: %s)", job.id, job.attempt,
                     code, message, extra=extra)
    elif status is None and settled_as == "completed":
        # The completion committed before this outcome could be: the runner did not hear
        # back (the connection died during COMMIT), or the handler returned just as the
        # supervisor took the job over (a timeout). Done, exactly once; nothing to retry.
        extra["event"] = "completed_unacknowledged"
        logger.info("job %s: attempt %d had already committed its completion (%s not "
                    "recorded); nothing to retry", job.id, job.attempt, code,
                    extra=extra)
    elif status is None:
        logger.warning("job %s: claim lost before the failure could be recorded (attempt "
                       "settled as %s)", job.id, settled_as, extra=extra)
    else:
        logger.info("job %s %s (%s)", job.id, status, code, extra=extra)


#: How many times a settling statement that failed with a non-transient error is tried again
#: before the job is handed back instead (transient conditions are retried without limit by
#: ``run_with_retry``). A unique-key conflict with a concurrent enqueue resolves on the first
#: retry: the statement then sees the committed newer job and settles this one as replaced.
SETTLE_ROUNDS = 3


class SettleFailed(Exception):
    """Neither the job's outcome nor a hand-back could be recorded."""


def _settle(
    alias: str, job: ClaimedJob, outcome: Outcome, interrupt: threading.Event | None,
    attempt_outcome: str | None, bounded: bool = False,
) -> tuple[str | None, Exception | None]:
    """Apply one transition, retrying a failed statement a few times; ``(status, error)``.
    ``bounded``: see ``record_outcome``."""
    charge_delay = (_backoff_for(registry.get(job.job_type), job.attempt)
                    if outcome.kind == "handback" else 0.0)

    def apply(cursor: Cursor) -> str | None:
        return store.transition(
            cursor, job.id, job.token, kind=outcome.kind, code=outcome.code,
            message=outcome.message, traceback=outcome.traceback, delay=outcome.delay,
            outcome=attempt_outcome, charge_delay=charge_delay,
            error_class=outcome.error_class, began=job.began,
        )

    error: Exception | None = None
    what = f"recording the outcome of job {job.id}"
    for round_ in range(SETTLE_ROUNDS):
        try:
            if bounded:
                return run_bounded(alias, apply, what=what), None
            return run_with_retry(alias, apply, what=what, interrupt=interrupt), None
        except NotNow:
            raise
        except Exception as exc:
            error = exc
            logger.warning(
                "job %s: recording %s failed (%s: %s); %s", job.id, _stored_code(outcome),
                type(exc).__name__, store.storable_text(exc, 500),
                "trying again" if round_ + 1 < SETTLE_ROUNDS else "giving up",
                extra={"event": "settle_retry", "job_id": str(job.id)},
            )
            if is_connection_error(exc):
                reset_connection(alias)
            threading.Event().wait(0.05 * 2**round_)
    return None, error


def record_outcome(
    alias: str, job: ClaimedJob, outcome: Outcome, runner_id: str,
    interrupt: threading.Event | None, attempt_outcome: str | None = None,
    bounded: bool = False, claim_report: Callable[[], bool] | None = None,
) -> str | None:
    """Apply a fenced transition, retrying through connection loss; returns the new status.

    No database error may take the runner down with it: a settling statement that keeps
    failing (not a transient condition, which is retried for as long as it lasts) is tried
    ``SETTLE_ROUNDS`` times, then the job is handed back (counted, so a job whose outcome can
    never be recorded still ends dead-lettered), and the runner goes on. Only if the hand-back
    fails as well does this raise ``SettleFailed``: the caller must then stop the runner, so
    that another one rescues the job rather than it staying claimed by a live runner.

    ``bounded`` (the supervisor): wait at most ``ROW_LOCK_TIMEOUT_SECONDS`` for the job's row
    lock and do not wait for an unreachable database; raise ``NotNow`` instead, and the caller
    tries again later.

    ``claim_report``: asked, when the statement finds the attempt already completed by its
    own execution, whether this call sends its ``job_finished`` (None: it does; the thread
    that ran the handler, whose commit landed although its answer was lost). The supervisor
    settling a job it took from a live execution (timeout, shutdown) passes the job's
    ``InFlight.claim_report`` where that execution shares it (threads, a dead worker's jobs),
    so that the attempt is reported once whichever of the two gets there first, and a claim
    that always fails for a live worker process, which reports its own completions.
    """
    status, error = _settle(alias, job, outcome, interrupt, attempt_outcome, bounded)
    if error is not None:
        fallback = Outcome(
            "release" if outcome.kind == "release" else "handback", "SETTLE_FAILED",
            f"could not record the outcome of attempt {job.attempt} ({outcome.code}: "
            f"{outcome.message[:1000]}): {type(error).__name__}: {_describe(error)}",
        )
        logger.error("job %s: handing it back, its outcome could not be recorded", job.id,
                     extra={"event": "settle_failed", "job_id": str(job.id),
                            "runner_id": runner_id, "error_code": _stored_code(outcome)})
        status, second = _settle(alias, job, fallback, interrupt, "interrupted", bounded)
        if second is not None:
            raise SettleFailed(f"job {job.id}: could not record its outcome nor hand it back: "
                               f"{second}") from second
        outcome = fallback
    if outcome.kind == "handback" and status in ("failed", "dead_lettered"):
        # Handed back once too often: the statement charged it as an interrupted attempt.
        outcome = dataclasses.replace(outcome, code="INTERRUPTED")
    settled_as = None
    if status is None:
        # Not ours any more: rescued, taken over, or (after a connection failure at COMMIT)
        # completed by this very attempt. Say which, for the operator reading the log.
        def read(cursor: Cursor) -> str | None:
            return store.attempt_outcome(cursor, job.token)

        what = f"reading the outcome of job {job.id}"
        settled_as = (run_bounded(alias, read, what=what) if bounded
                      else run_with_retry(alias, read, what=what, interrupt=interrupt))
    log_transition(job, status, outcome, runner_id, settled_as)
    if status is None and settled_as == "completed":
        if claim_report is None or claim_report():
            signals.finished(job, runner_id, status="completed")  # its commit did land
        # (Else not even ``finished(status=None)``: the start time it would drop is the one
        # the writer's report gives its duration from.)
    else:
        # As stored (``storable_text``): a NUL or a lone surrogate in a handler's code would
        # otherwise reach receivers that cannot carry it (a metric label, a log, a webhook).
        signals.finished(job, runner_id, status=status, code=_stored_code(outcome),
                         message=store.storable_text(outcome.message,
                                                     store.MESSAGE_MAX_LENGTH),
                         attempt_outcome="interrupted" if error is not None else attempt_outcome)
    return status


def _server_hung_up(raw: Any) -> bool:
    """True if an idle connection has heard from the server: for a connection that sent
    nothing, that can only be the server closing it (a restart, a terminated backend).

    Checking the socket costs no round trip, and catching this before the handler starts means
    a job does not pay an attempt (``DB_ERROR``) for a connection that died while idle.
    """
    try:
        if raw.closed or raw.broken:
            return True
        return syscalls.readable(raw.pgconn.socket)
    except Exception:
        return True


def prepare_connection(alias: str, inflight: InFlight, connection: Any = None) -> None:
    """Give the handler a live connection and note which server session it is. (A caller
    that holds this thread's ``connections[alias]`` passes it: each lookup goes through
    asgiref's thread-local machinery, a measurable share of a no-op job.)"""
    if connection is None:
        connection = connections[alias]
    if connection.connection is not None and _server_hung_up(connection.connection):
        reset_connection(alias)
    inflight.backend_pid, inflight.backend_start = _session(alias, connection)


def _session(alias: str, connection: Any = None) -> tuple[Any, Any]:
    """This thread's connection, opened if need be, and its server session (pid, start)."""
    if connection is None:
        connection = connections[alias]
    connection.ensure_connection()
    raw = connection.connection
    known = getattr(connection, "_pj_backend", None)
    if known is None or known[0] is not raw:
        # Once per connection, not per job.
        with connection.cursor() as cursor:
            cursor.execute("SELECT pid, backend_start FROM pg_stat_activity "
                           "WHERE pid = pg_backend_pid()")
            pid, started = cursor.fetchone()
        known = (raw, pid, started)
        connection._pj_backend = known
    return known[1], known[2]


def warm_connection(alias: str) -> None:
    """Open this thread's connection before its first job (a handler thread or a lane, when
    it starts): opening it, and asking which session it is, cost the first job on each
    thread several milliseconds, which an idle runner's pickup latency paid once per thread.
    A database that cannot be reached now is not an error here: the job's own attempt meets
    it and settles it as always."""
    try:
        _session(alias)
    except Exception as exc:
        logger.debug("could not open a connection ahead of the first job: %s", exc,
                     extra={"event": "connection_warm_up_failed"})


#: How often the event loop running an async handler looks whether the supervisor took the
#: job over (timeout, shutdown), so that it can cancel the coroutine instead of letting it run.
ASYNC_TAKE_OVER_POLL = 0.05


class _AsyncTakenOver(Exception):
    """An async handler was cancelled because the supervisor settled its job already."""


def run_awaitable(awaitable: Any, inflight: InFlight) -> Any:
    """Run an async handler's coroutine to completion, from the worker thread.

    ``async_to_sync`` runs the event loop in a helper thread and executes every
    ``sync_to_async(thread_sensitive=True)`` call, which includes Django's async ORM methods
    (``acreate``, ``aget``, ...), back in this worker thread, on this thread's connection and
    so inside the job's transaction: the handler's writes commit atomically with the
    completion and roll back with a failure, exactly as for a plain function. When the
    supervisor takes the job over (timeout, shutdown), the coroutine is cancelled.
    """

    async def drive() -> Any:
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=ASYNC_TAKE_OVER_POLL)
                if done:
                    return task.result()
                if inflight.taken_over.is_set():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                    raise _AsyncTakenOver(inflight.job.id)
        finally:
            if not task.done():
                task.cancel()

    return async_to_sync(drive)()


def execute(alias: str, inflight: InFlight, runner_id: str, interrupt: threading.Event) -> bool:
    """Run the handler and settle the job. Never raises except ``JobInterrupted``.

    True when the job's completion was handed to ``inflight.completer`` rather than written
    here: the handler is done and its thread free, but the job is settled (logged, signalled,
    ``inflight.on_settled`` called) on the completer's thread once the batch carrying it
    commits. False when the job is settled on return.
    """
    job = inflight.job
    job.decode_payload()  # (claimed undecoded: decoded here, where the handler runs)
    # Admitted before ``job_started`` is sent: a refused job never starts, and a start signal
    # without its ``job_finished`` would count an attempt that never ran and leave its
    # tracing span open (the current span of this thread, parent of every later job's).
    if job.waiting and inflight.gate is not None:
        admitted = inflight.gate.admit(job.token)
        if not admitted:
            # Handed back by another runner while it waited here (this runner's lease had
            # lapsed), or its start could not be written (an error retrying does not fix, the
            # gate's thread died, the runner is stopping with the database away): it must not
            # run.
            logger.warning("job %s: not started, %s", job.id,
                           "it was handed back while it waited for a worker"
                           if admitted is False else "its start could not be recorded",
                           extra={"event": "start_refused", "job_id": str(job.id),
                                  "runner_id": runner_id})
            if admitted is None:
                _hand_back_unadmitted(alias, job, runner_id, interrupt)
            return False
        inflight.ctx.started_monotonic = time.monotonic()  # (``ctx.time_left`` counts from here)
        if inflight.on_admitted is not None:
            inflight.on_admitted(inflight)
    signals.started(job, runner_id)
    if inflight.ctx.cancel_requested:
        # An operator cancelled it while it waited for a worker (claimed, not started): it
        # never starts. (Cancelling running work is cooperative; work that has not begun
        # has nothing to be careful about.)
        record_outcome(alias, job, Outcome(
            "cancel", "CANCELLED", "cancelled by an operator before its handler started",
        ), runner_id, interrupt)
        return False
    spec = registry.get(job.job_type)
    if spec is None:
        record_outcome(alias, job, Outcome(
            "dead", "UNKNOWN_JOB_TYPE",
            f"no handler is registered for job type {job.job_type!r} in runner {runner_id}",
        ), runner_id, interrupt)
        return False
    if job.payload_error is not None:
        record_outcome(alias, job, Outcome(
            "dead", "PAYLOAD_INVALID",
            f"the stored payload cannot be decoded: {job.payload_error}",
        ), runner_id, interrupt)
        return False
    if spec.validator is not None:
        try:
            spec.validator(job.payload)
        except Exception as exc:
            record_outcome(alias, job, Outcome(
                "dead", "PAYLOAD_INVALID", f"payload rejected by the validator: {exc}",
                "".join(tb_module.format_exception(exc)),
            ), runner_id, interrupt)
            return False
    connection = connections[alias]
    deferred: tuple[Completer, str | None] | None = None
    try:
        known = inflight.backend_pid, inflight.backend_start
        prepare_connection(alias, inflight, connection)
        if inflight.on_session is not None and (
                inflight.backend_pid, inflight.backend_start) != known:
            inflight.on_session(inflight)
        if spec.atomic:
            with transaction.atomic(using=alias):
                result = _call_handler(spec, inflight)
                inflight.returned = True
                # psycopg sends BEGIN lazily, so an idle connection here means the handler ran
                # no SQL on it: there is nothing to commit atomically with the completion, which
                # then goes to the completer (or runs as one autocommit statement) instead of
                # BEGIN + UPDATE + COMMIT. (Pending on_commit callbacks keep the transaction
                # path, so they still run after it.)
                raw = connection.connection
                solo = (raw is not None and not connection.run_on_commit
                        and raw.info.transaction_status == TransactionStatus.IDLE)
                if not solo:
                    with connection.cursor() as cursor:
                        if not store.complete(cursor, job, result):
                            raise ClaimLost(job.id)
        else:
            # Autocommit: whatever the handler wrote has committed as it ran; its completion
            # has nothing to be atomic with.
            result = _call_handler(spec, inflight)
            inflight.returned = True
            if _close_open_transaction(connection):
                raise RuntimeError(
                    f"the handler for {job.job_type!r} (atomic=False) returned with a "
                    "transaction open on its connection; it was rolled back")
            solo = True
        if solo:
            if inflight.completer is None:
                with connection.cursor() as cursor:
                    if not store.complete(cursor, job, result):
                        raise ClaimLost(job.id)
            else:
                deferred = (inflight.completer, result)
    except ClaimLost:
        _claim_lost(job, spec, runner_id)
        return False
    except JobInterrupted:
        # Taken over (timeout, shutdown). After the handler returned, the interruption may have
        # landed after the completion's commit (in an ``on_commit`` callback, say): then the
        # attempt completed, and is reported here unless the enforcer reported it already.
        if inflight.returned:
            _report_if_completed(alias, inflight, runner_id)
        raise
    except BaseException as exc:
        if inflight.taken_over.is_set():
            # The supervisor settles this attempt (timeout, hand-back) and reports what it
            # writes; but a completion of ours may have committed just before the supervisor
            # cut our session, and that one is reported here or by the supervisor, once.
            if inflight.returned:
                if is_connection_error(exc):
                    reset_connection(alias)
                _report_if_completed(alias, inflight, runner_id)
            return False
        # ``SystemExit`` (``sys.exit()`` in library code) or ``KeyboardInterrupt`` raised by a
        # handler ends the attempt, like any other exception, not the runner: handlers run on
        # worker threads, where no signal raises either (Ctrl-C reaches ``runjobs``' main
        # thread, or is ignored by a worker process), so it is the handler's own doing.
        if is_connection_error(exc):
            reset_connection(alias)
        elif not spec.atomic:
            _close_open_transaction(connection)
        record_outcome(alias, job, classify(exc, spec, job.attempt), runner_id, interrupt)
        return False
    if deferred is not None:
        completer, result = deferred

        def on_answer(written: bool | None, error: BaseException | None) -> None:
            failure: BaseException | None = None
            try:
                _answered(alias, inflight, spec, runner_id, interrupt, written, error)
            except BaseException as exc:
                failure = exc
            if inflight.on_settled is not None:
                inflight.on_settled(inflight, failure)
            elif failure is not None:
                raise failure

        if completer.submit(alias, job, result, on_answer):
            return True
        _completion_abandoned(job, runner_id)
        return False
    _completed(inflight, runner_id)
    return False


def _completed(inflight: InFlight, runner_id: str) -> None:
    """Report the attempt completed, unless another path reported it already."""
    if not inflight.claim_report():
        return
    job = inflight.job
    signals.finished(job, runner_id, status="completed")
    if completions_logger.isEnabledFor(logging.INFO):
        completions_logger.info(
            "job %s completed", job.id,
            extra={"event": "success", "job_id": str(job.id), "job_type": job.job_type,
                   "attempt": job.attempt, "runner_id": runner_id},
        )


#: Code of a waiting job handed back because its start could not be recorded.
START_FAILED = "START_FAILED"


def _hand_back_unadmitted(alias: str, job: ClaimedJob, runner_id: str,
                          interrupt: threading.Event) -> None:
    """Hand back, now, a waiting job whose start the gate could not write: it will not run
    here, and left claimed by a runner that goes on living, nobody would run it until this
    runner is gone. Uncharged (it never ran) but counted against ``HANDBACK_LIMIT``, as a lost
    runner's waiting job is (``store.release_waiting``): a job whose start can never be
    written ends dead-lettered instead of being claimed and handed back for ever.

    Bounded (``run_bounded``), a few tries while the row stays locked (the lock's holder, say
    another runner handing the job back, usually lets go within a second). With the database
    away, the row locked throughout, or the hand-back itself failing, the job stays claimed:
    it is rescued once this runner's row is gone; this thread does not wait for the
    database."""
    failure: Exception | None = None
    for tries_left in range(HANDBACK_TRIES - 1, -1, -1):
        try:
            record_outcome(alias, job, Outcome(
                "handback", START_FAILED,
                f"runner {runner_id} could not record the start of attempt {job.attempt}; "
                "handed back unstarted",
            ), runner_id, None, attempt_outcome="interrupted", bounded=True)
            return
        except NotNow as exc:
            failure = exc
            if not exc.locked or not tries_left or interrupt.wait(HANDBACK_RETRY_SECONDS):
                break
        except Exception as exc:  # SettleFailed: no worse than before, and not fatal
            failure = exc
            break
    logger.warning("job %s: could not hand it back either (%s); it stays claimed until this "
                   "runner is gone, then it is rescued", job.id, type(failure).__name__,
                   extra={"event": "start_handback_failed", "job_id": str(job.id),
                          "runner_id": runner_id})


#: Tries of that hand-back while the job's row stays locked, and the pause between them.
HANDBACK_TRIES = 5
HANDBACK_RETRY_SECONDS = 0.5


def _report_if_completed(alias: str, inflight: InFlight, runner_id: str) -> None:
    """A job taken over after its handler returned: if the attempt row says it completed
    after all (the commit landed before the interruption, or its answer was lost with the
    session the supervisor terminated), report it, once (``InFlight.claim_report``): a live
    worker process's supervisor leaves that to the worker. Bounded: this thread is abandoned,
    and a database that cannot answer now costs only the report, not the job (the row is
    right either way). Two tries: the first may meet the session the supervisor ended."""
    job = inflight.job
    if inflight.report_claimed:
        return
    settled: str | None = None
    for tries_left in (1, 0):
        try:
            settled = run_bounded(alias, lambda cursor: store.attempt_outcome(cursor, job.token),
                                  what=f"reading the outcome of job {job.id}")
            break
        except Exception as exc:
            if tries_left and isinstance(exc, NotNow):
                continue
            logger.warning("job %s: could not read whether its completion committed (%s); "
                           "job_finished not sent", job.id, type(exc).__name__,
                           extra={"event": "completion_unknown", "job_id": str(job.id)})
            return
    if settled == "completed":
        _completed(inflight, runner_id)


def _claim_lost(job: ClaimedJob, spec: HandlerSpec, runner_id: str) -> None:
    logger.warning(
        "job %s: claim lost (rescued, timed out or handed back); %s", job.id,
        "handler's writes rolled back" if spec.atomic
        else "its writes had committed as they ran (atomic=False)",
        extra={"event": "claim_lost", "job_id": str(job.id), "job_type": job.job_type,
               "runner_id": runner_id},
    )
    signals.finished(job, runner_id, status=None)


def _answered(
    alias: str, inflight: InFlight, spec: HandlerSpec, runner_id: str,
    interrupt: threading.Event, written: bool | None, error: BaseException | None,
) -> None:
    """Settle a job whose completion the completer wrote (or could not), on its thread: what
    ``execute`` does after a completion it wrote itself."""
    job = inflight.job
    if error is not None:
        if not inflight.taken_over.is_set():
            record_outcome(alias, job, classify(error, spec, job.attempt), runner_id, interrupt)
    elif written is None:
        _completion_abandoned(job, runner_id)
    elif not written:
        _claim_lost(job, spec, runner_id)
    else:
        _completed(inflight, runner_id)


def _call_handler(spec: HandlerSpec, inflight: InFlight) -> str | None:
    """Run the handler (to completion, if it is async); its result as JSON text, or None."""
    job = inflight.job
    returned = spec.func(job.payload, inflight.ctx)
    if inspect.isawaitable(returned):
        returned = run_awaitable(returned, inflight)
    elif inspect.isgenerator(returned) or inspect.isasyncgen(returned):
        raise PermanentJobError(
            f"the handler for {job.job_type!r} returned a generator, so its body never "
            "ran; a handler must be a plain function or an async def coroutine function",
            code="HANDLER_INVALID",
        )
    # Handlers that keep a result (django.tasks) return it as validated JSON text.
    return returned if spec.returns_json else None


def _close_open_transaction(connection: Any) -> bool:
    """Roll back a transaction an ``atomic=False`` handler left open on its connection (say,
    after ``set_autocommit(False)``); True if there was one. Left open, the failure record or
    the next job on this thread would run inside it, and never commit."""
    raw = connection.connection
    if raw is None or connection.in_atomic_block:
        return False
    if connection.get_autocommit() and raw.info.transaction_status == TransactionStatus.IDLE:
        return False
    with contextlib.suppress(Exception):
        connection.rollback()
    with contextlib.suppress(Exception):
        connection.set_autocommit(True)
    return True


def _completion_abandoned(job: ClaimedJob, runner_id: str) -> None:
    """The runner stopped while the database was away, before the batch carrying this job's
    completion could be written: the job stays claimed by this runner, and is rescued and run
    again once the runner's row is gone."""
    logger.error(
        "job %s: its handler finished but the runner stopped before the completion could be "
        "recorded; it will be rescued and run again", job.id,
        extra={"event": "completion_abandoned", "job_id": str(job.id), "job_type": job.job_type,
               "attempt": job.attempt, "runner_id": runner_id},
    )
    signals.finished(job, runner_id, status=None)
