"""Bad input gets ``EnqueueError`` (with a code) before any SQL, never a database error; and one
module's bounds decide every option, so what the system check accepts, enqueue accepts.

Every entry point is covered: ``enqueue``, ``enqueue_many`` (items and common options),
schedules, the operator services, handler options and settings.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_persistent_jobs import (
    ConfigurationError,
    Dedup,
    EnqueueError,
    JobNotFoundError,
    ScheduleError,
    add_schedule,
    bounds,
    cancel_job,
    conf,
    enqueue,
    enqueue_many,
    job_handler,
    pause_schedule,
    remove_schedule,
    resume_schedule,
    retry_job,
    run_schedule_now,
    update_schedule,
)
from django_persistent_jobs.checks import check_settings
from django_persistent_jobs.handlers import registry
from django_persistent_jobs.models import JobSchedule, PersistentJob
from tests.core_support import pj_settings

NUL, SURROGATE = "\x00", "\ud800"
HUGE_INT = 10**5000
FAR = datetime(9999, 12, 31, 23, 59, tzinfo=UTC)

#: (enqueue keyword arguments, a fragment of the message). Each reached PostgreSQL (or crashed
#: in the driver) before it was validated.
BAD_ENQUEUES: list[tuple[dict[str, Any], str]] = [
    ({"delay": timedelta(days=365 * 10**6)}, "delay must be >= 0 and at most"),
    ({"delay": 1e300}, "delay must be >= 0 and at most"),
    ({"delay": 10**400}, "delay must be >= 0 and at most"),
    ({"delay": math.inf}, "delay must be >= 0 and at most"),
    ({"delay": -math.inf}, "delay must be >= 0 and at most"),
    ({"delay": math.nan}, "delay must be >= 0 and at most"),
    ({"run_at": FAR}, "run_at must be between year 1 and 9999-12-31 UTC"),
    ({"run_at": datetime.max.replace(tzinfo=timezone(-timedelta(hours=5)))}, "run_at must be"),
    ({"run_at": datetime.min.replace(tzinfo=timezone(timedelta(hours=5)))}, "run_at must be"),
    ({"dedup_key": "k" + NUL}, "dedup_key 'k\\x00' contains a NUL character"),
    ({"dedup_key": "k" + SURROGATE}, "contains a lone surrogate"),
    ({"queue": "q" + NUL}, "queue 'q\\x00' contains a NUL character"),
    ({"queue": "q" + SURROGATE}, "contains a lone surrogate"),
    ({"queue": "q" * 150}, "queue must be a string of 1..100 characters"),
    # Names ``runjobs --queues`` cannot name (it splits on commas and strips each name): the
    # jobs would wait for ever.
    ({"queue": "a,b"}, "queue 'a,b' contains a comma"),
    ({"queue": " emails"}, "queue ' emails' begins or ends with whitespace"),
    ({"queue": "emails\t"}, "queue 'emails\\t' begins or ends with whitespace"),
    ({"tenant": "t" + NUL}, "tenant 't\\x00' contains a NUL character"),
    ({"tenant": "t" + SURROGATE}, "contains a lone surrogate"),
    ({"timeout": 1e300}, "timeout must be a number of seconds > 0 (at most 315360000)"),
    ({"max_retries": 10**30}, "max_retries must be an integer in 0..1000000"),
    ({"priority": 10**30}, "priority must be an integer in -32768..32767"),
    ({"payload": {"n": HUGE_INT}}, "payload['n'] is an integer of more than 4300 digits"),
    ({"payload": {"n": [-(10**4300)]}}, "payload['n'][0] is an integer of more than 4300"),
    ({"payload": {HUGE_INT: 1}}, "has a key <int> of type int"),
    ({"job_type": "test.noop" + NUL}, "job_type 'test.noop\\x00' contains a NUL character"),
    ({"job_type": "x" + SURROGATE}, "contains a lone surrogate"),
    ({"job_type": "x" * 201}, "job_type must be a string of 1..200 characters"),
]


def _ids(cases: list[tuple[dict[str, Any], str]]) -> list[str]:
    return [f"{next(iter(k))}-{i}" for i, (k, _) in enumerate(cases)]


def _enqueue(kwargs: dict[str, Any]) -> Any:
    args = dict(kwargs)
    return enqueue(args.pop("job_type", "test.noop"), args.pop("payload", {}), **args)


@pytest.fixture(autouse=True)
def _allow_unregistered() -> Iterator[None]:
    # With ALLOW_UNREGISTERED the job type is not looked up in the registry, which is how a job
    # type of 201 characters or with a NUL used to reach the database.
    with pj_settings(ALLOW_UNREGISTERED=True):
        yield


@pytest.mark.django_db
@pytest.mark.parametrize(("kwargs", "message"), BAD_ENQUEUES, ids=_ids(BAD_ENQUEUES))
def test_enqueue_refuses_bad_input_before_any_sql(kwargs: dict[str, Any], message: str) -> None:
    with CaptureQueriesContext(connection) as queries, pytest.raises(EnqueueError) as info:
        _enqueue(kwargs)
    assert message in str(info.value)
    assert info.value.code in ("ENQUEUE_INVALID", "PAYLOAD_INVALID")
    assert queries.captured_queries == []


@pytest.mark.django_db
@pytest.mark.parametrize(("kwargs", "message"), BAD_ENQUEUES, ids=_ids(BAD_ENQUEUES))
def test_enqueue_many_refuses_bad_input_before_any_sql(
    kwargs: dict[str, Any], message: str,
) -> None:
    item = {"job_type": "test.noop", "payload": {}, **kwargs}
    with CaptureQueriesContext(connection) as queries:
        with pytest.raises(EnqueueError) as info:
            enqueue_many([("test.noop", {}), item])
        assert str(info.value).startswith("item 1: ") and message in str(info.value)
        common = {k: v for k, v in kwargs.items() if k not in ("job_type", "payload")}
        if common:
            with pytest.raises(EnqueueError, match=r"^item 0: "):
                enqueue_many([("test.noop", {})], **common)
    assert queries.captured_queries == []


@pytest.mark.django_db
def test_enqueue_many_refuses_unknown_options_and_non_iterables() -> None:
    with pytest.raises(EnqueueError, match=r"unknown options \['colour'\]"):
        enqueue_many([("test.noop", {})], colour="red")
    with pytest.raises(EnqueueError, match="unknown options"):
        enqueue_many([("test.noop", {})], payload={})
    for items in (5, "test.noop", {"job_type": "test.noop"}, None):
        with pytest.raises(EnqueueError, match="takes an iterable of items"):
            enqueue_many(items)  # type: ignore[arg-type]
    with pytest.raises(EnqueueError, match=r"^item 1: .*priority must be an integer"):
        # True == 1 and hash(True) == hash(1): the options cache must not confuse them.
        enqueue_many([{"job_type": "test.noop", "priority": 1},
                      {"job_type": "test.noop", "priority": True}])


@pytest.mark.django_db(transaction=True)
def test_the_callers_transaction_survives_every_refusal() -> None:
    """Inside one ``atomic()`` block: every bad call is refused and the block still commits
    the good jobs around them (a database error would have aborted it)."""
    with transaction.atomic():
        before = enqueue("test.noop", {"n": "before"})
        refused = 0
        for kwargs, _ in BAD_ENQUEUES:
            with pytest.raises(EnqueueError):
                _enqueue(kwargs)
            with pytest.raises(EnqueueError):
                enqueue_many([{"job_type": "test.noop", **kwargs}])
            refused += 1
        for call in _BAD_SCHEDULE_CALLS + _BAD_OPERATOR_CALLS:
            with pytest.raises(EnqueueError):
                call()
        after = enqueue("test.noop", {"n": "after"})
    assert refused == len(BAD_ENQUEUES)
    assert set(PersistentJob.objects.values_list("id", flat=True)) == {before.id, after.id}


@pytest.mark.django_db
def test_the_limits_themselves_are_stored_and_read_back() -> None:
    at_limit = 10**bounds.PAYLOAD_INT_MAX_DIGITS - 1
    job = enqueue("test.noop", {"n": at_limit, "m": -at_limit})
    assert PersistentJob.objects.get(id=job.id).payload == {"n": at_limit, "m": -at_limit}
    far = enqueue("test.noop", delay=bounds.MAX_SECONDS)
    assert PersistentJob.objects.get(id=far.id).next_run_at.year > 2030
    latest = FAR - timedelta(days=1)
    late = enqueue("test.noop", run_at=latest)
    assert PersistentJob.objects.get(id=late.id).next_run_at == latest
    slow = enqueue("test.noop", timeout=bounds.MAX_SECONDS)
    assert PersistentJob.objects.get(id=slow.id).timeout_seconds == bounds.MAX_SECONDS
    edge = enqueue("x" * 200, queue="q" * 100, dedup_key="k" * 255, tenant="t" * 200)
    stored = PersistentJob.objects.get(id=edge.id)
    assert (len(stored.job_type), len(stored.queue), len(stored.dedup_key or ""),
            len(stored.tenant or "")) == (200, 100, 255, 200)


@pytest.mark.django_db
def test_a_payload_nested_beyond_pythons_recursion_limit_is_a_payload_error() -> None:
    deep: Any = 1
    for _ in range(5000):
        deep = [deep]
    with pj_settings(PAYLOAD_MAX_DEPTH=10**6), pytest.raises(EnqueueError) as info:
        enqueue("test.noop", {"deep": deep})
    assert "nested too deeply" in str(info.value) and info.value.code == "PAYLOAD_INVALID"


def test_bounds_match_the_columns() -> None:
    import threading

    # A handler may wait on ctx.time_left (wait_for_cancel) whatever its timeout.
    assert bounds.MAX_SECONDS < threading.TIMEOUT_MAX
    fields = {f.name: f for f in PersistentJob._meta.fields}
    assert fields["job_type"].max_length == bounds.JOB_TYPE_MAX_LENGTH
    assert fields["queue"].max_length == bounds.QUEUE_MAX_LENGTH
    assert fields["dedup_key"].max_length == bounds.DEDUP_KEY_MAX_LENGTH
    assert fields["tenant"].max_length == bounds.TENANT_MAX_LENGTH
    schedule = {f.name: f for f in JobSchedule._meta.fields}
    assert schedule["name"].max_length == bounds.SCHEDULE_NAME_MAX_LENGTH
    assert schedule["cron"].max_length == bounds.CRON_MAX_LENGTH
    assert schedule["timezone"].max_length == bounds.TIMEZONE_MAX_LENGTH
    assert schedule["queue"].max_length == bounds.QUEUE_MAX_LENGTH
    assert schedule["tenant"].max_length == bounds.TENANT_MAX_LENGTH


# ----------------------------------------------------------------------------- schedules
def _schedule(**kwargs: Any) -> Callable[[], Any]:
    args: dict[str, Any] = {"name": "v", "job_type": "test.recurring.tick",
                            "interval": timedelta(hours=1), **kwargs}

    def call() -> Any:
        rest = dict(args)
        return add_schedule(rest.pop("name"), rest.pop("job_type"), **rest)

    return call


_BAD_SCHEDULE_CALLS: list[Callable[[], Any]] = [
    _schedule(name="n" + NUL),
    _schedule(name="n" + SURROGATE),
    _schedule(job_type="test.recurring.tick" + NUL),
    _schedule(job_type="x" * 201),
    _schedule(interval=1e300),
    _schedule(interval=10**400),
    _schedule(interval=timedelta(days=999_999_999)),
    _schedule(interval=None, cron="0 2 * * *" + NUL),
    _schedule(interval=None, cron=",".join(map(str, range(60))) + " "
              + ",".join(map(str, range(24))) + " * * *"),  # valid, but longer than the column
    _schedule(timezone="Europe/Berlin" + NUL),
    _schedule(timezone="Z" * 100),
    _schedule(queue="q" + NUL),
    _schedule(priority=10**30),
    _schedule(tenant="t" + SURROGATE),
    _schedule(payload={"n": HUGE_INT}),
    _schedule(paused="yes"),
    lambda: update_schedule("n" + NUL, queue="q"),
    lambda: update_schedule("existing", queue="q" + NUL),
    lambda: update_schedule("existing", interval=1e300),
    lambda: update_schedule("existing", payload={"n": HUGE_INT}),
    lambda: pause_schedule("n" + NUL),
    lambda: resume_schedule("n" + NUL),
    lambda: remove_schedule("n" + SURROGATE),
    lambda: run_schedule_now("n" * 201),
]


@pytest.mark.django_db
@pytest.mark.parametrize("call", _BAD_SCHEDULE_CALLS,
                         ids=[str(i) for i in range(len(_BAD_SCHEDULE_CALLS))])
def test_schedules_refuse_bad_input_before_any_sql(call: Callable[[], Any]) -> None:
    with CaptureQueriesContext(connection) as queries, pytest.raises(ScheduleError) as info:
        call()
    assert isinstance(info.value, EnqueueError) and info.value.code == "SCHEDULE_INVALID"
    assert queries.captured_queries == []
    assert JobSchedule.objects.count() == 0


# ----------------------------------------------------------------------------- operator services
_BAD_OPERATOR_CALLS: list[Callable[[], Any]] = [
    lambda: retry_job("not-a-uuid"),
    lambda: retry_job(None),
    lambda: retry_job(12),
    lambda: retry_job("0" * 31 + NUL),
    lambda: cancel_job(["x"]),
    lambda: cancel_job("x" + SURROGATE),
    lambda: retry_job(uuid.uuid4(), mode="sometimes"),  # type: ignore[arg-type]
    lambda: retry_job(uuid.uuid4(), mode=["now"]),  # type: ignore[arg-type]
]


@pytest.mark.django_db
@pytest.mark.parametrize("call", _BAD_OPERATOR_CALLS,
                         ids=[str(i) for i in range(len(_BAD_OPERATOR_CALLS))])
def test_operator_services_refuse_bad_arguments_before_any_sql(call: Callable[[], Any]) -> None:
    with CaptureQueriesContext(connection) as queries, pytest.raises(EnqueueError) as info:
        call()
    assert info.value.code in ("INVALID_JOB_ID", "INVALID_RETRY_MODE")
    if info.value.code == "INVALID_JOB_ID":
        assert isinstance(info.value, JobNotFoundError)  # what callers caught before
        assert "is not a job id (a UUID)" in str(info.value)
    assert queries.captured_queries == []


# ----------------------------------------------------------------------------- one set of bounds
#: For each option: values on both sides of every bound.
PROBES: dict[str, list[Any]] = {
    "queue": ["q", "q" * 100, "q" * 101, "q" * 150, "", "q" + NUL, "q" + SURROGATE, 5,
              "a b", "a,b", " emails", "emails ", "emails\n", "a.b-c_d:e/f"],
    "priority": [0, -32768, 32767, 32768, -32769, 1.5, True, 10**30],
    "max_retries": [0, 1_000_000, 1_000_001, -1, "3", True, 10**30],
    "timeout": [1, 0.5, bounds.MAX_SECONDS, bounds.MAX_SECONDS * 2, 1e300, 0, -1, math.nan,
                math.inf, "30", True, timedelta(seconds=5), timedelta(0)],
    "dedup": ["skip", "enqueue", "replace", Dedup.REPLACE, "SKIP", "x", 5],
}


def _handler_accepts(option: str, value: Any) -> tuple[bool, bool]:
    """Whether the system check accepts ``@job_handler(option=value)``, and whether enqueueing
    that handler (its own option, nothing given at enqueue) then succeeds."""
    with registry.isolated():
        job_handler("core.bounds.probe", **{option: value})(lambda payload: None)
        spec = registry.get("core.bounds.probe")
        assert spec is not None
        try:
            enqueue("core.bounds.probe")
        except (EnqueueError, ConfigurationError):
            enqueued = False
        else:
            enqueued = True
        return not spec.errors, enqueued


def _enqueue_accepts(option: str, value: Any) -> bool:
    try:
        enqueue("test.noop", **{option: value})
    except EnqueueError:
        return False
    return True


def _setting_accepts(key: str, value: Any) -> tuple[bool, bool]:
    with pj_settings(**{key: value}):
        checked = not [m for m in check_settings() if key in m.msg]
        try:
            enqueue("test.noop")
        except ImproperlyConfigured:
            return checked, False
        return checked, True


@pytest.mark.django_db
@pytest.mark.parametrize("option", list(PROBES))
def test_what_the_check_accepts_enqueue_accepts_and_vice_versa(option: str) -> None:
    table = []
    for value in PROBES[option]:
        checked, enqueued = _handler_accepts(option, value)
        table.append((bounds.show(value), checked, enqueued, _enqueue_accepts(option, value)))
    assert all(checked == enqueued == direct for _, checked, enqueued, direct in table), table
    assert any(checked for _, checked, _, _ in table) and not all(c for _, c, _, _ in table)


@pytest.mark.django_db
@pytest.mark.parametrize(("key", "option"), [
    ("MAX_RETRIES", "max_retries"), ("TIMEOUT", "timeout"), ("DEFAULT_QUEUE", "queue"),
    ("DEDUP", "dedup"),
])
def test_a_setting_the_check_accepts_enqueue_accepts_and_vice_versa(key: str, option: str) -> None:
    table = []
    for value in PROBES[option]:
        checked, enqueued = _setting_accepts(key, value)
        table.append((bounds.show(value), checked, enqueued, _enqueue_accepts(option, value)))
    assert all(checked == enqueued == direct for _, checked, enqueued, direct in table), table


@pytest.mark.django_db
@pytest.mark.parametrize("option", ["queue", "priority", "tenant"])
def test_schedule_options_follow_the_same_bounds(option: str) -> None:
    values = PROBES.get(option, ["acme", "t" * 200, "t" * 201, "", "t" + NUL, 5])
    for index, value in enumerate(values):
        try:
            add_schedule(f"probe-{index}", "test.recurring.tick", interval=60, **{option: value})
        except ScheduleError:
            scheduled = False
        else:
            scheduled = True
        assert scheduled == _enqueue_accepts(option, value), (option, value)


def test_job_type_and_tenant_follow_the_same_bounds_at_registration() -> None:
    for job_type in ("a" * 200, "a" * 201, "a" + NUL, "a" + SURROGATE, 5):
        with registry.isolated():
            job_handler(job_type)(lambda payload: None)  # type: ignore[call-overload]
            spec = registry.get(job_type)  # type: ignore[arg-type]
            assert spec is not None
            assert (not spec.errors) == (bounds.job_type_problem(job_type) is None), job_type
    for tenant in ("acme", "t" * 200, "t" * 201, "", "t" + NUL):
        with registry.isolated():
            job_handler("core.bounds.tenant", interval=timedelta(hours=1), tenant=tenant)(
                lambda payload: None)
            spec = registry.get("core.bounds.tenant")
            assert spec is not None
            assert (not spec.errors) == (bounds.tenant_problem(tenant) is None), tenant


def test_backoff_results_follow_one_bound() -> None:
    assert bounds.backoff_seconds(5) == 5.0
    assert bounds.backoff_seconds(timedelta(minutes=1)) == 60.0
    assert bounds.backoff_seconds(-3) == 0.0  # "retry now"
    assert bounds.backoff_seconds(bounds.MAX_SECONDS) == bounds.MAX_SECONDS
    for bad in (math.inf, math.nan, bounds.MAX_SECONDS * 2, 10**400, "5", None):
        with pytest.raises(ValueError, match="a backoff must return finite seconds"):
            bounds.backoff_seconds(bad)


# ----------------------------------------------------------------------------- settings read
@pytest.mark.django_db
@pytest.mark.parametrize(("key", "value"), [
    ("MAX_RETRIES", "3"), ("MAX_RETRIES", -1), ("TIMEOUT", "30"), ("TIMEOUT", math.nan),
    ("DEFAULT_QUEUE", "q" * 150), ("DEDUP", "sometimes"), ("PAYLOAD_MAX_BYTES", "big"),
    ("JSON_ENCODER", "no.such.Encoder"), ("DATABASE", "nowhere"),
])
def test_a_process_that_skips_the_checks_gets_the_checks_message(key: str, value: Any) -> None:
    """A shell or WSGI worker never runs the system checks: enqueue must still say what is wrong
    with the setting, as ImproperlyConfigured, in the words of the check."""
    with pj_settings(**{key: value}):
        (check,) = [m for m in check_settings() if f"PERSISTENT_JOBS['{key}']" in m.msg]
        with CaptureQueriesContext(connection) as queries:
            with pytest.raises(ImproperlyConfigured) as info:
                enqueue("test.noop", {})
            with pytest.raises(ConfigurationError) as typed:
                getattr(conf.settings, key)
        assert str(info.value) == str(typed.value) == check.msg
        assert queries.captured_queries == []
    assert issubclass(ConfigurationError, ImproperlyConfigured)


def test_typed_settings_have_their_defaults_and_types() -> None:
    with pj_settings(TIMEOUT=timedelta(minutes=2), QUEUES=["a", "b"], BACKOFF=None):
        assert conf.settings.TIMEOUT == 120.0
        assert conf.settings.QUEUES == ("a", "b")
        assert conf.settings.BACKOFF is None
    assert conf.DEFAULTS["MAX_RETRIES"] == 3 and conf.DEFAULTS["DEDUP"] == "skip"
