"""The liveness sidecar: a tiny separate process that vouches for a runner whose Python threads
cannot run.

A runner's heartbeat is a Python thread, and a handler that spends seconds in a C call that does
not release the GIL (a regular expression backtracking, a big ``sum`` or bytes operation, a
careless extension) starves every thread of the process, the heartbeat included. Without help,
other runners would then declare a live runner dead and rescue its healthy job, again and again.

The sidecar is started by the runner with ``python sidecar.py`` (no Django, only psycopg) and its
own database connection. The runner's supervisor thread (the one that enforces timeouts) writes
a line to the sidecar's stdin four times a second, and a worker does when it starts a job: a
*vouch horizon*, how long from now the runner could legitimately be busy (the stale-lock timeout
plus the time left to its in-flight jobs' deadlines). When those lines stop coming, the sidecar
refreshes the runner's heartbeat itself, as long as:

* the runner process still exists and is its parent (end of file on stdin, or a new parent pid,
  means the runner died: the sidecar exits at once and never beats for a dead runner);
* the runner is not stopped or a zombie (``/proc/<pid>/stat`` state ``T``, ``t``, ``Z``, ``X``):
  a frozen runner is as good as dead and its jobs must be rescued;
* the last horizon has not run out: a runner that stays unresponsive past the deadlines of every
  job it holds is declared dead in the ordinary way, since it cannot enforce those deadlines.

So a runner is declared dead when its process is dead, frozen, or unresponsive past its jobs'
deadlines, and never merely because a handler holds the GIL within its timeout. The sidecar only
updates an existing row (``UPDATE ... WHERE id``): it cannot resurrect a runner already reaped.
Linux only (it reads ``/proc``); elsewhere the runner runs without it.

This module must import nothing but the standard library at module level: the child runs it as
a plain script, without Django.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: How much lower the sidecar's CPU priority is than its runner's (``os.nice``).
SIDECAR_NICENESS = 10
#: A parent state in which it is not running code: stopped (SIGSTOP, a debugger) or dead.
_NOT_RUNNING = frozenset("TtZX")
#: Runs this file as ``__main__`` without putting its directory (the runner package, whose
#: module names are not meant to be top-level) or the working directory on ``sys.path``.
_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"


def supported() -> bool:
    return sys.platform.startswith("linux") and Path("/proc/self/stat").exists()


class LivenessSidecar:
    """The runner's handle on its sidecar process (see the module docstring)."""

    def __init__(self, conninfo: dict[str, Any], runner_id: str, interval: float) -> None:
        self.conninfo = conninfo
        self.runner_id = runner_id
        self.interval = interval
        self.proc: subprocess.Popen[bytes] | None = None
        self._broken = False
        self._lock = threading.Lock()  # vouches come from the supervisor and from workers

    @classmethod
    def for_alias(cls, alias: str, runner_id: str, interval: float) -> LivenessSidecar:
        """Connection parameters as Django would use them, minus what is not libpq's."""
        from django.db import connections

        params = connections[alias].get_connection_params()
        conninfo = {key: value for key, value in params.items()
                    if isinstance(value, str | int | float) and not isinstance(value, bool)}
        app = conninfo.get("application_name")
        conninfo["application_name"] = f"{app}/liveness" if app else "pj-liveness"
        return cls(conninfo, runner_id, interval)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, __file__], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, close_fds=True,
        )
        assert self.proc.stdin is not None
        config = {"conninfo": self.conninfo, "runner_id": self.runner_id,
                  "interval": self.interval, "parent": os.getpid()}
        # The password travels over the pipe, not the command line or the environment.
        self.proc.stdin.write(json.dumps(config).encode() + b"\n")
        self.proc.stdin.flush()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def vouch(self, horizon: float) -> bool:
        """Tell the sidecar the runner is responsive and may be busy for ``horizon`` seconds."""
        if self.proc is None or self.proc.stdin is None or self._broken:
            return False
        try:
            with self._lock:
                self.proc.stdin.write(f"{horizon:.3f}\n".encode())
                self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            self._broken = True
            return False

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # end of file: the sidecar exits
        except OSError:
            pass
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(2)


# ------------------------------------------------------------------------------ the child
def _parent_state(pid: int) -> str | None:
    """The parent's scheduler state letter, or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def main() -> int:  # pragma: no cover - runs in the child process; tested through runners
    import signal

    # Its start (an interpreter, psycopg, a connection: about 0.2 s of CPU) must not take a
    # core from the runner it serves, which starts draining at the same moment. A lower
    # priority still runs it within a fraction of a second; its deadlines are seconds.
    with contextlib.suppress(OSError):
        os.nice(SIDECAR_NICENESS)
    import psycopg

    # The sidecar lives exactly as long as its runner: a Ctrl-C or a SIGTERM sent to the whole
    # process group is the runner's to handle, and the runner's exit ends the sidecar.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stdin = sys.stdin.buffer.fileno()
    buffer = b""
    while b"\n" not in buffer:
        chunk = os.read(stdin, 65536)
        if not chunk:
            return 0
        buffer += chunk
    first, buffer = buffer.split(b"\n", 1)
    config = json.loads(first)
    parent: int = config["parent"]
    interval: float = config["interval"]
    runner_id: str = config["runner_id"]
    conninfo: dict[str, Any] = config["conninfo"]
    conninfo.setdefault("connect_timeout", max(2, int(interval * 2)))
    last_vouch = time.monotonic()
    horizon = 0.0
    last_beat = 0.0
    connection: Any = None
    tick = max(0.02, min(0.25, interval / 4))
    while True:
        *lines, buffer = buffer.split(b"\n")
        if lines:  # the last word counts (lines may have arrived with the configuration)
            horizon = float(lines[-1])
            last_vouch = time.monotonic()
        ready, _, _ = select.select([stdin], [], [], tick)
        if ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return 0  # the runner closed the pipe, or died
            buffer += chunk
            continue
        if os.getppid() != parent:
            return 0  # the runner died; we were adopted
        now = time.monotonic()
        silent = now - last_vouch
        if silent <= interval or silent > horizon or now - last_beat < interval:
            continue
        state = _parent_state(parent)
        if state is None or state in _NOT_RUNNING:
            continue
        try:
            if connection is None or connection.closed:
                connection = psycopg.connect(**conninfo, autocommit=True)
                connection.execute("SET lock_timeout = '1s'")
                connection.execute("SET statement_timeout = '5s'")
            connection.execute(
                "UPDATE persistent_jobs_runners SET heartbeat_at = now() WHERE id = %s",
                [runner_id],
            )
            last_beat = now
        except psycopg.Error as exc:
            print(f"liveness sidecar of runner {runner_id}: heartbeat failed: {exc}",
                  file=sys.stderr, flush=True)
            if connection is not None:
                with contextlib.suppress(psycopg.Error):
                    connection.close()
            connection = None
            last_beat = now  # try again one interval later, not in a tight loop


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
