"""Rescue follows liveness (invariant 6) and fencing stops whatever rescue leaves behind
(invariant 3).

Scenario 2: a runner frozen with SIGSTOP mid-job past the stale-lock timeout is a zombie: its job
is rescued and completed elsewhere, and when it wakes (SIGCONT) its completion and business
writes are rejected. Scenario 3: a job three times longer than the stale-lock timeout on a
healthy runner is never rescued. Scenario 10: a restarted runner that reuses its predecessor's
host name and pid (or is given the same name) still gets the predecessor's jobs rescued.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest

from .harness import (
    STALE,
    Fleet,
    enqueue_jobs,
    enqueue_one,
    job_row,
    ledger_of,
    report,
    runner_pid_from_id,
    sql,
    verify,
    wait_all_terminal,
    wait_for,
    wait_status,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(120)]


def _outcomes(job_id: object) -> list[tuple[int, str, str, str]]:
    return [(a, r, o, c) for a, r, o, c in sql(
        "SELECT attempt, runner_id, outcome, error_code FROM persistent_jobs_attempts "
        "WHERE job_id = %s ORDER BY id", [job_id])]


def test_zombie_runner_cannot_commit_after_its_job_was_rescued(fleet: Fleet) -> None:
    zombie = fleet.spawn("zombie", concurrency=2)
    # Attempt 1 sleeps (long enough to be frozen in the middle); later attempts do not.
    job = enqueue_one({"sleep": 2.0, "upto": 1})
    running = wait_status(job, "running")
    assert running["locked_by"] == zombie.runner_id
    zombie.send(signal.SIGSTOP)
    frozen_at = time.monotonic()
    # The survivor serves the default queue only, so these wait for the zombie to wake up.
    survivor = fleet.spawn("survivor", concurrency=2, args=["--queues", "default"])
    later = enqueue_jobs(20, {"work": 0.05}, queue="zombie-only")

    done = wait_status(job, "completed", timeout=STALE + 20)
    rescued_after = time.monotonic() - frozen_at
    assert rescued_after >= STALE  # not before the zombie's heartbeat went stale
    assert done["attempts"] == 2
    assert _outcomes(job) == [
        (1, zombie.runner_id, "rescued", "RUNNER_LOST"),
        (2, survivor.runner_id, "completed", ""),
    ]
    assert ledger_of(job) == [(2, survivor.runner_id)]

    mark = zombie.mark()
    zombie.send(signal.SIGCONT)
    # The zombie finishes its handler (its ledger insert succeeds: the table has no unique
    # constraint), then its fenced completion matches nothing and everything rolls back.
    zombie.wait_line(rf"job {job}: claim lost", since=mark, timeout=20)
    zombie.wait_line(r"presumed dead by another runner", since=mark, timeout=20)
    assert ledger_of(job) == [(2, survivor.runner_id)]
    assert job_row(job)["attempts"] == 2 and job_row(job)["status"] == "completed"
    assert len(_outcomes(job)) == 2  # not run a third time
    verify([job])

    # Awake, the zombie proves itself alive (registers again) before it claims anything, so
    # the jobs it claims next are not orphans that the survivor would "rescue" from it.
    wait_all_terminal(later, timeout=30)
    verdict = verify(later)
    assert {(a.outcome, a.runner_id) for a in verdict.attempts} == {("completed",
                                                                     zombie.runner_id)}
    assert len(verdict.attempts) == len(later)
    assert zombie.alive and survivor.alive
    report("zombie", frozen_s=round(rescued_after, 1), attempts=2, ledger_rows=1)


def test_long_jobs_on_a_live_runner_are_never_rescued(fleet: Fleet) -> None:
    owner = fleet.spawn("owner", concurrency=2)
    duration = 3 * STALE
    # One waits (GIL released), one computes in pure Python (GIL held as much as it can).
    jobs = {kind: enqueue_one({kind: duration}, timeout=60) for kind in ("sleep", "spin")}
    wait_for(lambda: all(job_row(job)["locked_by"] == owner.runner_id
                         for job in jobs.values()), timeout=15, message="both jobs running",
             reconnect=True)
    # Another live runner, heartbeating and rescuing throughout, that would take the jobs if
    # rescue went by elapsed time.
    watcher = fleet.spawn("watcher", concurrency=1)
    wait_all_terminal(list(jobs.values()), timeout=duration + 20)
    for job in jobs.values():
        assert job_row(job)["status"] == "completed"
        assert _outcomes(job) == [(1, owner.runner_id, "completed", "")]
        assert ledger_of(job) == [(1, owner.runner_id)]
    ran = sql("SELECT min(extract(epoch FROM duration)) FROM persistent_jobs_attempts "
              "WHERE job_id = ANY(%s)", [list(jobs.values())])[0][0]
    assert ran >= duration  # each held its job for three stale-lock timeouts
    assert not owner.find(r"presumed dead") and not watcher.find(r"rescued from runner")
    verify(list(jobs.values()))
    report("long_jobs", job_seconds=round(float(ran), 1), stale_lock_timeout=STALE, rescues=0)


def _pid_namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    result = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "true"],
                            capture_output=True, check=False)
    return result.returncode == 0


@pytest.mark.skipif(not _pid_namespaces_work(), reason="needs unshare --pid (root or userns)")
def test_restarted_runner_reusing_host_and_pid_gets_predecessors_jobs_rescued(
    fleet: Fleet,
) -> None:
    # Each runner runs as pid 1 of its own pid namespace: same host name, same pid, for real.
    first = fleet.spawn("first", concurrency=1, pid_namespace=True)
    job = enqueue_one({"sleep": 60, "upto": 1})
    assert wait_status(job, "running")["locked_by"] == first.runner_id
    first.kill()
    second = fleet.spawn("second", concurrency=1, pid_namespace=True)
    assert first.runner_id and second.runner_id
    assert runner_pid_from_id(first.runner_id) == runner_pid_from_id(second.runner_id) == 1
    assert first.runner_id.split(":")[0] == second.runner_id.split(":")[0]
    assert first.runner_id != second.runner_id
    wait_status(job, "completed", timeout=2 * STALE + 20)
    assert _outcomes(job) == [(1, first.runner_id, "rescued", "RUNNER_LOST"),
                              (2, second.runner_id, "completed", "")]
    verify([job])


EMBEDDED = (
    "import sys; from django_persistent_jobs.runner import Runner; "
    "sys.exit(Runner(runner_id='fixed-id-runner', concurrency=1, scheduler=False)"
    ".run(install_signal_handlers=True))"
)


def test_restarted_runner_with_the_same_fixed_id_gets_predecessors_jobs_rescued(
    fleet: Fleet,
) -> None:
    # An embedded runner given a fixed id (the ``runner_id`` argument, a name) is killed mid-job
    # and restarted at once under the same name: the name is not its identity, so the dead
    # predecessor's row goes stale and the job it held comes back into play rather than stay
    # "running" forever.
    first = fleet.spawn("fixed1", command=["shell", "-c", EMBEDDED])
    job = enqueue_one({"sleep": 60, "upto": 1})
    assert wait_status(job, "running")["locked_by"] == first.runner_id
    assert first.runner_id and first.runner_id.startswith("fixed-id-runner:")
    first.kill()
    second = fleet.spawn("fixed2", command=["shell", "-c", EMBEDDED])
    assert second.runner_id and second.runner_id.startswith("fixed-id-runner:")
    assert second.runner_id != first.runner_id
    wait_status(job, "completed", timeout=2 * STALE + 20)
    assert [(o, c) for _, _, o, c in _outcomes(job)] == [("rescued", "RUNNER_LOST"),
                                                         ("completed", "")]
    verify([job])
    wait_for(lambda: second.alive, timeout=1, message="the restarted runner to stay up",
             reconnect=True)
