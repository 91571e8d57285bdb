"""``ctx.report_progress``'s writes, for the thread runner and worker processes alike.

Progress goes through a connection of its own, outside the job's transaction (the handler's
writes must not commit with it), shared by the process's handler threads. Progress is advisory:
a row lock held by someone else's transaction (even the reporting handler's own) makes a report
wait at most ``LOCK_TIMEOUT`` and then be dropped, and a lost connection is opened again once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from django.db import connections

from . import store
from .db import LOCK_NOT_AVAILABLE, is_connection_error, sqlstate

logger = logging.getLogger("django_persistent_jobs.runner")

#: How long a report waits for the job's row lock before it is dropped.
LOCK_TIMEOUT = "1s"


class ProgressWriter:
    """Writes progress reports on one lazily opened connection; ``close()`` at exit."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._lock = threading.Lock()
        self._connection: Any = None

    def write(self, job_id: Any, token: int, progress: Any) -> None:
        """Record ``progress`` for the attempt ``token`` of ``job_id`` (fenced), or log that it
        could not be; raises only for an error that is neither a lock wait nor a lost
        connection."""
        with self._lock:
            for _ in range(2):
                try:
                    if self._connection is None:
                        self._connection = self._open()
                    with self._connection.cursor() as cursor:
                        store.report_progress(cursor, job_id, token, progress)
                    return
                except Exception as exc:
                    if sqlstate(exc) == LOCK_NOT_AVAILABLE:
                        break
                    if not is_connection_error(exc):
                        raise
                    self._drop()
            logger.warning("could not record progress of job %s", job_id)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _open(self) -> Any:
        side = connections.create_connection(self.alias)
        side.inc_thread_sharing()
        try:
            with side.cursor() as cursor:
                cursor.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
        except BaseException:
            side.close()
            raise
        return side

    def _drop(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None
