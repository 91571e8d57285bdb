"""Retry delays. The default doubles per attempt, capped at 2**10 s (~17 min), with +/-10% jitter
so that a burst of jobs failing together does not retry together."""

from __future__ import annotations

import random


def default_backoff(attempt: int) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
    base = 2 ** min(max(attempt, 0), 10)
    return float(base * random.uniform(0.9, 1.1))


def constant(seconds: float):  # type: ignore[no-untyped-def]
    """A backoff that always waits ``seconds`` (useful in demos and tests)."""

    def backoff(attempt: int) -> float:
        return float(seconds)

    return backoff


#: Functions that make a backoff rather than being one: given as the backoff itself
#: (``BACKOFF = "django_persistent_jobs.backoff.constant"``), every retry would get a function
#: back instead of seconds. The checks refuse them by name (``bounds.backoff_callable_problem``).
FACTORIES = frozenset({constant})
