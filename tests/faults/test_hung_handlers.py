"""Scenario 7: hung handlers. ``time.sleep(3600)`` (blocked in C) and ``while True: pass`` (a
pure-Python spin) with a 1 s timeout: each attempt fails with ``TIMEOUT``, the slot comes back at
once, the runner keeps its throughput, and the hung code can never complete the job, not even
one that wakes up later.
"""

from __future__ import annotations

import time

import pytest

from .harness import (
    Fleet,
    cpu_seconds,
    enqueue_jobs,
    enqueue_one,
    job_row,
    ledger_of,
    report,
    sql,
    verify,
    wait_all_terminal,
    wait_for,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(120)]

CONCURRENCY = 2
QUICK = 150


def _drain_seconds(count: int) -> float:
    started = time.monotonic()
    ids = enqueue_jobs(count)
    wait_all_terminal(ids, timeout=60)
    verify(ids)
    return time.monotonic() - started


def test_hung_handlers_time_out_and_give_their_slots_back(fleet: Fleet) -> None:
    runner = fleet.spawn("hung", concurrency=CONCURRENCY)
    baseline = _drain_seconds(QUICK)

    sleeper = enqueue_one({"sleep": 3600}, timeout=1, max_retries=1)
    spinner = enqueue_one({"spin": -1}, timeout=1, max_retries=1)
    # Times out on attempt 1, then wakes up while attempt 2 is (or has been) completing.
    waker = enqueue_one({"sleep": 2.5, "upto": 1}, timeout=1, max_retries=1)
    quick = enqueue_jobs(QUICK)
    wait_all_terminal([sleeper, spinner, waker, *quick], timeout=60)

    for job in (sleeper, spinner):
        row = job_row(job)
        assert (row["status"], row["attempts"], row["code"]) == ("dead_lettered", 2, "TIMEOUT")
        assert sql("SELECT outcome, error_code FROM persistent_jobs_attempts WHERE job_id = %s",
                   [job]) == [("timed_out", "TIMEOUT")] * 2
        assert ledger_of(job) == []
    assert job_row(waker)["status"] == "completed"
    assert sql("SELECT outcome, error_code FROM persistent_jobs_attempts WHERE job_id = %s "
               "ORDER BY id", [waker]) == [("timed_out", "TIMEOUT"), ("completed", "")]
    verify(quick)
    verify([sleeper, spinner], require_completed=False)

    # The woken attempt 1 of ``waker`` ran on after its timeout; it ended without a trace.
    runner.wait_line(rf"abandoned worker for job {waker} exited", timeout=10)
    # The spinning threads were stopped by the injected exception.
    runner.wait_line(rf"abandoned worker for job {spinner} exited", timeout=10)
    assert ledger_of(waker) == [(2, runner.runner_id)]
    verify([waker])

    # Slots came back: both run at once again...
    pair = enqueue_jobs(CONCURRENCY, {"sleep": 1.5})
    wait_for(lambda: sql("SELECT count(*) FROM persistent_jobs WHERE id = ANY(%s) AND "
                         "status = 'running'", [pair])[0][0] == CONCURRENCY,
             timeout=10, message="all slots busy at once", reconnect=True)
    wait_all_terminal(pair, timeout=15)
    # ...nothing burns CPU while idle (a spinning zombie thread would burn a core)...
    wait_for(lambda: runner.find(r"abandoned worker for job .* exited"), timeout=5,
             message="abandoned workers to exit", reconnect=True)
    cpu_before = cpu_seconds(runner.pid)
    idle_started = time.monotonic()
    time.sleep(1.0)  # measuring CPU use over an idle second, not waiting for anything
    idle_cpu = (cpu_seconds(runner.pid) - cpu_before) / (time.monotonic() - idle_started)
    assert idle_cpu < 0.3, idle_cpu
    # ...and throughput is what it was before the hangs.
    after = _drain_seconds(QUICK)
    assert after <= 2 * baseline + 1.0, (baseline, after)
    assert runner.alive
    report("hung_handlers", timeout_s=1, timed_out_attempts=5, quick_jobs=3 * QUICK,
           drain_before_s=round(baseline, 2), drain_after_s=round(after, 2),
           idle_cpu=round(idle_cpu, 3))
