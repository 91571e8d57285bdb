"""The bytes between the supervisor and a worker: framing compatible with
``multiprocessing.Connection`` both ways, bulk reads, writes that never block, and the job codec.

Real socket pairs and real threads; no database is involved in framing.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from django_persistent_jobs.runner.store import ClaimedJob
from django_persistent_jobs.runner.workers import protocol
from django_persistent_jobs.runner.workers.channel import READ_SIZE, Reader, Writer, frame


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_reader_takes_every_message_one_read_brings(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    sender = Connection(os.dup(a.fileno()))
    for n in range(50):
        sender.send((protocol.DONE, [n]))
    messages = Reader(b.fileno()).read()
    assert messages == [(protocol.DONE, [n]) for n in range(50)]
    sender.close()


def test_a_message_split_across_reads_comes_out_whole_once_complete(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    data = frame((protocol.RUN, ["x" * 1000])) + frame((protocol.STOP,))
    reader = Reader(b.fileno())
    a.sendall(data[:3])  # not even a whole header
    assert reader.read() == []
    a.sendall(data[3:500])
    assert reader.read() == []
    a.sendall(data[500:])
    assert reader.read() == [(protocol.RUN, ["x" * 1000]), (protocol.STOP,)]


def test_end_of_file_is_eof_error_and_a_nonblocking_reader_returns_nothing_meanwhile(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    os.set_blocking(b.fileno(), False)
    reader = Reader(b.fileno())
    assert reader.read() == []  # nothing written yet: no waiting
    a.sendall(frame((protocol.READY, 1)))
    a.close()
    assert reader.drain() == [(protocol.READY, 1)]
    with pytest.raises(EOFError):
        reader.read()


def test_a_full_pipe_never_blocks_the_writer_and_loses_nothing(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A worker busy in a handler reads nothing: a large payload stays queued in the writer
    (the caller is not blocked) and arrives intact, in order, once the peer reads again."""
    a, b = pair
    os.set_blocking(a.fileno(), False)
    writer = Writer(a.fileno())
    big = os.urandom(8 * READ_SIZE)
    assert writer.send((protocol.RUN, big)) is False  # more than the socket buffer takes
    assert writer.pending
    assert writer.send((protocol.CANCEL, 7)) is False  # queued behind, never interleaved
    receiver = Connection(os.dup(b.fileno()))
    received: list[object] = []
    reading = threading.Thread(target=lambda: received.extend(
        [receiver.recv(), receiver.recv()]))
    reading.start()
    while not writer.flush():
        threading.Event().wait(0.001)
    reading.join(10)
    assert received == [(protocol.RUN, big), (protocol.CANCEL, 7)]
    receiver.close()


def test_frames_are_what_connection_recv_expects_and_a_dead_peer_is_an_os_error(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    os.set_blocking(a.fileno(), False)
    writer = Writer(a.fileno())
    receiver = Connection(os.dup(b.fileno()))
    assert writer.send((protocol.INTERRUPT, 5, 2)) is True
    assert receiver.recv() == (protocol.INTERRUPT, 5, 2)
    receiver.close()
    b.close()
    with pytest.raises(OSError):
        for _ in range(100):  # the first write after the close may still be accepted
            writer.send((protocol.STOP,))


def test_a_claimed_job_survives_the_round_trip() -> None:
    job = ClaimedJob(
        id=uuid.uuid4(), job_type="app.send", payload={"to": ["a@example.com"], "n": 1},
        attempt=2, max_retries=5, timeout=30.0, token=987654321, queue="mail", priority=-3,
        cancel_requested=True, tenant="acme",
        due_at=datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC),
        payload_error=None,
    )
    packed = protocol.pack_job(job)
    assert dataclasses.fields(ClaimedJob)[protocol._DUE_AT].name == "due_at"
    assert packed[0] == job.id.int
    # Only plain values: a UUID or an aware datetime would pickle through copyreg, slowly.
    assert all(isinstance(v, (int, float, str, bool, dict, type(None))) for v in packed)
    assert protocol.unpack_job(packed) == job
    unpacked_due = protocol.unpack_job(packed).due_at
    assert unpacked_due is not None and unpacked_due.microsecond == 678901  # exact, not a float
    # Messages name a job by its attempt's token: a late report of a timed-out attempt must
    # not be taken for its retry's.
    assert protocol.wire_id(job) == job.token == packed[protocol.TOKEN]
    elsewhere = dataclasses.replace(job, due_at=datetime.datetime(
        2026, 1, 2, 5, 4, 5, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=2))))
    assert protocol.unpack_job(protocol.pack_job(elsewhere)).due_at == elsewhere.due_at
    undue = dataclasses.replace(job, due_at=None)
    assert protocol.unpack_job(protocol.pack_job(undue)) == undue
    # USE_TZ = False: naive datetimes, which have no epoch to count from, go as they are.
    naive = dataclasses.replace(job, due_at=datetime.datetime(2026, 1, 2, 3, 4, 5, 678901))
    assert protocol.unpack_job(protocol.pack_job(naive)) == naive


def test_a_closed_writer_refuses_to_write_instead_of_using_a_reused_descriptor(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    fd = os.dup(a.fileno())
    writer = Writer(fd)
    writer.close()
    reused = os.dup(b.fileno())  # the kernel hands out the lowest free number: likely ``fd``
    try:
        with pytest.raises(OSError):
            writer.send((protocol.STOP,))
        assert writer.flush() is True
    finally:
        os.close(reused)
