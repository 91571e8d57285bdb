"""The bounds of every job option, in one place.

Handler options (and so ``manage.py check``), ``enqueue``, ``enqueue_many``, schedules and the
operator services all ask this module whether a value is acceptable, so a value the system check
accepts can never be refused by every enqueue (or the other way round). Each ``*_problem``
function returns ``None`` for an acceptable value or a sentence that says what is wrong, without
any prefix: callers add the context ("handler 'x': ...", "item 3: ...") and choose the exception
(``EnqueueError``, ``ScheduleError``, a system check error).

The limits follow what PostgreSQL stores: the column lengths of ``persistent_jobs``, a
``smallint`` priority, text without NUL characters or lone surrogates (PostgreSQL text is UTF-8
and cannot hold either), and times that ``now() + interval`` can compute and psycopg can read
back. This module imports nothing from Django so that every other module may import it.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

#: Column lengths of ``persistent_jobs`` (a test checks they match the model).
JOB_TYPE_MAX_LENGTH = 200
QUEUE_MAX_LENGTH = 100
DEDUP_KEY_MAX_LENGTH = 255
TENANT_MAX_LENGTH = 200
#: ``priority`` is a ``smallint``.
PRIORITY_MIN = -32768
PRIORITY_MAX = 32767
#: The largest ``max_retries`` (and MAX_RETRIES setting): far beyond any sensible retry count.
MAX_RETRIES_LIMIT = 1_000_000
#: The longest delay, timeout, ``retry_after`` or backoff result (about 1,000 years): far beyond
#: any real wait, and well inside what ``now() + seconds * interval '1 second'`` can compute and
#: psycopg can read back (Python datetimes end at year 9999).
MAX_SECONDS = 1000 * 365 * 86400.0
#: The latest ``run_at`` psycopg can read back into a Python datetime.
MAX_RUN_AT = datetime(9999, 12, 31, tzinfo=UTC)
#: The largest integer (in decimal digits) a payload may hold: Python's default limit for
#: converting between int and text, so every process (ours and the runner's) can read it back.
PAYLOAD_INT_MAX_DIGITS = 4300
DEDUP_CHOICES = ("skip", "enqueue", "replace")


def show(value: Any, limit: int = 60) -> str:
    """A ``repr`` short enough for an error message, safe for huge ints and odd objects."""
    try:
        text = repr(value)
    except Exception:  # an int beyond the str-conversion limit, a broken __repr__
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def text_problem(text: str) -> str | None:
    """Why PostgreSQL cannot store ``text`` (NUL; lone surrogates are not UTF-8), or ``None``."""
    if "\x00" in text:
        return "a NUL character, which PostgreSQL cannot store"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "a lone surrogate, which is not valid UTF-8"
    return None


def _string_problem(name: str, value: Any, max_length: int) -> str | None:
    if not isinstance(value, str) or not 0 < len(value) <= max_length:
        return f"{name} must be a string of 1..{max_length} characters, got {show(value)}."
    problem = text_problem(value)
    if problem:
        return f"{name} {show(value)} contains {problem}."
    return None


def job_type_problem(value: Any) -> str | None:
    return _string_problem("job_type", value, JOB_TYPE_MAX_LENGTH)


def queue_problem(value: Any) -> str | None:
    return _string_problem("queue", value, QUEUE_MAX_LENGTH)


def dedup_key_problem(value: Any) -> str | None:
    """``None`` (no key) is acceptable."""
    return None if value is None else _string_problem("dedup_key", value, DEDUP_KEY_MAX_LENGTH)


def tenant_problem(value: Any) -> str | None:
    """``None`` (no tenant) is acceptable; an empty string is not, so a blank form field or an
    unset variable cannot silently make a job tenant-less."""
    return None if value is None else _string_problem("tenant", value, TENANT_MAX_LENGTH)


def _integer_problem(name: str, value: Any, low: int, high: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return f"{name} must be an integer in {low}..{high}, got {show(value)}."
    return None


def priority_problem(value: Any) -> str | None:
    return _integer_problem("priority", value, PRIORITY_MIN, PRIORITY_MAX)


def max_retries_problem(value: Any) -> str | None:
    return _integer_problem("max_retries", value, 0, MAX_RETRIES_LIMIT)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def seconds_of(value: Any) -> float | None:
    """A number of seconds or a ``timedelta`` as float seconds; ``None`` if it is neither (or an
    int too large for a float)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if _is_number(value):
        try:
            return float(value)
        except OverflowError:
            return math.inf
    return None


def timeout_problem(value: Any) -> str | None:
    seconds = seconds_of(value)
    if seconds is None or not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
        return (f"timeout must be a number of seconds > 0 (at most {MAX_SECONDS:.0f}), "
                f"got {show(value)}.")
    return None


def delay_problem(value: Any) -> str | None:
    if seconds_of(value) is None:
        return f"delay must be a timedelta or seconds, got {show(value)}."
    seconds = seconds_of(value)
    assert seconds is not None
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS):
        return f"delay must be >= 0 and at most {MAX_SECONDS:.0f} seconds, got {show(value)}."
    return None


def run_at_problem(value: Any) -> str | None:
    if not isinstance(value, datetime):
        return f"run_at must be a datetime, got {type(value).__name__}."
    if value.tzinfo is None or value.utcoffset() is None:
        return ("run_at must be timezone-aware (for example timezone.now() + timedelta(...)); "
                "a naive datetime is ambiguous.")
    try:
        in_range = value.astimezone(UTC) < MAX_RUN_AT
    except OverflowError:
        in_range = False
    if not in_range:
        return f"run_at must be before {MAX_RUN_AT.date()}, got {show(value)}."
    return None


def backoff_problem(value: Any) -> str | None:
    """A backoff result (or ``retry_after``): seconds in ``0..MAX_SECONDS``."""
    seconds = seconds_of(value)
    if seconds is None or not (math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS):
        return (f"a backoff must be a number of seconds between 0 and {MAX_SECONDS:.0f}, "
                f"got {show(value)}.")
    return None


def dedup_problem(value: Any) -> str | None:
    choice = getattr(value, "value", value)  # a Dedup member or its string
    if choice not in DEDUP_CHOICES:
        return f"dedup must be one of {list(DEDUP_CHOICES)}, got {show(value)}."
    return None
