"""``runjobs --processes N``: a supervisor that runs no job code, and worker processes that can
hold the GIL, block in C or die without taking the runner's promises with them.

Real ``runjobs`` processes, real PostgreSQL; synchronisation by log lines and database states.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction

from django_persistent_jobs import cancel_job, enqueue

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
    wait_for,
    wait_status,
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
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def enqueue_typed(job_type: str, payload: dict[str, Any] | None = None, **options: Any) -> Any:
    with transaction.atomic():
        return enqueue(job_type, payload or {}, **options).id


def test_two_workers_drain_exactly_once_and_sigterm_exits_zero(fleet: Fleet) -> None:
    runner = fleet.spawn(args=["--processes", "2"], concurrency=3)
    wait_for(lambda: len(worker_pids(runner)) == 2, 30, "two workers", reconnect=True)
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
    wait_for(lambda: not any(_alive(pid) for pid in workers), 10, "workers to exit", reconnect=True)


def _ledger_pids(ids: list[Any]) -> list[tuple[Any, ...]]:
    from .harness import sql

    return sql("SELECT DISTINCT pid FROM faults_ledger WHERE job_id = ANY(%s)", [list(ids)])


def test_a_handler_holding_the_gil_for_three_stale_timeouts_completes_first_time(
    fleet: Fleet,
) -> None:
    """Two runners; one job holds its worker's GIL in C for 3x the stale-lock timeout. The
    supervisor's heartbeat is in another process, so nobody declares the runner dead."""
    first, second = (fleet.spawn(args=["--processes", "1"], concurrency=2) for _ in range(2))
    job_id = enqueue_typed("procs.gil", {"seconds": int(3 * STALE)})
    row = wait_status(job_id, "completed", timeout=60)
    assert row["attempts"] == 1
    assert [(a.attempt, a.outcome) for a in attempts_of([job_id])] == [(1, "completed")]
    assert len(ledger_of(job_id)) == 1
    assert first.alive and second.alive
    assert not first.find("presumed dead") and not second.find("presumed dead")


