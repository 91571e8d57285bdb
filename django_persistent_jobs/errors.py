"""Exceptions: the ones handlers raise to steer retries, and the ones our API raises on bad input.

Handlers raise ``TransientJobError`` (retry with backoff) or ``PermanentJobError`` (dead-letter
now). Anything else a handler raises is treated as transient with code ``HANDLER_ERROR``, because
an unexpected exception is more often a passing fault than a verdict on the job.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import ProgrammingError

from . import bounds
from .conf import ConfigurationError

__all__ = [
    "ConfigurationError",
    "DuplicateHandlerError",
    "EnqueueError",
    "InvalidJobIdError",
    "InvalidJobStateError",
    "JobCancelledError",
    "JobError",
    "JobNotFoundError",
    "PayloadError",
    "PermanentJobError",
    "PreparedStatementLostError",
    "ScheduleError",
    "ScheduleNotFoundError",
    "TransientJobError",
    "UnknownJobTypeError",
]


#: The longest ``retry_after`` accepted (about 10 years): ``bounds`` owns it.
MAX_RETRY_AFTER = bounds.MAX_SECONDS


class JobError(Exception):
    """Base class of the errors a handler raises; ``code`` is stored on the job and attempt."""

    default_code = "HANDLER_ERROR"
    transient = True

    def __init__(self, message: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None and not isinstance(code, str):
            # Refused here, where the traceback points at the mistake: ``code=429`` failed
            # with "'int' object is not subscriptable", and ``code=b"X"`` was stored as "b'X'".
            raise ValueError(
                f"code must be a string (for example 'RATE_LIMITED'), got {bounds.show(code)}"
            )
        # The code is stored in a 64-character column; a longer one is cut rather than allowed
        # to make recording the outcome fail.
        self.code = (code or self.default_code)[:64]


class TransientJobError(JobError):
    """The attempt failed but may succeed later: retry after backoff (or ``retry_after``)."""

    def __init__(
        self, message: str = "", code: str | None = None,
        retry_after: float | timedelta | None = None,
    ) -> None:
        super().__init__(message, code)
        if isinstance(retry_after, timedelta):
            retry_after = retry_after.total_seconds()
        if retry_after is not None and (
            isinstance(retry_after, bool) or not isinstance(retry_after, int | float)
            or not 0 <= retry_after <= MAX_RETRY_AFTER
        ):
            # NaN, infinity or millennia would make the retry's next_run_at overflow in SQL
            # when the runner records the failure.
            raise ValueError(
                "retry_after must be seconds (or a timedelta) between 0 and 10 years, "
                f"got {retry_after!r}"
            )
        self.retry_after: float | None = retry_after


class PermanentJobError(JobError):
    """Retrying cannot help: dead-letter the job now."""

    default_code = "PERMANENT_ERROR"
    transient = False


class JobCancelledError(JobError):
    """Raised by ``JobContext.raise_if_cancelled()``; the job ends as ``cancelled``."""

    default_code = "CANCELLED"
    transient = False


class EnqueueError(ValueError):
    """``enqueue()`` (or a schedule or operator function) refused its input before any SQL ran:
    nothing was written, and the caller's transaction is still usable. ``code`` says which rule
    refused it."""

    code = "ENQUEUE_INVALID"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code:
            self.code = code


class PayloadError(EnqueueError):
    """The payload is not storable as given (``PAYLOAD_INVALID`` or ``PAYLOAD_TOO_LARGE``)."""

    code = "PAYLOAD_INVALID"


class UnknownJobTypeError(EnqueueError):
    """No handler is registered for the job type in this process."""

    code = "UNKNOWN_JOB_TYPE"


class ScheduleError(EnqueueError):
    """A schedule definition is unusable (bad cron, bad interval, unknown zone, ...).

    An ``EnqueueError`` (and so a ``ValueError``): a schedule is a recipe for enqueues, and its
    arguments are refused under the same rules, before anything is written.
    """

    code = "SCHEDULE_INVALID"


class DedupKeyTakenError(EnqueueError):
    """A caller confined to one tenant named a dedup key that an active job of another tenant
    (or of none) holds. Skip would have handed it that job and Replace would have cancelled or
    queued behind it, so nothing was written."""

    code = "DEDUP_KEY_TAKEN"


class ScheduleNotFoundError(LookupError):
    """No schedule has the given name."""


class DuplicateHandlerError(ConfigurationError):
    """Two handlers claim the same job type."""


class JobNotFoundError(LookupError):
    """No job has the given id."""


class InvalidJobStateError(Exception):
    """An operator action does not apply to the job's current status."""


class InvalidJobIdError(EnqueueError, JobNotFoundError):
    """An operator function was given something that is not a job id (a UUID): refused before
    any query. Also a ``JobNotFoundError``, since no job can have that id."""

    code = "INVALID_JOB_ID"


def database_error_text(exc: BaseException) -> str:
    """A database error as one line (the driver's messages span several), for the operator
    surfaces that report one (the ``jobs`` command, the HTTP API); on a database that was never
    migrated, what to do about it (as ``runjobs`` says)."""
    message = " ".join(str(exc).split())
    if 'relation "persistent_jobs' in message and "does not exist" in message:
        return ("The persistent_jobs tables are missing; run `python manage.py migrate` first "
                f"(database error: {message}).")
    return f"database error: {message}"


class PreparedStatementLostError(ProgrammingError):
    """``enqueue()``'s prepared insert was gone from the server session inside the caller's
    transaction (a pooler in transaction mode that does not keep prepared statements), which
    aborted that transaction. A ``django.db.ProgrammingError``, so code that handles database
    errors handles it; its message says what to set. Later enqueues in the process send the
    insert unprepared."""
