"""How the console shows times, ids and payloads: one place, so every page reads the same.

Times are shown as absolute UTC with an age ("2026-11-23 01:52:03 UTC, 4 min ago"): operators
compare them with logs written in UTC, and the age answers "how long" without arithmetic. Ages
are measured against the database clock, which is what decides when jobs are due.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .. import conf

REDACTED = "***"


def db_now(*, clock: bool = False) -> datetime:
    """The jobs database's ``now()``, or with ``clock`` its wall clock (``clock_timestamp()``),
    which no row committed before the call can be later than."""
    with connections[conf.settings.DATABASE].cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()" if clock else "SELECT now()")
        value: datetime = cursor.fetchone()[0]
    return value


def utc(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(delta: timedelta | None) -> str:
    """A compact, human duration: 850 ms, 42 s, 4 min, 3 h 5 min, 2 d 4 h."""
    if delta is None:
        return "-"
    seconds = abs(delta.total_seconds())
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 90:
        return f"{minutes} min"
    hours = minutes // 60
    if hours < 48:
        return f"{hours} h {minutes % 60} min" if minutes % 60 else f"{hours} h"
    return f"{hours // 24} d {hours % 24} h" if hours % 24 else f"{hours // 24} d"


def age(value: datetime | None, now: datetime) -> str:
    """"4 min ago" for the past, "in 4 min" for the future."""
    if value is None:
        return "-"
    delta = now - value
    if abs(delta.total_seconds()) < 1:
        return "just now"
    return f"{duration(delta)} ago" if delta.total_seconds() > 0 else f"in {duration(delta)}"


def when(value: datetime | None, now: datetime) -> SafeString:
    """The age, with the absolute UTC time as its tooltip (lists, where space is short)."""
    if value is None:
        return format_html("{}", "-")
    return format_html('<span title="{}">{}</span>', utc(value), age(value, now))


def when_full(value: datetime | None, now: datetime) -> SafeString:
    """Absolute UTC time and age side by side (detail pages)."""
    if value is None:
        return format_html("{}", "-")
    return format_html('{} <span class="pj-age">({})</span>', utc(value), age(value, now))


def short_id(value: Any) -> str:
    """The last 8 hex digits of a UUID v7: its random part (the first digits are a timestamp,
    shared by jobs enqueued together). Unique enough to tell rows apart on a page, and the job
    search accepts it."""
    text = value.hex if isinstance(value, uuid.UUID) else str(value).replace("-", "")
    return text[-8:]


def redact(value: Any, keys: Iterable[str] | None = None) -> Any:
    """A copy of ``value`` with the values of secret-looking keys replaced by ``***``.

    A key is secret-looking when it contains one of ``REDACT_KEYS`` (case-insensitive), at any
    depth, so ``{"auth": {"api_key": ...}}`` and ``{"db_password": ...}`` are both caught.
    """
    patterns = [k.lower() for k in (conf.settings.REDACT_KEYS if keys is None else keys)]

    def walk(item: Any) -> Any:
        if isinstance(item, dict):
            return {
                k: REDACTED if any(p in str(k).lower() for p in patterns) else walk(v)
                for k, v in item.items()
            }
        if isinstance(item, list):
            return [walk(v) for v in item]
        return item

    return walk(value)


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def truncate(text: str, limit: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
