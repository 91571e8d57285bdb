"""The starts of waiting jobs that a worker process started on the fast path.

The supervisor notes such a start from the lane's ``STARTED``; the statement that settles the
job in the worker writes it too (``ClaimedJob.began``). So the supervisor's claims leave it
out: only a job still running when its start falls due (``starts.FLUSH_AFTER``) has it
written by the supervisor. Real worker processes, real PostgreSQL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_persistent_jobs import enqueue
from django_persistent_jobs.models import JobAttempt, JobStatus
from django_persistent_jobs.runner import Runner, starts
from tests.core_support import wait_for
from tests.faults.batch_handlers import runs_of
from tests.runner_support import a_job_waiting_behind_another, get_job, wait_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(90)]


def test_a_claim_leaves_out_the_start_a_workers_completion_wrote(
    start_runner: Callable[..., Runner], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    settings: Any,
) -> None:
    """A waiting job starts on the fast path in a worker and completes at once: its start is
    written by its completion, and the supervisor's next claim does not write it again (an
    update of the attempt row per job, for PostgreSQL, in a drain of short jobs)."""
    monkeypatch.setattr(starts, "FLUSH_AFTER", 60.0)  # nothing falls due during the test
    runner, waiting, token, open_gate = a_job_waiting_behind_another(
        start_runner, tmp_path, monkeypatch, settings, processes=1)
    log = runner.starts
    real_taken = log.taken
    written: list[int] = []

    @contextlib.contextmanager
    def recording(everything: bool = False) -> Iterator[tuple[list[int], list[Any]]]:
        with real_taken(everything) as (tokens, times):
            written.extend(tokens)
            yield tokens, times

    monkeypatch.setattr(log, "taken", recording)
    open_gate.touch()  # the first job returns; the waiting one starts in the worker, fast
    wait_status(waiting.id, JobStatus.COMPLETED)
    wait_for(lambda: log.due_in(5.0) == 5.0, timeout=10,
             message="the worker's DONE to clear the start from the supervisor's log")
    later = enqueue("test.noop", {})  # a claim after it
    wait_status(later.id, JobStatus.COMPLETED)
    assert token not in written
    attempt = JobAttempt.objects.get(id=token)
    assert attempt.started and attempt.started_at is not None
    assert attempt.started_at + attempt.duration == attempt.finished_at


def test_a_long_jobs_start_is_on_record_while_it_runs(
    start_runner: Callable[..., Runner], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    settings: Any,
) -> None:
    """A waiting job that runs on in its worker has its start written once it is due, without
    waiting for the job to settle: a runner lost meanwhile must have it charged, not handed
    back for free (see ``starts``)."""
    runs, hold = tmp_path / "long-runs", tmp_path / "hold"
    runner, waiting, token, open_gate = a_job_waiting_behind_another(
        start_runner, tmp_path, monkeypatch, settings, processes=1, job_type="faults.solo",
        payload={"runs": str(runs), "gate": str(hold)})
    open_gate.touch()
    wait_for(lambda: len(runs_of(runs)) == 1, timeout=30, message="the waiting job to start")
    wait_for(lambda: JobAttempt.objects.get(id=token).started, timeout=10,
             message="its start to be written while it runs")
    assert get_job(waiting.id).status == JobStatus.RUNNING
    hold.touch()
    wait_status(waiting.id, JobStatus.COMPLETED)
    assert runner.failure is None
