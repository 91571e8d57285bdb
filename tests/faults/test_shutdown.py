"""Scenario 8: graceful shutdown with SIGTERM.

A job shorter than the grace period finishes, the runner exits 0 and claims nothing after the
signal. A job longer than the grace period is handed back (pending, attempt not charged, attempt
recorded as ``interrupted``/``SHUTDOWN``), neither left running nor silently failed. A SIGTERM
that arrives while a claim is in flight hands the freshly claimed jobs straight back. A second
signal during the grace period stops the runner at once (exit 1): what runs is handed back as a
grace period that ran out would hand it back, and nothing of the runner is left behind.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import psycopg
import pytest

from django_persistent_jobs import enqueue

from .batch_handlers import runs_of
from .harness import (
    PROCESSES,
    Fleet,
    RunnerProcess,
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


def _group(runner: RunnerProcess) -> list[int]:
    """Processes alive (not zombies) in the runner's process group, which it leads (the fleet
    starts it in a session of its own): the runner, its liveness sidecar or its workers."""
    left: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == runner.pid and fields[0] != "Z":
                left.append(int(entry.name))
    return left


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_stops_at_once_and_hands_back_what_runs(
    fleet: Fleet, tmp_path: Path, second: signal.Signals,
) -> None:
    """SIGTERM with two long handlers in flight (one inside its transaction, blocked in C; one
    that ran no SQL) and two jobs claimed to wait for a slot; then, long before the 60 s grace
    ends, a second signal. guarantees.md 6, operations.md "Graceful shutdown and signals" and
    processes.md "Shutdown": the first signal hands the waiting jobs back unstarted (neither
    charged nor counted) and lets the running ones run on; the second stops at once, exit 1,
    handing back what runs (``interrupted``/``SHUTDOWN``, not charged, ``handbacks`` 1). Then
    no job is left running under the runner, its row and its sessions are gone, no process of
    its own (worker, sidecar) is left, the in-flight transaction did not commit, and the next
    runner runs every job once."""
    grace = 60.0
    runs, gate = tmp_path / "runs", tmp_path / "gate"
    runner = fleet.spawn("forced", concurrency=2,
                         settings={"SHUTDOWN_GRACE": grace, "PREFETCH": 2})
    in_tx = enqueue_one({"report_pid": True, "sleep": 60, "pid": runner.pid})
    solo = enqueue("faults.solo", {"runs": str(runs), "gate": str(gate)}).id
    wait_for(lambda: job_row(in_tx)["progress"] and len(runs_of(runs)) == 1, 20,
             "both long handlers to start", reconnect=True)
    waiting = enqueue_jobs(2)
    wait_for(lambda: status_counts(waiting) == {"running": 2}, 20,
             "two jobs claimed to wait for a slot", reconnect=True)
    # The runner and its sidecar (threads) or its workers (--processes N, no sidecar).
    workers = {int(m.group(1)) for m in runner.find(r"worker \d+ started \(pid (\d+)\)")}
    assert len(workers) == int(PROCESSES)
    group = _group(runner)
    assert len(group) >= 2 and workers <= set(group), (group, workers)

    mark = runner.mark()
    runner.send(signal.SIGTERM)
    runner.wait_line(r"stopping: no new claims", since=mark)
    wait_for(lambda: status_counts(waiting) == {"pending": 2}, 10,
             "the waiting jobs to be handed back unstarted", reconnect=True)
    assert runner.alive and status_counts([in_tx, solo]) == {"running": 2}

    forced_at = time.monotonic()
    runner.send(second)
    assert runner.wait_exit(15) == 1
    took = time.monotonic() - forced_at
    assert took < 10, took  # at once, not after the grace period
    assert runner.find(r"second signal: stopping now", since=mark)
    # Exited: what ran is handed back, nothing is left running under it, and it left nothing.
    for job in (in_tx, solo):
        row = job_row(job)
        assert (row["status"], row["attempts"], row["locked_by"], row["code"]) == (
            "pending", 0, None, "SHUTDOWN"), (job, row)
    # One attempt each, interrupted and not charged; counted only for the jobs that ran.
    assert sorted(_attempts([in_tx, solo, *waiting])) == sorted(
        (job, runner.runner_id, "interrupted", "SHUTDOWN") for job in [in_tx, solo, *waiting])
    assert dict((job, (attempts, handbacks)) for job, attempts, handbacks in sql(
        "SELECT id, attempts, handbacks FROM persistent_jobs WHERE id = ANY(%s)",
        [[in_tx, solo, *waiting]])) == {in_tx: (0, 1), solo: (0, 1),
                                        **{job: (0, 0) for job in waiting}}
    assert sql("SELECT count(*) FROM persistent_jobs WHERE locked_by = %s",
               [runner.runner_id]) == [(0,)]
    assert sql("SELECT count(*) FROM persistent_jobs_runners WHERE id = %s",
               [runner.runner_id]) == [(0,)]
    assert ledger_of(in_tx) == []  # its transaction was ended, not committed
    wait_for(lambda: not _group(runner), 5, "the runner's worker processes and sidecar to exit")
    left_after = time.monotonic() - forced_at
    wait_for(lambda: not backends("forced"), 5, "the runner's sessions to end", reconnect=True)

    gate.touch()  # the next run of the SQL-less job returns at once
    fleet.spawn("after", concurrency=2)
    wait_all_terminal([in_tx, solo, *waiting], timeout=30)
    assert status_counts([solo]) == {"completed": 1}
    assert runs_of(runs) == {str(solo): 2}  # the run handed back, and the one that completed
    verify([in_tx, *waiting])
    report(f"second_signal_{second.name}", exit_s=round(took, 2),
           processes_gone_s=round(left_after, 2), grace_s=grace)
