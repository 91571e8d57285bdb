"""Nothing a handler does can fool liveness or stall the runner (invariant 11), and a runner's
identity is its own (invariant 6 with operator-chosen names).

* a handler holding another running job's row lock cannot stop timeouts from being enforced;
* a rescue that cannot take a frozen runner's row lock does not stall the rescuer's heartbeat
  or its claims;
* a handler holding the GIL for several stale-lock timeouts does not get its live runner
  declared dead;
* two live runners given the same name get their own identities, and a dead twin's jobs are
  rescued by the other.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction

from django_persistent_jobs import enqueue

from .harness import (
    PROCESSES,
    STALE,
    Fleet,
    backends,
    job_row,
    ledger_of,
    report,
    sql,
    sql_value,
    verify,
    wait_for,
    wait_status,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(180)]

PROBE = "liveness.probe"


def probe(payload: dict[str, Any], **options: Any) -> Any:
    with transaction.atomic():
        return enqueue(PROBE, payload, **options).id


def attempts(job_id: Any) -> list[tuple[int, str, str, str, float]]:
    """``(attempt, runner, outcome, code, seconds)`` of each attempt, oldest first."""
    return [(a, r, o, c, float(d or 0)) for a, r, o, c, d in sql(
        "SELECT attempt, runner_id, outcome, error_code, extract(epoch FROM duration) "
        "FROM persistent_jobs_attempts WHERE job_id = %s ORDER BY id", [job_id])]


def heartbeat_age(runner_id: str) -> float | None:
    age = sql_value("SELECT extract(epoch FROM now() - heartbeat_at) FROM "
                    "persistent_jobs_runners WHERE id = %s", [runner_id])
    return None if age is None else float(age)


def test_a_row_lock_held_by_a_handler_does_not_stop_timeouts(fleet: Fleet) -> None:
    runner = fleet.spawn("locks", concurrency=2)
    victim = probe({"sleep": 60, "upto": 1}, timeout=3)
    wait_status(victim, "running")
    # The holder cancels the victim inside its own transaction, so it holds the victim's row
    # lock until that transaction ends; the victim's timeout comes first, the holder's later.
    holder = probe({"cancel": str(victim), "sleep": 40, "upto": 1}, timeout=6)
    wait_status(holder, "running")
    wait_status(holder, ("failed", "pending", "completed"), timeout=6 + 10)
    first = attempts(holder)[0]
    assert first[2:4] == ("timed_out", "TIMEOUT"), attempts(holder)
    assert first[4] < 6 + 4, f"timeout enforced only after {first[4]:.1f}s"
    for job in (victim, holder):
        wait_status(job, "completed", timeout=20)
        assert [(a, o, c) for a, _, o, c, _ in attempts(job)] == [
            (1, "timed_out", "TIMEOUT"), (2, "completed", "")]
        assert ledger_of(job) == [(2, runner.runner_id)]  # attempt 1's writes rolled back
    assert runner.alive
    runner.send(signal.SIGTERM)
    assert runner.wait_exit(15) == 0
    report("row_lock_timeouts", holder_timeout_s=round(first[4], 1),
           victim_timeout_s=round(attempts(victim)[0][4], 1))


def test_a_rescue_blocked_by_a_row_lock_stalls_neither_heartbeat_nor_claims(
    fleet: Fleet,
) -> None:
    frozen = fleet.spawn("frozen", concurrency=1)
    job = probe({"lock_self": True, "sleep": 120, "upto": 1}, timeout=600)
    assert wait_status(job, "running")["locked_by"] == frozen.runner_id
    wait_for(lambda: backends("frozen", "state = 'idle in transaction'"), timeout=15,
             message="the handler to hold its own job's row lock", reconnect=True)
    rescuer = fleet.spawn("rescuer", concurrency=2)
    frozen.send(signal.SIGSTOP)
    # The rescuer declares the frozen runner dead, then cannot take the job's row: the frozen
    # process's open transaction holds it.
    rescuer.wait_line(rf"runner {frozen.runner_id} presumed dead", timeout=3 * STALE + 20)
    worst = 0.0
    quick = probe({}, timeout=30)
    window_end = time.monotonic() + 3 * STALE
    while time.monotonic() < window_end:
        age = heartbeat_age(rescuer.runner_id)
        assert age is not None, "the live rescuer was declared dead"
        worst = max(worst, age)
        time.sleep(0.1)
    assert worst < STALE, f"the rescuer's heartbeat went {worst:.1f}s stale"
    assert job_row(quick)["status"] == "completed"  # it went on claiming
    assert job_row(job)["status"] == "running"
    frozen.kill()  # its connection closes; the row lock goes with it
    wait_status(job, "completed", timeout=STALE + 20)
    assert [(a, r, o, c) for a, r, o, c, _ in attempts(job)] == [
        (1, frozen.runner_id, "rescued", "RUNNER_LOST"),
        (2, rescuer.runner_id, "completed", "")]
    assert not rescuer.find(r"presumed dead by another runner")
    verify([job, quick])
    report("blocked_rescue", rescuer_worst_heartbeat_age_s=round(worst, 2))


@pytest.mark.parametrize("how", [
    "gil",
    # Computing in C for 5 stale-lock timeouts matters to a runner whose heartbeat
    # shares the handler's interpreter. With worker processes it does not: the supervisor's
    # heartbeat is in another process (test_worker_processes.py holds a worker's GIL for 3
    # stale-lock timeouts).
    pytest.param("gil_cpu", marks=pytest.mark.skipif(
        PROCESSES != "0", reason="threads only: a worker process's GIL is not the runner's")),
])
def test_a_handler_holding_the_gil_does_not_get_its_live_runner_declared_dead(
    fleet: Fleet, how: str,
) -> None:
    # The watcher reaps and rescues throughout; the owner alone serves the job's queue.
    # ``gil`` blocks in a C call (exactly ``hold`` seconds), ``gil_cpu`` computes in one (at
    # least ``hold`` seconds: its length is calibrated and lengthened until one call lasts
    # that long).
    watcher = fleet.spawn("watcher", concurrency=1, args=["--queues", "default"])
    owner = fleet.spawn("owner", concurrency=1, args=["--queues", "gil"])
    hold = 5 * STALE
    job = probe({how: hold}, timeout=120, queue="gil")
    row = wait_status(job, ("completed", "dead_lettered"), timeout=4 * hold + 30)
    assert row["status"] == "completed"
    assert [(a, r, o, c) for a, r, o, c, _ in attempts(job)] == [
        (1, owner.runner_id, "completed", "")]
    stall = row["progress"]["gil_stall"]
    assert stall >= 3 * STALE, f"the handler held the GIL for only {stall}s"
    assert ledger_of(job) == [(1, owner.runner_id)]
    assert not owner.find(r"presumed dead by another runner")
    assert not watcher.find(r"presumed dead") and not watcher.find(r"rescued from runner")
    verify([job])
    report("gil_holder", gil_stall_s=stall, stale_lock_timeout=STALE)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


TWIN = (
    "import sys; from django_persistent_jobs.runner import Runner; "
    "sys.exit(Runner(runner_id='twin', concurrency=2, scheduler=False)"
    ".run(install_signal_handlers=True))"
)


def test_two_live_runners_with_one_name_have_their_own_identities(fleet: Fleet) -> None:
    first = fleet.spawn("twin1", command=["shell", "-c", TWIN])
    job = probe({"sleep": 120, "upto": 1}, timeout=600)
    assert wait_status(job, "running")["locked_by"] == first.runner_id
    second = fleet.spawn("twin2", command=["shell", "-c", TWIN])
    assert first.runner_id and second.runner_id and first.runner_id != second.runner_id
    assert first.runner_id.startswith("twin") and second.runner_id.startswith("twin")
    second.wait_line(rf"another live runner named 'twin' \({first.runner_id},")
    rows = sql("SELECT id, name FROM persistent_jobs_runners WHERE id = ANY(%s) ORDER BY id",
               [[first.runner_id, second.runner_id]])
    assert sorted(rows) == sorted([(first.runner_id, "twin"), (second.runner_id, "twin")])
    # Neither the second twin's start-up nor anybody's rescue takes the first twin's live job,
    # over a stretch in which the second twin has long been allowed to reap.
    up_since = time.monotonic()
    while time.monotonic() - up_since < 3 * STALE:
        current = job_row(job)
        assert (current["status"], current["attempts"], current["locked_by"]) == (
            "running", 1, first.runner_id), current
        time.sleep(0.2)
    sidecars = _children(first.pid)
    assert sidecars, "the runner has no liveness sidecar"
    first.kill()
    killed_at = time.monotonic()
    # The dead twin's sidecar follows it at once instead of vouching for a dead runner.
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and
                             "Z" not in _state(pid) for pid in sidecars),
             timeout=10, message="the killed runner's sidecar to exit", reconnect=True)
    wait_status(job, "completed", timeout=2 * STALE + 20)
    assert [(a, r, o, c) for a, r, o, c, _ in attempts(job)] == [
        (1, first.runner_id, "rescued", "RUNNER_LOST"),
        (2, second.runner_id, "completed", "")]
    verify([job])
    assert second.alive
    report("twins", rescued_after_s=round(time.monotonic() - killed_at, 1))
