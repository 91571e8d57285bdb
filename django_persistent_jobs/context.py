"""What a handler learns about its execution, and how it talks back to the runner."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._flag import Flag
from .errors import JobCancelledError

logger = logging.getLogger("django_persistent_jobs.handler")


@dataclass
class JobContext:
    """Passed to two-parameter handlers.

    ``cancel_requested`` turns true when an operator cancels the running job; the handler decides
    when to stop (``raise_if_cancelled()`` ends the job as ``cancelled``). ``report_progress``
    writes through a separate connection, so operators see it while the job's own transaction is
    still open.
    """

    job_id: uuid.UUID
    job_type: str
    attempt: int
    max_retries: int
    runner_id: str
    queue: str = "default"
    priority: int = 0
    timeout: float | None = None
    tenant: str | None = None
    started_monotonic: float = field(default_factory=time.monotonic)
    _cancel_event: Flag = field(default_factory=Flag, repr=False)
    _progress_sink: Callable[[JobContext, Any], None] | None = field(default=None, repr=False)
    #: This attempt's fencing token: its progress is written for this attempt only (a
    #: timed-out attempt still running must not write over its retry's progress).
    _token: int | None = field(default=None, repr=False)

    @property
    def is_last_attempt(self) -> bool:
        return self.attempt >= self.max_retries + 1

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_event.is_set()

    def raise_if_cancelled(self) -> None:
        if self._cancel_event.is_set():
            raise JobCancelledError("cancelled by an operator while running")

    def wait_for_cancel(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds, waking early if cancelled; True if cancelled."""
        return self._cancel_event.wait(timeout)

    @property
    def time_left(self) -> float | None:
        if self.timeout is None:
            return None
        return max(0.0, self.timeout - (time.monotonic() - self.started_monotonic))

    def report_progress(self, progress: Any) -> None:
        """Store JSON progress (a number, or a dict such as ``{"done": 3, "of": 9}``)."""
        if self._progress_sink is not None:
            self._progress_sink(self, progress)

    @property
    def logger(self) -> logging.LoggerAdapter[logging.Logger]:
        return logging.LoggerAdapter(
            logger, {"job_id": str(self.job_id), "job_type": self.job_type, "attempt": self.attempt}
        )
