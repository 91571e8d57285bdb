"""The job runner: claim, execute, heartbeat, rescue, schedule and clean up.

``Runner`` is the embeddable API; ``python manage.py runjobs`` is a thin wrapper around it.
It is imported lazily so that a worker process can import its entry point
(``runner.workers.main``) before Django is set up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .supervisor import Runner

__all__ = ["Runner"]


def __getattr__(name: str) -> Any:
    if name == "Runner":
        from .supervisor import Runner

        return Runner
    raise AttributeError(name)
