"""A handler for the liveness scenarios: what an unkind job can do to its own runner.

``liveness.probe`` writes one ``faults_ledger`` row in the job's transaction (same evidence as
``faults.ledger``) after the misbehaviour its payload asks for, applied only while
``ctx.attempt <= upto`` (default: always):

``gil``         hold the GIL for this many seconds in a single C call: libc ``sleep()`` called
                through ``ctypes.PyDLL``, which does not release the GIL (exact on a busy
                machine, unlike a CPU-bound call); the longest stall a ticker thread saw while
                it ran is published as progress ``{"gil_stall": seconds}``
``gil_cpu``     the same with a CPU-bound C call (``sum`` over a ``range``, sized by a quick
                calibration, so only roughly that long)
``cancel``      inside the job's transaction, ``cancel_job()`` this other (running) job: the
                handler then holds that job's row lock until its own transaction ends
``lock_self``   inside the job's transaction, lock the job's own row (``SELECT ... FOR UPDATE``)
                as a completion ``UPDATE`` would, so a runner frozen now holds it
``sleep``       then ``time.sleep`` this many seconds
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
import time
from typing import Any

from django.db import connection

from django_persistent_jobs import JobContext, cancel_job, job_handler
from django_persistent_jobs.backoff import constant


def _hold_gil(seconds: float, cpu: bool) -> float:
    """Run one GIL-holding C call of about ``seconds``; return the longest stall another
    thread observed meanwhile (proof that the GIL was really held)."""
    stamps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            stamps.append(time.monotonic())
            time.sleep(0.02)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    time.sleep(0.1)
    if cpu:
        _cpu_bound(seconds)
    else:
        ctypes.PyDLL(None).sleep(ctypes.c_uint(math.ceil(seconds)))
    time.sleep(0.1)
    stop.set()
    ticker.join()
    return max((b - a for a, b in itertools.pairwise(stamps)), default=0.0)


def _cpu_bound(seconds: float) -> None:
    """One C call of at least ``seconds``: calibrated, and made longer until one call lasts
    that long (the machine's speed changes under load; shorter calls only hold it shorter)."""
    sample = 1_000_000
    timings = []
    for _ in range(5):
        begun = time.perf_counter()
        sum(range(sample))
        timings.append(time.perf_counter() - begun)
    per_item = max(min(timings) / sample, 1e-9)
    for _ in range(5):
        begun = time.perf_counter()
        sum(range(int(seconds / per_item)))
        took = time.perf_counter() - begun
        if took >= seconds:
            return
        per_item = took / int(seconds / per_item) / 1.5


@job_handler("liveness.probe", max_retries=3, backoff=constant(0.2), timeout=60)
def liveness_probe(payload: dict[str, Any], ctx: JobContext) -> None:
    upto = payload.get("upto")
    if upto is None or ctx.attempt <= int(upto):
        if payload.get("gil") or payload.get("gil_cpu"):
            cpu = bool(payload.get("gil_cpu"))
            stall = _hold_gil(float(payload["gil_cpu" if cpu else "gil"]), cpu)
            ctx.report_progress({"gil_stall": round(stall, 3)})
        if payload.get("cancel"):
            cancel_job(payload["cancel"])
        if payload.get("lock_self"):
            with connection.cursor() as cursor:
                cursor.execute("SELECT id FROM persistent_jobs WHERE id = %s FOR UPDATE",
                               [ctx.job_id])
        if payload.get("sleep"):
            time.sleep(float(payload["sleep"]))
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO faults_ledger (job_id, attempt, runner_id, pid) VALUES "
            "(%s, %s, %s, pg_backend_pid())",
            [ctx.job_id, ctx.attempt, ctx.runner_id],
        )
