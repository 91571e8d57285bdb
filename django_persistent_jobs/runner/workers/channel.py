"""The bytes on a worker's pipe: ``multiprocessing.Connection``'s framing, read and written in
bulk.

``Connection.recv`` costs two reads per message (and the supervisor's ``poll`` before it a third
system call); ``Reader`` takes whatever one read brings and cuts every complete message out of
it. The framing is ``Connection``'s (a 4-byte big-endian length, or -1 and an 8-byte length,
then the pickle), so either side may use a plain ``Connection`` instead.

The supervisor's end is non-blocking (``Writer``): a worker whose handler holds its GIL reads
nothing, and a large payload must not then block the supervisor's thread that writes it (the
one that also notices dead workers). What the kernel does not take at once waits in ``pending``
until the pipe is writable again.
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
from typing import Any

#: Bytes asked of the kernel per read: a burst of messages is read in one system call.
READ_SIZE = 1 << 16
_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")


def frame(message: Any) -> bytes:
    payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    size = len(payload)
    if size > 0x7FFFFFFF:
        return _HEADER.pack(-1) + _LONG_HEADER.pack(size) + payload
    return _HEADER.pack(size) + payload


class Reader:
    """The messages a peer sent on ``fd``, as many as one read brings.

    On a blocking descriptor ``read()`` blocks only when no complete message is buffered; on a
    non-blocking one it returns ``[]`` instead.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = bytearray()

    def read(self) -> list[Any]:
        """The complete messages that (at most) one read brings; ``EOFError`` once the peer has
        closed its end."""
        try:
            chunk = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return []
        if not chunk:
            raise EOFError
        self.buffer += chunk
        return self._parse()

    def drain(self) -> list[Any]:
        """Every complete message written so far, up to the end of file (a non-blocking
        descriptor: for a peer that has exited)."""
        messages: list[Any] = []
        while True:
            try:
                chunk = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                return messages
            if not chunk:
                return messages
            self.buffer += chunk
            messages += self._parse()

    def _parse(self) -> list[Any]:
        buffer = self.buffer
        messages = []
        offset = 0
        end = len(buffer)
        while end - offset >= 4:
            (size,) = _HEADER.unpack_from(buffer, offset)
            start = offset + 4
            if size == -1:
                if end - start < 8:
                    break
                (size,) = _LONG_HEADER.unpack_from(buffer, start)
                start += 8
            if end - start < size:
                break
            messages.append(pickle.loads(buffer[start:start + size]))
            offset = start + size
        if offset:
            del buffer[:offset]
        return messages


class Writer:
    """Writes framed messages to a non-blocking ``fd`` without ever blocking the caller.

    Safe to call from any thread. ``send`` returns False when part of the message is left in
    ``pending`` (the pipe is full): whoever watches the descriptor then calls ``flush`` when it
    is writable. A message is never interleaved with another: later ones queue behind it.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = bytearray()
        self.lock = threading.Lock()

    def send(self, message: Any) -> bool:
        """Write ``message`` (or queue it); raises ``OSError`` if the peer is gone."""
        data = frame(message)
        with self.lock:
            if self.fd < 0:
                raise OSError("the channel is closed")
            if self.pending:
                self.pending += data
                return False
            try:
                written = os.write(self.fd, data)
            except BlockingIOError:
                written = 0
            if written < len(data):
                self.pending += data[written:]
                return False
            return True

    def flush(self) -> bool:
        """Write what is pending, as far as the pipe takes it; True once nothing is left."""
        with self.lock:
            if self.fd < 0:
                return True
            while self.pending:
                try:
                    written = os.write(self.fd, self.pending)
                except BlockingIOError:
                    return False
                del self.pending[:written]
            return True

    def close(self) -> None:
        """Close the descriptor; later sends raise ``OSError``."""
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
                self.pending.clear()
