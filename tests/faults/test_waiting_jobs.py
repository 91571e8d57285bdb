"""Scenario 12: jobs claimed to wait for a free worker (``PREFETCH``) when their runner is lost.

A runner claims more jobs than it has idle workers: the extras wait in it, recorded as waiting
(their attempt not started), and a worker records a waiting job's start before running it.
Those jobs never ran, so:

* The runner is SIGKILLed: its lease (an advisory lock held by its LISTEN session) goes with its
  session, and a live runner hands the waiting jobs back, neither charged nor counted, within a
  couple of seconds, long before the stale-lock timeout that still governs the job the dead
  runner had started (that one is rescued and charged, as before). Each waiting job then runs
  exactly once.
* The runner is frozen and its LISTEN session is terminated (as if it were cut off from the
  server): its lease lapses and a live runner hands its waiting jobs back, which another runner
  then runs. Thawed, the frozen runner goes on with the jobs it still holds in memory: each is
  refused at its start (the hand-back got there first), so every job runs exactly once.

And (D) when their runner lives: a waiting job that starts and settles before any claim writes
its start has the start written by the statement that settles it, so its attempt says when it
ran, not when it was claimed.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from django_persistent_jobs import enqueue_many
from django_persistent_jobs.runner import store

from .batch_handlers import runs_of
from .harness import (
    Fleet,
    RunnerProcess,
    attempts_of,
    report,
    sql,
    status_counts,
    terminate,
    wait_all_terminal,
    wait_for,
)
from .runners import PROCESSES

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(120)]

STALE = 10.0
SETTINGS = {"STALE_LOCK_TIMEOUT": STALE, "HEARTBEAT_INTERVAL": 1.0}
WAITING = 3
LEEWAY = timedelta(seconds=0.5)



def _flags(ids: list[str]) -> dict[str, bool]:
    """Whether each job's current attempt is recorded as started."""
    return dict(sql("SELECT j.id::text, a.started FROM persistent_jobs j JOIN "
                    "persistent_jobs_attempts a ON a.id = j.lock_token WHERE j.id = ANY(%s)",
                    [ids]))


def _until_it_reaps(runner: RunnerProcess) -> int:
    """A runner hands back others' jobs only once it has beaten without a gap for a whole
    stale-lock timeout (see heartbeat.py), and says so: wait for that line rather than for a
    stale-lock timeout of wall time, since a slow beat on a loaded machine restarts the count.
    Returns a log mark for ``_handed_back``."""
    match = runner.wait_line(r"it now reaps runners whose heartbeat is stale", timeout=3 * STALE)
    with runner.cond:  # (the position of that line: a gap logged right after it counts too)
        return runner.lines.index(match.string)


def _handed_back(waiting: list[str], rescuer: RunnerProcess, since: int, timeout: float) -> None:
    """Wait for ``rescuer`` to hand the waiting jobs back. If it does not, say whether a
    heartbeat gap (a loaded machine) took its right to rescue away meanwhile: that is the
    documented, conservative behaviour, not the bug this scenario looks for."""
    try:
        wait_for(lambda: status_counts(waiting) == {"pending": WAITING}, timeout,
                 "the waiting jobs to be handed back", reconnect=True)
    except AssertionError as exc:
        gaps = [match.string for match in rescuer.find(r"between two heartbeats", since=since)]
        raise AssertionError(f"{exc}; heartbeat gaps of the rescuer since it could reap: "
                             f"{gaps or 'none'}") from exc


def _claim_with_waiting(fleet: Fleet, tmp_path: Path, name: str, linger: float = 0.0
                        ) -> tuple[RunnerProcess, list[str], Path, Path]:
    """A runner with one worker slot and room for ``WAITING`` more: it starts one job (held
    at a gate, and ``linger`` seconds after it opens) and holds the others waiting."""
    runs, gate = tmp_path / "runs", tmp_path / "gate"
    runner = fleet.spawn(name, concurrency=1, settings={**SETTINGS, "PREFETCH": WAITING},
                         args=["--queues", "held"])
    ids = [str(job.id) for job in enqueue_many(
        [("faults.solo", {"runs": str(runs), "gate": str(gate), "n": i, "linger": linger})
         for i in range(WAITING + 1)], queue="held")]
    wait_for(lambda: status_counts(ids) == {"running": WAITING + 1} and len(runs_of(runs)) == 1,
             20, "one job started and the others waiting", reconnect=True)
    return runner, ids, runs, gate


