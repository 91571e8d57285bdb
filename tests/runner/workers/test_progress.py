"""``ctx.report_progress`` is advisory in worker processes as on threads: a job row locked by
another session does not hold the handler up."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from django_persistent_jobs import Runner, enqueue
from django_persistent_jobs.models import JobStatus, PersistentJob
from tests.core_support import raw_connection, subprocess_env, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.mark.parametrize("processes", [0, 1])
def test_progress_gives_up_on_a_row_lock_instead_of_waiting_for_it(
    start_runner: Callable[..., Runner], tmp_path: Path, processes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another session holds the running job's row lock (an operator's long transaction, a
    lock taken by hand): the handler's ``report_progress`` gives up within about a second and
    the handler goes on. In worker processes it waited for the lock, up to the job's timeout."""
    for name, value in subprocess_env().items():  # worker processes use the test database
        monkeypatch.setenv(name, value)
    mark, go = tmp_path / "mark", tmp_path / "go"
    job = enqueue("test.progress_mark", {"mark": str(mark), "go": str(go)})
    start_runner(concurrency=1, processes=processes, liveness_sidecar=False)
    wait_for(lambda: PersistentJob.objects.get(id=job.id).status == JobStatus.RUNNING,
             timeout=30, message="the job to run")
    with raw_connection(autocommit=False) as conn:
        conn.execute("SELECT 1 FROM persistent_jobs WHERE id = %s FOR UPDATE", [job.id])
        go.write_text("go")
        started = time.monotonic()
        try:
            wait_for(mark.exists, timeout=8, message="the handler to get past report_progress")
            assert time.monotonic() - started < 5
        finally:
            conn.rollback()
    done = wait_for(lambda: PersistentJob.objects.filter(
        id=job.id, status=JobStatus.COMPLETED).first(), timeout=30, message="completion")
    assert done.progress is None  # skipped, not written late
