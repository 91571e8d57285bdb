"""Retry delays. The default doubles per attempt, capped at 2**10 s (~17 min), with +/-10% jitter
so that a burst of jobs failing together does not retry together."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import Any

from . import bounds  # (bounds imports this module only inside a function)


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


#: The retry delay used when a backoff function raises or returns no usable number of seconds.
FALLBACK_SECONDS = 60.0

logger = logging.getLogger("django_persistent_jobs.runner")


def delay_after(backoff: Callable[[int], Any], attempt: int) -> float:
    """The delay a runner waits before the next attempt, read as ``retry_job(mode="later")``
    reads a backoff's answer: seconds or a ``timedelta``. Huge and infinite values are left
    for the caller to bound (the database runner stores at most about ten years). Anything
    else (NaN, a string, None), or a backoff that raises, must not become "retry at once" in
    a loop: it is logged and ``FALLBACK_SECONDS`` is used. Shared by the runner and the
    in-process ``django.tasks`` backend."""
    try:
        value = backoff(attempt)
    except Exception:
        logger.exception("backoff function failed; retrying in %ss", FALLBACK_SECONDS)
        return FALLBACK_SECONDS
    seconds = bounds.seconds_of(value)
    if seconds is None or math.isnan(seconds):
        logger.error("backoff function returned %s, not seconds; retrying in %ss",
                     bounds.show(value), FALLBACK_SECONDS, extra={"event": "backoff_unusable"})
        return FALLBACK_SECONDS
    return max(0.0, seconds)
