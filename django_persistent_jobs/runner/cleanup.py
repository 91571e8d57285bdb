"""Cleanup loop: deletes finished jobs (and their attempts) older than ``RETENTION``.

Dead letters are kept by default: they are the operator's to-do list. Deletion goes in batches so
it never holds many locks or a long transaction.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from .. import conf
from . import store
from .db import run_with_retry

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper as Cursor

logger = logging.getLogger("django_persistent_jobs.runner")


def cleanup_once(alias: str, interrupt: Any = None) -> int:
    total = 0
    for status, keep in conf.settings.RETENTION.items():
        if keep is None:
            continue
        def delete_batch(cursor: Cursor, status: str = status, keep: float = keep) -> int:
            return store.cleanup(cursor, status, keep)

        while True:
            deleted = run_with_retry(alias, delete_batch, what="cleanup", interrupt=interrupt)
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
