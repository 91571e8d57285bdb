"""A named background loop whose unexpected death the supervisor notices."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from django.db import connections

from .db import SESSION_ADVICE, is_lost_prepared_statement

logger = logging.getLogger("django_persistent_jobs.runner")


class Loop:
    """Runs ``body`` in a daemon thread; an exception escaping it is kept as ``failure``.

    Loops handle database outages themselves (retrying), so an escaping exception is a bug or
    a broken invariant, and the runner stops loudly rather than limping on without that loop.
    """

    def __init__(self, name: str, body: Callable[[], None]) -> None:
        self.name = name
        self.body = body
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"pj-{name}", daemon=True)

    def _run(self) -> None:
        try:
            self.body()
        except BaseException as exc:
            self.failure = exc
            logger.critical("runner loop %r died: %r", self.name, exc, exc_info=exc,
                            extra={"event": "loop_died", "loop": self.name})
            if is_lost_prepared_statement(exc):
                logger.critical("runner loop %r died because %s.", self.name, SESSION_ADVICE,
                                extra={"event": "runner_needs_session", "loop": self.name})
        finally:
            with contextlib.suppress(Exception):
                connections.close_all()

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()
