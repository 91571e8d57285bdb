"""System checks: bad settings and bad handlers are reported before any runner starts.

This module owns the check ids: one id per condition, each with a hint that says what to do.
``conf.problems()`` and the handler registry say *what* is wrong (with the same message a
process that skips the checks gets as ``ConfigurationError``); the tables below say under which
id it is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import django
from django.apps import AppConfig, apps
from django.conf import settings as django_settings
from django.core import checks

from . import conf
from .handlers import BODY_NEVER_RUNS, OPTION_INVALID, SCHEDULE_INVALID, HandlerSpec, registry


def _known_keys() -> str:
    return "Known keys: " + ", ".join(sorted(conf.DEFAULTS)) + "."


def _database_aliases() -> str:
    return "Use one of: " + ", ".join(django_settings.DATABASES)


_Hint = str | Callable[[], str]

#: Settings: a key of ``PERSISTENT_JOBS`` (its value is unusable) or a cross-key condition.
SETTING_CHECKS: dict[str, tuple[str, _Hint]] = {
    conf.NOT_A_DICT: ("persistent_jobs.E001", "Set PERSISTENT_JOBS = {...}."),
    conf.UNKNOWN_KEY: ("persistent_jobs.E002", _known_keys),
    "MAX_RETRIES": ("persistent_jobs.E003", "Use a whole number of retries, 0 or more."),
    "TIMEOUT": ("persistent_jobs.E004", "Use seconds (a number or a timedelta)."),
    conf.HEARTBEAT_TOO_SLOW: ("persistent_jobs.E005",
                              "Lower HEARTBEAT_INTERVAL or raise STALE_LOCK_TIMEOUT."),
    "DEDUP": ("persistent_jobs.E006", "Use 'skip', 'enqueue' or 'replace'."),
    "BACKOFF": ("persistent_jobs.E007",
                "Give a callable attempt -> seconds, or its dotted path."),
    "JSON_ENCODER": ("persistent_jobs.E008",
                     "Give a json.JSONEncoder subclass or its dotted path."),
    "RETENTION": ("persistent_jobs.E009",
                  "Use a timedelta/seconds, None (keep forever), or a dict per status."),
    "QUEUES": ("persistent_jobs.E010", "For example ['default', 'emails'], or None."),
    "DEFAULT_QUEUE": ("persistent_jobs.E011", "For example 'default'."),
    "DATABASE": ("persistent_jobs.E012", _database_aliases),
    conf.NOT_POSTGRESQL: ("persistent_jobs.E013",
                          "Set DATABASES['default'] ENGINE to 'django.db.backends.postgresql' "
                          "(a new project starts on SQLite), or point "
                          "PERSISTENT_JOBS['DATABASE'] at a PostgreSQL alias."),
    "ALLOW_UNREGISTERED": ("persistent_jobs.E014", "Use True or False."),
    "CONCURRENCY": ("persistent_jobs.E015", "Use a whole number of at least 1."),
    "POLL_INTERVAL": ("persistent_jobs.E016", "Use seconds (a number or a timedelta)."),
    "STALE_LOCK_TIMEOUT": ("persistent_jobs.E017", "Use seconds (a number or a timedelta)."),
    "HEARTBEAT_INTERVAL": ("persistent_jobs.E018",
                           "Use seconds, or None for a third of STALE_LOCK_TIMEOUT."),
    "CLEANUP_INTERVAL": ("persistent_jobs.E019", "Use seconds (a number or a timedelta)."),
    "SHUTDOWN_GRACE": ("persistent_jobs.E020", "Use seconds >= 0."),
    "BATCH_SIZE": ("persistent_jobs.E021", "Use a whole number of at least 1, or None."),
    "PREFETCH": ("persistent_jobs.E022", "Use a whole number >= 0, or None."),
    "PAYLOAD_MAX_BYTES": ("persistent_jobs.E023", "Use a whole number of bytes."),
    "PAYLOAD_MAX_DEPTH": ("persistent_jobs.E024", "Use a whole number of levels."),
    "PAYLOAD_MAX_KEYS": ("persistent_jobs.E025", "Use a whole number of keys."),
    "SCHEDULER_INTERVAL": ("persistent_jobs.E026", "Use seconds (a number or a timedelta)."),
    "HANDBACK_LIMIT": ("persistent_jobs.E027", "Use a whole number >= 0."),
    "PROCESSES": ("persistent_jobs.E031",
                  "Use a whole number >= 0 (0 runs handlers on threads), or None."),
    "MAX_JOBS_PER_WORKER": ("persistent_jobs.E032", "Use a whole number of at least 1, or None."),
    "MAX_MEMORY_PER_WORKER": ("persistent_jobs.E033", "Use MiB (a number > 0), or None."),
    "TIMEOUT_GRACE": ("persistent_jobs.E034", "Use seconds (a number or a timedelta)."),
    "REDACT_KEYS": ("persistent_jobs.E030", "For example ['password', 'token']."),
    "PREPARED_STATEMENTS": ("persistent_jobs.E035", "Use True or False."),
}

#: Handlers registered with ``@job_handler``.
HANDLER_CHECKS: dict[str, tuple[str, str]] = {
    OPTION_INVALID: ("persistent_jobs.E101",
                     "Fix the option in the @job_handler call (or the class attribute)."),
    SCHEDULE_INVALID: ("persistent_jobs.E102",
                       "Fix cron/interval/timezone/payload/tenant in the @job_handler call."),
    BODY_NEVER_RUNS: ("persistent_jobs.E103",
                      "Use a plain function (or async def) that does the work when called; "
                      "a generator's body runs only when something iterates it."),
}


def setting_check(condition: str) -> tuple[str, str]:
    """The ``(id, hint)`` a settings problem is reported under."""
    check_id, hint = SETTING_CHECKS[condition]
    return check_id, hint() if callable(hint) else hint


@checks.register("persistent_jobs")
def check_settings(app_configs: Sequence[AppConfig] | None = None,
                   **kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for problem in conf.problems():
        check_id, hint = setting_check(problem.condition)
        errors.append(checks.Error(problem.message, hint=hint or None, id=check_id))
    return errors


@checks.register("persistent_jobs")
def check_handlers(app_configs: Sequence[AppConfig] | None = None,
                   **kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    # A schedule's payload is checked against the payload settings: while the settings have a
    # problem (``check_settings`` reports it), that check would only report it again, once per
    # recurring handler, as a handler error with a hint to fix the @job_handler call.
    settings_ok = not conf.problems()
    for spec in registry:
        for condition, message in spec.problems:
            check_id, hint = HANDLER_CHECKS[condition]
            errors.append(checks.Error(message, hint=hint, obj=spec.origin, id=check_id))
        if spec.is_recurring and not spec.problems:
            if settings_ok:
                errors.extend(_schedule_payload_problems(spec))
            if not django_settings.USE_TZ:
                from .schedules.services import NEED_USE_TZ

                errors.append(checks.Error(
                    f"{spec.job_type!r} is recurring, but USE_TZ is False. {NEED_USE_TZ}",
                    hint="Set USE_TZ = True, or drop cron/interval from this handler.",
                    obj=spec.origin, id="persistent_jobs.E104"))
    return errors


def _schedule_payload_problems(spec: HandlerSpec) -> list[checks.CheckMessage]:
    from .schedules.firing import payload_problem

    message = payload_problem(spec)
    if message is None:
        return []
    check_id, hint = HANDLER_CHECKS[SCHEDULE_INVALID]
    return [checks.Error(message, hint=hint, obj=spec.origin, id=check_id)]


@checks.register("persistent_jobs")
def check_task_backport_app(app_configs: Sequence[AppConfig] | None = None,
                            **kwargs: Any) -> list[checks.CheckMessage]:
    """On Django 5.2 the check that runs each task backend's own checks (E201-E207), and the
    signal receivers that log tasks and reset backends on a settings change, belong to the
    ``django_tasks`` backport's app config: without that app in INSTALLED_APPS a misconfigured
    backend of ours passes ``check`` silently, so say what is missing."""
    if django.VERSION >= (6, 0) or apps.is_installed("django_tasks"):
        return []
    from .backends.discovery import uses_our_backends

    if not uses_our_backends():
        return []
    installed = backport_installed()
    return [checks.Error(
        "settings.TASKS uses a django-persistent-jobs task backend, but 'django_tasks' is not "
        "in INSTALLED_APPS: on Django 5.2 the task API comes from the django-tasks backport, "
        "whose app runs the task backends' system checks"
        + ("." if installed else ", and the backport is not installed either (importing a "
           "task module would fail with ModuleNotFoundError: No module named 'django.tasks')."),
        hint="Add 'django_tasks' to INSTALLED_APPS." if installed else
        "pip install 'django-persistent-jobs[tasks]' (the django-tasks backport), then add "
        "'django_tasks' to INSTALLED_APPS; or move to Django 6.1 (Python 3.12+).",
        id="persistent_jobs.E208",
    )]


def backport_installed() -> bool:
    """Whether the ``django-tasks`` backport can be imported (Django 5.2's task API)."""
    import importlib.util

    return importlib.util.find_spec("django_tasks") is not None
