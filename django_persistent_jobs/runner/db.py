"""Database access for runner threads: each thread uses its own Django connection, and a lost
connection is closed and re-opened with backoff instead of killing the loop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import psycopg
from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper as Cursor

logger = logging.getLogger("django_persistent_jobs.runner")

#: While an operation keeps failing, its warning is repeated at most this often.
LOG_EVERY_SECONDS = 5.0

#: The longest a supervisor duty (recording a timeout, rescuing a job) waits for a job's row
#: lock before it leaves that job for its next round: the lock may belong to user code or to a
#: frozen runner, and waiting on it would stall every other duty of the thread.
ROW_LOCK_TIMEOUT_SECONDS = 0.2
#: SQLSTATE of "lock not available" (a ``lock_timeout`` expired, or ``NOWAIT``).
LOCK_NOT_AVAILABLE = "55P03"


class DatabaseUnreachable(Exception):
    """The runner gave up waiting for its database (``--database-wait``)."""

#: Errors that mean "the connection or server is unhealthy", as opposed to a bug in our SQL.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError, InterfaceError, psycopg.OperationalError, psycopg.InterfaceError,
)


def is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, CONNECTION_ERRORS):
        return True
    if sqlstate(exc) in SESSION_ENDED_SQLSTATES:
        return True
    # psycopg reports "terminating connection due to administrator command" as a DatabaseError
    # subclass on some paths; treat anything that left the connection unusable the same way.
    cause = exc.__cause__
    return isinstance(exc, DatabaseError) and cause is not None and type(cause).__name__ in {
        "AdminShutdown", "OperationalError", "InterfaceError", "ConnectionTimeout",
    }


#: SQLSTATEs outside the connection classes with which the server ends the session: 25P03,
#: ``idle_in_transaction_session_timeout`` (a handler that sat in its transaction too long;
#: psycopg raises it as an ``InternalError``). The connection is gone, as after a restart.
SESSION_ENDED_SQLSTATES = ("25P03",)


#: SQLSTATEs (classes, or exact codes) that describe the server's condition rather than our
#: statement: retrying the same statement later is expected to work. Class 08 connection
#: exceptions, 40 serialization failures and deadlocks, 53 insufficient resources (disk full,
#: out of memory, too many connections), 57 operator intervention (admin shutdown, crash
#: shutdown, "cannot connect now", query cancelled by a statement timeout), 58 system errors
#: (I/O), 55P03 lock not available, and 25006 read-only transaction: what a client sees while a
#: fail-over promotes a standby or an operator sets the database read-only for maintenance.
TRANSIENT_SQLSTATE_CLASSES = ("08", "40", "53", "57", "58")
TRANSIENT_SQLSTATES = ("55P03", "25006")


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error, whether psycopg's own or wrapped by Django."""
    for candidate in (exc, exc.__cause__):
        code = getattr(candidate, "sqlstate", None)
        if isinstance(code, str):
            return code
    return None


def error_line(exc: BaseException, fallback: str | None = None) -> str:
    """The first line of ``exc``'s message, for a one-line log: psycopg's messages go on with
    DETAIL and HINT lines. ``fallback`` (default: the exception's class name) when it has no
    message."""
    text = str(exc).strip()
    if text:
        return text.splitlines()[0]
    return type(exc).__name__ if fallback is None else fallback


#: A prepared statement the server session does not have (26000), or has from another client
#: under the same name (42P05 when preparing it; 08P01 when binding ours to one with another
#: number of parameters): what a connection pooler in transaction mode that does not keep
#: prepared statements (PgBouncer before 1.21, or ``max_prepared_statements = 0``) causes.
LOST_STATEMENT_SQLSTATES = frozenset({"26000", "42P05", "08P01"})
#: What a runner says when one of its loops died of that: the claim and the completions are
#: prepared statements, and LISTEN needs a session of its own too.
SESSION_ADVICE = (
    "its database connection lost a prepared statement: a connection pooler in transaction "
    "mode sits between the runner and PostgreSQL (PgBouncer before 1.21, or with "
    "max_prepared_statements = 0). A runner needs a server session of its own (its claim is a "
    "prepared statement, and LISTEN holds a session): point the DATABASES entry runjobs uses "
    "at PostgreSQL directly, or at a pool in session mode"
)


