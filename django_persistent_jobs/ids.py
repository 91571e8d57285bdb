"""UUID version 7 ids: time-ordered, so new jobs land at the right edge of the primary key index
instead of scattering writes across it as random v4 ids would."""

from __future__ import annotations

import os
import pickle
import struct
import threading
import time
import uuid
from collections.abc import Callable

_lock = threading.Lock()
_last_ms = 0
_counter = 0
#: Random bits are read from the OS in blocks: one ``getrandom`` call per id was the largest
#: single cost of ``enqueue_many`` after the insert itself.
_RANDOM_BLOCK = 4096
_random = b""
_random_at = 0


def _forget_random() -> None:
    """A forked child must not reuse the parent's unread random bits (same ids in both)."""
    global _random, _random_at
    _random, _random_at = b"", 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_random)


def _checked_uuid(value: int) -> uuid.UUID:
    return uuid.UUID(int=value)


def _unchecked_uuid(value: int) -> uuid.UUID:
    """``uuid.UUID(int=value)`` for a ``value`` known to fit in 128 bits, without the checks
    of ``UUID.__init__`` (its keyword handling and range test cost more than half of making an
    id, the largest share of ``enqueue_many``'s work per job after the payload)."""
    made = _new_uuid(uuid.UUID)
    _set_slot(made, "int", value)
    _set_slot(made, "is_safe", _SAFE_UNKNOWN)
    return made


_new_uuid = object.__new__
_set_slot = object.__setattr__
_SAFE_UNKNOWN = uuid.SafeUUID.unknown


def _uuid_maker() -> Callable[[int], uuid.UUID]:
    """The unchecked maker where it makes exactly what ``UUID(int=...)`` makes (this Python's
    ``UUID`` keeps its value in the ``int`` and ``is_safe`` slots, as CPython's always has),
    the checked one otherwise."""
    probe = (0x7 << 76) | (0b10 << 62) | 12345
    try:
        made, expected = _unchecked_uuid(probe), uuid.UUID(int=probe)
        same = (made == expected and hash(made) == hash(expected)
                and str(made) == str(expected) and made.version == 7
                and made.is_safe is expected.is_safe
                and pickle.loads(pickle.dumps(made)) == expected)
    except Exception:  # pragma: no cover - another Python's UUID
        same = False
    return _unchecked_uuid if same else _checked_uuid


_make_uuid = _uuid_maker()


def uuid7() -> uuid.UUID:
    """Return a UUIDv7 (RFC 9562) that is monotonic within this process.

    The 12-bit ``rand_a`` field carries a counter when several ids share a millisecond, so ids made
    by one process sort in creation order (``enqueue_many`` relies on it for FIFO).
    """
    return uuid7_many(1)[0]


def uuid7_many(count: int) -> list[uuid.UUID]:
    """``count`` UUIDv7s as ``uuid7`` would make them one after the other, under one lock and
    one clock read (``enqueue_many`` makes one per job)."""
    global _last_ms, _counter, _random, _random_at
    made: list[uuid.UUID] = []
    make = _make_uuid
    while len(made) < count:
        with _lock:
            ms = time.time_ns() // 1_000_000
            if ms <= _last_ms:
                ms = _last_ms
                if _counter >= 0xFFF:
                    ms = _last_ms = _last_ms + 1
                    first = 0
                else:
                    first = _counter + 1
            else:
                _last_ms = ms
                first = 0
            take = min(count - len(made), 0x1000 - first)
            _counter = first + take - 1
            need = 8 * take
            if len(_random) - _random_at < need:
                _random, _random_at = os.urandom(max(_RANDOM_BLOCK, need)), 0
            block = _random[_random_at:_random_at + need]
            _random_at += need
        head = (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | 0b10 << 62
        # The 62 random bits of each id from 8 bytes of the block, read all at once.
        for i, bits in enumerate(struct.unpack(f">{take}Q", block), first):
            made.append(make(head | i << 64 | bits & 0x3FFF_FFFF_FFFF_FFFF))
    return made


class UUID7Batch:
    """Hands out UUIDv7s one at a time, made ``size`` at a time by ``uuid7_many``; for a caller
    that needs many but does not know how many in advance (ids it does not use are skipped)."""

    __slots__ = ("_ids", "_size")

    def __init__(self, size: int = 256) -> None:
        self._ids: list[uuid.UUID] = []
        self._size = size

    def next(self) -> uuid.UUID:
        if not self._ids:
            self._ids = uuid7_many(self._size)
            self._ids.reverse()
            self._size = min(self._size * 4, 4096)
        return self._ids.pop()
