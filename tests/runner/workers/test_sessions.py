"""The supervisor's record of the database session each lane of a worker runs on: the session
a timeout terminates. Bookkeeping only, no processes and no database; the timeouts themselves
are exercised with real worker processes in ``tests/faults/test_worker_processes.py``."""

from __future__ import annotations

from typing import Any, cast

from django_persistent_jobs.runner.execute import InFlight
from django_persistent_jobs.runner.workers.manager import ProcessExecutor, WorkerHandle


def test_a_lanes_older_session_report_read_late_does_not_replace_a_newer_one() -> None:
    """A lane reports its session on the message pipe before a job, and on the start log when
    the job found the connection closed and opened another. The supervisor reads the pipe,
    then the log, then handles what the pipe held: the older report can come second, and
    must not make a timeout terminate the dead session instead of the job's."""
    executor = ProcessExecutor(1, 1, alias="default", runner_id="r-test",
                               on_lost=lambda item, why: None)
    worker = WorkerHandle(number=1, process=cast(Any, None), conn=None)
    item = InFlight(job=cast(Any, None), ctx=cast(Any, None), deadline=None)
    worker.in_flight[7] = item
    worker.lane_of[7] = 0
    with executor.lock:
        executor._session_locked(worker, 0, 2, 222, "new")  # from the start log
        executor._session_locked(worker, 0, 1, 111, "old")  # from the pipe, handled after
    assert (item.backend_pid, item.backend_start) == (222, "new")
    assert worker.sessions[0] == (222, "new")
    with executor.lock:
        executor._session_locked(worker, 0, 3, 333, "next")  # the lane's next connection
    assert (item.backend_pid, worker.sessions[0]) == (333, (333, "next"))