def test_a_handler_blocked_in_c_frees_its_slot_at_timeout_and_its_worker_is_replaced(
    fleet: Fleet,
) -> None:
    """Timeout 1 s, blocked in ``sleep(3600)``: the slot is free at the timeout (a job queued
    behind it runs at once) and the stuck worker is killed and replaced after the grace."""
    grace = 3.0
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1,
                         settings={"TIMEOUT_GRACE": grace})
    wait_for(lambda: worker_pids(runner), 30, "a worker", reconnect=True)
    (stuck_worker,) = worker_pids(runner)
    blocked = enqueue_typed("procs.c_sleep", {"report": True})
    progress = wait_for(lambda: job_row(blocked)["progress"], 20, "the handler to start",
                        reconnect=True)
    started = time.monotonic()
    follower = enqueue_jobs(1)[0]  # waits for the only slot
    row = wait_status(blocked, "dead_lettered", timeout=10)
    freed = time.monotonic() - started
    assert row["code"] == "TIMEOUT"
    assert freed <= 1.0 + grace + 1.0, freed
    # Its database session was terminated at the timeout: nothing it does can commit.
    wait_for(lambda: not sql_value("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                   [progress["backend"]]), 1.5, "the session to be terminated",
             reconnect=True)
    wait_status(follower, "completed", timeout=10)
    # The slot was free at the timeout, not at the end of the grace: the follower ran within
    # about a second of the blocked job's timeout (database clock, both sides).
    waited = sql_value(
        "SELECT extract(epoch FROM (SELECT min(created_at) FROM faults_ledger WHERE job_id = %s)"
        " - (SELECT started_at FROM persistent_jobs_attempts WHERE job_id = %s AND attempt = 1))",
        [follower, blocked])
    assert float(waited) <= 1.0 + 1.0 < 1.0 + grace, waited
    # The stuck thread never returns, so its process goes: killed after the grace, replaced.
    runner.wait_line(r"recycling worker 1 .*did not return", timeout=10)
    wait_for(lambda: not _alive(stuck_worker), 10, "the stuck worker to be killed", reconnect=True)
    killed_after = time.monotonic() - started
    # A planned kill, not a crash: operators alert on ``worker_lost`` ("died").
    runner.wait_line(r"killed at the end of its recycling grace", timeout=5)
    assert not runner.find(r"died \(")
    # At timeout + grace, with nothing else left in it to finish: not a second grace later.
    assert killed_after <= 1.0 + grace + 1.5, killed_after
    wait_for(lambda: len(worker_pids(runner)) == 1, 30, "a replacement worker", reconnect=True)
    assert worker_pids(runner) != [stuck_worker]
    later = enqueue_jobs(3)
    wait_all_terminal(later, timeout=30)
    verify([follower, *later])
    assert len(ledger_of(blocked)) == 0
    assert runner.alive


def test_a_handler_stuck_in_c_holding_the_gil_costs_its_worker_timeout_plus_grace(
    fleet: Fleet,
) -> None:
    """Stuck in C *holding the GIL*: its worker can run nothing else, not even answer for the
    job queued behind it. It is killed at timeout + grace (it used to wait a second grace for
    that queued job's answer), and the queued job runs on the replacement, not charged."""
    grace = 2.0
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1,
                         settings={"TIMEOUT_GRACE": grace})
    (stuck_worker,) = wait_for(lambda: worker_pids(runner), 30, "a worker", reconnect=True)
    blocked = enqueue_typed("procs.gil_at_once", {"seconds": 3600})
    wait_for(lambda: job_row(blocked)["progress"], 20, "the handler to start", reconnect=True)
    started = time.monotonic()
    follower = enqueue_jobs(1)[0]
    assert wait_status(blocked, "dead_lettered", timeout=10)["code"] == "TIMEOUT"
    wait_for(lambda: not _alive(stuck_worker), 10, "the stuck worker to be killed",
             reconnect=True)
    killed_after = time.monotonic() - started
    assert killed_after <= 1.0 + grace + 1.5, killed_after
    assert wait_status(follower, "completed", timeout=30)["attempts"] == 1
    assert not runner.find(r"died \(")
    assert runner.alive


def test_a_worker_recycled_for_a_stuck_handler_gives_back_the_jobs_in_its_queue(
    fleet: Fleet,
) -> None:
    """A worker whose timed-out handler is stuck in C is killed after the grace. A job waiting
    in its queue when it is recycled must not start there (it would be charged for the
    kill): the worker gives it back unstarted and the replacement runs it, first attempt.

    Timeline (grace 1.5 s): the blocked job times out at 1 s; a fresh lane starts ``first``
    (2 s), ``second`` waits in the worker's queue behind it; the recycle at 2.5 s recalls
    ``second``; ``first`` ends at 3 s, before the kill at 4 s. Without the recall ``second``
    would start at 3 s in the doomed worker and be killed mid-run."""
    grace = 1.5
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1,
                         settings={"TIMEOUT_GRACE": grace, "PREFETCH": 2})
    (stuck_worker,) = wait_for(lambda: worker_pids(runner), 30, "a worker", reconnect=True)
    blocked = enqueue_typed("procs.c_sleep", {"report": True})
    wait_for(lambda: job_row(blocked)["progress"], 20, "the handler to start", reconnect=True)
    with transaction.atomic():
        first = enqueue("procs.pid", {"sleep": 2}, priority=1).id
        second = enqueue("procs.pid", {"sleep": 2}).id
    runner.wait_line(r"recycling worker 1 .*did not return", timeout=20)
    wait_all_terminal([first, second], timeout=30)
    verify([first, second])
    for job_id in (first, second):
        assert [(a.attempt, a.outcome) for a in attempts_of([job_id])] == [(1, "completed")]
    assert [row[0] for row in _ledger_pids([first])] == [stuck_worker]
    assert stuck_worker not in [row[0] for row in _ledger_pids([second])]
    assert runner.alive


