"""System calls that cannot block, made without giving up the GIL.

Python releases the GIL around every system call it makes (``select.poll``, ``os.write``),
because most of them may block. With tens of threads that release is a hand-off: another thread
takes the GIL, and the caller waits to get it back, for up to the switch interval. Two calls sit
on every job's path: a handler thread polls its idle database connection before each job (a
connection the server closed while idle must not cost the job an attempt), and a worker
process's lane writes the job's start to the start log before the handler runs. ``py-spy`` of a
``--concurrency 32`` drain of no-op jobs put a quarter of all samples on that poll. Neither call
can block as made here (a zero timeout; a non-blocking pipe), so holding the GIL through them
costs nothing: ``ctypes.PyDLL`` calls C without releasing it.

Only the standard library is imported: a worker process imports this before Django is set up.
Where libc cannot be reached this way (not a POSIX system), the plain calls are used.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
from typing import Any

#: Where ``select.poll`` is missing (Windows), ``readable`` asks ``select.select``.
_HAS_POLL = hasattr(select, "poll")
_EVENTS = (select.POLLIN | select.POLLERR | select.POLLHUP) if _HAS_POLL else 0
#: The largest write a pipe takes all or nothing (POSIX guarantees at least 512 bytes).
_PIPE_BUF = getattr(select, "PIPE_BUF", 512)


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def _libc() -> ctypes.PyDLL | None:
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        libc.poll.argtypes = [ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.c_int]
        libc.poll.restype = ctypes.c_int
        libc.write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        libc.write.restype = ctypes.c_ssize_t
    except (OSError, AttributeError, TypeError):
        return None
    return libc


_LIBC = _libc()


def _select_poll(fd: int) -> bool:
    if not _HAS_POLL:
        readable_now, _, broken = select.select([fd], [], [fd], 0)
        return bool(readable_now or broken)
    poller = select.poll()
    poller.register(fd, _EVENTS)
    return bool(poller.poll(0))


#: One ``pollfd`` per descriptor polled, made once: building it and its pointer cost more than
#: the call itself. (A descriptor is polled by one thread at a time: the one whose connection
#: it is; ``poll`` only writes ``revents``, which nothing reads.)
_POLLFDS: dict[int, Any] = {}


def readable(fd: int) -> bool:
    """True if the socket has data, an error or a hang-up waiting; never blocks."""
    if _LIBC is None:
        return _select_poll(fd)
    pointer = _POLLFDS.get(fd)
    if pointer is None:
        pointer = _POLLFDS[fd] = ctypes.byref(_PollFd(fd, _EVENTS, 0))
    answer: int = _LIBC.poll(pointer, 1, 0)
    if answer < 0:
        return _select_poll(fd)  # EINTR and the like: ask the ordinary way
    return answer > 0


def write_whole(fd: int, data: bytes) -> None:
    """Write ``data`` (at most ``PIPE_BUF`` bytes) to the non-blocking pipe ``fd`` in one
    piece: holding the GIL while the pipe has room, and waiting for room with the GIL released
    when it is full. Raises ``OSError`` as ``os.write`` does (a pipe whose reader is gone)."""
    if len(data) > _PIPE_BUF:
        # Longer, a write may be cut short, and a reader would take the rest for a new frame.
        raise ValueError(f"{len(data)} bytes cannot be written to a pipe in one piece "
                         f"(at most {_PIPE_BUF})")
    while True:
        if _LIBC is not None:
            written = _LIBC.write(fd, data, len(data))
            if written >= 0:
                return  # (a pipe write of at most PIPE_BUF bytes is all or nothing)
            code = ctypes.get_errno()
            if code not in (errno.EAGAIN, errno.EINTR):
                raise OSError(code, os.strerror(code))
        else:
            try:
                os.write(fd, data)
                return
            except BlockingIOError:
                pass
        # Full: wait for room with the GIL released while the reader makes it.
        if _HAS_POLL:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            poller.poll()
        else:
            select.select([], [fd], [fd])
