"""Scenario 11: batched completions. Handlers that touched no database have their completions
written together, after they returned; what happens to a job whose handler has returned while
its completion is still being written?

* The runner is SIGKILLed: nothing was committed, the job stays running under the dead runner,
  is rescued (``RUNNER_LOST``, charged) and runs again: at least once, never lost.
* The runner is asked to stop (SIGTERM): it waits for the completions being written (within
  its grace period) and exits; each job completed once, by its only run.
* The same kill with ``atomic=False`` handlers, which wrote to the database (in autocommit)
  before returning: their writes stay, and the second run writes again. At least once, as
  documented for ``atomic=False``; the job itself is still completed once.
* Meanwhile the runner goes on: a handler that returned holds no slot, so the next jobs run
  while the completions wait.
* A worker process dies while its completions are being written: the supervisor settles those
  jobs like any other of the dead worker's (``WORKER_LOST``, charged), and they run again.

The completion is held back by a row lock the scenario takes on the running jobs, which the
batch statement waits for; the scenario sees it waiting in ``pg_stat_activity``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from django_persistent_jobs import enqueue_many
from django_persistent_jobs.runner.executor import COMPLETING_ALLOWANCE

from .batch_handlers import runs_of
from .harness import (
    Fleet,
    RunnerProcess,
    attempts_of,
    backends,
    database_url,
    ledger_of,
    report,
    status_counts,
    terminate,
    wait_all_terminal,
    wait_for,
)
from .runners import PROCESSES

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(120)]

JOBS = 4
SOLO = "faults.solo"



def _hold_completions(
    fleet: Fleet, tmp_path: Path, name: str, settings: dict[str, Any] | None = None,
    job_type: str = SOLO, args: tuple[str, ...] = (),
) -> tuple[RunnerProcess, list[str], Path, psycopg.Connection[Any]]:
    """Start a runner, let it run ``JOBS`` SQL-less jobs to their return, and hold their
    completions back with row locks. Returns the runner, the job ids, the runs file and the
    connection holding the locks (its transaction open)."""
    runs, gate = tmp_path / "runs", tmp_path / "gate"
    runner = fleet.spawn(name, concurrency=JOBS, settings=settings, args=args)
    ids = [str(job.id) for job in enqueue_many(
        [(job_type, {"runs": str(runs), "gate": str(gate), "n": i}) for i in range(JOBS)])]
    wait_for(lambda: len(runs_of(runs)) == JOBS, 20, "every handler to start", reconnect=True)
    blocker = psycopg.connect(database_url())
    blocker.execute("SELECT id FROM persistent_jobs WHERE id = ANY(%s::uuid[]) FOR UPDATE",
                    [ids])
    gate.touch()  # the handlers return; their completions wait for the rows
    wait_for(lambda: backends(name, "wait_event_type = 'Lock' AND query LIKE '%%unnest%%'"),
             20, "the batched completion to wait for the row locks", reconnect=True)
    assert status_counts(ids) == {"running": JOBS}
    return runner, ids, runs, blocker


def _stop_gracefully_while_held(runner: RunnerProcess) -> None:
    """SIGTERM: the runner stops claiming and, its completions held, stays up waiting for
    them."""
    mark = runner.mark()
    runner.send(signal.SIGTERM)
    runner.wait_line(r"stopping: no new claims", since=mark)
    assert runner.alive  # waiting for the completions, which wait for the rows


def _kill_while_held(fleet: Fleet, tmp_path: Path, job_type: str) -> tuple[
        list[str], Path, RunnerProcess, RunnerProcess]:
    victim, ids, runs, blocker = _hold_completions(fleet, tmp_path, "victim", job_type=job_type)
    with blocker:
        victim.kill()
        # The dead runner's blocked statement would otherwise still commit once the locks go
        # (PostgreSQL notices a vanished client only when it next talks to it): end it, as a
        # server that noticed the lost connection would.
        for pid, *_ in backends("victim"):
            terminate(pid)
        wait_for(lambda: not backends("victim"), 10, "the killed runner's sessions to end",
                 reconnect=True)
        blocker.rollback()
    rescuer = fleet.spawn("rescuer", concurrency=JOBS)
    wait_all_terminal(ids, timeout=30)
    assert status_counts(ids) == {"completed": JOBS}
    by_job: dict[str, list[tuple[int, str, str, str]]] = {}
    for attempt in attempts_of(ids):
        by_job.setdefault(str(attempt.job_id), []).append(
            (attempt.attempt, attempt.runner_id, attempt.outcome, attempt.error_code))
    for job_id in ids:
        assert by_job[job_id] == [(1, victim.runner_id, "rescued", "RUNNER_LOST"),
                                  (2, rescuer.runner_id, "completed", "")], by_job[job_id]
    assert runs_of(runs) == {job_id: 2 for job_id in ids}  # run again: at least once
    return ids, runs, victim, rescuer


def test_sigkill_while_completions_are_written_leaves_the_jobs_to_be_run_again(
    fleet: Fleet, tmp_path: Path,
) -> None:
    _, runs, _, _ = _kill_while_held(fleet, tmp_path, SOLO)
    report("batched_completion_killed", jobs=JOBS, runs=sum(runs_of(runs).values()))


def test_sigkill_after_atomic_false_handlers_wrote_keeps_their_writes_and_runs_them_again(
    fleet: Fleet, tmp_path: Path,
) -> None:
    ids, _, victim, rescuer = _kill_while_held(fleet, tmp_path, "faults.autocommit")
    for job_id in ids:  # the first run's write was committed when it ran, and is kept
        assert ledger_of(job_id) == [(1, victim.runner_id), (2, rescuer.runner_id)]
    report("atomic_false_killed", jobs=JOBS, ledger_rows=2 * JOBS)


def test_sigterm_writes_the_completions_being_written_before_exiting(
    fleet: Fleet, tmp_path: Path,
) -> None:
    runner, ids, runs, blocker = _hold_completions(
        fleet, tmp_path, "stopping", settings={"SHUTDOWN_GRACE": 20})
    with blocker:
        _stop_gracefully_while_held(runner)
        blocker.rollback()
    assert runner.wait_exit(20) == 0
    assert status_counts(ids) == {"completed": JOBS}
    assert sorted((str(a.job_id), a.attempt, a.outcome) for a in attempts_of(ids)) == sorted(
        (job_id, 1, "completed") for job_id in ids)
    assert runs_of(runs) == {job_id: 1 for job_id in ids}
    report("batched_completion_sigterm", jobs=JOBS)


def test_a_second_signal_while_completions_wait_for_a_row_lock_stops_at_once(
    fleet: Fleet, tmp_path: Path,
) -> None:
    """A second signal must stop the runner at once even while its completion writer is
    inside a statement that waits for row locks (it used to wait 2 s for the writer, then 5 s
    more after giving up on it). What happens to those jobs is what a crash in that window
    gives: the statement the server already has may still commit once the locks go (fenced:
    the job completed by its only run), or the job is rescued and runs again; never lost,
    never completed twice."""
    runner, ids, runs, blocker = _hold_completions(
        fleet, tmp_path, "forced", settings={"SHUTDOWN_GRACE": 60})
    with blocker:
        _stop_gracefully_while_held(runner)
        forced_at = time.monotonic()
        runner.send(signal.SIGTERM)
        assert runner.wait_exit(15) == 1
        took = time.monotonic() - forced_at
        assert took < 3.0, took  # at once: not the writer's 2 + 5 s
        blocker.rollback()
    fleet.spawn("rescuer", concurrency=JOBS)
    wait_all_terminal(ids, timeout=30)
    assert status_counts(ids) == {"completed": JOBS}
    for job_id in ids:
        outcomes = [a.outcome for a in attempts_of([job_id])]
        assert outcomes.count("completed") == 1, (job_id, outcomes)
        assert runs_of(runs)[job_id] == len(outcomes), (job_id, outcomes)
    report("batched_completion_second_signal", jobs=JOBS, exit_s=round(took, 2),
           runs=sum(runs_of(runs).values()))


def test_slots_are_free_while_completions_are_written(fleet: Fleet, tmp_path: Path) -> None:
    """Every slot's job has returned and waits for its completion: the next jobs still run, up
    to one more per slot and ``COMPLETING_ALLOWANCE`` (five batches) more per completion writer
    (the runner's, or each worker process's: ``executor.held_back``); then the runner stops
    claiming until completions land, instead of running jobs it cannot complete."""
    # No waiting jobs (PREFETCH 0): those would start as slots free up whatever the pending
    # completions, up to PREFETCH more than shown here.
    if int(PROCESSES) > 1:
        pytest.skip("the bound is per worker; with several, which worker holds the blocked "
                    "completions decides what the others run")
    runner, ids, _, blocker = _hold_completions(fleet, tmp_path, "busy", {"PREFETCH": 0})
    extra = JOBS + COMPLETING_ALLOWANCE  # one per slot (or lane), and the one completer's allowance
    more_runs = tmp_path / "more-runs"
    with blocker:
        more = [str(job.id) for job in enqueue_many(
            [(SOLO, {"runs": str(more_runs), "n": i}) for i in range(extra + JOBS)])]
        wait_for(lambda: len(runs_of(more_runs)) >= extra, 20,
                 "the next jobs to run while the first completions wait", reconnect=True)
        assert status_counts(ids) == {"running": JOBS}
        # Bounded look for what must not happen: jobs beyond the bound starting.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert len(runs_of(more_runs)) == extra
            assert status_counts(more)["pending"] == JOBS
            time.sleep(0.05)
        blocker.rollback()
    everything = [*ids, *more]
    wait_all_terminal(everything, timeout=30)
    assert status_counts(everything) == {"completed": len(everything)}
    assert {(a.attempt, a.outcome) for a in attempts_of(everything)} == {(1, "completed")}
    assert runner.alive
    report("slots_free_while_completing", jobs=len(everything))


def test_a_worker_that_dies_while_its_completions_are_written_has_them_run_again(
    fleet: Fleet, tmp_path: Path,
) -> None:
    """Process mode: the supervisor knows which returned jobs a worker had not completed yet,
    and settles them when that worker dies, as it does its running jobs."""
    from .test_worker_processes import worker_pids

    runner, ids, runs, blocker = _hold_completions(fleet, tmp_path, "dying",
                                                   args=("--processes", "1"))
    with blocker:
        [worker] = worker_pids(runner)
        os.kill(worker, signal.SIGKILL)
        # Its blocked completion statement would still commit once the locks go (PostgreSQL
        # notices a vanished client only when it next talks to it): end it, as a server that
        # noticed the lost connection would.
        for pid, *_ in backends("dying", "wait_event_type = 'Lock' AND query LIKE '%%unnest%%'"):
            terminate(pid)
        runner.wait_line(rf"worker \d+ \(pid {worker}\) died \(killed by signal 9\) with "
                         rf"{JOBS} job\(s\) in flight", timeout=10)
        blocker.rollback()
    wait_all_terminal(ids, timeout=30)
    assert status_counts(ids) == {"completed": JOBS}
    by_job: dict[str, list[tuple[int, str, str]]] = {}
    for attempt in attempts_of(ids):
        by_job.setdefault(str(attempt.job_id), []).append(
            (attempt.attempt, attempt.outcome, attempt.error_code))
    for job_id in ids:
        assert by_job[job_id] == [(1, "failed", "WORKER_LOST"), (2, "completed", "")], by_job
    assert runs_of(runs) == {job_id: 2 for job_id in ids}  # run again: at least once
    assert runner.alive
    report("worker_lost_while_completing", jobs=JOBS)
