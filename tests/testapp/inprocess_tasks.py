"""Tasks for the in-process backend tests (``backend="inprocess"``, WORKERS=2 in test settings)."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

from django_persistent_jobs.backends.compat import TaskContext
from django_persistent_jobs.backoff import constant
from tests.testapp.tasks_compat import task

#: (task, argument) per successful call, in call order.
CALLS: list[tuple[str, Any]] = []
GATE = threading.Event()


@task(backend="inprocess")
def double(value: int) -> int:
    CALLS.append(("double", value))
    return value * 2


@task(backend="inprocess", takes_context=True, max_retries=3, backoff=constant(0.05))
def fails_twice(context: TaskContext, value: str) -> str:
    if context.attempt < 3:
        raise ValueError(f"attempt {context.attempt}")
    return f"{value} on {context.attempt}"


@task(backend="inprocess", max_retries=1, backoff=constant(0.05))
def never_works() -> None:
    raise RuntimeError("never")


@task(backend="inprocess", timeout=0.3, max_retries=0)
def hangs() -> str:
    GATE.wait(10)
    return "late"


@task(backend="inprocess", timeout=30)
def hangs_until_released(index: int) -> int:
    GATE.wait(10)
    return index


@task(backend="inprocess", takes_context=True)
async def async_triple(context: TaskContext, value: int) -> dict[str, int]:
    await asyncio.sleep(0.01)
    return {"value": value * 3, "attempt": context.attempt}


@task(backend="serial")
def note(label: str) -> str:
    CALLS.append(("note", label))
    return label


@task(backend="serial", timeout=30)
def block_serial() -> None:
    GATE.wait(10)


@task(backend="serial", timeout=0.3, max_retries=0)
def hangs_serial() -> str:
    GATE.wait(10)
    return "late"


@task(backend="serial", timeout=0.5, max_retries=0)
def quick_serial(label: str) -> str:
    CALLS.append(("quick", label))
    return label


@task(backend="inprocess", max_retries=1, backoff=lambda attempt: timedelta(milliseconds=50))
def spaced_by_timedelta() -> None:
    """A ``timedelta`` backoff, as ``retry_job(mode="later")`` and the runner take it."""
    raise RuntimeError("again")


@task(backend="inprocess", max_retries=1, backoff=lambda attempt: float("nan"))
def unusable_backoff() -> None:
    raise RuntimeError("again")
