"""The fault suite's job handler, imported by ``tests/testapp/jobs.py`` so runner subprocesses
register it.

``faults.ledger`` writes one row to ``faults_ledger`` *inside the job's own transaction*, after
whatever fault its payload asks for. The table deliberately has no unique constraint: a second
commit of the same job would show up as a second row instead of being stopped by the schema, so
"one row per completed job" is evidence about the runner's fencing, not about an index.

Payload keys (all optional):

``upto``          apply the fault below only while ``ctx.attempt <= upto`` (default: always)
``pid``           apply the fault only in the runner process with this pid or its workers (a
                  hand-back does not charge the attempt, so ``upto`` cannot tell the runs apart)
``report_pid``    publish the handler's backend pid as progress before the fault
``sleep``         ``time.sleep`` this many seconds (releases the GIL, like waiting on I/O)
``spin``          busy-loop this many seconds in pure Python (``-1``: ``while True: pass``)
``exit``          ``os._exit(1)``: the poison pill that takes its runner process down
``sync_commit``   make this transaction's COMMIT wait for a synchronous standby (with the private
                  cluster's ghost standby this is how a commit is made to outlive its connection)
``work``          sleep this many seconds on every attempt (a job's normal duration)
``fail``          raise after the fault, before the ledger row is written (the attempt fails
                  and is retried)
"""

from __future__ import annotations

import os
import time
from typing import Any

from django.db import connection

from django_persistent_jobs import JobContext, job_handler
from django_persistent_jobs.backoff import constant

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS faults_ledger (
    id bigserial PRIMARY KEY,
    job_id uuid NOT NULL,
    attempt integer NOT NULL,
    runner_id text NOT NULL,
    pid integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


def _faulty(payload: dict[str, Any], ctx: JobContext) -> bool:
    upto = payload.get("upto")
    if upto is not None and ctx.attempt > int(upto):
        return False
    # A runner with worker processes runs the handler in a child of the runner's process.
    return payload.get("pid") in (None, os.getpid(), os.getppid())


@job_handler("faults.ledger", max_retries=3, backoff=constant(0.2), timeout=60)
def faults_ledger(payload: dict[str, Any], ctx: JobContext) -> None:
    """Run the payload's fault, then write the ledger row in the job's transaction."""
    if payload.get("work"):
        time.sleep(float(payload["work"]))
    if _faulty(payload, ctx):
        if payload.get("sync_commit"):
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit = on")
        if payload.get("report_pid"):
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                backend_pid = cursor.fetchone()[0]
            ctx.report_progress({"backend_pid": backend_pid, "attempt": ctx.attempt,
                                 "pid": os.getpid()})
        if payload.get("exit"):
            os._exit(1)
        if payload.get("sleep"):
            time.sleep(float(payload["sleep"]))
        spin = payload.get("spin")
        if spin is not None:
            end = time.monotonic() + float(spin)
            while spin < 0 or time.monotonic() < end:
                pass
        if payload.get("fail"):
            raise RuntimeError("asked to fail")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO faults_ledger (job_id, attempt, runner_id, pid) VALUES (%s, %s, %s, %s)",
            [ctx.job_id, ctx.attempt, ctx.runner_id, os.getpid()],
        )
