"""Cleanup loop: deletes finished jobs (and their attempts) older than ``RETENTION``.

Dead letters are kept by default: they are the operator's to-do list. Deletion goes in batches so
it never holds many locks or a long transaction.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import connections

from .. import conf
from . import store
from .db import run_with_retry

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper as Cursor

logger = logging.getLogger("django_persistent_jobs.runner")


def cleanup_once(alias: str, interrupt: Any = None, *, wait_for_database: bool = True) -> int:
    """Delete every finished job past its retention now; the number deleted.

    The runner's loop waits out a database outage (``run_with_retry``); ``manage.py jobs
    prune`` passes ``wait_for_database=False``: an operator's shell or cron job must get the
    database error at once, not wait for as long as the outage lasts."""
    def run(delete_batch: Callable[[Cursor], int]) -> int | None:
        if wait_for_database:
            return run_with_retry(alias, delete_batch, what="cleanup", interrupt=interrupt)
        with connections[alias].cursor() as cursor:
            return delete_batch(cursor)

    total = 0
    for status, keep in conf.settings.RETENTION.items():
        if keep is None:
            continue
        def delete_batch(cursor: Cursor, status: str = status, keep: float = keep) -> int:
            return store.cleanup(cursor, status, keep)

        while True:
            deleted = run(delete_batch)
            if not deleted:
                break
            total += deleted
            if deleted < 5000:
                break
    if total:
        logger.info("cleanup deleted %d finished job(s)", total,
                    extra={"event": "cleanup", "deleted": total})
    return total


def cleanup_loop(alias: str, interval: float, halt: threading.Event) -> None:
    """Clean up at once (a runner that restarts often still cleans), then every ``interval``
    seconds until ``halt``."""
    wait = 0.0
    while not halt.wait(wait):
        wait = interval
        cleanup_once(alias, halt)
