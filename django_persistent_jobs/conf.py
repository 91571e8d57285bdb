"""Settings for django-persistent-jobs: ``settings.PERSISTENT_JOBS``, typed and read lazily.

``conf.settings`` has one attribute per key, with its default next to it. Reading an attribute
looks the dict up again (Django's test runner and ``override_settings`` change it after our
modules are imported), checks the value and returns it typed; an invalid value raises
``ConfigurationError``, an ``ImproperlyConfigured``, with the very message the system check
reports. So a process that never runs the checks (a shell, a WSGI worker) still gets a clear
configuration error rather than a ``ValueError`` from deep inside ``enqueue``.

This module says what is wrong with a value; ``checks.py`` owns the check ids and hints. The
bounds shared with job options (MAX_RETRIES, TIMEOUT, DEFAULT_QUEUE, DEDUP) come from
``bounds.py``, so a setting the check accepts is accepted by ``enqueue`` too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar, overload

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.dispatch import receiver
from django.test.signals import setting_changed
from django.utils.module_loading import import_string

from . import bounds

#: Worker processes ``runjobs`` starts when neither ``--processes`` nor ``PROCESSES`` says.
RUNJOBS_DEFAULT_PROCESSES = 0

TERMINAL_RETENTION_KEYS = ("completed", "cancelled", "dead_lettered")
#: The longest retention: cleanup computes ``now() - retention``, which PostgreSQL refuses
#: past its timestamp range (``timedelta.max`` passed the check and then failed every cleanup
#: with "timestamp out of range"). The bound of every other seconds value; to keep jobs
#: longer, keep them forever (``None``).
_MAX_RETENTION_SECONDS = bounds.MAX_SECONDS


class ConfigurationError(ImproperlyConfigured):
    """A value in ``settings.PERSISTENT_JOBS`` (or a handler option) cannot be used."""


def _raw() -> dict[str, Any]:
    value = getattr(django_settings, "PERSISTENT_JOBS", None)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigurationError(
            f"settings.PERSISTENT_JOBS must be a dict, got {type(value).__name__}."
        )
    return value


def _name(key: str) -> str:
    return f"PERSISTENT_JOBS['{key}']"


def seconds(value: Any) -> float:
    """Accept seconds as a number or a ``timedelta`` (both are documented)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


# ----------------------------------------------------------------------------- value checks
# Each returns why ``value`` is unusable for ``key``, or None.
def _number_problem(key: str, value: Any, *, integer: bool, allow_zero: bool,
                    unit: str = "seconds") -> str | None:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        return f"{_name(key)} must be {kind}, got {bounds.show(value)}."
    number: Any = value
    if (isinstance(number, float) and not math.isfinite(number)) or number < 0 or (
        number == 0 and not allow_zero
    ):
        bound = ">= 0" if allow_zero else "> 0"
        kind = "an integer" if integer else "a finite number"
        return f"{_name(key)} must be {kind} {bound}, got {bounds.show(value)}."
    if not integer and number > bounds.MAX_SECONDS:
        return (f"{_name(key)} must be at most {bounds.MAX_SECONDS:.0f} {unit}, "
                f"got {bounds.show(value)}.")
    return None


def _positive_int(key: str, value: Any) -> str | None:
    return _number_problem(key, value, integer=True, allow_zero=False)


def _payload_bytes(key: str, value: Any) -> str | None:
    problem = _positive_int(key, value)
    if problem is None and value > bounds.PAYLOAD_MAX_BYTES_LIMIT:
        return (f"{_name(key)} must be at most {bounds.PAYLOAD_MAX_BYTES_LIMIT} (what jsonb "
                f"can hold), got {bounds.show(value)}.")
    return problem


def _non_negative_int(key: str, value: Any) -> str | None:
    return _number_problem(key, value, integer=True, allow_zero=True)


def _optional_int(*, allow_zero: bool) -> Callable[[str, Any], str | None]:
    def check(key: str, value: Any) -> str | None:
        if value is None:
            return None
        return _number_problem(key, value, integer=True, allow_zero=allow_zero)
    return check


