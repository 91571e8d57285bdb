"""Several ``runjobs`` processes on one queue: every job's business write commits exactly once."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

import pytest
from django.db import transaction

from django_persistent_jobs.enqueuing import enqueue_many
from django_persistent_jobs.models import JobAttempt, JobRunnerRecord, JobStatus, PersistentJob
from tests.runner_support import OutputReader, wait_for
from tests.testapp.models import LedgerEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

Spawn = Callable[..., "subprocess.Popen[bytes]"]
JOBS = 500


def test_three_runner_processes_drain_500_jobs_exactly_once(spawn_runner: Spawn) -> None:
    readers = [OutputReader(spawn_runner("--concurrency", "4", env={"PJ_TEST_LOG": "WARNING"}))
               for _ in range(3)]
    procs = [r.proc for r in readers]
    wait_for(lambda: JobRunnerRecord.objects.count() == 3, timeout=30,
             message="three runners to register")
    with transaction.atomic():  # one commit, one NOTIFY: all three race for the same jobs
        jobs = enqueue_many([("test.ledger", {"note": str(i)}) for i in range(JOBS)])
    ids = {job.id for job in jobs}

    def all_done() -> bool:
        finished = PersistentJob.objects.filter(status=JobStatus.COMPLETED).count()
        for reader in readers:
            assert reader.proc.poll() is None, f"a runner process died:\n{reader.text()}"
        return finished == JOBS

    wait_for(all_done, timeout=90, interval=0.1, message=f"{JOBS} jobs to complete")
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for reader in readers:
        code, output = reader.finish(30)
        assert code == 0, output

    assert PersistentJob.objects.exclude(status=JobStatus.COMPLETED).count() == 0
    assert set(PersistentJob.objects.values_list("attempts", flat=True)) == {1}
    # Exactly one business write per job (job_id is unique, so a duplicate commit would have
    # failed loudly rather than hid), and no job ran twice.
    assert LedgerEntry.objects.count() == JOBS
    assert set(LedgerEntry.objects.values_list("job_id", flat=True)) == ids
    assert JobAttempt.objects.count() == JOBS
    assert set(JobAttempt.objects.values_list("outcome", flat=True)) == {"completed"}
    # The work really was shared between processes.
    runners = set(JobAttempt.objects.values_list("runner_id", flat=True))
    assert len(runners) >= 2, runners
    assert not JobRunnerRecord.objects.exists()
