"""The starts of waiting jobs, noted in memory and written to the database in batches.

A job claimed to wait for a free worker (``PREFETCH``) is recorded as waiting; when a worker
starts it, the runner notes the start here, and the next claim statement writes every noted start
in the same round trip (``store.claim_sql``). When no claim follows within ``FLUSH_AFTER``
seconds (every worker busy, nothing more to claim), the claim loop writes them on their own. So a
start costs no statement of its own while the runner drains, and is on record within a fraction
of a second.

Until it is written, a started job counts as waiting: if the runner dies in that window the job
is handed back uncharged (counted against ``HANDBACK_LIMIT``, which still ends a job that keeps
killing its runner) instead of charged an attempt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

#: How long a noted start may wait for a claim to carry it before it is written on its own.
FLUSH_AFTER = 0.1


class StartLog:
    """Attempt ids (fencing tokens) of waiting jobs a worker started, with when, not yet
    written. Thread-safe: executors note from their threads, the claim loop takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: list[int] = []
        self._times: list[datetime] = []
        self._oldest: float | None = None

    def note(self, token: int) -> None:
        when = datetime.now(UTC)
        with self._lock:
            self._tokens.append(token)
            self._times.append(when)
            if self._oldest is None:
                self._oldest = time.monotonic()

    def due_in(self, limit: float) -> float:
        """Seconds until the oldest noted start must be written (``limit`` when none is)."""
        with self._lock:
            if self._oldest is None:
                return limit
            return max(0.0, min(limit, self._oldest + FLUSH_AFTER - time.monotonic()))

    @property
    def overdue(self) -> bool:
        with self._lock:
            return self._oldest is not None and time.monotonic() - self._oldest >= FLUSH_AFTER

    @contextmanager
    def taken(self) -> Iterator[tuple[list[int], list[datetime]]]:
        """The noted starts, for one statement to write; noted again if it raises (the retry,
        or the next claim, writes them then)."""
        with self._lock:
            tokens, times, oldest = self._tokens, self._times, self._oldest
            self._tokens, self._times, self._oldest = [], [], None
        try:
            yield tokens, times
        except BaseException:
            with self._lock:
                self._tokens[:0] = tokens
                self._times[:0] = times
                if oldest is not None:
                    self._oldest = min(oldest, self._oldest or oldest)
            raise