def test_a_handler_holding_the_gil_from_its_start_has_its_session_ended_at_its_timeout(
    fleet: Fleet,
) -> None:
    """The worker cannot say anything once the handler holds its GIL, yet at the timeout the
    supervisor terminates the job's session (its write never commits): the worker reported the
    session when the lane's connection opened, before the handler started. The worker itself
    is only recycled after the grace."""
    grace = 8.0
    runner = fleet.spawn(args=["--processes", "1"], concurrency=2,
                         settings={"TIMEOUT_GRACE": grace})
    (worker,) = wait_for(lambda: worker_pids(runner), 30, "a worker")
    job_id = enqueue_typed("procs.gil_at_once", {"seconds": 30})
    progress = wait_for(lambda: job_row(job_id)["progress"], 20, "the handler to start")
    started = time.monotonic()
    assert progress["pid"] == worker
    wait_for(lambda: not sql_value("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                     [progress["backend"]]), 1.0 + 2.0,
               "the session to be terminated at the timeout", interval=0.02)
    ended = time.monotonic() - started
    assert _alive(worker), "the session must end at the timeout, not when the worker is killed"
    assert ended < grace, ended
    row = wait_status(job_id, "dead_lettered", timeout=5)
    assert row["code"] == "TIMEOUT"
    assert ledger_of(job_id) == []
    runner.wait_line(r"recycling worker 1 .*did not return", timeout=grace + 5)
    wait_for(lambda: not _alive(worker), grace + 5, "the stuck worker to be killed")
    later = enqueue_jobs(3)
    wait_all_terminal(later, timeout=30)
    verify(later)
    assert runner.alive


def test_a_timed_out_attempt_returning_late_leaves_the_retry_on_its_worker_watched(
    fleet: Fleet,
) -> None:
    """Attempt 1 overruns its 2 s timeout and its thread returns at 3 s, while attempt 2 of
    the same job (retried at once) already runs on a fresh lane of the same worker. The
    late return reports attempt 1, not the job: attempt 2 is still watched, so it is timed
    out at its own deadline too and the job is dead-lettered, instead of running on
    unwatched and completing 6 s later."""
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1,
                         settings={"TIMEOUT_GRACE": 10.0, "POLL_INTERVAL": 0.1})
    wait_for(lambda: worker_pids(runner), 30, "a worker", reconnect=True)
    job_id = enqueue_typed("procs.overrun", {"seconds": {"1": 3, "2": 6}})
    wait_all_terminal([job_id], timeout=30)
    attempts = attempts_of([job_id])
    row = job_row(job_id)
    assert (row["status"], row["code"]) == ("dead_lettered", "TIMEOUT"), (row, attempts)
    assert [(a.attempt, a.outcome, a.error_code) for a in attempts] == [
        (1, "timed_out", "TIMEOUT"), (2, "timed_out", "TIMEOUT")], attempts
    # Attempt 2 started before attempt 1's thread returned: the case this is about.
    apart = sql_value("SELECT extract(epoch FROM max(started_at) - min(started_at)) "
                      "FROM persistent_jobs_attempts WHERE job_id = %s", [job_id])
    assert float(apart) < 3.0, apart
    assert ledger_of(job_id) == []
    assert runner.alive


