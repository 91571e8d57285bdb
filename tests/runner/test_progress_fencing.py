"""Progress is written for the attempt that reports it. A timed-out attempt whose code goes on
(a ``finally``, a thread of its own) while the job's retry already runs on the same runner
must not write over the retry's progress: both executors fence it by the reporting attempt's
own token, not by the job's current one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from django_persistent_jobs import enqueue
from django_persistent_jobs.models import JobStatus
from django_persistent_jobs.runner import Runner
from tests.core_support import subprocess_env, wait_for
from tests.runner_support import get_job, wait_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(90)]


@pytest.mark.parametrize("processes", [0, 1])
def test_a_timed_out_attempts_late_progress_does_not_overwrite_its_retrys(
    start_runner: Callable[..., Runner], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    processes: int,
) -> None:
    for name, value in subprocess_env().items():  # worker processes use the test database
        monkeypatch.setenv(name, value)
    returned, gate = tmp_path / "returned", tmp_path / "gate"
    start_runner(concurrency=2, processes=processes, poll_interval=0.1)
    job = enqueue("procs.late_progress", {"returned": str(returned), "gate": str(gate)})
    try:
        wait_for(lambda: get_job(job.id).attempts == 2 and get_job(job.id).progress == {
            "attempt": 2}, timeout=30, message="the retry to run and report its progress")
        wait_for(returned.exists, timeout=30, message="the timed-out attempt to return")
        assert get_job(job.id).progress == {"attempt": 2}
    finally:
        gate.touch()
    done = wait_status(job.id, JobStatus.COMPLETED, timeout=30)
    assert done.attempts == 2
