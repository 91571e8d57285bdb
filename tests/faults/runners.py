"""Runner processes the fault scenarios start, freeze and kill: ``manage.py runjobs``
subprocesses whose log lines are collected and waited for, and their database sessions (found by
``application_name``, so the suite never touches other sessions on a shared server).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.core_support import ROOT, subprocess_env

from .sql import sql, sql_value

#: Runner timings for the suite: short enough for CI, with the production ratios kept
#: (heartbeat well under half the stale-lock timeout).
STALE = 2.0
HEARTBEAT = 0.4
POLL = 0.5
FAST_SETTINGS: dict[str, Any] = {
    "STALE_LOCK_TIMEOUT": STALE,
    "HEARTBEAT_INTERVAL": HEARTBEAT,
    "POLL_INTERVAL": POLL,
    "SHUTDOWN_GRACE": 3,
    "CLEANUP_INTERVAL": 3600,
}
#: Where the suite's runners run job code: ``0`` on threads of the runner process, ``N`` in N
#: worker processes. CI runs the suite both ways (``PJ_TEST_PROCESSES=1`` on its Django 6.1 leg,
#: ``0`` on its Django 5.2 leg: ``scripts/test.sh``).
PROCESSES = os.environ.get("PJ_TEST_PROCESSES", "0")
APP_PREFIX = "pjfaults-"
_STARTED = re.compile(r"runner (\S+) started")



class RunnerProcess:
    """A ``manage.py runjobs`` subprocess whose log lines we collect and can wait for."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.lines: list[str] = []
        self.eof = False
        self.cond = threading.Condition()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by the reader)
        self.runner_id: str | None = None  # from its "runner ... started" line
        self.killed = False
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._log.write(line + "\n")
            if self.runner_id is None:
                started = _STARTED.search(line)
                if started:
                    self.runner_id = started.group(1)
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        self._log.close()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    # -- process
    @property
    def pid(self) -> int:
        """The runner's own pid (inside a pid namespace it is 1 to itself; this is the host's)."""
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: int) -> None:
        if sig in (signal.SIGSTOP, signal.SIGCONT):
            # Freeze or thaw the whole runner: its worker processes too, if it has any (they
            # share its process group; it leads one of its own).
            os.killpg(self.pid, sig)
        else:
            os.kill(self.pid, sig)

    @contextmanager
    def frozen(self) -> Iterator[Callable[[], int]]:
        """Frozen (SIGSTOP) for the block. It yields ``thaw``, which sends SIGCONT and returns a
        log mark taken just before, for the lines the thawed runner writes; a block that ends
        without thawing (a failed assertion) thaws on its way out, so the runner can be
        stopped and its log read."""
        thawed = False

        def thaw() -> int:
            nonlocal thawed
            mark = self.mark()
            self.send(signal.SIGCONT)
            thawed = True
            return mark

        self.send(signal.SIGSTOP)
        try:
            yield thaw
        finally:
            if not thawed:
                self.send(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and reap: no handler runs, no shutdown code, sockets just close."""
        self.killed = True
        if self.alive:
            self.send(signal.SIGKILL)
        self.proc.wait(10)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"runner {self.name} did not exit within {timeout}s\n{self.tail()}"
            ) from None

    # -- log
    def mark(self) -> int:
        """A position in the log; ``wait_line(..., since=mark)`` only looks at later lines."""
        with self.cond:
            return len(self.lines)

    def find(self, pattern: str, since: int = 0) -> list[re.Match[str]]:
        regex = re.compile(pattern)
        with self.cond:
            lines = self.lines[since:]
        return [m for m in (regex.search(line) for line in lines) if m]

    def wait_line(self, pattern: str, timeout: float = 15.0, since: int = 0,
                  count: int = 1) -> re.Match[str]:
        """Wait until ``count`` log lines after ``since`` match ``pattern``; return the last."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen: list[re.Match[str]] = []
        position = since
        with self.cond:
            while True:
                for line in self.lines[position:]:
                    match = regex.search(line)
                    if match:
                        seen.append(match)
                        if len(seen) >= count:
                            return match
                position = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.eof:
                    break
                self.cond.wait(min(remaining, 0.5))
        state = "exited" if self.eof else "still running"
        raise AssertionError(
            f"runner {self.name} ({state}): {len(seen)}/{count} lines matching {pattern!r} "
            f"after {timeout}s\n{self.tail()}"
        )

    def tail(self, lines: int = 40) -> str:
        with self.cond:
            return "\n".join(f"    [{self.name}] {line}" for line in self.lines[-lines:])


def _host_pid_of_child(pid: int) -> int | None:
    """The first child of ``pid`` (the runner that ``unshare --fork`` started)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


class Fleet:
    """Starts runner processes for one test and kills whatever is left at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.runners: list[RunnerProcess] = []
        self._count = 0

    def database_url(self, name: str, base: str | None = None) -> str:
        url = base or subprocess_env()["DATABASE_URL"]
        separator = "&" if "?" in url else "?"
        return f"{url}{separator}application_name={quote(APP_PREFIX + name)}"

    def spawn(
        self, name: str | None = None, *, concurrency: int = 4,
        settings: dict[str, Any] | None = None, args: Sequence[str] = (),
        database_url: str | None = None, wait_started: bool = True,
        pid_namespace: bool = False, timeout: float = 30.0, command: Sequence[str] | None = None,
    ) -> RunnerProcess:
        """Start ``manage.py runjobs`` with the suite's short timings (``settings`` on top).

        ``command`` replaces ``runjobs ...`` (another management command that runs a runner);
        ``pid_namespace`` runs it as pid 1 of a new pid namespace, so every such runner has the
        same pid: the pid-reuse case, for real.
        """
        self._count += 1
        name = name or f"r{self._count}"
        env = subprocess_env()
        env.update({
            "DATABASE_URL": self.database_url(name, database_url),
            "PJ_TEST_SETTINGS": json.dumps({**FAST_SETTINGS, **(settings or {})}),
            "PJ_TEST_LOG": "INFO",
        })
        if command is None and "--processes" not in args:
            args = [*args, "--processes", PROCESSES]
        argv = [sys.executable, str(ROOT / "manage.py"), *(command or [
            "runjobs", "--no-scheduler", "--concurrency", str(concurrency), *args])]
        if pid_namespace:
            argv = ["unshare", "--pid", "--fork", "--kill-child", *argv]
        runner = RunnerProcess(name, argv, env, self.log_dir / f"{name}-{self._count}.log")
        self.runners.append(runner)
        if wait_started:
            self.wait_started(runner, timeout)
        return runner

    def spawn_many(self, count: int, **options: Any) -> list[RunnerProcess]:
        """Start ``count`` runners side by side (Django boots in parallel), then wait for all."""
        runners = [self.spawn(wait_started=False, **options) for _ in range(count)]
        for runner in runners:
            self.wait_started(runner, options.get("timeout", 30.0))
        return runners

    @staticmethod
    def wait_started(runner: RunnerProcess, timeout: float = 30.0) -> str:
        match = runner.wait_line(_STARTED.pattern, timeout=timeout)
        runner.runner_id = match.group(1)
        return runner.runner_id

    def close(self) -> None:
        for runner in self.runners:
            if runner.alive:
                try:
                    runner.send(signal.SIGCONT)  # a frozen process cannot close its sockets
                    runner.send(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for runner in self.runners:
            with suppress(subprocess.TimeoutExpired):
                runner.proc.wait(10)
            runner._reader.join(5)
            # What the runner left in its process group (a liveness sidecar or a worker frozen
            # by SIGSTOP when the runner itself was SIGKILLed) must not outlive the scenario.
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(runner.pid, signal.SIGKILL)

    def logs(self) -> str:
        return "\n".join(f"--- {r.name} (pid {r.pid}, exit {r.proc.returncode})\n{r.tail(60)}"
                         for r in self.runners)


def database_url() -> str:
    """The URL of the database this test process uses (the shared server's test database)."""
    return subprocess_env()["DATABASE_URL"]


def runner_pid_from_id(runner_id: str) -> int:
    """Runner ids are ``host:pid:random``."""
    return int(runner_id.split(":")[-2])


def backends(app_name: str, where: str = "TRUE") -> list[tuple[Any, ...]]:
    """``(pid, state, wait_event, query)`` of one runner's connections (by application_name),
    in our own database only: the suite never touches other sessions on a shared server."""
    return sql(
        "SELECT pid, state, wait_event, query FROM pg_stat_activity WHERE datname = "
        f"current_database() AND application_name = %s AND pid <> pg_backend_pid() AND {where}",
        [APP_PREFIX + app_name],
    )


def terminate(pid: int) -> bool:
    """Terminate one of *our* runners' backends (checked by database and application name)."""
    return bool(sql_value(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = %s AND "
        "datname = current_database() AND application_name LIKE %s", [pid, APP_PREFIX + "%"]))


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")