def _optional_mib(key: str, value: Any) -> str | None:
    return None if value is None else _number_problem(key, value, integer=False,
                                                      allow_zero=False, unit="MiB")


def _seconds_problem(*, allow_zero: bool = False, optional: bool = False,
                     minimum: float | None = None) -> Callable[[str, Any], str | None]:
    """Seconds (a number or a timedelta); ``minimum`` for the period of a loop, which a tiny
    value would turn into a busy loop."""
    def check(key: str, value: Any) -> str | None:
        if value is None and optional:
            return None
        if isinstance(value, timedelta):
            value = value.total_seconds()
        problem = _number_problem(key, value, integer=False, allow_zero=allow_zero)
        if problem is None and minimum is not None and value < minimum:
            return (f"{_name(key)} must be at least {minimum:g} seconds (less keeps an idle "
                    f"runner busy), got {bounds.show(value)}.")
        return problem
    return check


#: The shortest period of a runner's loops: a poll or scheduler pass every 10 ms is already
#: far more often than any job needs; a cleanup pass deletes in bulk, once a second at most.
MIN_LOOP_INTERVAL = 0.01
MIN_CLEANUP_INTERVAL = 1.0


def _max_retries(key: str, value: Any) -> str | None:
    return bounds.max_retries_problem(value, _name(key))


def _timeout(key: str, value: Any) -> str | None:
    return bounds.timeout_problem(value, _name(key))


def _dedup(key: str, value: Any) -> str | None:
    return bounds.dedup_problem(value, _name(key))


def _default_queue(key: str, value: Any) -> str | None:
    return bounds.queue_problem(value, _name(key))


def _queues(key: str, value: Any) -> str | None:
    if value is None:
        return None
    listed = isinstance(value, list | tuple)
    problems = [p for q in value if (p := bounds.queue_problem(q)) is not None] if listed else []
    if not listed or not value or problems:
        because = f" The first bad one: {problems[0]}" if problems else ""
        return (f"{_name(key)} must be a non-empty list of queue names (strings of 1.."
                f"{bounds.QUEUE_MAX_LENGTH} characters) or None, got {bounds.show(value)}."
                f"{because}")
    return None