def test_a_job_on_a_connection_opened_again_has_that_session_ended_at_its_timeout(
    fleet: Fleet,
) -> None:
    """The server dropped the lane's idle connection (here ``pg_terminate_backend``; a
    restart does the same), so the next job runs on a session opened inside ``execute``,
    after the lane had reported its old one. That job blocks in C past its timeout: the
    session it really runs on is terminated at the timeout, not when its worker is killed
    at the end of the grace."""
    grace = 20.0
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1,
                         settings={"TIMEOUT_GRACE": grace})
    (worker,) = wait_for(lambda: worker_pids(runner), 30, "a worker", reconnect=True)
    first = enqueue_typed("procs.c_sleep", {"report": True, "seconds": 0})
    wait_status(first, "completed", timeout=20)
    old = job_row(first)["progress"]["backend"]
    assert sql_value("SELECT pg_terminate_backend(%s)", [old])
    wait_for(lambda: not sql_value("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                   [old]), 5, "the lane's idle session to end", reconnect=True)
    blocked = enqueue_typed("procs.c_sleep", {"report": True})
    progress = wait_for(lambda: job_row(blocked)["progress"], 20, "the handler to start",
                        reconnect=True)
    assert progress["pid"] == worker and progress["backend"] != old
    wait_for(lambda: not sql_value("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                   [progress["backend"]]), 1.0 + 3.0,
             "the job's new session to be terminated at its timeout", interval=0.02,
             reconnect=True)
    assert _alive(worker), "the session must end at the timeout, not when the worker is killed"
    row = wait_status(blocked, "dead_lettered", timeout=5)
    assert row["code"] == "TIMEOUT"
    assert len(ledger_of(first)) == 1 and ledger_of(blocked) == []
    assert runner.alive


def test_sigkill_of_a_worker_settles_its_jobs_within_a_second_and_draining_goes_on(
    fleet: Fleet,
) -> None:
    runner = fleet.spawn(args=["--processes", "2"], concurrency=2)
    wait_for(lambda: len(worker_pids(runner)) == 2, 30, "two workers", reconnect=True)
    ids = [enqueue_typed("procs.pid", {"sleep": 6}) for _ in range(4)]

    def pids_running() -> dict[Any, int] | None:
        rows = {job_id: (job_row(job_id)["progress"] or {}).get("pid") for job_id in ids}
        return rows if all(rows.values()) else None

    where = wait_for(pids_running, 30, "four jobs running", reconnect=True)
    victim = next(iter(where.values()))
    victims = [job_id for job_id, pid in where.items() if pid == victim]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: all(job_row(j)["status"] != "running" or job_row(j)["attempts"] > 1
                         for j in victims), 5, "the dead worker's jobs to be settled",
             interval=0.02, reconnect=True)
    settled = time.monotonic() - killed
    assert settled <= 1.0, settled
    lost = [a for a in attempts_of(victims) if a.attempt == 1]
    assert {(a.outcome, a.error_code) for a in lost} == {("failed", "WORKER_LOST")}
    runner.wait_line(rf"worker \d+ \(pid {victim}\) died \(killed by signal 9\)", timeout=5)
    more = enqueue_jobs(30)
    wait_all_terminal([*ids, *more], timeout=60)
    verdict = verify([*ids, *more])
    assert verdict.statuses["completed"] == 34
    # Only the dead worker's jobs paid for its death: the other worker's ran on, first attempt.
    survivors = [job_id for job_id in ids if job_id not in victims]
    assert survivors
    assert [(a.attempt, a.outcome) for a in attempts_of(survivors)] == [
        (1, "completed")] * len(survivors)
    assert runner.alive
    assert len(worker_pids(runner)) == 2 and victim not in worker_pids(runner)


def test_a_poison_pill_that_gets_its_worker_oom_killed_is_dead_lettered(fleet: Fleet) -> None:
    runner = fleet.spawn(args=["--processes", "1"], concurrency=2)
    pill = enqueue_typed("procs.oom")
    others = enqueue_jobs(10)
    row = wait_status(pill, "dead_lettered", timeout=60)
    assert row["attempts"] == 3 and row["code"] == "WORKER_LOST"
    assert [(a.outcome, a.error_code) for a in attempts_of([pill])] == [
        ("failed", "WORKER_LOST"), ("failed", "WORKER_LOST"), ("dead_lettered", "WORKER_LOST")]
    assert ledger_of(pill) == []  # killed mid-transaction: its write never committed
    wait_all_terminal(others, timeout=60)
    verify(others)
    assert runner.alive and len(runner.find(r"runner \S+ started:")) == 1


def test_sigkill_of_the_supervisor_leaves_no_worker_running(fleet: Fleet) -> None:
    runner = fleet.spawn(args=["--processes", "2"], concurrency=2)
    wait_for(lambda: len(worker_pids(runner)) == 2, 30, "two workers", reconnect=True)
    workers = worker_pids(runner)
    job_id = enqueue_typed("procs.pid", {"sleep": 30})
    wait_for(lambda: (job_row(job_id)["progress"] or {}).get("pid"), 20, "the job to start",
             reconnect=True)
    runner.kill()
    wait_for(lambda: not any(_alive(pid) for pid in workers), 5, "the workers to die",
             reconnect=True)
    assert ledger_of(job_id) == []


def test_sigterm_lets_jobs_finish_within_the_grace_hands_back_the_rest_and_exits_zero(
    fleet: Fleet,
) -> None:
    runner = fleet.spawn(args=["--processes", "1"], concurrency=2,
                         settings={"SHUTDOWN_GRACE": 3})
    workers = wait_for(lambda: worker_pids(runner), 30, "a worker", reconnect=True)
    short = enqueue_typed("procs.pid", {"sleep": 1})
    long = enqueue_typed("procs.pid", {"sleep": 60})
    for job_id in (short, long):
        wait_for(lambda job_id=job_id: job_row(job_id)["progress"], 20, "both jobs to start",
                 reconnect=True)
    runner.send(signal.SIGTERM)
    assert runner.wait_exit(20) == 0
    assert job_row(short)["status"] == "completed"
    handed = job_row(long)
    assert handed["status"] == "pending" and handed["attempts"] == 0
    assert [a.outcome for a in attempts_of([long])] == ["interrupted"]
    assert ledger_of(long) == []
    wait_for(lambda: not any(_alive(pid) for pid in workers), 5, "the workers to exit",
             reconnect=True)


def test_a_second_signal_stops_at_once(fleet: Fleet) -> None:
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1,
                         settings={"SHUTDOWN_GRACE": 60})
    workers = wait_for(lambda: worker_pids(runner), 30, "a worker", reconnect=True)
    job_id = enqueue_typed("procs.pid", {"sleep": 60})
    wait_for(lambda: job_row(job_id)["progress"], 20, "the job to start", reconnect=True)
    runner.send(signal.SIGTERM)
    runner.wait_line("stopping", timeout=10)
    runner.send(signal.SIGTERM)
    assert runner.wait_exit(15) == 1
    assert job_row(job_id)["status"] == "pending"
    wait_for(lambda: not any(_alive(pid) for pid in workers), 5, "the workers to exit",
             reconnect=True)


def test_prefetched_jobs_outlive_a_worker(fleet: Fleet) -> None:
    """``PREFETCH`` with worker processes: of the jobs claimed ahead, one waits in the worker's
    own queue (``PREFETCH`` 2 lets a worker of one lane hold one job beyond it) and one in the
    supervisor. A worker that dies takes only the job it was running: the one in its queue had
    not started, and another worker runs it, uncharged."""
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1, settings={"PREFETCH": 2})
    (worker,) = wait_for(lambda: worker_pids(runner), 30, "a worker")
    first = enqueue_typed("procs.pid", {"sleep": 60})
    wait_for(lambda: job_row(first)["progress"], 20, "the first job to start")
    waiting = [enqueue_typed("procs.pid") for _ in range(2)]
    wait_for(lambda: all(job_row(j)["status"] == "running" for j in waiting), 20,
               "two more jobs claimed ahead")
    assert all(job_row(j)["progress"] is None for j in waiting)  # claimed, not started
    os.kill(worker, signal.SIGKILL)
    wait_all_terminal([first, *waiting], timeout=60)
    verify([first, *waiting])
    assert [(a.attempt, a.outcome, a.error_code) for a in attempts_of([first])] == [
        (1, "failed", "WORKER_LOST"), (2, "completed", "")]
    for job_id in waiting:
        assert [(a.attempt, a.outcome) for a in attempts_of([job_id])] == [(1, "completed")]
    assert worker not in worker_pids(runner) and runner.alive