def test_a_killed_runners_waiting_jobs_are_handed_back_uncharged_before_the_stale_timeout(
    fleet: Fleet, tmp_path: Path,
) -> None:
    survivor = fleet.spawn("survivor", settings=SETTINGS, args=["--queues", "default"])
    victim, ids, runs, gate = _claim_with_waiting(fleet, tmp_path, "victim")
    (started,) = runs_of(runs)
    waiting = [job_id for job_id in ids if job_id != started]
    assert _flags(ids) == {started: True, **{job_id: False for job_id in waiting}}
    since = _until_it_reaps(survivor)

    victim.kill()
    killed = time.monotonic()
    _handed_back(waiting, survivor, since, STALE)
    handed_back_after = time.monotonic() - killed
    assert handed_back_after < STALE / 2, handed_back_after
    assert status_counts([started]) == {"running": 1}  # started: its heartbeat decides
    rows = sql("SELECT attempts, handbacks, last_error_code FROM persistent_jobs "
               "WHERE id = ANY(%s)", [waiting])
    assert rows == [(0, 1, "RUNNER_LOST")] * WAITING  # not charged

    gate.touch()
    finisher = fleet.spawn("finisher", settings=SETTINGS, args=["--queues", "held"])
    wait_all_terminal(ids, timeout=STALE + 20)
    assert status_counts(ids) == {"completed": WAITING + 1}
    history: dict[str, list[tuple[int, str, str, str]]] = {}
    for attempt in attempts_of(ids):
        history.setdefault(str(attempt.job_id), []).append(
            (attempt.attempt, attempt.runner_id, attempt.outcome, attempt.error_code))
    assert history[started] == [(1, victim.runner_id, "rescued", "RUNNER_LOST"),
                                (2, finisher.runner_id, "completed", "")]
    for job_id in waiting:
        assert history[job_id] == [(1, victim.runner_id, "interrupted", "RUNNER_LOST"),
                                   (1, finisher.runner_id, "completed", "")]
    runs_by_job = runs_of(runs)
    assert runs_by_job == {started: 2, **{job_id: 1 for job_id in waiting}}
    report("waiting_jobs_of_killed_runner", waiting=WAITING,
           handed_back_after_s=round(handed_back_after, 2), stale_lock_timeout_s=STALE)


def test_a_frozen_runner_whose_lease_lapsed_does_not_start_the_jobs_handed_back(
    fleet: Fleet, tmp_path: Path,
) -> None:
    watcher = fleet.spawn("watcher", settings=SETTINGS, args=["--queues", "default"])
    frozen, ids, runs, gate = _claim_with_waiting(fleet, tmp_path, "frozen")
    (started,) = runs_of(runs)
    waiting = [job_id for job_id in ids if job_id != started]
    since = _until_it_reaps(watcher)

    # Frozen (SIGSTOP) with its lease gone: as a runner cut off from the server would be.
    with frozen.frozen() as thaw:
        (holder,) = sql("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                        "AND classid = %s AND objid = (hashtext(%s)::bigint & 4294967295)"
                        "::text::oid", [store.LEASE_NAMESPACE, frozen.runner_id])
        assert terminate(holder[0])
        _handed_back(waiting, watcher, since, STALE / 2)
        assert status_counts([started]) == {"running": 1}  # its heartbeat is not stale yet
        gate.touch()
        finisher = fleet.spawn("finisher", settings=SETTINGS, args=["--queues", "held"])
        wait_all_terminal(waiting, timeout=20)
        mark = thaw()
    # Thawed, it goes on with its buffer: each waiting job is refused at its start.
    frozen.wait_line(r"not started, it was handed back while it waited", since=mark,
                     count=WAITING)
    wait_all_terminal(ids, timeout=20)
    assert status_counts(ids) == {"completed": WAITING + 1}
    assert runs_of(runs) == {job_id: 1 for job_id in ids}  # every job ran exactly once
    for attempt in attempts_of(waiting):
        assert (attempt.runner_id, attempt.outcome, attempt.error_code) in {
            (frozen.runner_id, "interrupted", "RUNNER_LOST"),
            (finisher.runner_id, "completed", "")}, attempt
    rows = sql("SELECT attempts, handbacks FROM persistent_jobs WHERE id = ANY(%s)", [waiting])
    assert rows == [(1, 1)] * WAITING  # charged once: the run that completed


