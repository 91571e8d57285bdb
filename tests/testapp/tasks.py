"""``django.tasks`` tasks for the task-backend tests (and the runner subprocesses they start).

Autodiscovered: the app config imports every installed app's ``tasks`` module when
``settings.TASKS`` uses ``PersistentJobsBackend``, so a ``runjobs`` process knows these tasks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from asgiref.sync import sync_to_async

from django_persistent_jobs.backends.compat import TaskContext
from django_persistent_jobs.backoff import constant
from tests.testapp.models import LedgerEntry, SideEffect
from tests.testapp.tasks_compat import task


@task()
def add(a: int, b: int) -> int:
    return a + b


@task()
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"args": list(args), "kwargs": kwargs}


@task(takes_context=True, max_retries=3, backoff=constant(0.1))
def flaky(context: TaskContext, fail_until: int, note: str) -> dict[str, Any]:
    """Fails on attempts before ``fail_until``; records every attempt's side effect."""
    job_id = context.task_result.id
    SideEffect.objects.create(job_id=job_id, attempt=context.attempt)
    if context.attempt < fail_until:
        raise ValueError(f"planned failure on attempt {context.attempt}")
    LedgerEntry.objects.create(job_id=job_id, note=note)
    return {"attempt": context.attempt, "note": note}


@task(takes_context=True, max_retries=1, backoff=constant(0.1))
def always_fails(context: TaskContext) -> None:
    SideEffect.objects.create(job_id=context.task_result.id, attempt=context.attempt)
    raise KeyError(f"nope {context.attempt}")


@task(timeout=1, max_retries=1, backoff=constant(0.1))
def too_slow(seconds: float) -> str:
    time.sleep(seconds)
    return "finished"


@task()
async def async_sleep_add(a: int, b: int) -> int:
    await asyncio.sleep(0.05)
    # Database work from an async task goes through sync_to_async; it shares the job's
    # transaction (thread-sensitive calls run on the handler's thread).
    await sync_to_async(LedgerEntry.objects.create)(
        job_id=uuid.uuid4(), note=f"async {a}+{b}")
    return a + b


@task(takes_context=True)
def record(context: TaskContext, label: str) -> str:
    LedgerEntry.objects.create(job_id=context.task_result.id, note=label)
    return label


@task()
def returns_datetime() -> Any:
    return datetime(2026, 1, 1, tzinfo=UTC)


@task(takes_context=True, max_retries=2, backoff=constant(0.1))
def hang_first(context: TaskContext, seconds: float) -> str:
    """Hangs on attempt 1 (its runner gets SIGKILLed meanwhile), succeeds afterwards."""
    SideEffect.objects.create(job_id=context.task_result.id, attempt=context.attempt)
    if context.attempt == 1:
        time.sleep(seconds)
    return f"done on attempt {context.attempt}"


@task(dedup_key=lambda user_id: f"user:{user_id}", dedup="skip")
def refresh_user(user_id: int) -> int:
    return user_id


@task(dedup_key="one-at-a-time", dedup="skip")
def one_at_a_time(n: int) -> int:
    return n


@task(max_retries=0)
def fails_for_good() -> None:
    raise ValueError("for good")


@task(max_retries=0)
def interrupted() -> None:
    """Raises ``KeyboardInterrupt`` on its only attempt: a failure like any other (it must not
    stop the runner)."""
    raise KeyboardInterrupt


@task(max_retries=0)
def one_try(value: int) -> int:
    """Succeeds, with no retry: its one attempt is also its last."""
    return value
