"""LISTEN loop: turns NOTIFYs into a wake-up of the claim loop.

NOTIFY is only a hint. The claim loop polls on its own, and this loop pings its connection every
few seconds, so a dead LISTEN connection (a restarted server, a terminated backend, a silently
dropped socket) is noticed and re-established, and a wake-up is sent after each reconnect in case
notifications were missed while it was down.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from django.db import connections

from ..services import NOTIFY_CHANNEL
from .db import Backoff, is_connection_error, reset_connection

if TYPE_CHECKING:
    from .supervisor import Runner

logger = logging.getLogger("django_persistent_jobs.runner")

KEEPALIVE_SECONDS = 5.0


def listen_loop(runner: Runner) -> None:
    alias = runner.alias
    backoff = Backoff()
    while not runner.halt.is_set():
        try:
            connection = connections[alias]
            connection.ensure_connection()
            raw = connection.connection
            assert raw is not None
            raw.execute(f"LISTEN {NOTIFY_CHANNEL}")
            runner.listening.set()
            runner.wake.set()  # anything committed while we were not listening
            backoff.reset()
            last_ping = time.monotonic()
            while not runner.halt.is_set():
                for _ in raw.notifies(timeout=0.1):
                    runner.wake.set()
                if time.monotonic() - last_ping >= KEEPALIVE_SECONDS:
                    raw.execute("SELECT 1")
                    last_ping = time.monotonic()
        except Exception as exc:
            if not is_connection_error(exc) and not _is_psycopg_error(exc):
                raise
            runner.listening.clear()
            reset_connection(alias)
            delay = backoff.next()
            logger.warning(
                "LISTEN connection lost (%s); polling every %.2fs until it is back, "
                "reconnecting in %.1fs", str(exc).strip().splitlines()[0] if str(exc) else exc,
                runner.settings.poll_interval, delay,
                extra={"event": "listen_lost", "runner_id": runner.runner_id},
            )
            runner.halt.wait(delay)
    runner.listening.clear()


def _is_psycopg_error(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc, psycopg.Error)
