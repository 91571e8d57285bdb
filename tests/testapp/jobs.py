"""Handlers the tests (and the runner subprocesses the fault tests start) use.

Behaviour is driven by the payload so one handler covers many scenarios:
``sleep`` seconds, ``fail_times`` (fail transiently until that many attempts failed),
``exit`` (kill the process: a poison pill), ``spin`` (a CPU-bound hang), ``permanent``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django_persistent_jobs import JobContext, PermanentJobError, TransientJobError, job_handler
from django_persistent_jobs.backoff import constant

# Autodiscovery imports each installed app's ``jobs`` module, so importing the other handler
# modules of the suite here registers them in every runner subprocess too: the fault suite's
# (kept with the suite), the operator console's, the recurring schedules' and the settling
# tests' that run real ``runjobs`` processes.
from tests.faults import batch_handlers as _batch_handlers  # noqa: F401
from tests.faults import handlers as _fault_handlers  # noqa: F401
from tests.faults import liveness_handlers as _liveness_handlers  # noqa: F401
from tests.faults import process_handlers as _process_handlers  # noqa: F401
from tests.testapp import console_jobs as _console_jobs  # noqa: F401
from tests.testapp import recurring_jobs as _recurring_jobs  # noqa: F401
from tests.testapp import settle_jobs as _settle_jobs  # noqa: F401
from tests.testapp.models import LedgerEntry, SideEffect


@job_handler("test.noop", backoff=constant(0))
def noop(payload: Any) -> None:
    return None


@job_handler("test.ledger", max_retries=3, backoff=constant(0.2), timeout=60)
def ledger(payload: dict[str, Any], ctx: JobContext) -> None:
    SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
    if payload.get("exit_on_attempts") and ctx.attempt <= payload["exit_on_attempts"]:
        os._exit(1)
    if payload.get("exit"):
        os._exit(1)
    if payload.get("sleep"):
        time.sleep(float(payload["sleep"]))
    if payload.get("spin"):
        while True:
            pass
    if ctx.attempt <= int(payload.get("fail_times", 0)):
        raise TransientJobError(f"planned failure {ctx.attempt}", code="PLANNED")
    if payload.get("permanent"):
        raise PermanentJobError("planned permanent failure", code="PLANNED_PERMANENT")
    LedgerEntry.objects.create(job_id=ctx.job_id, note=str(payload.get("note", "")))


@job_handler("test.oversleep", max_retries=1, backoff=constant(0), timeout=60)
def oversleep(payload: dict[str, Any], ctx: JobContext) -> None:
    """Sleeps ``sleep`` seconds; enqueued with a shorter timeout it times out on every attempt,
    and its retry is due the moment the timeout is recorded (no backoff)."""
    SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
    time.sleep(float(payload["sleep"]))


@job_handler("test.hang_first", max_retries=3, backoff=constant(0.1), timeout=120)
def hang_first(payload: dict[str, Any], ctx: JobContext) -> None:
    """Hangs (``sleep`` seconds, default 60) on attempt 1 only, then writes its ledger entry.

    Runner tests use it for a job that is in flight when its runner is killed or force-stopped
    and must complete normally once it is back in play.
    """
    SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
    if ctx.attempt == 1:
        time.sleep(float(payload.get("sleep", 60)))
    LedgerEntry.objects.create(job_id=ctx.job_id, note="hang_first")


@job_handler("test.progress_mark", max_retries=0, timeout=60)
def progress_mark(payload: dict[str, Any], ctx: JobContext) -> None:
    """Once the file ``payload["go"]`` exists, reports progress, then creates the file
    ``payload["mark"]``: a test that holds the job's row lock meanwhile sees from outside the
    runner (and its worker processes) whether reporting progress waited for the lock."""
    deadline = time.monotonic() + 30
    while not os.path.exists(payload["go"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    ctx.report_progress({"step": 1})
    with open(payload["mark"], "w") as mark:
        mark.write("reported")


@job_handler("test.commit_spin", backoff=constant(0), max_retries=0)
def commit_spin(payload: dict[str, Any], ctx: JobContext) -> None:
    """Returns at once, leaving an ``on_commit`` callback that runs past the job's timeout (a
    mail sent after commit, retried in a loop): the completion has committed by the time it
    spins. It writes ``interrupted`` to ``payload["mark"]`` when the runner stops it, and
    gives up after 30 s (a runner that never does fails the test, not the suite)."""
    from django.db import transaction

    mark = payload["mark"]

    def spin() -> None:
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                time.sleep(0.01)
        except BaseException:
            with open(mark, "w") as out:
                out.write("interrupted")
            raise
        with open(mark, "w") as out:
            out.write("not interrupted")

    transaction.on_commit(spin)


#: A file to which every ``job_finished`` this process sends is appended, one line each
#: (``pid job_id attempt status outcome``), when set in the environment before the process
#: starts: worker processes send the signals of the jobs they run, and a test in the
#: supervisor's process reads theirs from the file (``record_finished``).
FINISHED_LOG_ENV = "PJ_TEST_FINISHED_LOG"


def record_finished(path: str) -> Any:
    """Connect a ``job_finished`` receiver that appends to ``path``; returns it (to
    disconnect). One ``write`` per line on an ``O_APPEND`` file: lines from several processes
    never interleave."""
    from django_persistent_jobs.signals import job_finished

    def receiver(*, job_id: Any, attempt: int, status: str, outcome: str, **kwargs: Any) -> None:
        line = f"{os.getpid()} {job_id} {attempt} {status} {outcome}\n".encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    job_finished.connect(receiver, weak=False, dispatch_uid=f"tests-finished-log-{path}")
    return receiver


if os.environ.get(FINISHED_LOG_ENV):
    record_finished(os.environ[FINISHED_LOG_ENV])
