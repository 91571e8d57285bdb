"""The operator console in the Django admin.

One module per page: ``dashboard`` (the overview: queues, failures, stuck jobs, runners,
tenants), ``jobs`` (the job list and page), ``attempts`` (attempt history as data), ``runners``,
``schedules`` (recurring schedules); ``actions`` holds the audited retry and cancel actions and
``display`` how times, ids and payloads are shown, ``database`` where every page reads (the
``PERSISTENT_JOBS["DATABASE"]`` alias). Importing this package registers them all.
"""

from __future__ import annotations

from . import attempts, dashboard, jobs, runners, schedules

__all__ = ["attempts", "dashboard", "jobs", "runners", "schedules"]
