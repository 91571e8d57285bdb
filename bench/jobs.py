"""The benchmark's handlers, registered through the app's ``jobs`` autodiscovery.

Both are ordinary handlers on the normal, atomic path: the runner opens the transaction, calls the
handler, and commits the fenced completion in the same transaction.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import connection

from django_persistent_jobs import JobContext, job_handler

NOOP = "bench.noop"
NOOP_AUTOCOMMIT = "bench.noop_autocommit"
PICKUP = "bench.pickup"
PICKUP_CHANNEL = "pj_bench_pickup"


@job_handler(NOOP, max_retries=0)
def noop(payload: Any) -> None:
    """Does nothing, so a drain measures the job system's own cost per job."""
    return None


@job_handler(NOOP_AUTOCOMMIT, max_retries=0, atomic=False)
def noop_autocommit(payload: Any) -> None:
    """The throughput mode's no-op: ``atomic=False``, so the runner opens no transaction for it
    and its completion is always batched (a drain of these measures that mode's cost per job)."""
    return None


@job_handler(PICKUP, max_retries=0)
def pickup(payload: Any, ctx: JobContext) -> None:
    """Reports the wall-clock time at which the handler started.

    The time is taken before any database work and sent as a NOTIFY, which PostgreSQL delivers
    when the job's own transaction commits; the benchmark process waits on that channel instead of
    polling, so the waiting adds no load to the two cores the runner competes for.
    """
    started = time.time()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [PICKUP_CHANNEL, f"{ctx.job_id} {started!r}"])


CPU = "bench.cpu"


@job_handler(CPU, max_retries=0)
def cpu(payload: Any) -> None:
    """Pure-Python work: ``loops`` rounds of arithmetic (the benchmark calibrates the count to
    about 5 ms on an idle core). A fixed amount of work, not a fixed time: a timed busy loop
    would finish "on time" on a thread that only got a quarter of the GIL."""
    total = 0
    for i in range(int(payload["loops"])):
        total += i * i % 7
