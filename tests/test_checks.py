"""Bad settings and bad handler options are reported by system checks (with ids and messages that
say what to fix), and the runner and ``runjobs`` refuse to start on them."""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core import checks
from django.core.management import CommandError, call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_persistent_jobs import ConfigurationError, Runner, job_handler
from django_persistent_jobs import conf as pj_conf
from django_persistent_jobs.checks import check_handlers, check_settings
from django_persistent_jobs.handlers import registry
from tests.core_support import pj_settings


def pj_errors() -> list[tuple[str, str]]:
    return [(m.id, m.msg) for m in checks.run_checks(tags=["persistent_jobs"])]


def test_the_suites_settings_pass_every_check() -> None:
    assert pj_errors() == []
    assert check_settings() == [] and check_handlers() == []


BAD_SETTINGS: list[tuple[dict[str, Any], str, str]] = [
    ({"RETRIES": 3}, "persistent_jobs.E002", "Unknown key PERSISTENT_JOBS['RETRIES']."),
    ({"MAX_RETRIES": -1}, "persistent_jobs.E003",
     "PERSISTENT_JOBS['MAX_RETRIES'] must be an integer in 0..1000000, got -1."),
    ({"MAX_RETRIES": "3"}, "persistent_jobs.E003",
     "PERSISTENT_JOBS['MAX_RETRIES'] must be an integer in 0..1000000, got '3'."),
    ({"MAX_RETRIES": 10**7}, "persistent_jobs.E003",
     "PERSISTENT_JOBS['MAX_RETRIES'] must be an integer in 0..1000000, got 10000000."),
    ({"CONCURRENCY": 0}, "persistent_jobs.E015",
     "PERSISTENT_JOBS['CONCURRENCY'] must be an integer > 0, got 0."),
    ({"CONCURRENCY": True}, "persistent_jobs.E015", "must be an integer, got True"),
    ({"PAYLOAD_MAX_BYTES": 1.5}, "persistent_jobs.E023", "PAYLOAD_MAX_BYTES'] must be an integer"),
    ({"PAYLOAD_MAX_BYTES": 2**28}, "persistent_jobs.E023",
     "PAYLOAD_MAX_BYTES'] must be at most 268435455 (what jsonb can hold)"),
    ({"PAYLOAD_MAX_DEPTH": 0}, "persistent_jobs.E024",
     "PAYLOAD_MAX_DEPTH'] must be an integer > 0"),
    ({"PAYLOAD_MAX_KEYS": None}, "persistent_jobs.E025", "PAYLOAD_MAX_KEYS'] must be an integer"),
    ({"BATCH_SIZE": 0}, "persistent_jobs.E021", "BATCH_SIZE'] must be an integer > 0"),
    ({"PREFETCH": -1}, "persistent_jobs.E022", "PREFETCH'] must be an integer >= 0"),
    ({"TIMEOUT": 0}, "persistent_jobs.E004",
     "PERSISTENT_JOBS['TIMEOUT'] must be a number of seconds > 0 (at most 315360000), got 0."),
    ({"TIMEOUT": timedelta(0)}, "persistent_jobs.E004",
     "TIMEOUT'] must be a number of seconds > 0"),
    ({"TIMEOUT": 1e300}, "persistent_jobs.E004", "TIMEOUT'] must be a number of seconds > 0"),
    ({"POLL_INTERVAL": "1s"}, "persistent_jobs.E016",
     "PERSISTENT_JOBS['POLL_INTERVAL'] must be a number, got '1s'."),
    ({"POLL_INTERVAL": float("nan")}, "persistent_jobs.E016",
     "POLL_INTERVAL'] must be a finite number > 0, got nan."),
    ({"POLL_INTERVAL": 1e300}, "persistent_jobs.E016",
     "POLL_INTERVAL'] must be at most 315360000 seconds, got 1e+300."),
    ({"STALE_LOCK_TIMEOUT": float("inf")}, "persistent_jobs.E017",
     "STALE_LOCK_TIMEOUT'] must be a finite number > 0, got inf."),
    ({"SHUTDOWN_GRACE": -1}, "persistent_jobs.E020",
     "SHUTDOWN_GRACE'] must be a finite number >= 0"),
    ({"CLEANUP_INTERVAL": 0}, "persistent_jobs.E019", "CLEANUP_INTERVAL'] must be"),
    ({"SCHEDULER_INTERVAL": -2}, "persistent_jobs.E026", "SCHEDULER_INTERVAL'] must be"),
    # Loops this tight busy-wait (a runner idled at 55% CPU with POLL_INTERVAL = 1e-6).
    ({"POLL_INTERVAL": 1e-6}, "persistent_jobs.E016",
     "PERSISTENT_JOBS['POLL_INTERVAL'] must be at least 0.01 seconds (less keeps an idle "
     "runner busy), got 1e-06."),
    ({"SCHEDULER_INTERVAL": timedelta(microseconds=1)}, "persistent_jobs.E026",
     "PERSISTENT_JOBS['SCHEDULER_INTERVAL'] must be at least 0.01 seconds"),
    ({"CLEANUP_INTERVAL": 0.5}, "persistent_jobs.E019",
     "PERSISTENT_JOBS['CLEANUP_INTERVAL'] must be at least 1 seconds"),
    ({"HEARTBEAT_INTERVAL": 0}, "persistent_jobs.E018", "HEARTBEAT_INTERVAL'] must be"),
    ({"HEARTBEAT_INTERVAL": 2, "STALE_LOCK_TIMEOUT": 3}, "persistent_jobs.E005",
     "PERSISTENT_JOBS['HEARTBEAT_INTERVAL'] (2s) must be at most half of STALE_LOCK_TIMEOUT "
     "(3s), or a live runner could be taken for dead."),
    ({"DEDUP": "SKIP"}, "persistent_jobs.E006",
     "PERSISTENT_JOBS['DEDUP'] must be one of ['skip', 'enqueue', 'replace'], got 'SKIP'."),
    ({"BACKOFF": "no.such.module.backoff"}, "persistent_jobs.E007",
     "PERSISTENT_JOBS['BACKOFF'] = 'no.such.module.backoff' cannot be imported"),
    ({"BACKOFF": 5}, "persistent_jobs.E007", "PERSISTENT_JOBS['BACKOFF'] must be callable, got 5."),
    # Callables the runner cannot call as backoff(attempt): every retry failed instead.
    ({"BACKOFF": "django_persistent_jobs.backoff.constant"}, "persistent_jobs.E007",
     "PERSISTENT_JOBS['BACKOFF'] is django_persistent_jobs.backoff.constant, which makes a "
     "backoff rather than being one: call it, for example constant(5)."),
    ({"BACKOFF": lambda: 5}, "persistent_jobs.E007",
     "PERSISTENT_JOBS['BACKOFF'] is called as backoff(attempt), but <function <lambda>"),
    ({"JSON_ENCODER": "json.dumps"}, "persistent_jobs.E008",
     "PERSISTENT_JOBS['JSON_ENCODER'] must be a json.JSONEncoder subclass"),
    ({"JSON_ENCODER": "nope.Encoder"}, "persistent_jobs.E008", "cannot be imported"),
    ({"RETENTION": -5}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION'] must be positive and finite, got -5."),
    ({"RETENTION": float("inf")}, "persistent_jobs.E009", "must be positive and finite, got inf"),
    ({"RETENTION": "7d"}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION'] must be a timedelta, seconds, None or a dict, got '7d'."),
    ({"RETENTION": {"completed": "soon"}}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION']['completed'] must be a timedelta, seconds or None, got 'soon'."),
    ({"RETENTION": {"dead_lettered": timedelta(0)}}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION']['dead_lettered'] must be positive and finite"),
    ({"RETENTION": {"done": 60}}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION'] has unknown statuses ['done']"),
    # Past what cleanup's ``now() - interval`` can compute: PostgreSQL fails the statement.
    ({"RETENTION": timedelta(days=10**8)}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION'] must be at most 315360000 seconds"),
    ({"RETENTION": {"dead_lettered": timedelta.max}}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION']['dead_lettered'] must be at most 315360000 seconds"),
    # Integers too large for a float: an OverflowError traceback from check and runjobs.
    ({"RETENTION": 10**400}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION'] must be at most 315360000 seconds (about 10 years), got "
     "1000000000"),
    ({"RETENTION": {"completed": 10**5000}}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION']['completed'] must be at most 315360000 seconds (about 10 "
     "years), got <int>; use None"),
    ({"RETENTION": {"cancelled": -(10**400)}}, "persistent_jobs.E009",
     "PERSISTENT_JOBS['RETENTION']['cancelled'] must be positive and finite, got -1000000000"),
    ({"RETENTION": {"done": 60, 7: 60}}, "persistent_jobs.E009",  # keys that do not sort
     "PERSISTENT_JOBS['RETENTION'] has unknown statuses ['done', 7]"),
    ({"QUEUES": []}, "persistent_jobs.E010",
     "PERSISTENT_JOBS['QUEUES'] must be a non-empty list of queue names (strings of 1..100 "
     "characters) or None, got []."),
    ({"QUEUES": "default"}, "persistent_jobs.E010", "got 'default'"),
    ({"QUEUES": ["a", ""]}, "persistent_jobs.E010", "must be a non-empty list of queue names"),
    ({"QUEUES": ["q" * 101]}, "persistent_jobs.E010", "must be a non-empty list of queue names"),
    ({"DEFAULT_QUEUE": 5}, "persistent_jobs.E011",
     "PERSISTENT_JOBS['DEFAULT_QUEUE'] must be a string of 1..100 characters, got 5."),
    ({"DEFAULT_QUEUE": "q" * 101}, "persistent_jobs.E011",
     "PERSISTENT_JOBS['DEFAULT_QUEUE'] must be a string of 1..100 characters"),
    ({"DEFAULT_QUEUE": "q\x00"}, "persistent_jobs.E011", "contains a NUL character"),
    ({"DEFAULT_QUEUE": "a,b"}, "persistent_jobs.E011",
     "PERSISTENT_JOBS['DEFAULT_QUEUE'] 'a,b' contains a comma: runjobs --queues separates "
     "queue names with commas, so no runner could be told to serve it."),
    ({"DEFAULT_QUEUE": "emails "}, "persistent_jobs.E011",
     "PERSISTENT_JOBS['DEFAULT_QUEUE'] 'emails ' begins or ends with whitespace: runjobs "
     "--queues strips it from each name, so no runner could be told to serve it."),
    ({"QUEUES": ["a", " b"]}, "persistent_jobs.E010", "queue ' b' begins or ends with whitespace"),
    ({"DATABASE": "replica"}, "persistent_jobs.E012",
     "PERSISTENT_JOBS['DATABASE'] names 'replica', which is not in settings.DATABASES."),
    ({"DATABASE": ""}, "persistent_jobs.E012",
     "PERSISTENT_JOBS['DATABASE'] must be a non-empty string, got ''."),
    ({"HANDBACK_LIMIT": -1}, "persistent_jobs.E027",
     "PERSISTENT_JOBS['HANDBACK_LIMIT'] must be an integer >= 0, got -1."),
    ({"HANDBACK_LIMIT": None}, "persistent_jobs.E027", "HANDBACK_LIMIT'] must be an integer"),
    ({"PROCESSES": -1}, "persistent_jobs.E031", "PROCESSES'] must be an integer >= 0"),
    ({"MAX_JOBS_PER_WORKER": 0}, "persistent_jobs.E032", "MAX_JOBS_PER_WORKER'] must be"),
    ({"MAX_MEMORY_PER_WORKER": "1G"}, "persistent_jobs.E033", "MAX_MEMORY_PER_WORKER'] must be"),
    ({"TIMEOUT_GRACE": 0}, "persistent_jobs.E034", "TIMEOUT_GRACE'] must be a finite number"),
    ({"REDACT_KEYS": "password"}, "persistent_jobs.E030",
     "REDACT_KEYS'] must be a list of non-empty strings"),
    ({"REDACT_KEYS": ["password", ""]}, "persistent_jobs.E030",
     "REDACT_KEYS'] must be a list of non-empty strings"),
    ({"ALLOW_UNREGISTERED": "no"}, "persistent_jobs.E014",
     "PERSISTENT_JOBS['ALLOW_UNREGISTERED'] must be True or False, got 'no'."),
    ({"PREPARED_STATEMENTS": 1}, "persistent_jobs.E035",
     "PERSISTENT_JOBS['PREPARED_STATEMENTS'] must be True or False, got 1."),
]


@pytest.mark.parametrize(("overrides", "check_id", "message"), BAD_SETTINGS,
                         ids=[f"{i}-{next(iter(o))}" for i, (o, _, _) in enumerate(BAD_SETTINGS)])
def test_bad_settings_are_reported_with_an_id(
    overrides: dict[str, Any], check_id: str, message: str,
) -> None:
    with pj_settings(**overrides):
        errors = pj_errors()
        assert any(i == check_id and message in m for i, m in errors), errors
        assert all(i.startswith("persistent_jobs.E") for i, _ in errors)
        with pytest.raises(ConfigurationError) as info:  # and the runner will not start
            Runner()
        assert message in str(info.value)


def test_a_hint_says_what_to_do() -> None:
    with pj_settings(RETRIES=1, DATABASE="replica"):
        by_id = {m.id: m for m in check_settings()}
    assert "MAX_RETRIES" in (by_id["persistent_jobs.E002"].hint or "")
    assert by_id["persistent_jobs.E012"].hint == "Use one of: default, jobs"


def test_persistent_jobs_must_be_a_dict() -> None:
    with override_settings(PERSISTENT_JOBS=[("MAX_RETRIES", 3)]):
        assert pj_errors() == [("persistent_jobs.E001",
                                "settings.PERSISTENT_JOBS must be a dict, got list.")]
        with pytest.raises(ConfigurationError, match="must be a dict"):
            Runner()


def test_a_non_postgresql_database_is_refused() -> None:
    databases = {**settings.DATABASES,
                 "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Django warns that overriding DATABASES is unusual
        with override_settings(DATABASES=databases), pj_settings(DATABASE="lite"):
            assert pj_errors() == [(
                "persistent_jobs.E013",
                "Database 'lite' uses 'django.db.backends.sqlite3'; django-persistent-jobs "
                "needs PostgreSQL (django.db.backends.postgresql).",
            )]


def test_several_problems_are_all_reported() -> None:
    with pj_settings(CONCURRENCY=0, DEDUP="x", QUEUES=[]):
        assert sorted(i for i, _ in pj_errors()) == [
            "persistent_jobs.E006", "persistent_jobs.E010", "persistent_jobs.E015"]
    with pj_settings(CONCURRENCY=0), pytest.raises(SystemCheckError) as info:
        call_command("check")
    assert "persistent_jobs.E015" in str(info.value)


def test_valid_alternatives_are_accepted() -> None:
    with pj_settings(TIMEOUT=timedelta(minutes=5), RETENTION=timedelta(days=1), BACKOFF=None,
                     QUEUES=("a", "b"), JSON_ENCODER="django.core.serializers.json."
                     "DjangoJSONEncoder", HEARTBEAT_INTERVAL=None, SHUTDOWN_GRACE=0,
                     ALLOW_UNREGISTERED=True, BATCH_SIZE=50, MAX_RETRIES=0):
        assert pj_errors() == []
        assert pj_conf.settings.RETENTION == {"completed": 86400.0, "cancelled": 86400.0,
                                       "dead_lettered": None}
        loaded = pj_conf.RunnerSettings.load()
        assert loaded.queues == ("a", "b") and loaded.heartbeat_interval == 1.0
    with pj_settings(RETENTION=None):
        retention = pj_conf.settings.RETENTION
        assert retention == dict.fromkeys(("completed", "cancelled", "dead_lettered"))


# ------------------------------------------------------------------ handler checks

def test_bad_handler_options_are_reported_per_handler() -> None:
    with registry.isolated():
        @job_handler("core.chk.bad", max_retries=-1, timeout=float("nan"), dedup="maybe",
                     queue="", priority=10**6, backoff=5, validator="nope")  # type: ignore
        def bad(payload: Any) -> None:
            return None

        @job_handler("core.chk.cron_sync", max_retries="many")  # type: ignore[arg-type]
        def cron_named(payload: Any) -> None:
            return None

        @job_handler("core.chk.sched", cron="61 * * * *", timezone="Mars/Olympus")
        def bad_schedule(payload: Any) -> None:
            return None

        @job_handler("core.chk.both", cron="* * * * *", interval=timedelta(minutes=1))
        def both(payload: Any) -> None:
            return None

        errors = [(m.id, m.obj, m.msg) for m in check_handlers()]
        origins = {t: spec.origin for t in ("bad", "cron_sync", "sched", "both")
                   if (spec := registry.get(f"core.chk.{t}")) is not None}
        with pytest.raises(ConfigurationError, match="Invalid job handlers: "):
            Runner()
    assert check_handlers() == []  # gone with the isolated registry

    origin = origins["bad"]
    assert origin.endswith(".<locals>.bad")
    bad_msgs = [msg for i, obj, msg in errors if obj == origin]
    assert all(i == "persistent_jobs.E101" for i, obj, _ in errors if obj == origin)
    prefix = f"handler 'core.chk.bad' ({origin}): "
    assert {m.removeprefix(prefix).split(",")[0].split(" got")[0] for m in bad_msgs} >= {
        "max_retries must be an integer in 0..1000000",
        "timeout must be a number of seconds > 0 (at most 315360000)",
        "dedup must be one of ['skip'",
        "backoff must be a callable attempt -> seconds.",
        "validator must be callable.",
        "queue must be a string of 1..100 characters",
        "priority must be an integer in -32768..32767",
    }
    # A job type that merely contains "cron" is still an option problem (E101), not E102.
    assert [(i, m) for i, obj, m in errors if obj == origins["cron_sync"]] == [(
        "persistent_jobs.E101",
        f"handler 'core.chk.cron_sync' ({origins['cron_sync']}): max_retries must be an integer "
        "in 0..1000000, got 'many'.",
    )]
    schedule_ids = {i for i, obj, _ in errors if obj in (origins["sched"], origins["both"])}
    assert schedule_ids == {"persistent_jobs.E102"}
    sched_msgs = " | ".join(m for _, obj, m in errors if obj == origins["sched"])
    assert "cron '61 * * * *'" in sched_msgs and "time zone" in sched_msgs
    assert any("give either cron or interval, not both" in m for _, _, m in errors)


def test_a_backoff_that_cannot_be_called_with_the_attempt_is_a_handler_error() -> None:
    """``backoff=lambda: 5`` or the factory ``constant`` (not ``constant(5)``) passed the
    check, then failed every retry."""
    from django_persistent_jobs.backoff import constant

    def two_args(attempt: int, extra: int) -> float:
        return 1.0

    def variadic(*args: Any) -> float:
        return 1.0

    with registry.isolated():
        for name, backoff in [("zero", lambda: 5), ("two", two_args), ("factory", constant),
                              ("ok_constant", constant(5)), ("ok_variadic", variadic),
                              ("ok_builtin", float), ("ok_unreadable", min)]:
            job_handler(f"core.chk.backoff_{name}", backoff=backoff)(lambda payload: None)
        errors = {m.msg.split(":")[0].split("'")[1]: (m.id, m.msg) for m in check_handlers()}
    assert set(errors) == {"core.chk.backoff_zero", "core.chk.backoff_two",
                           "core.chk.backoff_factory"}
    assert {i for i, _ in errors.values()} == {"persistent_jobs.E101"}
    assert "backoff is called as backoff(attempt), but <function" in errors[
        "core.chk.backoff_zero"][1]
    assert "too many positional arguments" in errors["core.chk.backoff_zero"][1]
    assert "missing a required argument: 'extra'" in errors["core.chk.backoff_two"][1]
    assert ("backoff is django_persistent_jobs.backoff.constant, which makes a backoff rather "
            "than being one: call it, for example constant(5).") in errors[
        "core.chk.backoff_factory"][1]


def test_schedule_options_on_a_handler_that_is_not_recurring_are_check_errors() -> None:
    """``payload=`` without cron/interval was silently ignored (the handler got ``{}``) and
    ``timezone=`` was not refused, while ``tenant=`` in the same case was E102."""
    with registry.isolated():
        job_handler("core.chk.payload_only", payload={"x": 1})(lambda payload: None)
        job_handler("core.chk.timezone_only", timezone="Europe/Berlin")(lambda payload: None)
        job_handler("core.chk.empty_payload", payload={})(lambda payload: None)
        job_handler("core.chk.recurring", interval=timedelta(hours=1), payload={"x": 1})(
            lambda payload: None)
        job_handler("core.chk.cron_zone", cron="0 3 * * *", timezone="Europe/Berlin")(
            lambda payload: None)
        errors = [(m.id, m.msg) for m in check_handlers()]
    by_type = {m.split("'")[1]: (i, m) for i, m in errors}
    assert set(by_type) == {"core.chk.payload_only", "core.chk.timezone_only",
                            "core.chk.empty_payload"}
    assert {i for i, _ in by_type.values()} == {"persistent_jobs.E102"}
    assert by_type["core.chk.payload_only"][1].endswith(
        "payload is the payload of the scheduled runs; give cron or interval, or pass the "
        "payload to enqueue().")
    assert by_type["core.chk.timezone_only"][1].endswith(
        "timezone is the zone a cron expression is read in; give cron, or drop timezone.")


@pytest.mark.parametrize("overrides", [
    {"PERSISTENT_JOBS": []}, {"PERSISTENT_JOBS": {"JSON_ENCODER": "json"}},
    {"PERSISTENT_JOBS": {"PAYLOAD_MAX_BYTES": 0}},
], ids=["not-a-dict", "bad-encoder", "bad-limit"])
def test_a_settings_error_is_not_also_reported_against_each_recurring_handler(
    overrides: dict[str, Any],
) -> None:
    """Checking a schedule's payload reads the settings: a bad setting was reported once more
    per recurring handler, as E102 with the hint "Fix cron/interval/timezone/payload/tenant in
    the @job_handler call"."""
    with registry.isolated():
        job_handler("core.chk.hourly", interval=timedelta(hours=1), payload={"n": 1})(
            lambda payload: None)
        assert pj_errors() == []
        with override_settings(**overrides):
            errors = pj_errors()
    assert errors and all(i.startswith("persistent_jobs.E0") for i, _ in errors), errors


# ------------------------------------------------------------------ runjobs arguments

@pytest.mark.parametrize(("options", "message"), [
    ({"concurrency": 0}, "--concurrency must be at least 1."),
    ({"poll_interval": 0}, "--poll-interval must be greater than 0."),
    ({"poll_interval": -1.5}, "--poll-interval must be greater than 0."),
    ({"poll_interval": 1e-6}, "--poll-interval must be at least 0.01 seconds"),
    ({"queues": " , ,"}, "--queues needs at least one queue name."),
])
def test_runjobs_refuses_bad_arguments(options: dict[str, Any], message: str) -> None:
    with pytest.raises(CommandError, match=message.replace(".", r"\.")):
        call_command("runjobs", **options)


def test_runjobs_refuses_bad_settings_and_handlers_as_command_errors() -> None:
    with pj_settings(CONCURRENCY=-3), pytest.raises(CommandError) as info:
        call_command("runjobs", burst=True)
    assert "PERSISTENT_JOBS['CONCURRENCY'] must be an integer > 0, got -3." in str(info.value)
    with registry.isolated():
        job_handler("core.chk.runjobs", timeout=-1)(lambda payload: None)
        with pytest.raises(CommandError, match="timeout must be a number of seconds > 0"):
            call_command("runjobs", burst=True)


# ------------------------------------------------------------------ one id per condition

def test_every_check_id_is_one_condition_with_a_hint_and_a_test() -> None:
    """``checks.py`` owns the ids: one per condition (each setting key, each cross-key rule,
    each kind of handler problem), every one with a hint, and every one exercised above."""
    from django_persistent_jobs.checks import HANDLER_CHECKS, SETTING_CHECKS, setting_check

    ids = [i for i, _ in SETTING_CHECKS.values()] + [i for i, _ in HANDLER_CHECKS.values()]
    assert len(ids) == len(set(ids))  # no id covers two conditions
    assert set(pj_conf.DEFAULTS) <= set(SETTING_CHECKS)  # every key has its own id
    assert all(setting_check(condition)[1] for condition in SETTING_CHECKS)
    assert all(hint for _, hint in HANDLER_CHECKS.values())
    tested = {check_id for _, check_id, _ in BAD_SETTINGS} | {
        "persistent_jobs.E001",  # test_persistent_jobs_must_be_a_dict
        "persistent_jobs.E013",  # test_a_non_postgresql_database_is_refused
        "persistent_jobs.E101", "persistent_jobs.E102",  # test_bad_handler_options_...
        "persistent_jobs.E103",  # test_registry: generator handlers
    }
    assert set(ids) == tested


@pytest.mark.parametrize(("overrides", "check_id", "message"), BAD_SETTINGS,
                         ids=[f"{i}-{next(iter(o))}" for i, (o, _, _) in enumerate(BAD_SETTINGS)])
def test_reading_a_bad_setting_raises_the_checks_message(
    overrides: dict[str, Any], check_id: str, message: str,
) -> None:
    """A process that never ran the checks (a shell, a WSGI worker) gets the same message, as
    ImproperlyConfigured, from the typed setting it reads."""
    from django.core.exceptions import ImproperlyConfigured

    key = next(iter(overrides))
    if key not in pj_conf.DEFAULTS or check_id == "persistent_jobs.E005":
        return  # an unknown key, or a rule between two keys: nothing reads it alone
    with pj_settings(**overrides):
        (reported,) = [m.msg for m in check_settings() if m.id == check_id]
        with pytest.raises(ImproperlyConfigured) as info:
            getattr(pj_conf.settings, key)
    assert str(info.value) == reported


@pytest.mark.django_db
def test_recurring_schedules_without_time_zone_support_are_refused_not_crashed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With ``USE_TZ = False`` the database's times are naive and no tick can be computed: a
    recurring handler is a check error (``runjobs`` does not start), a runtime schedule is
    refused when stored, and a runner's scheduler loop says why it fires nothing and ends,
    instead of stopping the runner (or switching every stored schedule off as invalid)."""
    import logging
    import threading

    from django_persistent_jobs.errors import ScheduleError
    from django_persistent_jobs.runner.lifecycle import Lifecycle
    from django_persistent_jobs.runner.scheduler import scheduler_loop
    from django_persistent_jobs.schedules.services import add_schedule

    with registry.isolated():
        @job_handler("core.chk.nightly", cron="0 3 * * *")
        def nightly(payload: Any) -> None:
            return None

        @job_handler("core.chk.plain")
        def plain(payload: Any) -> None:
            return None

        assert check_handlers() == []
        with override_settings(USE_TZ=False):
            found = [(m.id, m.msg) for m in check_handlers()]
            with pytest.raises(ScheduleError, match="need USE_TZ = True"):
                add_schedule("nightly-too", "core.chk.plain", cron="0 3 * * *")
            lifecycle = Lifecycle()
            with caplog.at_level(logging.ERROR, logger="django_persistent_jobs.scheduler"):
                loop = threading.Thread(target=scheduler_loop,
                                        args=("default", "r-chk", 0.1, lifecycle))
                loop.start()
                loop.join(10)
            lifecycle.stopping.set()
    assert [i for i, _ in found] == ["persistent_jobs.E104"]
    assert "'core.chk.nightly' is recurring, but USE_TZ is False" in found[0][1]
    assert not loop.is_alive()
    assert "schedules are not fired: Recurring schedules need USE_TZ = True" in caplog.text
