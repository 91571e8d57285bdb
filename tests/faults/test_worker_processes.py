"""``runjobs --processes N``: a supervisor that runs no job code, and worker processes that can
hold the GIL, block in C or die without taking the runner's promises with them.

Real ``runjobs`` processes, real PostgreSQL; synchronisation by log lines and database states.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction

from django_persistent_jobs import enqueue

from .harness import (
    STALE,
    Fleet,
    RunnerProcess,
    attempts_of,
    enqueue_jobs,
    job_row,
    ledger_of,
    sql_value,
    verify,
    wait_all_terminal,
    wait_status,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

_WORKER = re.compile(r"worker (\d+) started \(pid (\d+)\)")


def worker_pids(runner: RunnerProcess) -> list[int]:
    """Pids of the runner's worker processes that are alive now (from its log)."""
    pids = [int(m.group(2)) for m in runner.find(_WORKER.pattern)]
    return [pid for pid in pids if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def enqueue_typed(job_type: str, payload: dict[str, Any] | None = None, **options: Any) -> Any:
    with transaction.atomic():
        return enqueue(job_type, payload or {}, **options).id


def test_two_workers_drain_exactly_once_and_sigterm_exits_zero(fleet: Fleet) -> None:
    runner = fleet.spawn(args=["--processes", "2"], concurrency=3)
    wait_until(lambda: len(worker_pids(runner)) == 2, 30, "two workers")
    assert set(worker_pids(runner)) <= set(children(runner.pid))
    ids = enqueue_jobs(300)
    wait_all_terminal(ids, timeout=90)
    verdict = verify(ids)
    assert {outcome for outcome, _ in verdict.outcomes} == {"completed"}
    assert sql_value("SELECT max(attempts) FROM persistent_jobs WHERE id = ANY(%s)", [ids]) == 1
    # The handlers ran in the workers, never in the supervisor, and both workers took jobs.
    pids = {row[0] for row in _ledger_pids(ids)}
    assert runner.pid not in pids
    assert pids == set(worker_pids(runner)), (pids, worker_pids(runner))
    workers = worker_pids(runner)
    runner.send(signal.SIGTERM)
    assert runner.wait_exit(30) == 0
    wait_until(lambda: not any(_alive(pid) for pid in workers), 10, "workers to exit")


def _ledger_pids(ids: list[Any]) -> list[tuple[Any, ...]]:
    from .harness import sql

    return sql("SELECT DISTINCT pid FROM faults_ledger WHERE job_id = ANY(%s)", [list(ids)])
