"""A job an operator cancels while it waits for a worker (claimed, not started yet) never
starts: it ends ``cancelled`` (``CANCELLED``) without its handler running. Cancelling running
work is cooperative (the handler decides where to stop); work that has not begun is not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from django_persistent_jobs import cancel_job
from django_persistent_jobs.models import JobStatus
from django_persistent_jobs.runner import Runner
from tests.core_support import wait_for
from tests.faults.batch_handlers import runs_of
from tests.runner_support import a_job_waiting_behind_another, attempts_of, wait_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(90)]


@pytest.mark.parametrize("processes", [0, 1])
def test_a_job_cancelled_while_it_waits_for_a_worker_never_starts(
    start_runner: Callable[..., Runner], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    settings: Any, processes: int,
) -> None:
    runs = tmp_path / "waiting-runs"
    runner, waiting, _, open_gate = a_job_waiting_behind_another(
        start_runner, tmp_path, monkeypatch, settings, processes, job_type="faults.solo",
        payload={"runs": str(runs)})
    assert cancel_job(waiting.id).cancel_requested
    wait_for(lambda: any(item.ctx.cancel_requested for item in list(runner.pool.in_flight.values())
                         if item.job.id == waiting.id),
             timeout=10, message="the runner to relay the request to the waiting job")
    open_gate.touch()  # the slot frees; the waiting job's turn comes
    done = wait_status(waiting.id, JobStatus.CANCELLED, JobStatus.COMPLETED, timeout=30)
    assert (done.status, done.last_error_code) == ("cancelled", "CANCELLED")
    assert runs_of(runs) == {}  # its handler never ran
    assert [(a.outcome, a.error_code) for a in attempts_of(waiting.id)] == [
        ("cancelled", "CANCELLED")]
    assert runner.failure is None
