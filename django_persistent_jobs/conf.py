"""Settings for django-persistent-jobs, read lazily from ``settings.PERSISTENT_JOBS``.

Settings are never read at import time: Django's test runner and ``override_settings`` change
them after our modules are imported, so every accessor looks the dict up again. Validation lives
here too so that the system check (``checks.py``) and the runner report the same messages.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings as django_settings
from django.utils.module_loading import import_string

#: Every key accepted in ``settings.PERSISTENT_JOBS`` with its default.
DEFAULTS: dict[str, Any] = {
    "MAX_RETRIES": 3,
    "TIMEOUT": 300,
    "CONCURRENCY": 10,
    "POLL_INTERVAL": 1.0,
    "STALE_LOCK_TIMEOUT": 30,
    "HEARTBEAT_INTERVAL": None,  # None: a third of STALE_LOCK_TIMEOUT
    "DEDUP": "skip",
    "BACKOFF": None,  # None: 2 ** min(attempt, 10) seconds, +/-10% jitter
    "RETENTION": {"completed": timedelta(days=7), "cancelled": timedelta(days=7),
                  "dead_lettered": None},
    "CLEANUP_INTERVAL": 300,
    "SHUTDOWN_GRACE": 30,
    "QUEUES": None,  # None: every queue
    "DEFAULT_QUEUE": "default",
    "BATCH_SIZE": None,  # None: as many as there are free slots
    "PREFETCH": 0,  # claimed jobs held waiting for a worker; None: as many as CONCURRENCY
    "DATABASE": "default",
    "PAYLOAD_MAX_BYTES": 128 * 1024,
    "PAYLOAD_MAX_DEPTH": 10,
    "PAYLOAD_MAX_KEYS": 500,
    "JSON_ENCODER": None,
    "ALLOW_UNREGISTERED": False,
    "SCHEDULER_INTERVAL": 1.0,
    "HANDBACK_LIMIT": 3,  # free hand-backs of one job at shutdown; later ones use an attempt
    # Worker processes (see docs/processes.md). None: runjobs uses RUNJOBS_DEFAULT_PROCESSES,
    # an embedded Runner runs jobs on threads in its own process (0).
    "PROCESSES": None,
    "MAX_JOBS_PER_WORKER": None,  # None: never recycle a worker for the jobs it ran
    "MAX_MEMORY_PER_WORKER": None,  # MiB of RSS; None: never recycle a worker for its memory
    "TIMEOUT_GRACE": 5.0,  # seconds a timed-out handler gets to return before its worker goes
}

#: Worker processes ``runjobs`` starts when neither ``--processes`` nor ``PROCESSES`` says.
RUNJOBS_DEFAULT_PROCESSES = 1

TERMINAL_RETENTION_KEYS = ("completed", "cancelled", "dead_lettered")
#: The largest ``max_retries`` ``enqueue`` accepts (and so the largest MAX_RETRIES setting).
MAX_RETRIES_LIMIT = 1_000_000
#: Retention must fit PostgreSQL's interval arithmetic; timedelta's own maximum does.
_MAX_RETENTION_SECONDS = timedelta.max.total_seconds()
DEDUP_CHOICES = ("skip", "enqueue", "replace")


class ConfigurationError(Exception):
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


def get(key: str) -> Any:
    """Return one setting, falling back to its default."""
    if key not in DEFAULTS:
        raise KeyError(f"Unknown PERSISTENT_JOBS setting {key!r}")
    return _raw().get(key, DEFAULTS[key])


def _positive_number(
    key: str, value: Any, *, integer: bool, allow_zero: bool = False
) -> str | None:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    number: float = value
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        return f"PERSISTENT_JOBS['{key}'] must be {kind}, got {value!r}."
    if (isinstance(number, float) and not math.isfinite(number)) or number < 0 or (
        number == 0 and not allow_zero
    ):
        bound = ">= 0" if allow_zero else "> 0"
        kind = "an integer" if integer else "a finite number"
        return f"PERSISTENT_JOBS['{key}'] must be {kind} {bound}, got {value!r}."
    return None


def seconds(value: Any) -> float:
    """Accept seconds as a number or a ``timedelta`` (both are documented)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def validate(raw: dict[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """Return ``(check_id, message, hint)`` for every invalid setting; empty when all is well."""
    errors: list[tuple[str, str, str]] = []
    try:
        conf = _raw() if raw is None else raw
    except ConfigurationError as exc:
        return [("persistent_jobs.E001", str(exc), "Set PERSISTENT_JOBS = {...}.")]

    for key in conf:
        if key not in DEFAULTS:
            known = ", ".join(sorted(DEFAULTS))
            errors.append(("persistent_jobs.E002", f"Unknown key PERSISTENT_JOBS['{key}'].",
                           f"Known keys: {known}."))

    def value(key: str) -> Any:
        return conf.get(key, DEFAULTS[key])

    for key, integer, zero in (
        ("MAX_RETRIES", True, True), ("CONCURRENCY", True, False),
        ("PAYLOAD_MAX_BYTES", True, False), ("PAYLOAD_MAX_DEPTH", True, False),
        ("PAYLOAD_MAX_KEYS", True, False), ("HANDBACK_LIMIT", True, True),
    ):
        msg = _positive_number(key, value(key), integer=integer, allow_zero=zero)
        if msg:
            errors.append(("persistent_jobs.E003", msg, "Use a whole number."))
    if not _positive_number("MAX_RETRIES", value("MAX_RETRIES"), integer=True, allow_zero=True) \
            and value("MAX_RETRIES") > MAX_RETRIES_LIMIT:
        errors.append(("persistent_jobs.E003",
                       f"PERSISTENT_JOBS['MAX_RETRIES'] must be at most {MAX_RETRIES_LIMIT}, "
                       f"got {value('MAX_RETRIES')!r}.", "Use a whole number."))
    for key in ("TIMEOUT", "POLL_INTERVAL", "STALE_LOCK_TIMEOUT", "CLEANUP_INTERVAL",
                "SHUTDOWN_GRACE", "SCHEDULER_INTERVAL"):
        raw_value = value(key)
        if isinstance(raw_value, timedelta):
            raw_value = raw_value.total_seconds()
        msg = _positive_number(key, raw_value, integer=False, allow_zero=key == "SHUTDOWN_GRACE")
        if msg:
            errors.append(("persistent_jobs.E004", msg, "Use seconds (a number or timedelta)."))
    for key, integer, zero in (("PROCESSES", True, True), ("MAX_JOBS_PER_WORKER", True, False),
                               ("MAX_MEMORY_PER_WORKER", False, False)):
        if value(key) is not None:
            msg = _positive_number(key, value(key), integer=integer, allow_zero=zero)
            if msg:
                errors.append(("persistent_jobs.E003", msg, "Use a number or None."))
    grace_msg = _positive_number("TIMEOUT_GRACE", value("TIMEOUT_GRACE"), integer=False)
    if grace_msg:
        errors.append(("persistent_jobs.E004", grace_msg, "Use seconds."))
    heartbeat = value("HEARTBEAT_INTERVAL")
    if heartbeat is not None:
        hb = heartbeat.total_seconds() if isinstance(heartbeat, timedelta) else heartbeat
        msg = _positive_number("HEARTBEAT_INTERVAL", hb, integer=False)
        if msg:
            errors.append(("persistent_jobs.E004", msg, "Use seconds or None."))
        else:
            stale = value("STALE_LOCK_TIMEOUT")
            stale_s = stale.total_seconds() if isinstance(stale, timedelta) else stale
            if isinstance(stale_s, int | float) and hb * 2 > stale_s:
                errors.append((
                    "persistent_jobs.E005",
                    f"PERSISTENT_JOBS['HEARTBEAT_INTERVAL'] ({hb}s) must be at most half of "
                    f"STALE_LOCK_TIMEOUT ({stale_s}s), or a live runner could be taken for dead.",
                    "Lower HEARTBEAT_INTERVAL or raise STALE_LOCK_TIMEOUT.",
                ))
    prefetch = value("PREFETCH")
    if prefetch is not None:
        msg = _positive_number("PREFETCH", prefetch, integer=True, allow_zero=True)
        if msg:
            errors.append(("persistent_jobs.E003", msg, "Use a whole number >= 0 or None."))
    batch = value("BATCH_SIZE")
    if batch is not None:
        msg = _positive_number("BATCH_SIZE", batch, integer=True)
        if msg:
            errors.append(("persistent_jobs.E003", msg, "Use a whole number or None."))
    if value("DEDUP") not in DEDUP_CHOICES:
        errors.append(("persistent_jobs.E006",
                       f"PERSISTENT_JOBS['DEDUP'] must be one of {DEDUP_CHOICES}, "
                       f"got {value('DEDUP')!r}.", "Use 'skip', 'enqueue' or 'replace'."))
    backoff = value("BACKOFF")
    if backoff is not None:
        try:
            resolve_callable(backoff, "BACKOFF")
        except ConfigurationError as exc:
            errors.append(("persistent_jobs.E007", str(exc),
                           "Give a callable attempt -> seconds, or its dotted path."))
    encoder = value("JSON_ENCODER")
    if encoder is not None:
        try:
            resolve_encoder(encoder)
        except ConfigurationError as exc:
            errors.append(("persistent_jobs.E008", str(exc),
                           "Give a json.JSONEncoder subclass or its dotted path."))
    try:
        retention(conf)
    except ConfigurationError as exc:
        errors.append(("persistent_jobs.E009", str(exc),
                       "Use a timedelta/seconds, None (keep forever), or a dict per status."))
    queues = value("QUEUES")
    if queues is not None and (
        not isinstance(queues, list | tuple) or not queues
        or not all(isinstance(q, str) and q for q in queues)
    ):
        errors.append(("persistent_jobs.E010",
                       f"PERSISTENT_JOBS['QUEUES'] must be a non-empty list of queue names or "
                       f"None, got {queues!r}.", "For example ['default', 'emails']."))
    for key in ("DATABASE", "DEFAULT_QUEUE"):
        if not isinstance(value(key), str) or not value(key):
            errors.append(("persistent_jobs.E011",
                           f"PERSISTENT_JOBS['{key}'] must be a non-empty string.", ""))
    default_queue = value("DEFAULT_QUEUE")
    if isinstance(default_queue, str) and len(default_queue) > 100:
        errors.append(("persistent_jobs.E011",
                       "PERSISTENT_JOBS['DEFAULT_QUEUE'] must be at most 100 characters "
                       f"(the queue column's length), got {len(default_queue)}.", ""))
    if not isinstance(value("ALLOW_UNREGISTERED"), bool):
        errors.append(("persistent_jobs.E014",
                       "PERSISTENT_JOBS['ALLOW_UNREGISTERED'] must be True or False, got "
                       f"{value('ALLOW_UNREGISTERED')!r}.", ""))
    alias = value("DATABASE")
    if isinstance(alias, str) and alias not in django_settings.DATABASES:
        errors.append(("persistent_jobs.E012",
                       f"PERSISTENT_JOBS['DATABASE'] names {alias!r}, which is not in "
                       "settings.DATABASES.",
                       "Use one of: " + ", ".join(django_settings.DATABASES)))
    elif isinstance(alias, str):
        engine = django_settings.DATABASES[alias].get("ENGINE", "")
        if "postgresql" not in engine:
            errors.append(("persistent_jobs.E013",
                           f"Database {alias!r} uses {engine!r}; django-persistent-jobs needs "
                           "PostgreSQL (django.db.backends.postgresql).", ""))
    return errors


def resolve_callable(value: Any, key: str) -> Callable[..., Any]:
    """Turn a callable or its dotted path into the callable, with a message that names ``key``."""
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ConfigurationError(
                f"PERSISTENT_JOBS['{key}'] = {value!r} cannot be imported: {exc}"
            ) from exc
    if not callable(value):
        raise ConfigurationError(f"PERSISTENT_JOBS['{key}'] must be callable, got {value!r}.")
    return value


def resolve_encoder(value: Any) -> type[json.JSONEncoder]:
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ConfigurationError(
                f"PERSISTENT_JOBS['JSON_ENCODER'] = {value!r} cannot be imported: {exc}"
            ) from exc
    if not (isinstance(value, type) and issubclass(value, json.JSONEncoder)):
        raise ConfigurationError(
            f"PERSISTENT_JOBS['JSON_ENCODER'] must be a json.JSONEncoder subclass, got {value!r}."
        )
    return value


def retention(conf: dict[str, Any] | None = None) -> dict[str, float | None]:
    """Seconds to keep each terminal status (``None`` keeps forever)."""
    raw = (conf if conf is not None else _raw()).get("RETENTION", DEFAULTS["RETENTION"])
    if raw is None or (isinstance(raw, int | float | timedelta) and not isinstance(raw, bool)):
        # One value applies to completed and cancelled; dead letters are kept for operators.
        base = None if raw is None else seconds(raw)
        if base is not None and not 0 < base <= _MAX_RETENTION_SECONDS:
            raise ConfigurationError(
                f"PERSISTENT_JOBS['RETENTION'] must be positive and finite, got {raw!r}."
            )
        return {"completed": base, "cancelled": base, "dead_lettered": None}
    if not isinstance(raw, dict):
        raise ConfigurationError(
            f"PERSISTENT_JOBS['RETENTION'] must be a timedelta, seconds, None or a dict, "
            f"got {raw!r}."
        )
    result: dict[str, float | None] = dict.fromkeys(TERMINAL_RETENTION_KEYS)
    defaults = DEFAULTS["RETENTION"]
    for status in TERMINAL_RETENTION_KEYS:
        item = raw.get(status, defaults[status])
        if item is None:
            continue
        if isinstance(item, bool) or not isinstance(item, int | float | timedelta):
            raise ConfigurationError(
                f"PERSISTENT_JOBS['RETENTION']['{status}'] must be a timedelta, seconds or "
                f"None, got {item!r}."
            )
        if not 0 < seconds(item) <= _MAX_RETENTION_SECONDS:
            raise ConfigurationError(
                f"PERSISTENT_JOBS['RETENTION']['{status}'] must be positive and finite, "
                f"got {item!r}."
            )
        result[status] = seconds(item)
    unknown = set(raw) - set(TERMINAL_RETENTION_KEYS)
    if unknown:
        raise ConfigurationError(
            f"PERSISTENT_JOBS['RETENTION'] has unknown statuses {sorted(unknown)}; "
            f"use {list(TERMINAL_RETENTION_KEYS)}."
        )
    return result


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
        errors = validate()
        if errors:
            raise ConfigurationError("; ".join(msg for _, msg, _ in errors))
        stale = seconds(get("STALE_LOCK_TIMEOUT"))
        heartbeat = get("HEARTBEAT_INTERVAL")
        queues = get("QUEUES")
        values: dict[str, Any] = {
            "concurrency": get("CONCURRENCY"),
            "poll_interval": seconds(get("POLL_INTERVAL")),
            "stale_lock_timeout": stale,
            "heartbeat_interval": stale / 3 if heartbeat is None else seconds(heartbeat),
            "cleanup_interval": seconds(get("CLEANUP_INTERVAL")),
            "shutdown_grace": seconds(get("SHUTDOWN_GRACE")),
            "queues": tuple(queues) if queues else None,
            "batch_size": get("BATCH_SIZE"),
            "prefetch": get("PREFETCH"),
            "database": get("DATABASE"),
            "scheduler_interval": seconds(get("SCHEDULER_INTERVAL")),
            "processes": get("PROCESSES") or 0,
            "max_jobs_per_worker": get("MAX_JOBS_PER_WORKER"),
            "max_memory_per_worker": get("MAX_MEMORY_PER_WORKER"),
            "timeout_grace": float(get("TIMEOUT_GRACE")),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values["prefetch"] is None:
            values["prefetch"] = values["concurrency"]
        return cls(**values)
