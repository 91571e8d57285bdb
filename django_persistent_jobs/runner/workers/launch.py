"""Starting a worker process: a fresh interpreter that runs this package's entry point and
nothing of the program that started the supervisor.

``multiprocessing``'s spawn start method re-imports the parent's ``__main__`` module in the
child. A program that starts ``runjobs`` from a plain script without an
``if __name__ == "__main__"`` guard (a deployment script, a benchmark harness, ``django-admin``
wrappers, an embedding host) would run ``runjobs`` again in every worker at import time, where
``multiprocessing`` refuses to start processes, and the supervisor would replace the dead
worker forever. So a worker is started with ``subprocess`` instead: ``python -c _BOOT`` reads
one start message from its end of a socket pair, takes the supervisor's ``sys.path`` (so a
settings module or handler package the supervisor can import, the worker can too), and calls
``main.boot``. The socket pair is then the message pipe, wrapped in ``multiprocessing``'s
``Connection``: the per-job messages are exactly what they were.

Death is noticed through a pidfd (Linux ≥ 5.3): it becomes readable the moment the process
exits, whatever killed it. Where there is none, the end of file on the pipe does the same job
(the worker's end closes when it dies).
"""

from __future__ import annotations

import contextlib
import multiprocessing.spawn
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

#: Only the standard library runs before ``sys.path`` is the supervisor's. ``sys.argv`` is the
#: supervisor's too, as ``multiprocessing`` gives its children (settings modules look at it).
#: A supervisor that died before sending the start message leaves an end of file: exit quietly.
_BOOT = """\
import sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
try:
    start = conn.recv()
except (EOFError, OSError):
    raise SystemExit(0)
sys.path[:] = start["sys_path"]
sys.argv[:] = start["sys_argv"]
__import__(start["module"], fromlist=["boot"]).boot(conn, start)
"""
#: The module whose ``boot(conn, start)`` runs the worker.
ENTRY_MODULE = __name__.rpartition(".")[0] + ".main"


def _interpreter_flags() -> list[str]:
    """The supervisor's own interpreter options (``-X dev``, ``-W``, ``-O``...), as
    ``multiprocessing`` passes them to its children."""
    flags = getattr(subprocess, "_args_from_interpreter_flags", None)
    if flags is None:  # pragma: no cover - present on every supported CPython
        return []
    return list(flags())


class WorkerProcess:
    """One started worker: its pid, a sentinel to wait on for its death, its exit code."""

    def __init__(self, options: dict[str, Any], *, label: str) -> None:
        ours, theirs = socket.socketpair()
        # The start log: a pipe of its own for the lanes' ``STARTED`` reports, which the
        # supervisor reads whenever it reads the message pipe, at housekeeping, and to the end
        # when the worker dies, but is not woken by (``protocol``).
        log_read, log_write = os.pipe()
        try:
            self.popen = subprocess.Popen(
                [multiprocessing.spawn.get_executable(), *_interpreter_flags(), "-c", _BOOT,
                 str(theirs.fileno()), label],
                pass_fds=(theirs.fileno(), log_write), close_fds=True,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            os.close(log_read)
            raise
        finally:
            theirs.close()
            os.close(log_write)
        self.pid: int = self.popen.pid
        self.conn = Connection(ours.detach())
        os.set_blocking(log_read, False)
        self.start_log: int | None = log_read
        self._lock = threading.Lock()
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):  # a kernel without pidfds: the pipe's EOF
                self._pidfd = os.pidfd_open(self.pid)
        start = {
            "sys_path": list(sys.path), "sys_argv": list(sys.argv), "module": ENTRY_MODULE,
            "parent_pid": os.getpid(), "settings_module": settings_module(), "options": options,
            "start_log_fd": log_write,  # (``pass_fds`` keeps the number)
        }
        self.conn.send(start)  # buffered by the socket until the child reads it

    @property
    def sentinel(self) -> int | None:
        """A file descriptor readable once the process has exited (None: watch the pipe)."""
        return self._pidfd

    @property
    def exitcode(self) -> int | None:
        """As ``multiprocessing`` reports it: negative for a signal, None while it runs."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def kill(self) -> None:
        """SIGKILL it (through the pidfd where there is one: never another process that reused
        the pid)."""
        with self._lock:
            if self.popen.poll() is not None:
                return
            if self._pidfd is not None and hasattr(signal, "pidfd_send_signal"):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                with contextlib.suppress(ProcessLookupError):
                    self.popen.kill()

    def close(self) -> None:
        """Release its file descriptors (once it is gone and unwatched)."""
        with self._lock:
            if self._pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._pidfd)
                self._pidfd = None
            if self.start_log is not None:
                with contextlib.suppress(OSError):
                    os.close(self.start_log)
                self.start_log = None
        with contextlib.suppress(OSError):
            self.conn.close()


def settings_module() -> str | None:
    """The settings module a worker loads: the supervisor's (None when Django was configured
    with ``settings.configure()``, which no other process can repeat)."""
    from django.conf import settings

    name = os.environ.get("DJANGO_SETTINGS_MODULE") or getattr(settings, "SETTINGS_MODULE", None)
    return name if isinstance(name, str) and name else None
