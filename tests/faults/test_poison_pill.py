"""Scenario 4: a poison pill. A handler that calls ``os._exit(1)`` takes its runner process down
on every attempt. Because the attempt is counted when the job is claimed (invariant 5), it is
dead-lettered after its retries instead of looping forever, and the runners, restarted as a
process manager would, keep serving everything else.
"""

from __future__ import annotations

import time

import pytest

from .harness import (
    PROCESSES,
    STALE,
    Fleet,
    RunnerProcess,
    enqueue_jobs,
    enqueue_one,
    job_row,
    ledger_of,
    report,
    sql,
    status_counts,
    verify,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(150)]

RETRIES = 2
HANDBACK_LIMIT = 3  # the setting's default


def test_poison_pill_is_dead_lettered_and_runners_keep_serving(fleet: Fleet) -> None:
    runners = fleet.spawn_many(2, concurrency=2)
    pill = enqueue_one({"exit": True}, max_retries=RETRIES)
    others = enqueue_jobs(200, {"work": 0.05}, max_retries=5)
    deaths: list[RunnerProcess] = []
    deadline = time.monotonic() + 30 + (RETRIES + 1) * (STALE + 10)
    # A process manager's loop: restart whatever died, until everything is settled.
    while True:
        for index, runner in enumerate(runners):
            if not runner.alive:
                deaths.append(runner)
                runners[index] = fleet.spawn(wait_started=False, concurrency=2)
        counts = status_counts([pill, *others])
        if counts["completed"] + counts["dead_lettered"] == len(others) + 1:
            break
        assert time.monotonic() < deadline, f"not settled: {dict(counts)}"
        time.sleep(0.1)

    row = job_row(pill)
    assert row["status"] == "dead_lettered" and row["attempts"] == RETRIES + 1
    if PROCESSES != "0":
        _check_worker_processes_contained_the_pill(pill, others, deaths, runners, row)
        return
    assert row["code"] in {"RUNNER_LOST", "INTERRUPTED"}
    attempts = sql("SELECT runner_id, outcome, error_code FROM persistent_jobs_attempts "
                   "WHERE job_id = %s ORDER BY id", [pill])
    # Every run is charged, but for one the pill's runner had not recorded as started yet: it
    # had waited for the busy slot (PREFETCH) and the pill killed the runner within the 0.1 s
    # before its start was written. Such a run is handed back (not charged, counted against
    # HANDBACK_LIMIT), so the pill still ends dead-lettered, after at most that many more runs.
    outcomes = [(o, c) for _, o, c in attempts]
    handed_back = outcomes.count(("interrupted", "RUNNER_LOST"))
    charged = [pair for pair in outcomes if pair != ("interrupted", "RUNNER_LOST")]
    assert len(charged) == RETRIES + 1, outcomes
    assert set(charged) <= {("rescued", "RUNNER_LOST"), ("failed", "INTERRUPTED"),
                            ("dead_lettered", "INTERRUPTED")}, outcomes
    assert handed_back <= HANDBACK_LIMIT, outcomes
    # Each attempt took down a different runner process, and nothing else did.
    assert [d.proc.returncode for d in deaths] == [1] * len(outcomes)
    assert {runner_id for runner_id, _, _ in attempts} == {d.runner_id for d in deaths}
    assert ledger_of(pill) == []
    verify([pill], require_completed=False)
    verdict = verify(others)  # every other job completed, exactly once
    assert all((a.outcome, a.error_code) in {("completed", ""), ("rescued", "RUNNER_LOST"),
                                             ("interrupted", "RUNNER_LOST")}
               for a in verdict.attempts)
    assert all(r.alive for r in runners)
    report("poison_pill", max_retries=RETRIES, runner_deaths=len(deaths),
           other_jobs=len(others), other_jobs_rescued=verdict.outcomes[("rescued",
                                                                        "RUNNER_LOST")])


def _check_worker_processes_contained_the_pill(
    pill: object, others: list[object], deaths: list[RunnerProcess], runners: list[RunnerProcess],
    row: dict[str, object],
) -> None:
    """With worker processes the pill kills a worker, never a runner: each attempt is settled
    at once as ``WORKER_LOST`` (charged), and only jobs sharing that worker are retried."""
    assert row["code"] == "WORKER_LOST"
    attempts = sql("SELECT outcome, error_code FROM persistent_jobs_attempts WHERE job_id = %s "
                   "ORDER BY id", [pill])
    assert attempts == [("failed", "WORKER_LOST")] * RETRIES + [("dead_lettered", "WORKER_LOST")]
    assert deaths == []
    assert ledger_of(pill) == []
    verify([pill], require_completed=False)
    verdict = verify(others)
    assert all((a.outcome, a.error_code) in {("completed", ""), ("failed", "WORKER_LOST")}
               for a in verdict.attempts)
    assert all(r.alive for r in runners)
