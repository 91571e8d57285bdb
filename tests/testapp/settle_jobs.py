"""Handlers for the settling tests that run real ``runjobs`` processes.

``settle.new_release`` exists only in processes started with ``PJ_TEST_NEW_RELEASE=1``: it plays
a job type that only the next release of a service knows, during a rolling deploy.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django_persistent_jobs import JobContext, TransientJobError, job_handler
from django_persistent_jobs.backoff import constant
from tests.testapp.models import LedgerEntry, SideEffect


@job_handler("settle.bad_text", max_retries=0)
def bad_text(payload: dict[str, Any]) -> None:
    name = b"upload-\xfe.bin".decode("utf-8", "surrogateescape")
    raise TransientJobError(f"cannot read {name}: NUL at \x00", code="BAD\x00TEXT")


@job_handler("settle.gets_runner_stopped", max_retries=0, backoff=constant(0))
def gets_runner_stopped(payload: dict[str, Any], ctx: JobContext) -> None:
    """Runs until its runner stops (a watchdog SIGTERMs it) and hands it back."""
    SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
    while True:
        time.sleep(0.02)


if os.environ.get("PJ_TEST_NEW_RELEASE"):

    @job_handler("settle.new_release")
    def new_release(payload: dict[str, Any], ctx: JobContext) -> None:
        LedgerEntry.objects.create(job_id=ctx.job_id, note="new release")