def test_a_runner_frozen_until_reaped_does_not_start_the_jobs_handed_back(
    fleet: Fleet, tmp_path: Path,
) -> None:
    """Frozen past the stale-lock timeout with its LISTEN session intact, so it still holds its
    lease: another runner reaps it (its heartbeat is stale) and hands its waiting jobs back
    anyway. Thawed, its session is heard from at once, in the same period of the lease, but
    its last heartbeat no longer keeps its row safe: each waiting job goes through the gate and
    is refused, never started a second time."""
    watcher = fleet.spawn("watcher", settings=SETTINGS, args=["--queues", "default"])
    # The started job returns half a second after the thaw: by then the LISTEN session has been
    # heard from again, so only the heartbeat's word keeps the next jobs off the fast path.
    frozen, ids, runs, gate = _claim_with_waiting(fleet, tmp_path, "reaped", linger=0.5)
    (started,) = runs_of(runs)
    waiting = [job_id for job_id in ids if job_id != started]
    since = _until_it_reaps(watcher)

    with frozen.frozen() as thaw:
        # Its lease stays held (the session is alive): only the reap hands these back.
        wait_for(lambda: status_counts(ids) != {"running": WAITING + 1}, 2 * STALE + 10,
                 "the watcher to reap the frozen runner", reconnect=True)
        _handed_back(waiting, watcher, since, 10)
        gate.touch()
        finisher = fleet.spawn("finisher", settings=SETTINGS, args=["--queues", "held"])
        wait_all_terminal(ids, timeout=30)
        mark = thaw()
    frozen.wait_line(r"not started, it was handed back while it waited", since=mark,
                     count=WAITING)
    frozen.wait_line(r"has registered again", since=mark)
    assert status_counts(ids) == {"completed": WAITING + 1}
    # The waiting jobs ran once each, on the finisher; the started one ran on the frozen runner
    # (its completion refused) and again on the finisher after its rescue.
    assert runs_of(runs) == {started: 2, **{job_id: 1 for job_id in waiting}}
    for attempt in attempts_of(waiting):
        assert attempt.runner_id in {frozen.runner_id, finisher.runner_id}, attempt
        if attempt.runner_id == finisher.runner_id:
            assert attempt.outcome == "completed", attempt
        else:
            assert attempt.outcome != "completed", attempt



def test_attempts_that_waited_for_a_worker_record_when_they_ran_not_when_they_were_claimed(
        fleet: Fleet, tmp_path: Path) -> None:
    """Jobs claimed together behind a 1.5-second job on the only worker slot wait for it, then
    start one after the other on the fast path (their starts noted, for a later claim to
    write) and settle at once. With ``PREFETCH`` jobs waiting, the claim loop waits for half
    of them to leave before it claims again, so most of them settle before any claim writes
    their start. The settling statement records the start itself, whichever way the job
    settles: completed in its handler's transaction (a handler that ran SQL), completed in a
    batch (one that ran none), or failed. So every attempt is started, and its ``started_at``
    and ``duration`` are its run's, not the time it waited after its claim."""
    if int(PROCESSES) > 1:
        pytest.skip("one worker slot: with more worker processes the jobs would not wait")
    count = 12
    runner = fleet.spawn(concurrency=1, settings={**SETTINGS, "PREFETCH": count},
                         args=["--queues", "timed"])
    kinds = [("faults.ledger", {}, "completed"),  # SQL in its handler: completed in its transaction
             ("faults.solo", {"runs": str(tmp_path / "runs")}, "completed"),  # none: batched
             ("faults.ledger", {"fail": True, "upto": 1}, "failed")]  # fails once, then completes
    plan = [kinds[i % len(kinds)] for i in range(count)]
    blocker, *waiting = [str(job.id) for job in enqueue_many(
        [("faults.ledger", {"work": 1.5})]  # (enqueued first: claimed first, runs at once)
        + [(job_type, payload) for job_type, payload, _ in plan], queue="timed")]
    wait_all_terminal([blocker, *waiting], timeout=30)
    rows = sql("SELECT job_id::text, attempt, outcome, started, started_at, duration "
               "FROM persistent_jobs_attempts WHERE job_id = ANY(%s::uuid[])",
               [[blocker, *waiting]])
    first = {job_id: (outcome, started, started_at, duration)
             for job_id, attempt, outcome, started, started_at, duration in rows if attempt == 1}
    _, _, blocker_start, blocker_took = first[blocker]
    assert blocker_took.total_seconds() >= 1.5
    wrong = []
    for job_id, (_, _, expected) in zip(waiting, plan, strict=True):
        outcome, started, started_at, duration = first[job_id]
        # Started after the blocker ran, and its duration is not the wait: measured from its
        # claim it would be longer than the blocker's run. (Half a second of slack for a
        # database that stalls a commit on a loaded machine.)
        if not (outcome == expected and started and duration < blocker_took - LEEWAY
                and started_at >= blocker_start + blocker_took * 0.9):
            wrong.append((job_id, expected, outcome, started, started_at, duration))
    assert not wrong, (f"attempts recorded wrongly (the blocker ran from {blocker_start} for "
                       f"{blocker_took}): {wrong}")
    assert runner.alive
