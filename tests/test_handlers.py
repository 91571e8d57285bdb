"""Handlers: @job_handler on functions and JobHandler subclasses, autodiscovery, duplicates and
per-handler options merged over settings."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from django_persistent_jobs import (
    ConfigurationError,
    Dedup,
    JobContext,
    JobHandler,
    enqueue,
    job_handler,
)
from django_persistent_jobs.backoff import constant, default_backoff
from django_persistent_jobs.errors import DuplicateHandlerError
from django_persistent_jobs.handlers import HandlerSpec, registry
from django_persistent_jobs.models import PersistentJob
from django_persistent_jobs.runner import Runner
from tests.core_support import pj_settings

SEEN: dict[str, Any] = {}


def triple(attempt: int) -> float:
    return 3.0 * attempt


@job_handler("core.reg.one")
def one_param(payload: dict[str, Any]) -> None:
    SEEN["one"] = payload


@job_handler("core.reg.two", max_retries=1, timeout=5, queue="reg", priority=3,
             dedup=Dedup.REPLACE, backoff=constant(7))
def two_params(payload: dict[str, Any], ctx: JobContext) -> None:
    SEEN["two"] = (payload, ctx)


@job_handler
class ClassHandler(JobHandler):
    job_type = "core.reg.class"
    max_retries = 6
    timeout = 9.5
    queue = "classy"
    priority = -2
    dedup = Dedup.ENQUEUE

    def execute(self, payload: Any, ctx: JobContext) -> None:
        SEEN["class"] = (payload, ctx.job_type, ctx.attempt)


def test_installed_apps_jobs_modules_are_autodiscovered() -> None:
    noop, ledger = registry.get("test.noop"), registry.get("test.ledger")
    assert noop is not None and ledger is not None
    assert noop.origin == "tests.testapp.jobs.noop"
    assert ledger.origin == "tests.testapp.jobs.ledger"
    assert (ledger.max_retries, ledger.timeout) == (3, 60)
    assert {"test.noop", "test.ledger", "core.reg.one"} <= set(registry.job_types())
    assert "test.noop" in registry and "core.reg.missing" not in registry


def test_function_and_class_registrations_keep_their_options() -> None:
    two = registry.get("core.reg.two")
    assert two is not None and not two.errors
    assert (two.max_retries, two.timeout, two.queue, two.priority, two.dedup) == (
        1, 5, "reg", 3, "replace")
    assert two.effective_backoff()(4) == 7
    cls = registry.get("core.reg.class")
    assert cls is not None and not cls.errors
    assert (cls.max_retries, cls.timeout, cls.queue, cls.priority, cls.dedup) == (
        6, 9.5, "classy", -2, "enqueue")
    assert cls.origin == f"{__name__}.ClassHandler"
    # The decorator hands back what it decorated, tagged with its job type.
    assert one_param.job_type == "core.reg.one"  # type: ignore[attr-defined]
    assert ClassHandler.job_type == "core.reg.class"
    one_param({"direct": True})
    assert SEEN.pop("one") == {"direct": True}


def test_decorator_options_override_class_attributes() -> None:
    with registry.isolated():
        @job_handler("core.reg.renamed", max_retries=0, priority=9)
        class Renamed(ClassHandler):
            pass

        spec = registry.get("core.reg.renamed")
        assert spec is not None
        assert (spec.max_retries, spec.priority, spec.timeout, spec.queue) == (0, 9, 9.5,
                                                                               "classy")
    assert registry.get("core.reg.renamed") is None  # isolated() dropped it


def test_atomic_is_an_option_of_functions_and_classes_and_must_be_a_bool() -> None:
    with registry.isolated():
        job_handler("core.reg.atomic.default")(lambda payload: None)
        job_handler("core.reg.atomic.off", atomic=False)(lambda payload: None)

        @job_handler
        class Loose(JobHandler):
            job_type = "core.reg.atomic.class"
            atomic = False

            def execute(self, payload: Any, ctx: JobContext) -> None:
                return None

        @job_handler("core.reg.atomic.override", atomic=True)
        class Strict(Loose):
            pass

        specs = {t: registry.get(f"core.reg.atomic.{t}") for t in (
            "default", "off", "class", "override")}
        assert {t: (s.atomic, s.errors) for t, s in specs.items() if s is not None} == {
            "default": (True, []), "off": (False, []), "class": (False, []),
            "override": (True, [])}
        for bad in ("no", 0, 1, None.__class__):
            job_handler(f"core.reg.atomic.bad{id(bad)}", atomic=bad)(  # type: ignore[arg-type]
                lambda payload: None)
            spec = registry.get(f"core.reg.atomic.bad{id(bad)}")
            assert spec is not None
            assert any("atomic must be True or False" in e for e in spec.errors), (bad, spec.errors)
            with pytest.raises(ConfigurationError, match="atomic must be True or False"):
                enqueue(f"core.reg.atomic.bad{id(bad)}", {})


@pytest.mark.django_db(transaction=True)
def test_each_handler_kind_runs_with_what_it_asked_for(
    start_runner: Callable[..., Runner],
) -> None:
    SEEN.clear()
    one = enqueue("core.reg.one", {"a": 1})
    two = enqueue("core.reg.two", {"b": 2})
    three = enqueue("core.reg.class", {"c": 3})
    runner = start_runner(burst=True, scheduler=False)
    assert runner.finished.wait(20)
    assert set(PersistentJob.objects.values_list("status", flat=True)) == {"completed"}
    assert SEEN["one"] == {"a": 1}
    payload, ctx = SEEN["two"]
    assert payload == {"b": 2}
    assert isinstance(ctx, JobContext)
    assert (ctx.job_id, ctx.job_type, ctx.attempt, ctx.max_retries, ctx.runner_id) == (
        two.id, "core.reg.two", 1, 1, runner.runner_id)
    assert (ctx.queue, ctx.priority, ctx.timeout) == ("reg", 3, 5.0)
    assert not ctx.cancel_requested and not ctx.is_last_attempt
    assert SEEN["class"] == ({"c": 3}, "core.reg.class", 1)
    assert one.id != three.id


def test_registering_a_job_type_twice_is_an_error() -> None:
    original = registry.get("test.noop")
    with registry.isolated():
        with pytest.raises(DuplicateHandlerError) as info:
            @job_handler("test.noop")
            def impostor(payload: Any) -> None:
                return None

        message = str(info.value)
        assert "'test.noop' is already handled by tests.testapp.jobs.noop" in message
        assert "impostor cannot register it again" in message

        with pytest.raises(DuplicateHandlerError):
            @job_handler
            class Impostor(JobHandler):
                job_type = "core.reg.one"

                def execute(self, payload: Any, ctx: JobContext) -> None:
                    return None

        job_handler("core.reg.lambda")(lambda payload: None)
        with pytest.raises(DuplicateHandlerError):  # same module and name, different code
            job_handler("core.reg.lambda")(lambda payload: 1)
    assert registry.get("test.noop") is original


def test_bad_handler_shapes_fail_at_decoration() -> None:
    with registry.isolated():
        with pytest.raises(ConfigurationError, match=r"must accept \(payload\) or \(payload, ctx\);"
                                                     " it takes 3 positional parameters"):
            @job_handler("core.reg.three")
            def three(payload: Any, ctx: Any, extra: Any) -> None:
                return None

        with pytest.raises(ConfigurationError, match="it takes 0 positional parameters"):
            job_handler("core.reg.zero")(lambda: None)
        with pytest.raises(ConfigurationError, match="a function or a JobHandler subclass"):
            @job_handler("core.reg.plain")
            class Plain:
                pass

        with pytest.raises(ConfigurationError, match="has no job type"):
            @job_handler
            class Nameless(JobHandler):
                def execute(self, payload: Any, ctx: JobContext) -> None:
                    return None

        with pytest.raises(ConfigurationError, match="cannot decorate"):
            job_handler("core.reg.value")(42)  # type: ignore[arg-type]
        assert [t for t in registry.job_types() if t.startswith("core.reg.")] == [
            "core.reg.class", "core.reg.one", "core.reg.two"]


class _SlottedService:
    __slots__ = ()

    def handle(self, payload: Any, ctx: JobContext) -> str:
        return f"service {payload} {ctx.job_type}"


class _SlottedCallable:
    __slots__ = ()

    def __call__(self, payload: Any) -> str:
        return f"callable {payload}"


def test_bound_methods_slotted_callables_and_builtins_register_whole() -> None:
    """``target.job_type = ...`` ran after the handler was registered and raised
    ``AttributeError`` for targets that take no attributes (a bound method, an object with
    ``__slots__``, a builtin), leaving the job type registered by a decoration that failed."""
    ctx = JobContext(job_id=uuid.uuid4(), job_type="core.reg.method", attempt=1,
                     max_retries=0, runner_id="r")
    with registry.isolated():
        method = _SlottedService().handle
        assert job_handler("core.reg.method")(method) == method
        slotted = _SlottedCallable()
        assert job_handler("core.reg.slotted")(slotted) is slotted
        assert job_handler("core.reg.builtin")(len) is len
        specs = [registry.get(t) for t in ("core.reg.method", "core.reg.slotted",
                                           "core.reg.builtin")]
        assert all(spec is not None and not spec.errors for spec in specs)
        assert specs[0].func(1, ctx) == "service 1 core.reg.method"  # type: ignore[union-attr]
        assert specs[1].func(2, ctx) == "callable 2"  # type: ignore[union-attr]
        assert specs[2].func([1, 2], ctx) == 2  # type: ignore[union-attr]
        # A function still gets its job type as an attribute.
        def plain(payload: Any) -> None:
            return None

        assert job_handler("core.reg.attr")(plain).job_type == "core.reg.attr"  # type: ignore[attr-defined]

        # A builtin whose signature cannot be read is refused saying so, and not registered.
        with pytest.raises(ConfigurationError, match="cannot read the parameters of"):
            job_handler("core.reg.min")(min)
        assert "core.reg.min" not in registry


def test_a_class_handlers_execute_is_held_to_the_same_shapes_as_a_function() -> None:
    """``execute(self, payload)`` gets the payload only, as a one-parameter function does; any
    other shape is refused at decoration, not found out by every attempt failing with a
    ``TypeError`` until the job is dead-lettered."""
    import asyncio

    with registry.isolated():
        @job_handler("core.reg.class_one")
        class ClassOne(JobHandler):
            def execute(self, payload: Any) -> str:  # type: ignore[override]
                return f"one {payload}"

        @job_handler("core.reg.class_one_async")
        class ClassOneAsync(JobHandler):
            async def execute(self, payload: Any) -> str:  # type: ignore[override]
                return f"async one {payload}"

        ctx = JobContext(job_id=uuid.uuid4(), job_type="core.reg.class_one", attempt=1,
                         max_retries=0, runner_id="r")
        one, one_async = registry.get("core.reg.class_one"), registry.get(
            "core.reg.class_one_async")
        assert one is not None and one_async is not None
        assert not one.errors and not one_async.errors and one_async.is_async
        assert one.func({"a": 1}, ctx) == "one {'a': 1}"
        assert asyncio.run(one_async.func(5, ctx)) == "async one 5"  # type: ignore[arg-type]

        with pytest.raises(ConfigurationError, match=r"must accept \(payload\) or \(payload, ctx\);"
                                                     " it takes 0 positional parameters"):
            @job_handler("core.reg.class_zero")
            class ClassZero(JobHandler):
                def execute(self) -> None:  # type: ignore[override]
                    return None

        with pytest.raises(ConfigurationError, match="it takes 3 positional parameters"):
            @job_handler("core.reg.class_three")
            class ClassThree(JobHandler):
                def execute(self, payload: Any, ctx: JobContext,  # type: ignore[override]
                            extra: Any) -> None:
                    return None
        assert "core.reg.class_zero" not in registry
        assert "core.reg.class_three" not in registry


def test_a_jobhandler_subclass_without_execute_is_refused_at_decoration() -> None:
    """It passed registration and ``manage.py check``; every job of it then failed with
    ``NotImplementedError`` until it was dead-lettered."""
    with registry.isolated():
        with pytest.raises(ConfigurationError) as info:
            @job_handler
            class NoExecute(JobHandler):
                job_type = "core.reg.no_execute"

                def validate(self, payload: Any) -> None:
                    return None

        message = str(info.value)
        assert "NoExecute" in message and "does not define execute(self, payload" in message
        assert "core.reg.no_execute" not in registry

        class Base(JobHandler):
            def execute(self, payload: Any, ctx: JobContext) -> str:
                return "inherited"

        @job_handler("core.reg.inherits_execute")
        class Child(Base):  # an execute inherited from a user's base class is fine
            pass

        assert "core.reg.inherits_execute" in registry


def test_handler_options_merge_over_settings_at_call_time() -> None:
    spec = HandlerSpec(job_type="core.reg.bare", func=lambda p, c: None, origin="x")
    assert (spec.effective_max_retries(), spec.effective_timeout(), spec.effective_dedup(),
            spec.effective_queue()) == (3, 300.0, Dedup.SKIP, "default")
    assert spec.effective_backoff() is default_backoff
    with pj_settings(MAX_RETRIES=0, TIMEOUT=timedelta(seconds=90), DEDUP="enqueue",
                     DEFAULT_QUEUE="q2", BACKOFF=f"{__name__}.triple"):
        assert (spec.effective_max_retries(), spec.effective_timeout(), spec.effective_dedup(),
                spec.effective_queue()) == (0, 90.0, Dedup.ENQUEUE, "q2")
        assert spec.effective_backoff()(2) == 6.0
        two = registry.get("core.reg.two")
        assert two is not None
        assert (two.effective_max_retries(), two.effective_timeout(), two.effective_dedup(),
                two.effective_queue(), two.effective_backoff()(1)) == (1, 5, Dedup.REPLACE,
                                                                       "reg", 7.0)
    with pj_settings(BACKOFF=triple):
        assert spec.effective_backoff() is triple


def test_default_backoff_doubles_with_ten_percent_jitter_capped_at_2_pow_10() -> None:
    for attempt, base in ((1, 2), (2, 4), (5, 32), (10, 1024), (30, 1024)):
        values = [default_backoff(attempt) for _ in range(200)]
        assert all(0.9 * base <= v <= 1.1 * base for v in values), (attempt, min(values))
        assert len(set(values)) > 1  # jittered


def test_job_context_reports_and_cancels() -> None:
    progress: list[Any] = []
    ctx = JobContext(job_id=uuid.uuid4(), job_type="t", attempt=2, max_retries=1, runner_id="r",
                     timeout=30, _progress_sink=lambda c, p: progress.append(p))
    assert ctx.is_last_attempt and ctx.time_left is not None and 29 < ctx.time_left <= 30
    ctx.report_progress({"done": 1, "of": 3})
    assert progress == [{"done": 1, "of": 3}]
    ctx.raise_if_cancelled()
    assert not ctx.wait_for_cancel(0)
    ctx._cancel_event.set()
    assert ctx.cancel_requested and ctx.wait_for_cancel(0)
    from django_persistent_jobs import JobCancelledError

    with pytest.raises(JobCancelledError):
        ctx.raise_if_cancelled()


def test_public_names_are_the_api_objects_not_their_submodules() -> None:
    import types

    import django_persistent_jobs as pj
    from django_persistent_jobs import enqueue as public_enqueue
    from django_persistent_jobs import registry as public_registry
    from django_persistent_jobs.enqueuing import enqueue as module_enqueue
    from django_persistent_jobs.handlers import Registry

    # django.setup() imported the submodules (the admin needs them) before this test ran.
    assert public_enqueue is module_enqueue
    assert isinstance(public_registry, Registry) and public_registry is registry
    for name in pj.__all__:
        assert not isinstance(getattr(pj, name), types.ModuleType), name


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), 1e12, True, "5"])
def test_transient_error_refuses_a_retry_after_the_database_cannot_schedule(bad: Any) -> None:
    from django_persistent_jobs import TransientJobError

    with pytest.raises(ValueError, match="retry_after must be seconds"):
        TransientJobError("later", retry_after=bad)


@pytest.mark.parametrize("error", ["TransientJobError", "PermanentJobError"])
@pytest.mark.parametrize("bad", [429, b"RATE_LIMITED", ["RATE_LIMITED"]])
def test_an_error_code_that_is_not_a_string_is_refused_saying_so(error: str, bad: Any) -> None:
    """Codes are stored as text and grouped by the admin's filter: ``code=429`` failed with
    "'int' object is not subscriptable", and ``code=b"X"`` was stored as ``"b'X'"``."""
    import django_persistent_jobs as pj

    with pytest.raises(ValueError, match=r"code must be a string \(for example 'RATE_LIMITED'\)"):
        getattr(pj, error)("failed", code=bad)


def test_transient_error_accepts_seconds_or_a_timedelta() -> None:
    from django_persistent_jobs import PermanentJobError, TransientJobError

    assert TransientJobError("x", retry_after=timedelta(minutes=2)).retry_after == 120.0
    error = TransientJobError("x", code="RATE_LIMITED", retry_after=0)
    assert (error.retry_after, error.code, error.message, error.transient) == (
        0, "RATE_LIMITED", "x", True)
    assert TransientJobError("x").code == "HANDLER_ERROR"
    assert PermanentJobError("y").code == "PERMANENT_ERROR" and not PermanentJobError.transient


# ------------------------------------------------------------------ handlers whose body never runs

def test_generator_handlers_are_refused_with_their_own_check_id() -> None:
    """Calling a generator function only builds an iterator: the job would be marked completed
    although its body never ran. Such handlers are check errors (E103), cannot be enqueued, and
    no runner starts while one is registered."""
    from django_persistent_jobs.checks import check_handlers

    with registry.isolated():
        @job_handler("core.reg.gen")
        def gen(payload: Any) -> Any:
            yield payload

        @job_handler("core.reg.agen")
        async def agen(payload: Any, ctx: JobContext) -> Any:
            yield payload

        @job_handler
        class GenClass(JobHandler):
            job_type = "core.reg.gen_class"

            def execute(self, payload: Any, ctx: JobContext) -> Any:  # type: ignore[override]
                yield payload

        errors = {m.obj: m for m in check_handlers()}
        for job_type, kind in (("core.reg.gen", "a generator function"),
                               ("core.reg.agen", "an async generator function"),
                               ("core.reg.gen_class", "a generator function")):
            spec = registry.get(job_type)
            assert spec is not None
            error = errors[spec.origin]
            assert error.id == "persistent_jobs.E103"
            assert f"is {kind}: calling it runs nothing" in error.msg
            assert error.hint and "generator" in error.hint
            with pytest.raises(ConfigurationError, match="calling it runs nothing"):
                enqueue(job_type)
        with pytest.raises(ConfigurationError, match="Invalid job handlers: "):
            Runner()


def test_async_handlers_are_accepted_and_marked() -> None:
    """``async def`` is accepted; ``spec.is_async`` tells the runner to await ``spec.func``,
    which is then always a coroutine function taking ``(payload, ctx)``."""
    import inspect

    with registry.isolated():
        @job_handler("core.reg.async_two")
        async def async_two(payload: Any, ctx: JobContext) -> str:
            return f"two {payload} {ctx.job_type}"

        @job_handler("core.reg.async_one")
        async def async_one(payload: Any) -> str:
            return f"one {payload}"

        @job_handler
        class AsyncClass(JobHandler):
            job_type = "core.reg.async_class"

            async def execute(self, payload: Any, ctx: JobContext) -> None:  # type: ignore[override]
                return None

        class Awaitable:
            async def __call__(self, payload: Any) -> str:
                return "callable"

        class AwaitableTwo:
            async def __call__(self, payload: Any, ctx: JobContext) -> str:
                return "callable two"

        job_handler("core.reg.async_callable")(Awaitable())
        job_handler("core.reg.async_callable_two")(AwaitableTwo())
        sync = registry.get("core.reg.one")
        assert sync is not None and not sync.is_async
        for job_type in ("core.reg.async_two", "core.reg.async_one", "core.reg.async_class",
                         "core.reg.async_callable", "core.reg.async_callable_two"):
            spec = registry.get(job_type)
            assert spec is not None and spec.errors == [], job_type
            assert spec.is_async and inspect.iscoroutinefunction(spec.func), job_type
        ctx = JobContext(job_id=uuid.uuid4(), job_type="core.reg.async_two", attempt=1,
                         max_retries=0, runner_id="r")
        import asyncio

        one, two = registry.get("core.reg.async_one"), registry.get("core.reg.async_two")
        assert one is not None and two is not None
        assert asyncio.run(one.func({"a": 1}, ctx)) == "one {'a': 1}"
        assert asyncio.run(two.func(5, ctx)) == "two 5 core.reg.async_two"


def test_a_bare_job_handler_on_a_function_is_refused_at_once() -> None:
    """``@job_handler`` without a type above a function took the function for the type and
    registered nothing: ``check`` was clean and every enqueue said "not registered"."""
    before = registry.job_types()
    with pytest.raises(ConfigurationError, match=r"needs a job type.*@job_handler\("):
        @job_handler
        def resize_image(payload: Any) -> None:
            return None
    assert registry.job_types() == before
