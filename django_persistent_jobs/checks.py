"""System checks: bad settings and bad handler options are reported before any runner starts.

Ids: ``persistent_jobs.E001``-``E013`` for settings (see ``conf.validate``), ``E101`` for handler
options, ``E102`` for recurring-schedule problems.
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from . import conf
from .registry import registry


@checks.register("persistent_jobs")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return [
        checks.Error(message, hint=hint or None, id=check_id)
        for check_id, message, hint in conf.validate()
    ]


@checks.register("persistent_jobs")
def check_handlers(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for spec in registry:
        for problem in spec.errors:
            check_id = "persistent_jobs.E102" if ("cron" in problem or "interval" in problem
                                                  or "time zone" in problem) else (
                "persistent_jobs.E101")
            errors.append(checks.Error(problem, obj=spec.origin, id=check_id))
    return errors