def is_lost_prepared_statement(exc: BaseException) -> bool:
    """``exc`` says a prepared statement was not there, or was someone else's (see
    ``LOST_STATEMENT_SQLSTATES``). 08P01 is any protocol violation; only one raised while
    binding parameters to a prepared statement counts (the server reports it as an ERROR and
    the session goes on; a real violation of the protocol ends the session, a connection
    error). Told apart by where the server raised it, not by its message, which the server
    translates (``lc_messages``)."""
    code = sqlstate(exc)
    if code != "08P01":
        return code in LOST_STATEMENT_SQLSTATES
    for candidate in (exc, exc.__cause__):
        diag = getattr(candidate, "diag", None)
        source = getattr(diag, "source_function", None) if diag is not None else None
        if source is not None:
            return bool(source == "exec_bind_message"
                        and getattr(diag, "severity_nonlocalized", None) != "FATAL")
    # An error without the server's diagnostics (made by the client): its English message.
    return "prepared statement" in str(exc)


def is_transient_error(exc: BaseException) -> bool:
    """True if retrying the same statement later is the right response to ``exc``.

    Connection loss is transient; so are the server conditions listed above, which a runner
    must ride out the way it rides out a restart, instead of leaving a job half-settled.

    A lost prepared statement is not weather, although psycopg raises its 08P01 as an
    ``OperationalError``: it says a pooler in transaction mode sits in front of the database,
    and a fresh connection only moves the failure to a later statement. The caller's loop
    dies of it and the runner says what to change (``SESSION_ADVICE``).
    """
    if is_lost_prepared_statement(exc):
        return False
    if is_connection_error(exc):
        return True
    code = sqlstate(exc)
    if code is None:
        return False
    return code[:2] in TRANSIENT_SQLSTATE_CLASSES or code in TRANSIENT_SQLSTATES


def is_refusal(exc: BaseException) -> bool:
    """True if the database refused the statement itself (a trigger or constraint of the
    project's own, say): not weather to wait out, and not a pooler's lost prepared statement,
    which no single job causes and which stops the loop that meets it. A loop settling or
    deleting one job at a time leaves such a job as it is and goes on with the others."""
    return (isinstance(exc, DatabaseError) and not is_transient_error(exc)
            and not is_lost_prepared_statement(exc))


def reset_connection(alias: str) -> None:
    """Drop this thread's connection so the next query opens a fresh one."""
    try:
        connections[alias].close()
    except Exception:  # closing a dead socket may raise; the object is reset regardless
        connections[alias].connection = None


