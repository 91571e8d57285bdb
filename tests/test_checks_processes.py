"""The worker-process settings and options: validated like every other, and ``--burst`` works
with worker processes."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from django.core import checks
from django.core.management import CommandError, call_command
from django.db import transaction

from django_persistent_jobs import ConfigurationError, Runner, enqueue_many
from django_persistent_jobs import conf as pj_conf
from django_persistent_jobs.models import JobStatus, PersistentJob
from tests.core_support import pj_settings
from tests.runner_support import OutputReader

BAD = [
    ({"PROCESSES": -1}, "persistent_jobs.E031", "PROCESSES'] must be an integer >= 0"),
    ({"PROCESSES": "2"}, "persistent_jobs.E031", "PROCESSES'] must be an integer"),
    ({"PROCESSES": True}, "persistent_jobs.E031", "PROCESSES'] must be an integer"),
    ({"MAX_JOBS_PER_WORKER": 0}, "persistent_jobs.E032", "MAX_JOBS_PER_WORKER'] must be"),
    ({"MAX_MEMORY_PER_WORKER": -5}, "persistent_jobs.E033", "MAX_MEMORY_PER_WORKER'] must be"),
    ({"MAX_MEMORY_PER_WORKER": 1e12}, "persistent_jobs.E033", "at most 315360000 MiB"),
    ({"TIMEOUT_GRACE": 0}, "persistent_jobs.E034", "TIMEOUT_GRACE'] must be a finite number"),
    ({"TIMEOUT_GRACE": None}, "persistent_jobs.E034", "TIMEOUT_GRACE'] must be a number"),
]


@pytest.mark.parametrize(("overrides", "check_id", "message"), BAD,
                         ids=[f"{i}-{next(iter(o))}" for i, (o, _, _) in enumerate(BAD)])
def test_bad_worker_settings_fail_the_checks_and_the_runner(
    overrides: dict[str, Any], check_id: str, message: str,
) -> None:
    with pj_settings(**overrides):
        errors = [(m.id, m.msg) for m in checks.run_checks(tags=["persistent_jobs"])]
        assert any(i == check_id and message in m for i, m in errors), errors
        with pytest.raises(ConfigurationError, match=message.split("'")[0]):
            Runner()


def test_good_worker_settings_are_loaded() -> None:
    with pj_settings(PROCESSES=3, MAX_JOBS_PER_WORKER=100, MAX_MEMORY_PER_WORKER=512.5,
                     TIMEOUT_GRACE=2):
        assert [m for m in checks.run_checks(tags=["persistent_jobs"])] == []
        loaded = pj_conf.RunnerSettings.load()
    assert (loaded.processes, loaded.max_jobs_per_worker, loaded.max_memory_per_worker,
            loaded.timeout_grace) == (3, 100, 512.5, 2.0)


def test_processes_must_not_be_negative() -> None:
    with pytest.raises(CommandError, match="--processes must be 0 or more"):
        call_command("runjobs", "--processes", "-1")
    with pytest.raises(ConfigurationError, match="processes must be >= 0"):
        Runner(processes=-1)


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_burst_with_worker_processes_runs_everything_due_and_exits_zero(
    spawn_runner: Callable[..., subprocess.Popen[bytes]],
) -> None:
    with transaction.atomic():
        jobs = enqueue_many([("test.ledger", {"n": i}) for i in range(40)])
    reader = OutputReader(spawn_runner("--burst", "--processes", "2", "--concurrency", "2",
                                       env={"PJ_TEST_LOG": "INFO"}))
    code, output = reader.finish(90)
    assert code == 0, output
    assert "processes=2" in output and "worker 2 started" in output
    assert PersistentJob.objects.filter(id__in=[j.id for j in jobs],
                                        status=JobStatus.COMPLETED).count() == 40
