"""The GIL-holding system calls of ``runner.syscalls``: the same answers as the plain calls,
and a full pipe still waits with the GIL released (a writer holding it while blocked would stop
every other thread of its process, the reader included)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from django_persistent_jobs.runner import syscalls


@pytest.fixture(params=["libc", "plain"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test runs against the ``PyDLL`` calls and against the standard-library fallback."""
    if request.param == "plain":
        monkeypatch.setattr(syscalls, "_LIBC", None)
    elif syscalls._LIBC is None:
        pytest.skip("libc's poll and write are not reachable through ctypes here")
    yield request.param


def test_readable_says_whether_a_socket_has_data_or_a_hang_up(mode: str) -> None:
    mine, peer = socket.socketpair()
    try:
        assert syscalls.readable(mine.fileno()) is False
        peer.sendall(b"x")
        assert syscalls.readable(mine.fileno()) is True
        assert mine.recv(1) == b"x"
        assert syscalls.readable(mine.fileno()) is False
        peer.close()  # the server closing an idle connection looks like this
        assert syscalls.readable(mine.fileno()) is True
    finally:
        mine.close()
        peer.close()


def test_write_whole_writes_a_frame_in_one_piece(mode: str) -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        syscalls.write_whole(write_end, b"frame-1")
        syscalls.write_whole(write_end, b"frame-2")
        assert os.read(read_end, 100) == b"frame-1frame-2"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_full_pipe_waits_for_room_with_the_gil_released(mode: str) -> None:
    """The writer fills the pipe and must then wait; the reader is a thread of this same
    process, so it can only make room if the waiting writer gave up the GIL."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    frame = b"x" * 100
    frames = 3 * 65536 // len(frame)  # three times what a default pipe holds
    written = threading.Event()
    failure: list[BaseException] = []

    def writer() -> None:
        try:
            for _ in range(frames):
                syscalls.write_whole(write_end, frame)
        except BaseException as exc:  # pragma: no cover - reported below
            failure.append(exc)
        finally:
            written.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    received = 0
    try:
        while received < frames * len(frame):
            chunk = os.read(read_end, 65536)
            assert chunk, "the pipe closed early"
            received += len(chunk)
        assert written.wait(10), "the writer never finished"
        assert not failure, failure
        assert received == frames * len(frame)  # nothing lost, nothing cut
    finally:
        os.close(read_end)
        thread.join(10)
        os.close(write_end)


def test_write_whole_raises_once_the_reader_is_gone(mode: str) -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    os.close(read_end)
    try:
        with pytest.raises(OSError):
            syscalls.write_whole(write_end, b"late")
    finally:
        os.close(write_end)


def test_a_frame_longer_than_a_pipe_writes_whole_is_refused() -> None:
    """Cut short, the rest of it would read as the start of the next frame."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        with pytest.raises(ValueError, match="in one piece"):
            syscalls.write_whole(write_end, b"x" * (syscalls._PIPE_BUF + 1))
        syscalls.write_whole(write_end, b"x" * syscalls._PIPE_BUF)
        assert len(os.read(read_end, 2 * syscalls._PIPE_BUF)) == syscalls._PIPE_BUF
    finally:
        os.close(read_end)
        os.close(write_end)
