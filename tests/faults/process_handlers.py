"""Handlers that misbehave below Python: what worker processes exist to contain.

Each writes a ``faults_ledger`` row in the job's transaction when (if ever) it returns, so a
completion is visible as exactly one row.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any

from django.db import connection

from django_persistent_jobs import JobContext, job_handler
from django_persistent_jobs.backoff import constant


def _ledger(ctx: JobContext) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO faults_ledger (job_id, attempt, runner_id, pid) VALUES (%s, %s, %s, %s)",
            [ctx.job_id, ctx.attempt, ctx.runner_id, os.getpid()],
        )


@job_handler("procs.gil", max_retries=3, backoff=constant(0.2), timeout=120)
def hold_gil(payload: dict[str, Any], ctx: JobContext) -> None:
    """Sleep inside C *holding the GIL* (a ``PyDLL`` call does not release it): no other thread
    of this process runs meanwhile, a heartbeat thread included."""
    ctypes.PyDLL(None).sleep(int(payload["seconds"]))
    _ledger(ctx)


@job_handler("procs.gil_at_once", max_retries=0, timeout=1)
def hold_gil_at_once(payload: dict[str, Any], ctx: JobContext) -> None:
    """Write in the job's transaction, publish the job's session, then hold the worker's GIL
    inside C: from here on no thread of the worker runs, so nothing in the worker can tell the
    supervisor anything (the supervisor must already know the session)."""
    _ledger(ctx)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    ctx.report_progress({"pid": os.getpid(), "backend": backend})
    ctypes.PyDLL(None).sleep(int(payload.get("seconds", 30)))


@job_handler("procs.c_sleep", max_retries=0, timeout=1)
def c_sleep(payload: dict[str, Any], ctx: JobContext) -> None:
    """Block in C for an hour (GIL released): no exception injected into this thread can end
    it before ``sleep`` returns."""
    if payload.get("report"):
        with connection.cursor() as cursor:  # the job's own session, inside its transaction
            cursor.execute("SELECT pg_backend_pid()")
            backend = cursor.fetchone()[0]
        ctx.report_progress({"pid": os.getpid(), "backend": backend})
    ctypes.CDLL(None).sleep(int(payload.get("seconds", 3600)))
    _ledger(ctx)


@job_handler("procs.oom", max_retries=2, backoff=constant(0.1), timeout=60)
def oom(payload: dict[str, Any], ctx: JobContext) -> None:
    """Die the way the OOM killer kills: SIGKILL, no cleanup, mid-transaction."""
    _ledger(ctx)
    os.kill(os.getpid(), signal.SIGKILL)


@job_handler("procs.pid", max_retries=3, backoff=constant(0.1), timeout=60)
def report_pid(payload: dict[str, Any], ctx: JobContext) -> None:
    """Publish the process running the handler, then sleep (on the first attempt only, unless
    ``every``) and write the ledger."""
    ctx.report_progress({"pid": os.getpid(), "attempt": ctx.attempt})
    if ctx.attempt == 1 or payload.get("every"):
        ctx.wait_for_cancel(float(payload.get("sleep", 0)))
    ctx.raise_if_cancelled()
    _ledger(ctx)


@job_handler("procs.cpu", max_retries=0, timeout=120)
def cpu(payload: dict[str, Any], ctx: JobContext) -> None:
    """Pure-Python work holding the GIL for ``ms`` milliseconds (no SQL: the solo completion)."""
    import time

    end = time.perf_counter() + float(payload.get("ms", 5)) / 1000
    while time.perf_counter() < end:
        pass


@job_handler("procs.async", max_retries=0, timeout=60)
async def async_ledger(payload: dict[str, Any], ctx: JobContext) -> None:
    """An ``async def`` handler, run on an event loop in the worker, its write in the job's
    transaction (``sync_to_async`` runs it on the job's thread, so on the job's connection)."""
    import asyncio

    from asgiref.sync import sync_to_async

    await asyncio.sleep(float(payload.get("sleep", 0.01)))
    await sync_to_async(_ledger)(ctx)


@job_handler("procs.segfault", max_retries=1, backoff=constant(0.1), timeout=60)
def segfault(payload: dict[str, Any], ctx: JobContext) -> None:
    """Crash the interpreter: read address 0 (SIGSEGV), as a broken C extension would."""
    _ledger(ctx)
    ctypes.string_at(0)


@job_handler("procs.overrun", max_retries=1, backoff=constant(0), timeout=2)
def overrun(payload: dict[str, Any], ctx: JobContext) -> None:
    """Block in C for ``payload["seconds"][attempt]`` (no exception injected into the thread
    ends it sooner), then write the ledger: each attempt overruns its 2 s timeout by its own
    amount."""
    ctypes.CDLL(None).usleep(int(float(payload["seconds"][str(ctx.attempt)]) * 1_000_000))
    _ledger(ctx)


@job_handler("procs.late_progress", max_retries=1, backoff=constant(0), timeout=3)
def late_progress(payload: dict[str, Any], ctx: JobContext) -> None:
    """Attempt 1 reports progress, overruns its 3 s timeout blocked in C for 4 s, and reports
    progress again on its way out (a ``finally``), then touches ``payload["returned"]``; by
    then attempt 2 runs, has reported its own progress and waits for ``payload["gate"]``."""
    from pathlib import Path

    from .batch_handlers import wait_for_gate

    ctx.report_progress({"attempt": ctx.attempt})
    try:
        if ctx.attempt == 1:
            ctypes.CDLL(None).usleep(4_000_000)
        else:
            wait_for_gate(payload)
    finally:
        if ctx.attempt == 1:
            ctx.report_progress({"attempt": 1, "late": True})
            Path(payload["returned"]).touch()