class Backoff:
    """Exponential retry delay: ``first`` (0.1 s) doubling up to ``cap`` seconds."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first = first
        self.cap = cap
        self.current = first

    def next(self) -> float:
        delay = self.current
        self.current = min(self.cap, self.current * 2)
        return delay

    def reset(self) -> None:
        self.current = self.first


T = TypeVar("T")  # no PEP 695 generics: Python 3.11 (Django 5.2) is supported


def kept_cursor(alias: str) -> Cursor:
    """This thread's cursor on ``alias``, made once per connection and kept open.

    For the loops that run a statement per batch of jobs on a connection of their own (the
    claim loop, the completer): Django's ``connection.cursor()`` costs about 100 µs on the
    first statement after an idle spell (measured on the 2-core VM, 2026-11-29: 95 µs of an
    idle runner's 1.6 ms pickup), which a cursor kept for the connection's lifetime does not
    pay again. A new connection (after ``reset_connection``, or a reconnect) gets a new cursor.
    """
    db = connections[alias]
    kept = getattr(db, "_pj_kept_cursor", None)
    raw = db.connection
    if kept is not None and raw is not None and kept[0] is raw and not raw.closed:
        cursor: Cursor = kept[1]
        return cursor
    cursor = db.cursor()  # (opens the connection if need be)
    db._pj_kept_cursor = (db.connection, cursor)  # type: ignore[attr-defined]
    return cursor


def run_with_retry(
    alias: str, fn: Callable[[Cursor], T], *, what: str, interrupt: threading.Event | None = None,
    backoff: Backoff | None = None, keep_cursor: bool = False,
) -> T | None:
    """Run ``fn(cursor)`` in autocommit, retrying while the database is unreachable or reports
    a transient condition (see ``is_transient_error``). ``keep_cursor``: on this thread's kept
    cursor (``kept_cursor``), for a loop that runs on a connection of its own.

    Returns None only if ``interrupt`` is set while the database is still failing (a stop or a
    forced stop); the caller then leaves the work to rescue by another runner. Any other error
    is raised: it is a bug or a broken invariant, not weather.
    """
    backoff = backoff or Backoff()
    failures = 0
    last_logged = 0.0
    while True:
        try:
            if keep_cursor:
                return fn(kept_cursor(alias))
            with connections[alias].cursor() as cursor:
                return fn(cursor)
        except Exception as exc:
            if not is_transient_error(exc):
                raise
            if is_connection_error(exc):
                reset_connection(alias)
            if interrupt is not None and interrupt.is_set():
                logger.error("giving up on %s: %s", what, exc, extra={"event": "db_give_up"})
                return None
            delay = backoff.next()
            failures += 1
            now = time.monotonic()
            if failures == 1 or now - last_logged >= LOG_EVERY_SECONDS:
                # The first failure, then a reminder now and then: an outage of minutes must
                # not flood the log with one line per fast retry.
                last_logged = now
                logger.warning(
                    "database unavailable during %s (%s); retrying in %.1fs%s", what,
                    error_line(exc), delay,
                    f" (failure {failures})" if failures > 1 else "",
                    extra={"event": "db_retry", "operation": what, "failures": failures},
                )
            (interrupt or threading.Event()).wait(delay)


_last_bounded_warning = 0.0


class NotNow(Exception):
    """A bounded attempt did not happen this time (a row was locked, the database was away);
    the caller keeps the work and tries again on its next round."""

    def __init__(self, what: str, *, locked: bool) -> None:
        super().__init__(what)
        self.locked = locked  # a lock was not granted (rather than: the database was away)


def run_bounded(
    alias: str, fn: Callable[[Cursor], T], *, what: str,
    lock_timeout: float = ROW_LOCK_TIMEOUT_SECONDS,
) -> T:
    """Run ``fn(cursor)`` once, in a transaction that waits at most ``lock_timeout`` for a lock.

    Raises ``NotNow`` if a lock was not granted in time or the database reported a transient
    condition (the connection is reset if it was lost); any other error is raised as is. It
    never waits on the database for longer than the lock timeout plus the statement itself, so
    a thread with several duties can run them all in turn.
    """
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, true)",
                           [f"{max(1, int(lock_timeout * 1000))}ms"])
            return fn(cursor)
    except Exception as exc:
        if sqlstate(exc) == LOCK_NOT_AVAILABLE:
            logger.debug("%s: row locked by another session; trying again later", what,
                         extra={"event": "row_locked", "operation": what})
            raise NotNow(what, locked=True) from exc
        if not is_transient_error(exc):
            raise
        if is_connection_error(exc):
            reset_connection(alias)
        global _last_bounded_warning
        now = time.monotonic()
        if now - _last_bounded_warning >= LOG_EVERY_SECONDS:  # an outage must not flood the log
            _last_bounded_warning = now
            logger.warning("database unavailable during %s (%s); trying again later", what,
                           error_line(exc), extra={"event": "db_retry", "operation": what})
        raise NotNow(what, locked=False) from exc
