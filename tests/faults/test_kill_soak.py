"""Scenario 1: SIGKILL soak. Three runner processes drain 3,000 jobs while one of them is killed
with SIGKILL every 1-2 s and restarted. Nothing is lost, nothing commits twice, and every
attempt a kill interrupted is on record as rescued (``RUNNER_LOST``) from the runner we killed.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from .harness import (
    TERMINAL,
    Fleet,
    RunnerProcess,
    backends,
    enqueue_jobs,
    report,
    runner_pid_from_id,
    sql,
    status_counts,
    verify,
    wait_for,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(240)]

JOBS = 3000
RUNNERS = 3
CONCURRENCY = 4
#: Each job sleeps this long, so a kill always finds jobs in flight however fast the machine
#: (and the drain lasts long enough for several kills).
WORK = 0.04
SOAK_DEADLINE = 180.0


def _running_jobs(runner_id: str) -> list[object]:
    return [row[0] for row in sql(
        "SELECT id FROM persistent_jobs WHERE status = 'running' AND locked_by = %s",
        [runner_id])]


def test_sigkill_soak(fleet: Fleet) -> None:
    seed = int(os.environ.get("PJ_FAULTS_SEED", "20240601"))
    rng = random.Random(seed)
    runners = fleet.spawn_many(RUNNERS, concurrency=CONCURRENCY)
    ids = enqueue_jobs(JOBS, {"work": WORK}, max_retries=20)
    began = time.monotonic()
    deadline = began + SOAK_DEADLINE
    kills: list[tuple[str, int, list[object]]] = []  # (runner id, pid, jobs it held when killed)
    caught: set[object] = set()  # every job a kill caught in flight

    def drained() -> bool:
        counts = status_counts(ids)
        return sum(counts[s] for s in TERMINAL) == len(ids)

    while not drained():
        assert time.monotonic() < deadline, f"soak did not drain in {SOAK_DEADLINE}s"
        next_kill = time.monotonic() + rng.uniform(1.0, 2.0)  # the fault schedule
        while time.monotonic() < next_kill and not drained():
            time.sleep(0.05)
        if drained():
            break
        # The victim: a started runner with jobs in flight right now, so every kill counts, and
        # at least one of them a job no earlier kill caught. Otherwise the last few jobs of the
        # drain are caught again and again: the runner that claims them after their rescue is
        # the only one with jobs in flight, is killed at once, and they end dead-lettered.
        def victim() -> RunnerProcess | None:
            candidates = [r for r in runners if r.runner_id is not None
                          and set(_running_jobs(r.runner_id)) - caught]
            return rng.choice(candidates) if candidates else None

        target: RunnerProcess | None = wait_for(
            lambda: victim() or drained(), timeout=30, message="a runner with jobs in flight",
            reconnect=True)
        if not isinstance(target, RunnerProcess):
            break
        assert target.runner_id is not None
        target.kill()
        # Post mortem, once the server has finished with the dead runner's sessions (a COMMIT
        # it sent just before dying still completes): what it holds now must be rescued.
        victim_name = target.name
        wait_for(lambda: not backends(victim_name), timeout=10,  # noqa: B023 (used at once)
                 message=f"runner {victim_name}'s sessions to end", reconnect=True)
        kills.append((target.runner_id, target.pid, _running_jobs(target.runner_id)))
        caught.update(kills[-1][2])
        runners[runners.index(target)] = fleet.spawn(wait_started=False,
                                                     concurrency=CONCURRENCY)
    duration = time.monotonic() - began

    verdict = verify(ids)
    killed_ids = {runner_id for runner_id, _, _ in kills}
    killed_pids = {pid for _, pid, _ in kills}
    lost = [a for a in verdict.attempts if a.outcome != "completed"]
    # Every attempt that did not complete was cut short by one of our kills, and says so:
    # rescued (charged) if it had started, handed back (not charged) if it was still waiting
    # in the killed runner for a worker (PREFETCH).
    assert all((a.outcome, a.error_code) in {("rescued", "RUNNER_LOST"),
                                             ("interrupted", "RUNNER_LOST")} for a in lost), \
        {(a.outcome, a.error_code) for a in lost}
    assert all(a.runner_id in killed_ids for a in lost)
    assert all(runner_pid_from_id(a.runner_id) in killed_pids for a in lost)
    # ...and every job a killed runner held has a rescued attempt from that runner.
    rescued = {(a.job_id, a.runner_id) for a in lost}
    held = [(job_id, runner_id) for runner_id, _, jobs in kills for job_id in jobs]
    assert all(pair in rescued for pair in held)
    assert len(kills) >= 4, f"only {len(kills)} kills: the soak was too short to mean much"
    assert held, "no kill caught a job in flight"
    # Dead runners are eventually forgotten; the live ones are still registered.
    wait_for(lambda: not sql("SELECT id FROM persistent_jobs_runners WHERE id = ANY(%s)",
                             [list(killed_ids)]),
             timeout=10, message="killed runners to be reaped", reconnect=True)
    assert all(r.alive for r in runners)
    report("sigkill_soak", jobs=JOBS, runners=RUNNERS, concurrency=CONCURRENCY, kills=len(kills),
           jobs_in_flight_at_kills=len(held), rescued_attempts=len(lost),
           total_attempts=len(verdict.attempts), ledger_rows=verdict.ledger_rows,
           duration_s=round(duration, 1), seed=seed)
