"""Shared fixtures: in-process runners and ``runjobs`` processes against the test database.

Helpers that are not fixtures live in ``core_support`` (every test) and ``runner_support``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_persistent_jobs.runner import Runner
from django_persistent_jobs.runner.execute import RUNJOBS_LOGGERS
from tests.core_support import ROOT, subprocess_env


@pytest.fixture(autouse=True)
def _restore_runjobs_log_levels() -> Iterator[None]:
    """A test that calls ``runjobs`` in-process must not change what later tests log."""
    levels = [logging.getLogger(name).level for name in RUNJOBS_LOGGERS]
    yield
    for name, level in zip(RUNJOBS_LOGGERS, levels, strict=True):
        logging.getLogger(name).setLevel(level)


@pytest.fixture
def start_runner() -> Iterator[Callable[..., Runner]]:
    """Start in-process runners (real threads, own connections); all are stopped at teardown."""
    runners: list[Runner] = []

    def start(**kwargs: Any) -> Runner:
        kwargs.setdefault("cleanup", False)
        runner = Runner(**kwargs)
        runner.start()
        assert runner.wait_until_started(30), "runner did not start"
        runners.append(runner)
        return runner

    yield start
    for runner in runners:
        runner.force_stop() if runner.forced.is_set() else runner.request_stop()
    for runner in runners:
        runner.finished.wait(30)


@pytest.fixture
def spawn_runner() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``manage.py runjobs`` processes against the test database; killed at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        full_env = subprocess_env()
        full_env.update(env or {})
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runjobs", *args],
            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
