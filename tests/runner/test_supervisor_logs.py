"""Structured log records: each lifecycle step logs an ``event`` with ids in ``extra``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from django_persistent_jobs import enqueue
from django_persistent_jobs.models import JobStatus
from django_persistent_jobs.runner import Runner, store
from tests.core_support import claim_as
from tests.runner_support import wait_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

StartRunner = Callable[..., Runner]


def _events(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


def test_lifecycle_events_are_logged_with_extra(
    start_runner: StartRunner, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="django_persistent_jobs")
    orphan = enqueue("test.ledger", {"note": "orphan"})
    with connection.cursor() as cursor:  # claimed by a runner that died long ago
        store.register_runner(cursor, "ghost:logs", "ghost-host", 1, None, 1, "test")
        cursor.execute("UPDATE persistent_jobs_runners SET heartbeat_at = now() - interval "
                       "'1 hour' WHERE id = 'ghost:logs'")
        [claimed] = claim_as(cursor, "ghost:logs", 1, None)
    ok = enqueue("test.ledger", {"note": "ok"})
    flaky = enqueue("test.ledger", {"fail_times": 1})
    doomed = enqueue("test.ledger", {"permanent": True})
    assert claimed.id == orphan.id
    runner = start_runner(concurrency=2)
    for job in (ok, flaky, orphan):
        wait_status(job.id, JobStatus.COMPLETED)
    wait_status(doomed.id, JobStatus.DEAD_LETTERED)
    runner.stop(timeout=30)

    def one(event: str, job: Any) -> logging.LogRecord:
        matches = [r for r in _events(caplog, event) if getattr(r, "job_id", None) == str(job.id)]
        assert matches, f"no {event!r} record for job {job.id}"
        return matches[0]

    for job in (ok, flaky, doomed, orphan):
        record = one("enqueue", job)
        assert record.levelno == logging.DEBUG and record.job_type == "test.ledger"  # type: ignore[attr-defined]

    claims = _events(caplog, "claim")
    assert claims and all(r.levelno == logging.DEBUG for r in claims)
    claimed_ids = {i for r in claims for i in r.job_ids}  # type: ignore[attr-defined]
    assert {str(ok.id), str(flaky.id), str(doomed.id)} <= claimed_ids
    assert {r.runner_id for r in claims} == {runner.runner_id}  # type: ignore[attr-defined]

    for job in (ok, flaky, orphan):
        success = one("success", job)
        assert success.levelno == logging.INFO
        assert success.runner_id == runner.runner_id  # type: ignore[attr-defined]
        assert success.job_type == "test.ledger"  # type: ignore[attr-defined]

    retry = one("retry", flaky)
    assert retry.levelno == logging.WARNING
    assert (retry.error_code, retry.attempt, retry.status) == ("PLANNED", 1, "failed")  # type: ignore[attr-defined]

    failure = one("failure", flaky)
    assert (failure.error_code, failure.attempt) == ("PLANNED", 1)  # type: ignore[attr-defined]
    assert one("failure", doomed).error_code == "PLANNED_PERMANENT"  # type: ignore[attr-defined]
    dead = one("dead_letter", doomed)
    assert dead.levelno == logging.ERROR
    assert (dead.error_code, dead.status) == ("PLANNED_PERMANENT", "dead_lettered")  # type: ignore[attr-defined]

    rescue = one("rescue", orphan)
    assert rescue.levelno == logging.WARNING
    assert rescue.dead_runner_id == "ghost:logs"  # type: ignore[attr-defined]
    assert _events(caplog, "runner_dead")

    assert _events(caplog, "runner_started") and _events(caplog, "runner_stopped")
    # Every record from the package carries its event name.
    package = [r for r in caplog.records if r.name.startswith("django_persistent_jobs")]
    assert all(hasattr(r, "event") for r in package), [
        r.getMessage() for r in package if not hasattr(r, "event")
    ]
