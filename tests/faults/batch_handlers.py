"""Handlers whose completions the runner batches: they write nothing in the job's transaction.

``faults.solo`` touches no database at all. ``faults.autocommit`` is registered with
``atomic=False``: it writes its ``faults_ledger`` row in autocommit (committed at once, kept
whatever happens to the attempt) before it waits. Each run appends ``job_id attempt pid`` to
the file named by ``runs`` (so a scenario can count runs without the database), then waits
until the file named by ``gate`` exists (at most 30 s): a scenario holds the jobs there, in
flight, and lets them return together.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from django.db import connection

from django_persistent_jobs import JobContext, job_handler
from django_persistent_jobs.backoff import constant

#: The longest a handler waits for its gate (a scenario that never opens it fails, not hangs).
GATE_LIMIT = 30.0


def record_run(payload: dict[str, Any], ctx: JobContext) -> None:
    with open(payload["runs"], "a", encoding="utf-8") as out:
        out.write(f"{ctx.job_id} {ctx.attempt} {os.getpid()}\n")


def runs_of(path: Path) -> Counter[str]:
    """Runs per job id, from what ``record_run`` wrote (no database involved)."""
    if not path.exists():
        return Counter()
    return Counter(line.split()[0] for line in path.read_text().splitlines() if line.strip())


def wait_for_gate(payload: dict[str, Any]) -> None:
    """Wait for the gate, then ``linger`` seconds more (a scenario that needs the handler to
    return a while after the gate opens)."""
    gate = payload.get("gate")
    if not gate:
        return
    deadline = time.monotonic() + GATE_LIMIT
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(float(payload.get("linger", 0)))


@job_handler("faults.solo", max_retries=3, backoff=constant(0.2), timeout=60)
def faults_solo(payload: dict[str, Any], ctx: JobContext) -> None:
    record_run(payload, ctx)
    wait_for_gate(payload)


@job_handler("faults.autocommit", atomic=False, max_retries=3, backoff=constant(0.2), timeout=60)
def faults_autocommit(payload: dict[str, Any], ctx: JobContext) -> None:
    record_run(payload, ctx)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO faults_ledger (job_id, attempt, runner_id, pid) VALUES (%s, %s, %s, %s)",
            [ctx.job_id, ctx.attempt, ctx.runner_id, os.getpid()],
        )
    wait_for_gate(payload)
