"""Database access for runner threads: each thread uses its own Django connection, and a lost
connection is closed and re-opened with backoff instead of killing the loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, connections

logger = logging.getLogger("django_persistent_jobs.runner")

T = TypeVar("T")

#: Errors that mean "the connection or server is unhealthy", as opposed to a bug in our SQL.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (OperationalError, InterfaceError)


def is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, CONNECTION_ERRORS):
        return True
    # psycopg reports "terminating connection due to administrator command" as a DatabaseError
    # subclass on some paths; treat anything that left the connection unusable the same way.
    cause = exc.__cause__
    return isinstance(exc, DatabaseError) and cause is not None and type(cause).__name__ in {
        "AdminShutdown", "OperationalError", "InterfaceError", "ConnectionTimeout",
    }


def reset_connection(alias: str) -> None:
    """Drop this thread's connection so the next query opens a fresh one."""
    try:
        connections[alias].close()
    except Exception:  # closing a dead socket may raise; the object is reset regardless
        connections[alias].connection = None


class Backoff:
    """Exponential reconnect delay: 0.1 s doubling up to ``cap`` seconds."""

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


def run_with_retry(
    alias: str, fn: Callable[[Any], T], *, what: str, interrupt: threading.Event | None = None,
) -> T | None:
    """Run ``fn(cursor)`` in autocommit, retrying while the database is unreachable.

    Returns None only if ``interrupt`` is set while the database is still unreachable (a stop
    or a forced stop); the caller then leaves the work to rescue by another runner.
    """
    backoff = Backoff()
    while True:
        try:
            with connections[alias].cursor() as cursor:
                return fn(cursor)
        except Exception as exc:
            if not is_connection_error(exc):
                raise
            reset_connection(alias)
            if interrupt is not None and interrupt.is_set():
                logger.error("giving up on %s: %s", what, exc, extra={"event": "db_give_up"})
                return None
            delay = backoff.next()
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            logger.warning(
                "database unavailable during %s (%s); retrying in %.1fs", what,
                first_line or type(exc).__name__, delay,
                extra={"event": "db_retry", "operation": what},
            )
            (interrupt or threading.Event()).wait(delay)
