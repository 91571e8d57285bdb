"""Test-side SQL for the fault scenarios: queries that survive a PostgreSQL restart under the
test's feet, polls with deadlines, and the suite's jobs (``faults.ledger``) enqueued through the
public API.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from django.db import InterfaceError, OperationalError, connection, transaction

from django_persistent_jobs import enqueue_many
from tests.core_support import wait_for

from .handlers import LEDGER_DDL

JOB_TYPE = "faults.ledger"
TERMINAL = ("completed", "dead_lettered", "cancelled")


def db_retrying(fn: Callable[[], Any]) -> Any:
    """Run a test-side query, reconnecting once if the server restarted under us."""
    try:
        return fn()
    except (OperationalError, InterfaceError):
        connection.close()
        return fn()


def sql(query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return list(cursor.fetchall()) if cursor.description else []


def sql_value(query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> Any:
    rows = sql(query, params)
    return rows[0][0] if rows else None


def create_ledger() -> None:
    """The ledger table (no unique constraint, on purpose; see handlers.py), emptied per test."""
    with connection.cursor() as cursor:
        cursor.execute(LEDGER_DDL)
        cursor.execute("TRUNCATE faults_ledger")


def enqueue_jobs(count: int, payload: dict[str, Any] | None = None, **options: Any) -> list[Any]:
    """Enqueue ``count`` ``faults.ledger`` jobs through the public API; return their ids."""
    items = [(JOB_TYPE, dict(payload or {}, n=i)) for i in range(count)]
    ids: list[Any] = []
    with transaction.atomic():
        for start in range(0, count, 1000):
            ids.extend(job.id for job in enqueue_many(items[start:start + 1000], **options))
    return ids


def enqueue_one(payload: dict[str, Any] | None = None, **options: Any) -> Any:
    return enqueue_jobs(1, payload, **options)[0]


def status_counts(ids: Sequence[Any]) -> Counter[str]:
    rows = sql("SELECT status, count(*) FROM persistent_jobs WHERE id = ANY(%s) GROUP BY status",
               [list(ids)])
    return Counter({status: n for status, n in rows})


def job_row(job_id: Any) -> dict[str, Any]:
    rows = sql(
        "SELECT status, attempts, locked_by, last_error_code, progress, lock_token "
        "FROM persistent_jobs WHERE id = %s", [job_id],
    )
    assert rows, f"job {job_id} does not exist"
    status, attempts, locked_by, code, progress, token = rows[0]
    if isinstance(progress, str):
        progress = json.loads(progress)
    return {"status": status, "attempts": attempts, "locked_by": locked_by, "code": code,
            "progress": progress, "token": token}


def wait_status(job_id: Any, statuses: str | Iterable[str],
                timeout: float = 20.0) -> dict[str, Any]:
    wanted = (statuses,) if isinstance(statuses, str) else tuple(statuses)
    return wait_for(lambda: (row := job_row(job_id))["status"] in wanted and row,
                    timeout, f"job {job_id} to be {'/'.join(wanted)}", reconnect=True)


def wait_all_terminal(ids: Sequence[Any], timeout: float) -> Counter[str]:
    def done() -> Counter[str] | None:
        counts = status_counts(ids)
        return counts if sum(counts[s] for s in TERMINAL) == len(ids) else None

    try:
        return wait_for(done, timeout, f"{len(ids)} jobs to reach a terminal state",
                        interval=0.2, reconnect=True)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; statuses: {dict(db_retrying(lambda: status_counts(ids)))}") \
            from None


def new_id() -> str:
    return uuid.uuid4().hex[:8]
