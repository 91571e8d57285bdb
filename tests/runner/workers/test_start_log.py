"""A lane's ``STARTED`` goes on the start log, never elsewhere.

The start log exists so that a job's start does not wake the supervisor; the report must still
be written before the handler runs, whatever the state of the log: a full log (a supervisor
that has not read it lately) holds the lane until it is read, and drops nothing. Real pipes, a
real ``Worker`` (no lanes started), no database.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from django_persistent_jobs.runner.workers import protocol
from django_persistent_jobs.runner.workers.channel import Reader
from django_persistent_jobs.runner.workers.main import Lane, Worker


@pytest.fixture
def pipes() -> Iterator[tuple[Worker, Reader, Reader, int]]:
    """A worker wired to a message pipe and a start log, and the supervisor's readers."""
    ours, theirs = socket.socketpair()
    log_read, log_write = os.pipe()
    os.set_blocking(log_read, False)  # the supervisor's ends
    ours.setblocking(False)
    worker = Worker(Connection(theirs.detach()),
                    {"alias": "default", "runner_id": "r-test", "number": 1, "concurrency": 1,
                     "start_log_fd": log_write})
    try:
        yield worker, Reader(ours.fileno()), Reader(log_read), log_write
    finally:
        worker.conn.close()
        ours.close()
        os.close(log_read)
        os.close(log_write)


def test_a_start_goes_on_the_log_with_its_time_and_wakes_nothing(
    pipes: tuple[Worker, Reader, Reader, int],
) -> None:
    worker, messages, log, _ = pipes
    before = time.monotonic()
    worker._report_started(Lane(3), 12345, True)
    after = time.monotonic()
    [started] = log.drain()
    assert started[:4] == (protocol.STARTED, 3, 12345, True)
    assert before <= started[4] <= after
    assert messages.read() == []  # the message pipe, which the supervisor waits on, is quiet


def test_a_full_log_holds_the_lane_until_the_supervisor_reads_it(
    pipes: tuple[Worker, Reader, Reader, int],
) -> None:
    """Never on the message pipe instead: there it could be handled after a newer start of
    the same lane from the log, and the lane's running job be taken for returned."""
    worker, messages, log, log_write = pipes
    # The worker's end does not block: its write holds the GIL while the log has room, and
    # waits for room with it released (a blocking write holding the GIL would stop this
    # test's own thread, the "supervisor" below, from ever reading).
    assert not os.get_blocking(log_write)
    filler = 0
    while True:  # fill the log as a supervisor that reads nothing would leave it
        try:
            filler += os.write(log_write, b"\0" * 4096)
        except BlockingIOError:
            break
    done = threading.Event()

    def start() -> None:
        worker._report_started(Lane(0), 888, False)
        done.set()

    threading.Thread(target=start, daemon=True).start()
    # Bounded negative check: the lane is still waiting, and wrote nowhere else.
    assert not done.wait(0.3), "the start went elsewhere, or was dropped"
    assert messages.read() == []
    while filler:  # the supervisor reads the log
        filler -= len(os.read(log.fd, min(filler, 65536)))
    assert done.wait(10)
    [started] = log.drain()
    assert started[:4] == (protocol.STARTED, 0, 888, False)
