"""Cleanup loop: deletes finished jobs (and their attempts) older than ``RETENTION``.

Dead letters are kept by default: they are the operator's to-do list. Deletion goes in batches so
it never holds many locks or a long transaction.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections, transaction

from .. import conf
from . import store
from .db import error_line, is_refusal, run_with_retry

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper as Cursor

logger = logging.getLogger("django_persistent_jobs.runner")


#: Batch size of a cleanup statement.
BATCH = 5000
#: Finished jobs the database refused to delete, per database alias, kept out of later batches
#: in this process (at most ``MAX_REFUSED`` of them; a restart tries them again).
_refused: dict[str, set[uuid.UUID]] = {}
MAX_REFUSED = 10_000


def cleanup_once(alias: str, interrupt: Any = None, *, wait_for_database: bool = True) -> int:
    """Delete every finished job past its retention now; the number deleted.

    The runner's loop waits out a database outage (``run_with_retry``); ``manage.py jobs
    prune`` passes ``wait_for_database=False``: an operator's shell or cron job must get the
    database error at once, not wait for as long as the outage lasts.

    A batch the database refuses (a project's own foreign key to a finished job, a trigger) is
    deleted again one job at a time: the jobs it refuses are kept, logged once per pass
    (``cleanup_refused``), and left out of later batches; the rest go. A refusal must not stop
    the runner, nor every later cleanup at the same batch."""
    def run(delete_batch: Callable[[Cursor], int]) -> int | None:
        if wait_for_database:
            return run_with_retry(alias, delete_batch, what="cleanup", interrupt=interrupt)
        with connections[alias].cursor() as cursor:
            return delete_batch(cursor)

    refused = _refused.setdefault(alias, set())
    refusals: list[tuple[uuid.UUID, BaseException]] = []
    total = 0
    for status, keep in conf.settings.RETENTION.items():
        if keep is None:
            continue
        def delete_batch(cursor: Cursor, status: str = status, keep: float = keep) -> int:
            # (A savepoint when called inside a transaction: a refused batch must not leave
            # the caller's transaction aborted.)
            with transaction.atomic(using=alias):
                return store.cleanup(cursor, status, keep, BATCH, refused)

        def one_by_one(cursor: Cursor, status: str = status, keep: float = keep) -> int:
            deleted = 0
            for job_id in store.past_retention(cursor, status, keep, BATCH, refused):
                try:
                    with transaction.atomic(using=alias):
                        store.delete_finished(cursor, job_id)
                except DatabaseError as exc:
                    if not is_refusal(exc):
                        raise
                    if len(refused) < MAX_REFUSED:
                        refused.add(job_id)
                    refusals.append((job_id, exc))
                else:
                    deleted += 1
            return deleted

        while True:
            try:
                deleted = run(delete_batch)
            except DatabaseError as exc:
                if not is_refusal(exc):
                    raise
                deleted = run(one_by_one)
            if not deleted:
                break
            total += deleted
            if deleted < BATCH:
                break
    if refusals:
        first_id, first_error = refusals[0]
        logger.warning(
            "cleanup: the database refused to delete %d finished job(s) past their retention "
            "(job %s: %s); they are kept, and left out of cleanup until this process restarts",
            len(refusals), first_id, error_line(first_error),
            extra={"event": "cleanup_refused", "refused": len(refusals),
                   "job_id": str(first_id)})
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
