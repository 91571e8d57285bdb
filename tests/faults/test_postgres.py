"""Scenario 5: PostgreSQL restarts and outages; and scenario 9's lost COMMIT answer.

These run against a private PostgreSQL cluster the test creates (``initdb`` into a temporary
directory, its own port), because the development server is shared and must not be restarted.
The runner subprocesses and the test itself are pointed at it; ``pg_ctl restart``/``stop``/
``start`` are the faults.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from .harness import (
    STALE,
    Fleet,
    PrivateCluster,
    RunnerProcess,
    backends,
    create_ledger,
    enqueue_jobs,
    enqueue_one,
    job_row,
    ledger_of,
    report,
    sql,
    status_counts,
    terminate,
    using_database,
    verify,
    wait_all_terminal,
    wait_for,
    wait_status,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(180)]

DATABASE = "pj_faults"
CONCURRENCY = 4


@pytest.fixture
def private_db(private_cluster: PrivateCluster, ledger: None) -> Iterator[str]:
    """The private cluster's database, emptied, as this process's default database."""
    url = private_cluster.url(DATABASE)
    with using_database(url):
        create_ledger()
        sql("TRUNCATE persistent_jobs, persistent_jobs_attempts, persistent_jobs_runners "
            "CASCADE")
        yield url


def _running(ids: list[object]) -> int:
    return int(status_counts(ids)["running"])


def _attempt_shapes(ids: list[object]) -> dict[object, list[tuple[str, str]]]:
    shapes: dict[object, list[tuple[str, str]]] = {}
    for job_id, outcome, code in sql(
        "SELECT job_id, outcome, error_code FROM persistent_jobs_attempts "
        "WHERE job_id = ANY(%s) ORDER BY id", [ids]):
        shapes.setdefault(job_id, []).append((outcome, code))
    return shapes


def _busy_then_queued(queued: int, sleep: float) -> tuple[list[object], list[object]]:
    """Fill every slot of the fleet with a job that sleeps (on attempt 1), then queue more."""
    slots = 3 * CONCURRENCY
    busy = enqueue_jobs(slots, {"sleep": sleep, "upto": 1})
    wait_for(lambda: _running(busy) == slots, timeout=20, message="every slot busy", reconnect=True)
    waiting = enqueue_jobs(queued)
    assert status_counts(waiting) == {"pending": queued}
    return busy, waiting


def test_postgres_restart_and_outage(private_cluster: PrivateCluster, private_db: str,
                                     fleet: Fleet) -> None:
    # They serve the default queue; the "late" queue is for the runner started mid-outage.
    # PREFETCH 0: "running" must mean "a handler is executing" for the assertions below (a
    # prefetched job is claimed, so running, before any worker starts it).
    runners = fleet.spawn_many(3, concurrency=CONCURRENCY, database_url=private_db,
                               args=["--queues", "default"], settings={"PREFETCH": 0})
    began = time.monotonic()

    # A. Restart while the runners are idle: their pooled connections are all dead afterwards,
    # yet jobs enqueued next must not pay for it (max_retries=0: a wasted attempt would
    # dead-letter them).
    warm = enqueue_jobs(200)
    wait_all_terminal(warm, timeout=30)
    private_cluster.restart()
    after_idle_restart = enqueue_jobs(200, max_retries=0)
    wait_all_terminal(after_idle_restart, timeout=60)
    verify(warm + after_idle_restart)

    # B. Restart with 1,000 jobs queued and every slot running a job.
    marks = [r.mark() for r in runners]
    busy, queued = _busy_then_queued(1000, sleep=4.0)
    private_cluster.restart()
    wait_all_terminal(busy + queued, timeout=90)
    for runner, mark in zip(runners, marks, strict=True):
        runner.wait_line(r"database unavailable .*retrying in", since=mark, timeout=1)

    # C. An outage longer than the stale-lock timeout, and a runner started during it.
    busy2, queued2 = _busy_then_queued(300, sleep=4.0)
    for_late = enqueue_jobs(50, queue="late")
    private_cluster.stop()
    down_at = time.monotonic()
    late = fleet.spawn("late", concurrency=CONCURRENCY, database_url=private_db,
                       wait_started=False, args=["--queues", "default,late"],
                       settings={"PREFETCH": 0})
    late.wait_line(r"database not reachable", count=2, timeout=30)  # it waits...
    outage = STALE + 1.5  # the fault's length: every heartbeat in the fleet is now stale
    time.sleep(max(0.0, outage - (time.monotonic() - down_at)))
    private_cluster.start()
    up_at = time.monotonic()
    Fleet.wait_started(late, timeout=30)  # ...and starts once the server is back
    wait_all_terminal(busy2 + queued2 + for_late, timeout=90)
    drained_at = time.monotonic()

    everything = warm + after_idle_restart + busy + queued + busy2 + queued2 + for_late
    verdict = verify(everything)
    shapes = _attempt_shapes(everything)
    # Jobs whose handler was running lost its connection: one DB_ERROR, then completed.
    for job in busy + busy2:
        assert shapes[job] == [("failed", "DB_ERROR"), ("completed", "")], shapes[job]
    # Every other job ran exactly once: no attempt wasted on a dead pooled connection, and no
    # live runner's job "rescued" because heartbeats went stale while the server was away.
    for job in warm + after_idle_restart + queued + queued2 + for_late:
        assert shapes[job] == [("completed", "")], shapes[job]
    assert verdict.outcomes[("rescued", "RUNNER_LOST")] == 0
    # The runner that started while the server was down did its share.
    assert {a.runner_id for a in verdict.attempts if a.job_id in set(for_late)} == {
        late.runner_id}
    everyone: list[RunnerProcess] = [*runners, late]
    assert all(r.alive for r in everyone)
    assert not any(r.find(r"presumed dead") for r in everyone)
    for runner in everyone:
        runner.send(signal.SIGTERM)
    assert [r.wait_exit(20) for r in everyone] == [0] * len(everyone)
    report("postgres_restart", jobs=len(everything), restarts=2, stops=1, outage_s=round(outage, 1),
           runners=len(everyone), recovery_after_outage_s=round(drained_at - up_at, 1),
           duration_s=round(drained_at - began, 1))


def test_commit_that_succeeds_while_its_connection_dies(private_db: str, fleet: Fleet) -> None:
    """The ambiguous case: COMMIT happened, but the runner only sees its connection die.

    The handler opts its transaction into ``synchronous_commit = on``; the cluster's standby
    never connects, so the COMMIT is durable locally and then waits. Terminating that backend
    now is exactly "the commit succeeded, the answer was lost". The runner must neither run the
    job again nor record a failure over the completion.
    """
    runner = fleet.spawn("syncrep", concurrency=2, database_url=private_db)
    job = enqueue_one({"sync_commit": True, "upto": 1})
    waiting = wait_for(lambda: backends("syncrep", "wait_event = 'SyncRep'"), timeout=15,
                       message="the COMMIT to wait for the standby", reconnect=True)
    assert terminate(waiting[0][0])
    runner.wait_line(rf"job {job}: .*committed", timeout=15)
    row = job_row(job)
    assert (row["status"], row["attempts"]) == ("completed", 1)
    assert _attempt_shapes([job]) == {job: [("completed", "")]}
    assert ledger_of(job) == [(1, runner.runner_id)]
    more = enqueue_jobs(20)
    wait_all_terminal(more, timeout=20)
    verify([job, *more])
    assert runner.alive
    wait_status(job, "completed", timeout=1)
