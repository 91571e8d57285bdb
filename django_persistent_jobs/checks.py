"""System checks: bad settings and bad handler options are reported before any runner starts.

Ids: ``persistent_jobs.E001``-``E014`` for settings (see ``conf.validate``), ``E101`` for handler
options, ``E102`` for recurring-schedule problems.
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from . import conf
from .handlers import registry


@checks.register("persistent_jobs")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return [
        checks.Error(message, hint=hint or None, id=check_id)
        for check_id, message, hint in conf.validate()
    ]


#: How the schedule-related problems of ``registry._check_options`` begin (after the handler's
#: name); everything else is a plain option problem.
_SCHEDULE_PROBLEMS = ("cron", "interval", "give either cron or interval", "time zone",
                      "unknown time zone")


def _problem_id(spec: Any, problem: str) -> str:
    # Classify on the text after "handler 'type' (origin): ", never on the whole message: a job
    # type such as 'reports.cron_sync' must not turn its max_retries problem into E102.
    prefix = f"handler {spec.job_type!r} ({spec.origin}): "
    detail = problem[len(prefix):] if problem.startswith(prefix) else problem
    return "persistent_jobs.E102" if detail.startswith(_SCHEDULE_PROBLEMS) else (
        "persistent_jobs.E101")


@checks.register("persistent_jobs")
def check_handlers(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for spec in registry:
        for problem in spec.errors:
            errors.append(checks.Error(problem, obj=spec.origin, id=_problem_id(spec, problem)))
    return errors
