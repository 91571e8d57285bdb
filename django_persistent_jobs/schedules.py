"""Cron and interval schedules: parsing and next-tick computation."""

from __future__ import annotations

from croniter import croniter


def cron_problem(expression: object) -> str | None:
    """Return why ``expression`` is not a usable cron expression, or ``None`` if it is.

    Five fields are standard cron; a sixth (croniter's optional seconds field) is accepted.
    """
    if not isinstance(expression, str) or not expression.strip():
        return f"cron must be a non-empty string, got {expression!r}."
    fields = expression.split()
    if len(fields) not in (5, 6):
        return (f"cron {expression!r} has {len(fields)} fields; use 5 (minute hour day month "
                "weekday) or 6 (with seconds last).")
    if not croniter.is_valid(expression):
        return f"cron {expression!r} is not a valid cron expression."
    return None