def _database(key: str, value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return f"{_name(key)} must be a non-empty string, got {bounds.show(value)}."
    if value not in django_settings.DATABASES:
        return (f"{_name(key)} names {value!r}, which is not in settings.DATABASES.")
    return None


def _redact_keys(key: str, value: Any) -> str | None:
    if not isinstance(value, list | tuple) or not all(isinstance(k, str) and k for k in value):
        return f"{_name(key)} must be a list of non-empty strings, got {bounds.show(value)}."
    return None


def _boolean(key: str, value: Any) -> str | None:
    if not isinstance(value, bool):
        return f"{_name(key)} must be True or False, got {bounds.show(value)}."
    return None


def _backoff(key: str, value: Any) -> str | None:
    if value is None:
        return None
    try:
        resolved = resolve_callable(value, key)
    except ConfigurationError as exc:
        return str(exc)
    return bounds.backoff_callable_problem(resolved, _name(key))


def _encoder(key: str, value: Any) -> str | None:
    if value is None:
        return None
    try:
        resolve_encoder(value)
    except ConfigurationError as exc:
        return str(exc)
    return None


def _retention(key: str, value: Any) -> str | None:
    try:
        _retention_of(value)
    except ConfigurationError as exc:
        return str(exc)
    return None


# ----------------------------------------------------------------------------- conversions
def _imported(value: Any, key: str) -> Any:
    """``value`` itself, or the object its dotted path names, with a message that names ``key``."""
    if not isinstance(value, str):
        return value
    try:
        return import_string(value)
    except ImportError as exc:
        raise ConfigurationError(f"{_name(key)} = {value!r} cannot be imported: {exc}") from exc


def resolve_callable(value: Any, key: str) -> Callable[..., Any]:
    """Turn a callable or its dotted path into the callable, with a message that names ``key``."""
    value = _imported(value, key)
    if not callable(value):
        raise ConfigurationError(f"{_name(key)} must be callable, got {bounds.show(value)}.")
    resolved: Callable[..., Any] = value
    return resolved


def resolve_encoder(value: Any) -> type[json.JSONEncoder]:
    value = _imported(value, "JSON_ENCODER")
    if not (isinstance(value, type) and issubclass(value, json.JSONEncoder)):
        raise ConfigurationError(
            "PERSISTENT_JOBS['JSON_ENCODER'] must be a json.JSONEncoder subclass, got "
            f"{bounds.show(value)}."
        )
    return value


_DEFAULT_RETENTION: dict[str, timedelta | None] = {
    "completed": timedelta(days=7), "cancelled": timedelta(days=7), "dead_lettered": None,
}


def _retention_of(raw: Any) -> dict[str, float | None]:
    """Seconds to keep each terminal status (``None`` keeps forever)."""
    if raw is None or (isinstance(raw, int | float | timedelta) and not isinstance(raw, bool)):
        # One value applies to completed and cancelled; dead letters are kept for operators.
        base = None if raw is None else _retention_seconds(raw, "PERSISTENT_JOBS['RETENTION']")
        return {"completed": base, "cancelled": base, "dead_lettered": None}
    if not isinstance(raw, dict):
        raise ConfigurationError(
            f"PERSISTENT_JOBS['RETENTION'] must be a timedelta, seconds, None or a dict, "
            f"got {bounds.show(raw)}."
        )
    result: dict[str, float | None] = dict.fromkeys(TERMINAL_RETENTION_KEYS)
    for status in TERMINAL_RETENTION_KEYS:
        item = raw.get(status, _DEFAULT_RETENTION[status])
        if item is None:
            continue
        if isinstance(item, bool) or not isinstance(item, int | float | timedelta):
            raise ConfigurationError(
                f"PERSISTENT_JOBS['RETENTION']['{status}'] must be a timedelta, seconds or "
                f"None, got {bounds.show(item)}."
            )
        result[status] = _retention_seconds(item, f"PERSISTENT_JOBS['RETENTION']['{status}']")
    unknown = set(raw) - set(TERMINAL_RETENTION_KEYS)
    if unknown:
        # Sorted by repr: keys of mixed types (a stray int) do not sort among themselves.
        raise ConfigurationError(
            f"PERSISTENT_JOBS['RETENTION'] has unknown statuses {sorted(unknown, key=repr)}; "
            f"use {list(TERMINAL_RETENTION_KEYS)}."
        )
    return result


def _retention_seconds(raw: int | float | timedelta, name: str) -> float:
    """``raw`` (seconds or a timedelta) as float seconds, or the ``ConfigurationError`` that
    says why it cannot be a retention. An int too large for a float (``10**400``) is "too
    long", not an ``OverflowError`` out of ``manage.py check`` and ``runjobs``."""
    value = bounds.seconds_of(raw)
    assert value is not None  # (the callers checked the type)
    overflowed = math.isinf(value) and isinstance(raw, int)
    if not (value > 0 and (math.isfinite(value) or overflowed)):  # (NaN fails the first test)
        raise ConfigurationError(f"{name} must be positive and finite, got {bounds.show(raw)}.")
    if value > _MAX_RETENTION_SECONDS:
        raise ConfigurationError(
            f"{name} must be at most {_MAX_RETENTION_SECONDS:.0f} seconds (about 10 years), "
            f"got {bounds.show(raw)}; use None to keep these jobs forever."
        )
    return value


def _optional_seconds(value: Any) -> float | None:
    return None if value is None else seconds(value)


def _optional_callable(value: Any) -> Callable[..., Any] | None:
    return None if value is None else resolve_callable(value, "BACKOFF")


def _optional_encoder(value: Any) -> type[json.JSONEncoder] | None:
    return None if value is None else resolve_encoder(value)


def _optional_queues(value: Any) -> tuple[str, ...] | None:
    return tuple(value) if value else None


def _same(value: Any) -> Any:
    return value



T = TypeVar("T")

# ----------------------------------------------------------------------------- the settings
class Setting(Generic[T]):
    """One key of ``PERSISTENT_JOBS``: its default, what makes a value unusable, its type."""

    key: str

    def __init__(self, default: Any, check: Callable[[str, Any], str | None],
                 convert: Callable[[Any], T]) -> None:
        self.default = default
        self.check = check
        self.convert = convert

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = name

    def raw(self, values: dict[str, Any] | None = None) -> Any:
        """The configured value (or the default), unchecked."""
        return (_raw() if values is None else values).get(self.key, self.default)

    def problem(self, values: dict[str, Any] | None = None) -> str | None:
        return self.check(self.key, self.raw(values))

    @overload
    def __get__(self, instance: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, instance: Settings, owner: type) -> T: ...

    def __get__(self, instance: Settings | None, owner: type) -> Setting[T] | T:
        if instance is None:
            return self
        try:
            cached: T = instance._cache[self.key]
            return cached
        except KeyError:
            pass
        value = self.raw()
        problem = self.check(self.key, value)
        if problem is not None:
            raise ConfigurationError(problem)  # not cached: raised on every read until fixed
        converted = self.convert(value)
        instance._cache[self.key] = converted
        return converted


class Settings:
    """``settings.PERSISTENT_JOBS``, one typed attribute per key (each key is optional).

    Checked values are cached (``enqueue`` reads several per call) until Django reports a
    settings change (``override_settings``, the ``settings`` test fixture), like Django's own
    cached settings.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def clear(self) -> None:
        self._cache.clear()

    #: Retries after the first attempt (a job runs at most ``1 + MAX_RETRIES`` times).
    MAX_RETRIES = Setting[int](3, _max_retries, int)
    #: Per-attempt timeout in seconds (a number or a timedelta).
    TIMEOUT = Setting[float](300, _timeout, seconds)
    #: Jobs one runner executes at once.
    CONCURRENCY = Setting[int](10, _positive_int, int)
    #: Seconds between polls when no NOTIFY arrives.
    POLL_INTERVAL = Setting[float](1.0, _seconds_problem(minimum=MIN_LOOP_INTERVAL), seconds)
    #: Seconds without a heartbeat after which a runner is dead and its jobs are rescued.
    STALE_LOCK_TIMEOUT = Setting[float](30, _seconds_problem(), seconds)
    #: Seconds between heartbeats; None: a third of STALE_LOCK_TIMEOUT.
    HEARTBEAT_INTERVAL = Setting[float | None](
        None, _seconds_problem(optional=True), _optional_seconds)
    #: The dedup strategy of handlers that do not choose one.
    DEDUP = Setting[str]("skip", _dedup, str)
    #: A callable ``attempt -> seconds`` (or its dotted path); None: 2 ** min(attempt, 10)
    #: seconds with +/-10% jitter.
    BACKOFF = Setting[Callable[..., Any] | None](None, _backoff, _optional_callable)
    #: How long finished jobs are kept, per terminal status (None keeps forever).
    RETENTION = Setting[dict[str, float | None]](dict(_DEFAULT_RETENTION), _retention,
                                                 _retention_of)
    #: Seconds between cleanup passes.
    CLEANUP_INTERVAL = Setting[float](300, _seconds_problem(minimum=MIN_CLEANUP_INTERVAL),
                                        seconds)
    #: Seconds in-flight jobs get to finish at shutdown.
    SHUTDOWN_GRACE = Setting[float](30, _seconds_problem(allow_zero=True), seconds)
    #: Queues a runner serves; None: every queue.
    QUEUES = Setting[tuple[str, ...] | None](None, _queues, _optional_queues)
    #: The queue of handlers that do not choose one.
    DEFAULT_QUEUE = Setting[str]("default", _default_queue, str)
    #: Jobs claimed per statement; None: as many as there are free slots.
    BATCH_SIZE = Setting[int | None](None, _optional_int(allow_zero=False), _same)
    #: Claimed jobs held waiting for a worker; None: adaptive (see runner/claimer.py).
    PREFETCH = Setting[int | None](None, _optional_int(allow_zero=True), _same)
    #: The database alias jobs live in.
    DATABASE = Setting[str]("default", _database, str)
    #: Largest serialized payload, in UTF-8 bytes.
    PAYLOAD_MAX_BYTES = Setting[int](128 * 1024, _payload_bytes, int)
    #: Deepest payload nesting.
    PAYLOAD_MAX_DEPTH = Setting[int](10, _positive_int, int)
    #: Most keys in a payload, counted over every nested object.
    PAYLOAD_MAX_KEYS = Setting[int](500, _positive_int, int)
    #: A ``json.JSONEncoder`` subclass (or its dotted path) applied to payloads first.
    JSON_ENCODER = Setting[type[json.JSONEncoder] | None](None, _encoder, _optional_encoder)
    #: Accept job types without a handler in this process (another service runs them).
    ALLOW_UNREGISTERED = Setting[bool](False, _boolean, bool)
    #: Seconds between scheduler passes.
    SCHEDULER_INTERVAL = Setting[float](1.0, _seconds_problem(minimum=MIN_LOOP_INTERVAL),
                                          seconds)
    #: A server-side prepared statement for ``enqueue()``'s insert (the runner's claim is always
    #: prepared). Off by default: behind a pooler that does not keep prepared statements
    #: (PgBouncer before 1.21, or ``max_prepared_statements = 0``, in transaction mode) a
    #: client can meet another client's statement under the same psycopg name (``_pg3_N``),
    #: which fails, or runs the wrong statement when its parameters fit. A loss that is
    #: noticed turns it off in the process (``enqueuing._stop_preparing``).
    PREPARED_STATEMENTS = Setting[bool](False, _boolean, bool)
    #: Free hand-backs of one job at shutdown; later ones are charged as attempts.
    HANDBACK_LIMIT = Setting[int](3, _non_negative_int, int)
    #: Worker processes ``runjobs`` runs handlers in (0: threads of the runjobs process);
    #: None: ``RUNJOBS_DEFAULT_PROCESSES``. An embedded ``Runner`` does not read it.
    PROCESSES = Setting[int | None](None, _optional_int(allow_zero=True), _same)
    #: Recycle a worker process after this many jobs; None: never.
    MAX_JOBS_PER_WORKER = Setting[int | None](None, _optional_int(allow_zero=False), _same)
    #: Recycle a worker process whose RSS exceeds this many MiB; None: never.
    MAX_MEMORY_PER_WORKER = Setting[float | None](None, _optional_mib, _same)
    #: Seconds a timed-out handler's thread gets to return before its worker is recycled.
    TIMEOUT_GRACE = Setting[float](5.0, _seconds_problem(), seconds)
    #: Payload and result keys the admin shows as "***" (case-insensitive substrings of the
    #: key, at any depth).
    REDACT_KEYS = Setting[tuple[str, ...]](
        ("password", "passwd", "secret", "token", "api_key", "apikey", "authorization",
         "credential", "private_key", "cookie", "session"), _redact_keys, tuple)

    @classmethod
    def declared(cls) -> dict[str, Setting[Any]]:
        return {k: v for k, v in vars(cls).items() if isinstance(v, Setting)}


settings = Settings()
_SETTINGS = Settings.declared()


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("PERSISTENT_JOBS", "DATABASES"):
        settings.clear()


#: Every key accepted in ``settings.PERSISTENT_JOBS`` with its default.
DEFAULTS: dict[str, Any] = {key: s.default for key, s in _SETTINGS.items()}


# ----------------------------------------------------------------------------- the problems
@dataclass(frozen=True)
class Problem:
    """Something wrong with the settings. ``condition`` is a setting key or one of the
    cross-key conditions below; ``checks.py`` maps each condition to its id and hint."""

    condition: str
    message: str


NOT_A_DICT = "NOT_A_DICT"
UNKNOWN_KEY = "UNKNOWN_KEY"
HEARTBEAT_TOO_SLOW = "HEARTBEAT_TOO_SLOW"
NOT_POSTGRESQL = "NOT_POSTGRESQL"


def problems(raw: dict[str, Any] | None = None) -> list[Problem]:
    """Every problem with the settings (empty when all is well), in key order."""
    try:
        values = _raw() if raw is None else raw
    except ConfigurationError as exc:
        return [Problem(NOT_A_DICT, str(exc))]
    found: list[Problem] = [
        Problem(UNKNOWN_KEY, f"Unknown key {_name(key)}.") for key in values
        if key not in _SETTINGS
    ]
    for key, setting in _SETTINGS.items():
        message = setting.problem(values)
        if message is not None:
            found.append(Problem(key, message))
    bad = {p.condition for p in found}
    heartbeat = Settings.HEARTBEAT_INTERVAL.raw(values)
    if heartbeat is not None and not bad & {"HEARTBEAT_INTERVAL", "STALE_LOCK_TIMEOUT"}:
        hb, stale = seconds(heartbeat), seconds(Settings.STALE_LOCK_TIMEOUT.raw(values))
        if hb * 2 > stale:
            found.append(Problem(
                HEARTBEAT_TOO_SLOW,
                f"PERSISTENT_JOBS['HEARTBEAT_INTERVAL'] ({hb:g}s) must be at most half of "
                f"STALE_LOCK_TIMEOUT ({stale:g}s), or a live runner could be taken for dead.",
            ))
    if "DATABASE" not in bad:
        alias = Settings.DATABASE.raw(values)
        engine = django_settings.DATABASES[alias].get("ENGINE", "")
        if "postgresql" not in engine:
            found.append(Problem(
                NOT_POSTGRESQL,
                f"Database {alias!r} uses {engine!r}; django-persistent-jobs needs PostgreSQL "
                "(django.db.backends.postgresql).",
            ))
    return found


@dataclass(frozen=True)
class RunnerSettings:
    """The settings the runner needs, resolved once when a runner starts."""

    concurrency: int
    poll_interval: float
    stale_lock_timeout: float
    heartbeat_interval: float
    cleanup_interval: float
    shutdown_grace: float
    queues: tuple[str, ...] | None
    batch_size: int | None
    prefetch: int | None
    database: str
    scheduler_interval: float
    processes: int = 0
    max_jobs_per_worker: int | None = None
    max_memory_per_worker: float | None = None  # MiB
    timeout_grace: float = 5.0

    @classmethod
    def load(cls, **overrides: Any) -> RunnerSettings:
        found = problems()
        if found:
            raise ConfigurationError("; ".join(p.message for p in found))
        stale = settings.STALE_LOCK_TIMEOUT
        heartbeat = settings.HEARTBEAT_INTERVAL
        values: dict[str, Any] = {
            "concurrency": settings.CONCURRENCY,
            "poll_interval": settings.POLL_INTERVAL,
            "stale_lock_timeout": stale,
            "heartbeat_interval": stale / 3 if heartbeat is None else heartbeat,
            "cleanup_interval": settings.CLEANUP_INTERVAL,
            "shutdown_grace": settings.SHUTDOWN_GRACE,
            "queues": settings.QUEUES,
            "batch_size": settings.BATCH_SIZE,
            "prefetch": settings.PREFETCH,
            "database": settings.DATABASE,
            "scheduler_interval": settings.SCHEDULER_INTERVAL,
            "processes": settings.PROCESSES or 0,
            "max_jobs_per_worker": settings.MAX_JOBS_PER_WORKER,
            "max_memory_per_worker": settings.MAX_MEMORY_PER_WORKER,
            "timeout_grace": settings.TIMEOUT_GRACE,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
