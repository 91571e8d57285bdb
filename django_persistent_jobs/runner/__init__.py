"""The job runner: claim, execute, heartbeat, rescue, schedule and clean up.

``Runner`` is the embeddable API; ``python manage.py runjobs`` is a thin wrapper around it.
"""

from .supervisor import Runner

__all__ = ["Runner"]