@pytest.mark.parametrize("prefetch", [1, 2], ids=["waits-in-supervisor", "waits-in-worker"])
def test_a_job_that_waits_for_a_lane_starts_its_timeout_clock_when_it_starts(
        fleet: Fleet, prefetch: int) -> None:
    """Claimed together with a job that runs for 3 s, a job with a 1 s timeout waits for the
    only lane without running down its timeout: the clock starts when a lane starts it (the
    lane's ``STARTED``), whether the job waited in the supervisor or in the worker's queue."""
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1,
                         settings={"PREFETCH": prefetch})
    wait_for(lambda: worker_pids(runner), 30, "a worker")
    with transaction.atomic():  # one claim takes both
        first = enqueue("procs.pid", {"sleep": 3, "every": True}, priority=1).id
        second = enqueue("procs.pid", {}, timeout=1).id
    wait_all_terminal([first, second], timeout=30)
    verify([first, second])
    for job_id in (first, second):
        assert [(a.attempt, a.outcome) for a in attempts_of([job_id])] == [(1, "completed")]
    assert runner.alive


def _stop_with_jobs_waiting(fleet: Fleet, grace: float) -> tuple[Any, list[Any], list[int]]:
    """A runner of one single-lane worker running a long job, two more claimed ahead (one in
    the worker's queue, one in the supervisor), stopped by SIGTERM with ``grace``: the running
    job, the waiting ones, the worker pids."""
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1,
                         settings={"PREFETCH": 2, "SHUTDOWN_GRACE": grace})
    workers = wait_for(lambda: worker_pids(runner), 30, "a worker")
    running = enqueue_typed("procs.pid", {"sleep": 60})
    wait_for(lambda: job_row(running)["progress"], 20, "the first job to start")
    waiting = [enqueue_typed("procs.pid") for _ in range(2)]
    wait_for(lambda: all(job_row(j)["status"] == "running" for j in waiting), 20,
             "two more jobs claimed ahead")
    runner.send(signal.SIGTERM)
    assert runner.wait_exit(20) == 0
    return running, waiting, workers


