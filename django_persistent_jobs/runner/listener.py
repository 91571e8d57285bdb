"""LISTEN loop: turns NOTIFYs into a wake-up of the claim loop.

NOTIFY is only a hint. The claim loop polls on its own, and this loop pings its connection every
few seconds, so a dead LISTEN connection (a restarted server, a terminated backend, a silently
dropped socket) is noticed and re-established, and a wake-up is sent after each reconnect in case
notifications were missed while it was down.
"""

from __future__ import annotations

import logging
import time

from django.db import connections

from ..services import NOTIFY_CHANNEL
from .db import Backoff, is_connection_error, reset_connection
from .lifecycle import Lifecycle

logger = logging.getLogger("django_persistent_jobs.runner")

KEEPALIVE_SECONDS = 5.0


def listen_loop(alias: str, lifecycle: Lifecycle, *, runner_id: str,
                poll_interval: float) -> None:
    """Set ``lifecycle.wake`` for every NOTIFY until ``lifecycle.halt``; ``listening`` tells
    whether notifications can arrive right now (``poll_interval`` is only for the log)."""
    halt, wake, listening = lifecycle.halt, lifecycle.wake, lifecycle.listening
    backoff = Backoff()
    while not halt.is_set():
        try:
            connection = connections[alias]
            connection.ensure_connection()
            raw = connection.connection
            assert raw is not None
            raw.execute(f"LISTEN {NOTIFY_CHANNEL}")
            listening.set()
            wake.set()  # anything committed while we were not listening
            backoff.reset()
            last_ping = time.monotonic()
            while not halt.is_set():
                for _ in raw.notifies(timeout=0.1):
                    wake.set()
                if time.monotonic() - last_ping >= KEEPALIVE_SECONDS:
                    raw.execute("SELECT 1")
                    last_ping = time.monotonic()
        except Exception as exc:
            if not is_connection_error(exc) and not _is_psycopg_error(exc):
                raise
            listening.clear()
            reset_connection(alias)
            delay = backoff.next()
            logger.warning(
                "LISTEN connection lost (%s); polling every %.2fs until it is back, "
                "reconnecting in %.1fs", str(exc).strip().splitlines()[0] if str(exc) else exc,
                poll_interval, delay, extra={"event": "listen_lost", "runner_id": runner_id},
            )
            halt.wait(delay)
    listening.clear()


def _is_psycopg_error(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc, psycopg.Error)
