"""UUID version 7 ids: time-ordered, so new jobs land at the right edge of the primary key index
instead of scattering writes across it as random v4 ids would."""

from __future__ import annotations

import os
import threading
import time
import uuid

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


def uuid7() -> uuid.UUID:
    """Return a UUIDv7 (RFC 9562) that is monotonic within this process.

    The 12-bit ``rand_a`` field carries a counter when several ids share a millisecond, so ids made
    by one process sort in creation order (``enqueue_many`` relies on it for FIFO).
    """
    global _last_ms, _counter, _random, _random_at
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _last_ms:
            _counter += 1
            if _counter > 0xFFF:
                _last_ms += 1
                _counter = 0
            ms = _last_ms
        else:
            _last_ms = ms
            _counter = 0
        counter = _counter
        if _random_at >= len(_random):
            _random, _random_at = os.urandom(_RANDOM_BLOCK), 0
        rand_b = int.from_bytes(_random[_random_at:_random_at + 8], "big") & 0x3FFF_FFFF_FFFF_FFFF
        _random_at += 8
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand_b
    return uuid.UUID(int=value)