def test_prefetched_jobs_are_handed_back_unstarted_at_shutdown(fleet: Fleet) -> None:
    running, waiting, workers = _stop_with_jobs_waiting(fleet, grace=2)
    for job_id in (running, *waiting):
        row = job_row(job_id)
        assert (row["status"], row["attempts"]) == ("pending", 0), row
        assert [a.outcome for a in attempts_of([job_id])] == ["interrupted"]
        assert ledger_of(job_id) == []
    assert all(job_row(j)["progress"] is None for j in waiting)  # never started
    wait_for(lambda: not any(_alive(pid) for pid in workers), 5, "the workers to exit")


def test_a_stop_without_grace_still_releases_worker_queued_jobs_as_unstarted(
    fleet: Fleet,
) -> None:
    """``SHUTDOWN_GRACE`` 0: the running job is handed back at once (a hand-back counted), the
    jobs waiting in the worker's queue and in the supervisor are released as never started (no
    hand-back counted, no attempt), and none of them starts during the stop."""
    running, waiting, workers = _stop_with_jobs_waiting(fleet, grace=0)

    def handbacks(job_id: Any) -> int:
        return int(sql_value("SELECT handbacks FROM persistent_jobs WHERE id = %s", [job_id]))

    assert (job_row(running)["status"], handbacks(running)) == ("pending", 1)
    for job_id in waiting:
        row = job_row(job_id)
        assert (row["status"], row["attempts"], handbacks(job_id)) == ("pending", 0, 0), row
        assert row["progress"] is None  # never started
    wait_for(lambda: not any(_alive(pid) for pid in workers), 5, "the workers to exit")


