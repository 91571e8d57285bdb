"""The liveness sidecar runs at a lower CPU priority than its runner: its start (an
interpreter, psycopg, a connection) must not take a core from the runner's first claims. A real
runner and its real sidecar process; the priority is read from the kernel."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from django_persistent_jobs.runner import Runner
from django_persistent_jobs.runner.sidecar import SIDECAR_NICENESS, supported
from tests.core_support import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True), pytest.mark.timeout(60),
    pytest.mark.skipif(not supported(), reason="the sidecar needs Linux's /proc"),
]


def test_the_sidecar_runs_at_a_lower_priority_than_its_runner(
        start_runner: Callable[..., Runner]) -> None:
    runner = start_runner(concurrency=1)
    pid = runner.sidecar.proc.pid
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + SIDECAR_NICENESS)
    wait_for(lambda: os.getpriority(os.PRIO_PROCESS, pid) == expected, timeout=20,
             message=f"the sidecar's niceness to become {expected}")
