"""A lane's ``STARTED`` goes on the start log, and on the message pipe when the log is full.

The start log exists so that a job's start does not wake the supervisor; the report must still
be written before the handler runs, whatever the state of the log: a full log (a supervisor
that has not read it lately) must not drop it or block the lane. Real pipes, a real ``Worker``
(no lanes started), no database.
"""

from __future__ import annotations

import os
import socket
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
    os.set_blocking(log_read, False)
    os.set_blocking(log_write, False)
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


def test_a_full_log_sends_the_start_on_the_message_pipe_with_the_reports_waiting(
    pipes: tuple[Worker, Reader, Reader, int],
) -> None:
    worker, messages, _, log_write = pipes
    while True:  # fill the log as a supervisor that reads nothing would leave it
        try:
            os.write(log_write, b"\0" * 4096)
        except BlockingIOError:
            break
    worker._report(protocol.RETURNED, 777, flush=False)  # a report waiting to be written
    worker._report_started(Lane(0), 888, False)
    got = messages.read()
    assert [m[0] for m in got] == [protocol.RETURNED, protocol.STARTED]
    assert got[0][1] == [777]
    assert got[1][:4] == (protocol.STARTED, 0, 888, False)
    assert worker.finished == []