def test_workers_are_recycled_after_max_jobs_and_max_memory(fleet: Fleet) -> None:
    runner = fleet.spawn(args=["--processes", "1"], concurrency=2,
                         settings={"MAX_JOBS_PER_WORKER": 5})
    # Jobs long enough to be running when their worker reaches its limit: a graceful recycle
    # lets them finish there, first attempt (a worker killed at once would have them charged
    # ``WORKER_LOST`` and run again).
    ids = enqueue_jobs(20, {"sleep": 0.2})
    wait_all_terminal(ids, timeout=90)
    verify(ids)
    assert len(_ledger_pids(ids)) >= 4  # 5 jobs per process, at most
    assert runner.find("MAX_JOBS_PER_WORKER")
    assert sql_value("SELECT max(attempts) FROM persistent_jobs WHERE id = ANY(%s)", [ids]) == 1
    assert not runner.find("died")
    # A replacement worker is the supervisor's like the first: a shutdown gives its job the
    # grace period (it is not killed when the claim loop stops).
    last = enqueue_typed("procs.pid", {"sleep": 1.5})
    wait_for(lambda: job_row(last)["progress"], 20, "the job to start", reconnect=True)
    runner.send(signal.SIGTERM)
    assert runner.wait_exit(20) == 0
    assert job_row(last)["status"] == "completed"
    assert [(a.attempt, a.outcome) for a in attempts_of([last])] == [(1, "completed")]

    hungry = fleet.spawn(args=["--processes", "1"], concurrency=1,
                         settings={"MAX_MEMORY_PER_WORKER": 1})  # every worker is over 1 MiB
    # A fresh worker is over the limit before it ran anything: replacing it cannot help, so it
    # stays, and the runner says the limit is too low (once), instead of starting a process a
    # second forever.
    hungry.wait_line("MAX_MEMORY_PER_WORKER .* is below", timeout=30)
    first_worker = worker_pids(hungry)
    assert not hungry.find("exceeds MAX_MEMORY_PER_WORKER")
    # Once it has run jobs it is recycled (each one over the limit after its job), gracefully.
    more = enqueue_jobs(5, {"sleep": 1.5})
    wait_all_terminal(more, timeout=90)
    verify(more)
    hungry.wait_line("exceeds MAX_MEMORY_PER_WORKER", timeout=30)
    assert worker_pids(hungry) != first_worker
    assert sql_value("SELECT max(attempts) FROM persistent_jobs WHERE id = ANY(%s)", [more]) == 1
    assert len(hungry.find("is below")) == 1


def test_cancel_reaches_a_handler_in_a_worker(fleet: Fleet) -> None:
    runner = fleet.spawn(args=["--processes", "1"], concurrency=2)
    job_id = enqueue_typed("procs.pid", {"sleep": 60})
    wait_for(lambda: job_row(job_id)["progress"], 20, "the job to start", reconnect=True)
    started = time.monotonic()
    cancel_job(job_id)
    wait_status(job_id, "cancelled", timeout=10)
    assert time.monotonic() - started < 5  # the handler saw it, long before its 60 s
    assert ledger_of(job_id) == []
    assert runner.alive


def test_async_handlers_run_to_completion_in_a_worker(fleet: Fleet) -> None:
    runner = fleet.spawn(args=["--processes", "1"], concurrency=2)
    ids = [enqueue_typed("procs.async", {"n": i}) for i in range(5)]
    wait_all_terminal(ids, timeout=30)
    verify(ids)
    pids = {row[0] for row in _ledger_pids(ids)}
    assert pids and runner.pid not in pids and pids <= set(worker_pids(runner))


def test_a_segfaulting_handler_costs_its_attempts_not_the_runner(fleet: Fleet) -> None:
    runner = fleet.spawn(args=["--processes", "1"], concurrency=1)
    job_id = enqueue_typed("procs.segfault")
    row = wait_status(job_id, "dead_lettered", timeout=60)
    assert (row["attempts"], row["code"]) == (2, "WORKER_LOST")
    runner.wait_line(r"died \(killed by signal 11\)", timeout=5)
    assert ledger_of(job_id) == []
    after = enqueue_jobs(5)
    wait_all_terminal(after, timeout=30)
    verify(after)
    assert runner.alive
