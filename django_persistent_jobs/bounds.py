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

import inspect
import math
from datetime import UTC, datetime, timedelta
from typing import Any

#: Column lengths of ``persistent_jobs`` (a test checks they match the model).
JOB_TYPE_MAX_LENGTH = 200
QUEUE_MAX_LENGTH = 100
DEDUP_KEY_MAX_LENGTH = 255
TENANT_MAX_LENGTH = 200
#: Column lengths of the schedules table.
SCHEDULE_NAME_MAX_LENGTH = 200
CRON_MAX_LENGTH = 200
TIMEZONE_MAX_LENGTH = 64
#: ``priority`` is a ``smallint``.
PRIORITY_MIN = -32768
PRIORITY_MAX = 32767
#: The largest ``max_retries`` (and MAX_RETRIES setting): far beyond any sensible retry count.
MAX_RETRIES_LIMIT = 1_000_000
#: The longest delay, timeout, ``retry_after`` or backoff result (about 10 years): far beyond
#: any real wait, the longest retry delay the runner stores, inside what ``now() + seconds *
#: interval '1 second'`` can compute and psycopg can read back (Python datetimes end at year
#: 9999), and below ``threading.TIMEOUT_MAX``, so a handler may wait on ``ctx.time_left``
#: whatever its timeout.
MAX_SECONDS = 10 * 365 * 86400.0
#: The latest ``run_at`` psycopg can read back into a Python datetime.
MAX_RUN_AT = datetime(9999, 12, 31, tzinfo=UTC)
#: The largest integer (in decimal digits) a payload may hold: Python's default limit for
#: converting between int and text, so every process (ours and the runner's) can read it back.
PAYLOAD_INT_MAX_DIGITS = 4300
#: The largest serialized payload a ``jsonb`` value can hold (its size field has 28 bits).
PAYLOAD_MAX_BYTES_LIMIT = 2**28 - 1
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


def job_type_problem(value: Any, name: str = "job_type") -> str | None:
    return _string_problem(name, value, JOB_TYPE_MAX_LENGTH)


def queue_problem(value: Any, name: str = "queue") -> str | None:
    """Also refuses names ``runjobs --queues`` cannot name: it splits its argument on commas
    and strips each name, so jobs in queue ``"a,b"`` or ``" emails"`` would wait for ever."""
    problem = _string_problem(name, value, QUEUE_MAX_LENGTH)
    if problem is not None:
        return problem
    if "," in value:
        return (f"{name} {show(value)} contains a comma: runjobs --queues separates queue "
                "names with commas, so no runner could be told to serve it.")
    if value != value.strip():
        return (f"{name} {show(value)} begins or ends with whitespace: runjobs --queues "
                "strips it from each name, so no runner could be told to serve it.")
    return None


def dedup_key_problem(value: Any, name: str = "dedup_key") -> str | None:
    """``None`` (no key) is acceptable."""
    return None if value is None else _string_problem(name, value, DEDUP_KEY_MAX_LENGTH)


def tenant_problem(value: Any, name: str = "tenant") -> str | None:
    """``None`` (no tenant) is acceptable; an empty string is not, so a blank form field or an
    unset variable cannot silently make a job tenant-less."""
    return None if value is None else _string_problem(name, value, TENANT_MAX_LENGTH)


