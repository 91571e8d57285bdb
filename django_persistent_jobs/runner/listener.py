"""LISTEN loop: turns NOTIFYs into a wake-up of the claim loop, and holds the runner's lease.

The lease is a session-level advisory lock on the LISTEN connection (``store.take_lease``): the
server drops it the moment this session ends, however the runner died (SIGKILL, a lost host),
so other runners can hand back this runner's *waiting* jobs within a second or two instead of
after the stale-lock timeout. Its heartbeat still decides when its *started* jobs are rescued.
A runner that is alive but lost this session for a while may see its waiting jobs handed back
too: each is refused when a worker is about to start it (``starts.StartGate``), so nothing runs
twice; the reconnected session takes the lease again. The loop notes, in ``lease``, when it last
heard from its session while holding the lease: waiting jobs start on the fast path only while
that is recent (``starts``).

NOTIFY is only a hint. The claim loop polls on its own, and this loop pings its connection every
few seconds, so a dead LISTEN connection (a restarted server, a terminated backend, a silently
dropped socket) is noticed and re-established, and a wake-up is sent after each reconnect in case
notifications were missed while it was down.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.db import connections

from ..services import NOTIFY_CHANNEL
from . import store
from .db import Backoff, error_line, is_connection_error, reset_connection
from .lifecycle import Lifecycle
from .starts import Lease

logger = logging.getLogger("django_persistent_jobs.runner")

KEEPALIVE_SECONDS = 5.0
#: How long one wait for notifications lasts, and how late it may end and still count as
#: hearing from the session (see the loop).
WAIT_SECONDS = 0.1
LATE_SECONDS = 0.1
#: How often to try for a lease our previous session still holds.
LEASE_RETRY_SECONDS = 0.5


def listen_loop(alias: str, lifecycle: Lifecycle, *, runner_id: str,
                poll_interval: float, lease: Lease | None = None) -> None:
    """Set ``lifecycle.wake`` for every NOTIFY until ``lifecycle.halt``; ``listening`` tells
    whether notifications can arrive right now (``poll_interval`` is only for the log), and
    ``lease`` whether this session holds the runner's lease and when it was last heard from."""
    lease = lease if lease is not None else Lease()
    halt, wake, listening = lifecycle.halt, lifecycle.wake, lifecycle.listening
    backoff = Backoff()
    while not halt.is_set():
        try:
            connection = connections[alias]
            connection.ensure_connection()
            raw = connection.connection
            assert raw is not None
            asked = time.monotonic()
            owned = _take_lease(raw, runner_id)
            lease.held(owned, asked)
            raw.execute(f"LISTEN {NOTIFY_CHANNEL}")
            listening.set()
            wake.set()  # anything committed while we were not listening
            backoff.reset()
            last_ping = last_try = time.monotonic()
            while not halt.is_set():
                began = time.monotonic()
                for _ in raw.notifies(timeout=WAIT_SECONDS):
                    wake.set()
                now = time.monotonic()
                if now - began <= WAIT_SECONDS + LATE_SECONDS:
                    # A wait that ended in time without an error: the server had not ended the
                    # session when it began (it would have said so, and the wait would have
                    # raised). A wait that overran proves nothing (this process was frozen, or
                    # starved, meanwhile, and the session may have ended unread): the next
                    # wait, which reads whatever came, decides.
                    lease.held(owned, began)
                if not owned and now - last_try >= LEASE_RETRY_SECONDS:
                    # Our previous session still holds it (the server has not noticed that
                    # it is gone): take it over the moment it goes.
                    owned, last_try = _take_lease(raw, runner_id), now
                if now - last_ping >= KEEPALIVE_SECONDS:
                    raw.execute("SELECT 1")
                    last_ping = now
        except Exception as exc:
            if not is_connection_error(exc) and not _is_psycopg_error(exc):
                raise
            listening.clear()
            lease.lost()
            reset_connection(alias)
            delay = backoff.next()
            logger.warning(
                "LISTEN connection lost (%s); polling every %.2fs until it is back, "
                "reconnecting in %.1fs", error_line(exc, ""),
                poll_interval, delay, extra={"event": "listen_lost", "runner_id": runner_id},
            )
            halt.wait(delay)
    listening.clear()
    lease.lost()


def _take_lease(raw: Any, runner_id: str) -> bool:
    """Take the lease on this session; False while another session holds it (most likely our
    previous one, not yet gone on the server side: it protects this runner's jobs as well)."""
    with raw.cursor() as cursor:
        return store.take_lease(cursor, runner_id)


def _is_psycopg_error(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc, psycopg.Error)
