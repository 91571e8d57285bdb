"""``runjobs`` against a database it cannot reach: a burst gives up after a bounded wait, and a
runner stopped before it ever connected says so with a non-zero exit (real processes)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable

import pytest

from tests.runner_support import OutputReader

pytestmark = [pytest.mark.timeout(120)]

Spawn = Callable[..., "subprocess.Popen[bytes]"]


def _unreachable_url() -> str:
    """A PostgreSQL URL on a local port nobody listens on (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgres://postgres@127.0.0.1:{port}/nowhere"


@pytest.mark.django_db
def test_burst_against_an_unreachable_database_fails_after_a_bounded_wait(
    spawn_runner: Spawn,
) -> None:
    env = {"DATABASE_URL": _unreachable_url(), "PJ_TEST_LOG": "INFO"}
    began = time.monotonic()
    reader = OutputReader(spawn_runner("--burst", "--database-wait", "2", env=env))
    reader.wait_for_line("database not reachable", timeout=30)
    code, output = reader.finish(timeout=60)
    elapsed = time.monotonic() - began
    assert code == 1, output
    assert "could not reach database 'default' within 2s" in output, output
    assert "Traceback" not in output, output
    assert elapsed < 30, f"took {elapsed:.1f}s"


@pytest.mark.django_db
def test_database_wait_zero_gives_up_after_one_attempt(spawn_runner: Spawn) -> None:
    env = {"DATABASE_URL": _unreachable_url(), "PJ_TEST_LOG": "INFO"}
    began = time.monotonic()
    code, output = OutputReader(spawn_runner("--burst", "--database-wait", "0",
                                             env=env)).finish(timeout=60)
    assert code == 1, output
    assert "could not reach database 'default' within 0s (connection failed" in output, output
    assert "Traceback" not in output, output
    assert time.monotonic() - began < 30


@pytest.mark.django_db
def test_burst_waits_a_bounded_time_by_default(spawn_runner: Spawn) -> None:
    """The default bound is 30 s: the first retry says when the burst gives up (the test above
    shows that it does give up then, with a bound short enough to wait out)."""
    env = {"DATABASE_URL": _unreachable_url(), "PJ_TEST_LOG": "INFO"}
    proc = spawn_runner("--burst", env=env)
    reader = OutputReader(proc)
    line = reader.wait_for_line("database not reachable", timeout=30)
    assert line.rstrip().endswith(("giving up in 30s", "giving up in 29s")), line
    proc.send_signal(signal.SIGTERM)
    code, output = reader.finish(timeout=30)
    assert code == 3, output


@pytest.mark.django_db
def test_a_runner_stopped_before_it_ever_connected_exits_non_zero(spawn_runner: Spawn) -> None:
    env = {"DATABASE_URL": _unreachable_url(), "PJ_TEST_LOG": "INFO"}
    proc = spawn_runner(env=env)
    reader = OutputReader(proc)
    line = reader.wait_for_line("database not reachable", timeout=30)
    assert "giving up" not in line, line  # without --burst it waits as long as it takes
    proc.send_signal(signal.SIGTERM)
    code, output = reader.finish(timeout=30)
    assert code == 3, output  # documented: stopped before it ever reached the database
    assert "stopped before it could reach database 'default'" in output, output


def test_database_wait_must_not_be_negative(spawn_runner: Spawn) -> None:
    reader = OutputReader(spawn_runner("--burst", "--database-wait", "-1"))
    code, output = reader.finish(timeout=60)
    assert code != 0
    assert "--database-wait must be" in output, output
