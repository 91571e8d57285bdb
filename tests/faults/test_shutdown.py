"""Scenario 8: graceful shutdown with SIGTERM.

A job shorter than the grace period finishes, the runner exits 0 and claims nothing after the
signal. A job longer than the grace period is handed back (pending, attempt not charged, attempt
recorded as ``interrupted``/``SHUTDOWN``), neither left running nor silently failed. A SIGTERM
that arrives while a claim is in flight hands the freshly claimed jobs straight back.
"""

from __future__ import annotations

import signal

import psycopg
import pytest

from .harness import (
    Fleet,
    backends,
    database_url,
    enqueue_jobs,
    enqueue_one,
    job_row,
    ledger_of,
    report,
    sql,
    status_counts,
    verify,
    wait_all_terminal,
    wait_for,
    wait_status,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(120)]


def _attempts(ids: list[object]) -> list[tuple[object, str, str, str]]:
    rows = sql("SELECT job_id, runner_id, outcome, error_code FROM persistent_jobs_attempts "
               "WHERE job_id = ANY(%s) ORDER BY id", [ids])
    return [(job, runner_id, outcome, code) for job, runner_id, outcome, code in rows]


def test_sigterm_lets_a_short_job_finish_and_claims_nothing_more(fleet: Fleet) -> None:
    runner = fleet.spawn("short", concurrency=1, settings={"SHUTDOWN_GRACE": 10})
    job = enqueue_one({"sleep": 1.5})
    wait_status(job, "running")
    waiting = enqueue_jobs(5)  # due, but the only slot is busy
    mark = runner.mark()
    runner.send(signal.SIGTERM)
    runner.wait_line(r"stopping: no new claims", since=mark)
    assert runner.wait_exit(15) == 0
    assert job_row(job)["status"] == "completed"
    assert ledger_of(job) == [(1, runner.runner_id)]
    # Nothing was claimed after the signal. The one job claimed before it to wait for the busy
    # slot (PREFETCH, by default as many as CONCURRENCY) was handed back unstarted: neither
    # charged nor counted.
    assert status_counts(waiting) == {"pending": 5}
    handed_back = _attempts(waiting)
    assert len(handed_back) <= 1
    assert all(a[1:] == (runner.runner_id, "interrupted", "SHUTDOWN") for a in handed_back)
    assert sql("SELECT sum(attempts), sum(handbacks) FROM persistent_jobs WHERE id = ANY(%s)",
               [waiting]) == [(0, 0)]
    assert sql("SELECT count(*) FROM persistent_jobs_runners WHERE id = %s",
               [runner.runner_id]) == [(0,)]
    fleet.spawn("drain", concurrency=2)
    wait_all_terminal(waiting, timeout=20)
    verify([job, *waiting])


def test_sigterm_hands_back_a_job_longer_than_the_grace_period(fleet: Fleet) -> None:
    grace = 1.0
    runner = fleet.spawn("long", concurrency=1, settings={"SHUTDOWN_GRACE": grace})
    job = enqueue_one({"sleep": 60, "pid": runner.pid})  # hangs in this runner only
    wait_status(job, "running")
    runner.send(signal.SIGTERM)
    assert runner.wait_exit(grace + 10) == 0
    row = job_row(job)
    # Handed back: waiting again, the interrupted attempt not charged, and on record.
    assert (row["status"], row["attempts"], row["locked_by"]) == ("pending", 0, None)
    assert row["code"] == "SHUTDOWN"
    assert _attempts([job]) == [(job, runner.runner_id, "interrupted", "SHUTDOWN")]
    assert ledger_of(job) == []
    successor = fleet.spawn("successor", concurrency=1)
    wait_status(job, "completed", timeout=20)
    assert _attempts([job])[-1] == (job, successor.runner_id, "completed", "")
    verify([job])
    report("shutdown_handback", grace_s=grace)


def test_sigterm_during_a_claim_hands_the_claimed_jobs_back(fleet: Fleet) -> None:
    # Hold the attempts table so the runner's first claim blocks in the middle of the
    # statement. (The jobs exist before the runner starts: a claim statement sees the rows
    # committed when it began, so one that began earlier would come back empty.)
    with psycopg.connect(database_url()) as blocker:
        blocker.execute("LOCK TABLE persistent_jobs_attempts IN EXCLUSIVE MODE")
        jobs = enqueue_jobs(2)
        runner = fleet.spawn("claiming", concurrency=2, settings={"SHUTDOWN_GRACE": 5})
        wait_for(lambda: backends("claiming", "wait_event_type = 'Lock' AND "
                                  "query LIKE '%%WITH picked AS%%'"),
                 timeout=10, message="the claim to block on the lock", reconnect=True)
        mark = runner.mark()
        runner.send(signal.SIGTERM)
        runner.wait_line(r"stopping: no new claims", since=mark)
        blocker.rollback()  # the claim now goes through, after the signal
    assert runner.wait_exit(15) == 0
    assert status_counts(jobs) == {"pending": 2}
    assert sorted(_attempts(jobs)) == sorted(
        (job, runner.runner_id, "interrupted", "SHUTDOWN") for job in jobs)
    assert all(job_row(job)["attempts"] == 0 for job in jobs)
    fleet.spawn("after", concurrency=2)
    wait_all_terminal(jobs, timeout=20)
    verify(jobs)