def _integer_problem(name: str, value: Any, low: int, high: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return f"{name} must be an integer in {low}..{high}, got {show(value)}."
    return None


def priority_problem(value: Any, name: str = "priority") -> str | None:
    return _integer_problem(name, value, PRIORITY_MIN, PRIORITY_MAX)


def max_retries_problem(value: Any, name: str = "max_retries") -> str | None:
    return _integer_problem(name, value, 0, MAX_RETRIES_LIMIT)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def seconds_of(value: Any) -> float | None:
    """A number of seconds or a ``timedelta`` as float seconds; ``None`` if it is neither. An
    int too large for a float is an infinity of its sign."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if _is_number(value):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    return None


def timeout_problem(value: Any, name: str = "timeout") -> str | None:
    """Seconds (a number or a ``timedelta``) in ``(0, MAX_SECONDS]``."""
    seconds = seconds_of(value)
    if seconds is None or not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
        return (f"{name} must be a number of seconds > 0 (at most {MAX_SECONDS:.0f}), "
                f"got {show(value)}.")
    return None


def delay_problem(value: Any, name: str = "delay") -> str | None:
    seconds = seconds_of(value)
    if seconds is None:
        return f"{name} must be a timedelta or seconds, got {show(value)}."
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS):
        return f"{name} must be >= 0 and at most {MAX_SECONDS:.0f} seconds, got {show(value)}."
    return None


def run_at_problem(value: Any) -> str | None:
    if not isinstance(value, datetime):
        return f"run_at must be a datetime, got {type(value).__name__}."
    if value.tzinfo is None or value.utcoffset() is None:
        # The hint must work whatever USE_TZ says: without time zone support
        # ``timezone.now()`` is naive itself.
        return ("run_at must be timezone-aware (for example datetime.now(UTC) + timedelta(...), "
                "or timezone.now() + timedelta(...) with USE_TZ = True); a naive datetime is "
                "ambiguous.")
    try:
        in_range = value.astimezone(UTC) < MAX_RUN_AT
    except OverflowError:  # beyond year 1 or 9999 once converted to UTC
        in_range = False
    if not in_range:
        return f"run_at must be between year 1 and {MAX_RUN_AT.date()} UTC, got {show(value)}."
    return None


def backoff_problem(value: Any) -> str | None:
    """What a backoff callable returned: finite seconds (a number or a ``timedelta``) of at most
    ``MAX_SECONDS``; a negative result means "retry now"."""
    seconds = seconds_of(value)
    if seconds is None or not (math.isfinite(seconds) and seconds <= MAX_SECONDS):
        return (f"a backoff must return finite seconds, at most {MAX_SECONDS:.0f}, "
                f"got {show(value)}.")
    return None


def backoff_callable_problem(value: Any, name: str = "backoff") -> str | None:
    """Why the runner could not call ``value`` as ``backoff(attempt)`` (a callable given as a
    handler's, a task's or the BACKOFF setting's backoff), or ``None``.

    Found out here rather than at each retry of each job: a callable that cannot be bound to
    one positional argument (``lambda: 5``), or a backoff factory given instead of the backoff
    it makes (``constant`` for ``constant(5)``). A callable whose signature cannot be read (a
    builtin) passes; what it returns is read at each retry (``backoff.delay_after``).
    """
    from .backoff import FACTORIES

    if any(value is factory for factory in FACTORIES):  # (``value`` may be unhashable)
        path = f"{value.__module__}.{value.__qualname__}"
        return (f"{name} is {path}, which makes a backoff rather than being one: call it, for "
                f"example {value.__name__}(5).")
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(1)
    except TypeError as exc:
        return (f"{name} is called as backoff(attempt), but {show(value)} cannot take that "
                f"call: {exc}.")
    return None


def backoff_seconds(value: Any) -> float:
    """A backoff result as the delay to store; ``ValueError`` (with ``backoff_problem``'s
    message) when it is unusable."""
    problem = backoff_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return max(0.0, seconds_of(value) or 0.0)


def atomic_problem(value: Any, name: str = "atomic") -> str | None:
    """Only a real bool: ``atomic="no"`` or ``atomic=0`` would read as a choice it is not."""
    if not isinstance(value, bool):
        return f"{name} must be True or False, got {show(value)}."
    return None


def dedup_problem(value: Any, name: str = "dedup") -> str | None:
    choice = getattr(value, "value", value)  # a Dedup member or its string
    if not isinstance(choice, str) or choice not in DEDUP_CHOICES:
        return f"{name} must be one of {list(DEDUP_CHOICES)}, got {show(value)}."
    return None
