"""Scenario 6: connections killed under a live runner with ``pg_terminate_backend``.

A worker's connection killed mid-job: the attempt fails as ``DB_ERROR`` (its writes were on that
connection and are gone) and the retry completes the job. The LISTEN connection killed while
idle: the runner notices at once, listens again on a new connection, and new jobs are picked up
by NOTIFY again, not by the (deliberately slow) poll. Only this test's runners' backends are
terminated: they are found by database and application name.
"""

from __future__ import annotations

import time

import pytest

from .harness import (
    Fleet,
    backends,
    enqueue_jobs,
    enqueue_one,
    job_row,
    ledger_of,
    report,
    sql,
    terminate,
    verify,
    wait_all_terminal,
    wait_for,
    wait_status,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(120)]

LISTENING = "(query LIKE 'LISTEN %%' OR query = 'SELECT 1')"


def test_worker_connection_killed_mid_job(fleet: Fleet) -> None:
    runner = fleet.spawn("worker", concurrency=2)
    job = enqueue_one({"report_pid": True, "sleep": 1.0, "upto": 1})
    progress = wait_for(lambda: (job_row(job)["progress"] or {}).get("backend_pid"),
                        timeout=15, message="the handler to report its connection", reconnect=True)
    assert terminate(progress)
    done = wait_status(job, "completed", timeout=15)
    assert done["attempts"] == 2
    attempts = sql("SELECT attempt, outcome, error_code FROM persistent_jobs_attempts "
                   "WHERE job_id = %s ORDER BY id", [job])
    assert attempts == [(1, "failed", "DB_ERROR"), (2, "completed", "")]
    assert ledger_of(job) == [(2, runner.runner_id)]
    # The runner is unharmed: it keeps working with fresh connections.
    more = enqueue_jobs(50, {"work": 0.01})
    wait_all_terminal(more, timeout=30)
    verify([job, *more])
    assert runner.alive


def _pickup_seconds() -> float:
    """Enqueue one job and time it from the enqueuing commit until it completed."""
    started = time.monotonic()
    job = enqueue_one()
    wait_status(job, "completed", timeout=30)
    return time.monotonic() - started


def test_listen_connection_killed_while_idle(fleet: Fleet) -> None:
    poll = 5.0  # slow polling, so a quick pickup can only be NOTIFY's doing
    fleet.spawn("listener", concurrency=2, settings={"POLL_INTERVAL": poll})
    old = wait_for(lambda: backends("listener", LISTENING), timeout=10,
                   message="the LISTEN connection", reconnect=True)
    assert len(old) == 1
    before = [_pickup_seconds() for _ in range(3)]
    assert max(before) < 1.0, before

    assert terminate(old[0][0])
    # A job enqueued right away is not lost: the listener wakes the claimer when it is back,
    # and polling would find it anyway.
    orphan_notify = _pickup_seconds()
    assert orphan_notify < poll + 2, orphan_notify
    renewed = wait_for(lambda: [b for b in backends("listener", LISTENING) if b[0] != old[0][0]],
                       timeout=5, message="LISTEN to be re-established", reconnect=True)
    assert len(renewed) == 1
    after = [_pickup_seconds() for _ in range(3)]
    assert max(after) < 1.0, after  # NOTIFY-driven again, far below the 5 s poll

    # Terminated a second time (a fresh connection each time), it recovers again.
    assert terminate(renewed[0][0])
    wait_for(lambda: [b for b in backends("listener", LISTENING) if b[0] != renewed[0][0]],
             timeout=5, message="LISTEN to be re-established again", reconnect=True)
    again = [_pickup_seconds() for _ in range(3)]
    assert max(again) < 1.0, again
    jobs = [row[0] for row in sql("SELECT id FROM persistent_jobs")]
    verify(jobs)
    report("listen_killed", pickup_before_s=round(max(before), 3),
           pickup_while_reconnecting_s=round(orphan_notify, 3),
           pickup_after_s=round(max(after + again), 3), poll_interval_s=poll)
