"""The handler registry: which code runs for which ``job_type``, and with what options.

Handlers are registered at import time by ``@job_handler``; the app config imports every
installed app's ``jobs`` module, so a runner and a web process see the same registry. Option
errors are collected rather than raised at import, so that ``manage.py check`` can list all of
them with ids; the runner refuses to start while any remain.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from . import bounds, conf
from .errors import ConfigurationError, DuplicateHandlerError
from .types import Dedup

if TYPE_CHECKING:
    from .context import JobContext

BackoffFn = Callable[[int], float]
Validator = Callable[[Any], Any]
T = TypeVar("T")  # no PEP 695 generics: Python 3.11 (Django 5.2) is supported

#: The kinds of handler problem; ``checks.py`` reports each under its own id.
OPTION_INVALID = "OPTION_INVALID"
SCHEDULE_INVALID = "SCHEDULE_INVALID"
BODY_NEVER_RUNS = "BODY_NEVER_RUNS"


class JobHandler:
    """Base class for class-based handlers; override ``execute``.

    Class attributes (``job_type``, ``max_retries``, ``timeout``, ``dedup``, ``queue``, ...) are
    read as defaults for the registration, so a subclass can carry its whole configuration.
    """

    job_type: ClassVar[str] = ""

    def execute(self, payload: Any, ctx: JobContext) -> None:
        raise NotImplementedError("JobHandler subclasses must implement execute(payload, ctx)")

    def validate(self, payload: Any) -> None:
        """Optional payload validator; raise ``ValueError`` (or any exception) to refuse."""


@dataclass
class HandlerSpec:
    """A registered handler with its own options; ``None`` means "use the global default"."""

    job_type: str
    func: Callable[[Any, JobContext], Any]
    origin: str
    max_retries: int | None = None
    timeout: float | timedelta | None = None
    dedup: str | None = None
    backoff: BackoffFn | None = None
    queue: str | None = None
    priority: int = 0
    validator: Validator | None = None
    cron: str | None = None
    interval: timedelta | None = None
    schedule_payload: Any = None
    timezone: str | None = None
    #: The tenant given to every run of the handler's schedule (recurring handlers only).
    tenant: str | None = None
    #: ``(kind, message)`` for every problem with the options (kinds above); a handler with any
    #: cannot be enqueued, and no runner starts while one is registered.
    problems: list[tuple[str, str]] = field(default_factory=list)
    #: True for an ``async def`` handler (or ``execute``): ``func`` is then a coroutine function
    #: taking ``(payload, ctx)``, and the runner must await it.
    is_async: bool = False
    #: ``file:line`` of the handler's code; tells a harmless re-registration of the same code
    #: from a second handler that happens to share the origin (two lambdas, a factory).
    location: str | None = None
    #: The handler returns its result as JSON text, stored in the job's ``result`` column
    #: (the django.tasks adapter); other handlers' return values are ignored.
    returns_json: bool = False
    #: False: the handler runs in autocommit (its writes commit as they run, none is fenced)
    #: and its completion is batched with others (``runner/completer.py``).
    atomic: bool = True

    @property
    def is_recurring(self) -> bool:
        return self.cron is not None or self.interval is not None

    @property
    def errors(self) -> list[str]:
        """The problems' messages."""
        return [message for _, message in self.problems]

    # Merged configuration: the handler's value over settings.PERSISTENT_JOBS over the default.
    def effective_max_retries(self) -> int:
        return self.max_retries if self.max_retries is not None else conf.settings.MAX_RETRIES

    def effective_timeout(self) -> float:
        if self.timeout is None:
            return conf.settings.TIMEOUT
        return conf.seconds(self.timeout)

    def effective_dedup(self) -> Dedup:
        return Dedup(self.dedup if self.dedup is not None else conf.settings.DEDUP)

    def effective_queue(self) -> str:
        return self.queue if self.queue is not None else conf.settings.DEFAULT_QUEUE

    def effective_backoff(self) -> BackoffFn:
        if self.backoff is not None:
            return self.backoff
        return global_backoff()


def global_backoff() -> BackoffFn:
    from .backoff import default_backoff

    configured = conf.settings.BACKOFF
    return default_backoff if configured is None else configured


class Registry:
    """Maps job types to ``HandlerSpec``. Thread-safe: runners read it from many threads."""

    def __init__(self) -> None:
        self._handlers: dict[str, HandlerSpec] = {}
        self._lock = threading.Lock()

    def register(self, spec: HandlerSpec) -> HandlerSpec:
        with self._lock:
            existing = self._handlers.get(spec.job_type)
            if existing is not None and (
                existing.origin != spec.origin or existing.location != spec.location
            ):
                first, second = existing.origin, spec.origin
                if first == second:
                    first, second = f"{first} ({existing.location})", f"{second} ({spec.location})"
                raise DuplicateHandlerError(
                    f"Job type {spec.job_type!r} is already handled by {first}; "
                    f"{second} cannot register it again. Give one of them another job type."
                )
            self._handlers[spec.job_type] = spec
        return spec

    def unregister(self, job_type: str) -> None:
        with self._lock:
            self._handlers.pop(job_type, None)

    def get(self, job_type: str) -> HandlerSpec | None:
        return self._handlers.get(job_type)

    def __contains__(self, job_type: object) -> bool:
        return job_type in self._handlers

    def __iter__(self) -> Iterator[HandlerSpec]:
        return iter(list(self._handlers.values()))

    def __len__(self) -> int:
        return len(self._handlers)

    def job_types(self) -> list[str]:
        return sorted(self._handlers)

    def resolve(
        self, job_type: str, *, missing: type[Exception], invalid: type[Exception], hint: str,
    ) -> HandlerSpec | None:
        """The handler that must exist before a job (or a schedule) of ``job_type`` is created.

        ``None`` when nothing is registered but ``ALLOW_UNREGISTERED`` says another service runs
        it. Otherwise an unknown type raises ``missing`` (naming the known types, then ``hint``)
        and a handler with invalid options raises ``invalid``.
        """
        spec = self.get(job_type)
        if spec is None:
            if conf.settings.ALLOW_UNREGISTERED:
                return None
            known = ", ".join(self.job_types()) or "none registered"
            raise missing(
                f"No handler is registered for job type {job_type!r} (known: {known}){hint}"
            )
        if spec.errors:
            raise invalid("; ".join(spec.errors))
        return spec

    @contextmanager
    def isolated(self) -> Iterator[Registry]:
        """Let a test register handlers and drop them afterwards."""
        with self._lock:
            saved = dict(self._handlers)
        try:
            yield self
        finally:
            with self._lock:
                self._handlers = saved


registry = Registry()


def code_location(target: Any) -> str | None:
    """``file:line`` of a handler's code: the same function registered again (its module
    imported twice, a reload) is the same handler, while two definitions sharing a job type and
    a qualified name are a duplicate, and the message names both places."""
    code = getattr(target, "__code__", None)
    if code is None and isinstance(target, type):
        code = getattr(getattr(target, "execute", None), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else None


def _positional_arity(func: Callable[..., Any], origin: str) -> int:
    try:
        signature = inspect.signature(func)
    except (ValueError, TypeError) as exc:  # some builtins publish no signature
        raise ConfigurationError(
            f"Handler {origin}: cannot read the parameters of {bounds.show(func)} ({exc}), so "
            "it cannot be told whether it takes (payload) or (payload, ctx); wrap it in a "
            "function."
        ) from exc
    params = [
        p for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(params)


def check_options(spec: HandlerSpec, subject: str | None = None) -> list[tuple[str, str]]:
    """``(kind, message)`` for every problem with a handler's options (the system check reports
    them). The bounds are those ``enqueue`` applies, from ``bounds``: a handler that passes the
    check can be enqueued with its own options."""
    problems: list[tuple[str, str]] = []
    name = subject or f"handler {bounds.show(spec.job_type, 80)} ({spec.origin})"

    def option(problem: str | None) -> None:
        if problem is not None:
            problems.append((OPTION_INVALID, f"{name}: {problem}"))

    def schedule(problem: str | None) -> None:
        if problem is not None:
            problems.append((SCHEDULE_INVALID, f"{name}: {problem}"))

    option(bounds.job_type_problem(spec.job_type))
    if spec.max_retries is not None:
        option(bounds.max_retries_problem(spec.max_retries))
    if spec.timeout is not None:
        option(bounds.timeout_problem(spec.timeout))
    if spec.dedup is not None:
        option(bounds.dedup_problem(spec.dedup))
    if spec.backoff is not None and not callable(spec.backoff):
        option("backoff must be a callable attempt -> seconds.")
    elif spec.backoff is not None:
        option(bounds.backoff_callable_problem(spec.backoff))
    if spec.validator is not None and not callable(spec.validator):
        option("validator must be callable.")
    if spec.queue is not None:
        option(bounds.queue_problem(spec.queue))
    option(bounds.priority_problem(spec.priority))
    option(bounds.atomic_problem(spec.atomic))
    if spec.cron is not None and spec.interval is not None:
        schedule("give either cron or interval, not both.")
    if spec.cron is not None:
        from .schedules.timing import cron_problem

        schedule(cron_problem(spec.cron))
    if spec.interval is not None:
        from .schedules.timing import interval_problem

        schedule(interval_problem(spec.interval))
    if spec.timezone is not None:
        from .schedules.timing import timezone_problem

        schedule(timezone_problem(spec.timezone))
    if spec.tenant is not None:
        schedule(bounds.tenant_problem(spec.tenant))
        if not spec.is_recurring:
            schedule("tenant is the tenant of the scheduled runs; give cron or interval, or "
                     "pass tenant= to enqueue().")
    # Like tenant, these mean something only for the handler's schedule: on any other handler
    # they would be silently ignored (a handler expecting its payload would get {}).
    if spec.schedule_payload is not None and not spec.is_recurring:
        schedule("payload is the payload of the scheduled runs; give cron or interval, or "
                 "pass the payload to enqueue().")
    if spec.timezone is not None and not spec.is_recurring:
        schedule("timezone is the zone a cron expression is read in; give cron, or drop "
                 "timezone.")
    return problems


def _body_problem(code: Any, origin: str) -> str | None:
    """Why calling ``code`` would not run its body (a generator only builds an iterator)."""
    if inspect.isasyncgenfunction(code):
        return (f"Handler {origin} is an async generator function: calling it runs nothing, "
                "so the job would complete without doing its work.")
    if inspect.isgeneratorfunction(code):
        return (f"Handler {origin} is a generator function: calling it runs nothing, so the "
                "job would complete without doing its work.")
    return None


def _is_coroutine_function(code: Any) -> bool:
    """``async def`` functions and methods, also behind ``functools.partial`` or as the
    ``__call__`` of a callable object."""
    if inspect.iscoroutinefunction(code):
        return True
    call = inspect.getattr_static(type(code), "__call__", None)
    return not inspect.isroutine(code) and inspect.iscoroutinefunction(call)


def _as_payload_ctx(code: Callable[..., Any], origin: str,
                    is_async: bool) -> Callable[[Any, JobContext], Any]:
    """``code`` (a function, a callable object or a ``JobHandler``'s bound ``execute``) as the
    ``(payload, ctx)`` callable the runner calls.

    One shape rule for functions and classes alike: one positional parameter gets the payload
    only, two get the payload and the context, anything else is refused here, at import. A
    class's ``execute(self, payload)`` would otherwise be registered as it is and fail every
    attempt with a ``TypeError`` until its job is dead-lettered.
    """
    arity = _positional_arity(code, origin)
    if arity == 1 and is_async:
        async def one_async(payload: Any, ctx: JobContext,
                            _f: Callable[[Any], Any] = code) -> Any:
            return await _f(payload)
        return one_async
    if arity == 1:
        def one_arg(payload: Any, ctx: JobContext, _f: Callable[[Any], Any] = code) -> Any:
            return _f(payload)
        return one_arg
    if arity == 2 and is_async and not inspect.iscoroutinefunction(code):
        async def two_async(payload: Any, ctx: JobContext,  # an async __call__
                            _f: Callable[[Any, JobContext], Any] = code) -> Any:
            return await _f(payload, ctx)
        return two_async
    if arity == 2:
        return code
    raise ConfigurationError(
        f"Handler {origin} must accept (payload) or (payload, ctx); "
        f"it takes {arity} positional parameters."
    )


@overload
def job_handler(job_type: type[T], /) -> type[T]: ...
@overload
def job_handler(
    job_type: str | None = None, *, max_retries: int | None = None,
    timeout: float | timedelta | None = None, dedup: Dedup | str | None = None,
    backoff: BackoffFn | None = None, queue: str | None = None, priority: int | None = None,
    validator: Validator | None = None, cron: str | None = None,
    interval: timedelta | None = None, payload: Any = None, timezone: str | None = None,
    tenant: str | None = None, atomic: bool | None = None,
) -> Callable[[T], T]: ...


def job_handler(
    job_type: Any = None, *, max_retries: int | None = None,
    timeout: float | timedelta | None = None, dedup: Dedup | str | None = None,
    backoff: BackoffFn | None = None, queue: str | None = None, priority: int | None = None,
    validator: Validator | None = None, cron: str | None = None,
    interval: timedelta | None = None, payload: Any = None,
    timezone: str | None = None, tenant: str | None = None, atomic: bool | None = None,
) -> Any:
    """Register a function ``(payload[, ctx])`` or a ``JobHandler`` subclass for a job type.

    ``cron``/``interval`` make the handler recurring; ``payload``, ``timezone`` and ``tenant``
    then set the payload of each scheduled run, the zone the cron expression is read in and the
    tenant each run is enqueued for. ``atomic=False`` gives up the handler's transaction: its
    writes commit as they run (at least once, none fenced), and its completion is batched.
    """
    if isinstance(job_type, type):  # bare @job_handler on a JobHandler subclass
        return job_handler()(job_type)
    if callable(job_type):
        # Bare @job_handler on a function: it would become the job type, the function would be
        # replaced by the decorator, and nothing would be registered until an enqueue said so.
        name = getattr(job_type, "__qualname__", None) or repr(job_type)
        raise ConfigurationError(
            f"@job_handler needs a job type to decorate a function ({name}): write "
            "@job_handler(\"app.name\"). Only a JobHandler subclass with a job_type attribute "
            "can use a bare @job_handler.")

    def decorate(target: Any) -> Any:
        options: dict[str, Any] = {
            "max_retries": max_retries, "timeout": timeout, "backoff": backoff,
            "queue": queue, "validator": validator, "cron": cron, "interval": interval,
            "timezone": timezone, "tenant": tenant,
        }
        resolved_type = job_type
        resolved_priority = priority
        resolved_dedup = dedup
        resolved_payload = payload
        resolved_atomic = atomic
        if isinstance(target, type):
            if not issubclass(target, JobHandler):
                raise ConfigurationError(
                    f"@job_handler can decorate a function or a JobHandler subclass, "
                    f"not {target!r}."
                )
            if target.execute is JobHandler.execute:
                # Refused here, not found out by every job failing with NotImplementedError
                # until it is dead-lettered.
                raise ConfigurationError(
                    f"JobHandler subclass {target.__module__}.{target.__qualname__} does not "
                    "define execute(self, payload, ctx) (or execute(self, payload)): there is "
                    "nothing for its jobs to run."
                )
            instance = target()
            resolved_type = resolved_type or target.job_type
            for key in list(options):
                if options[key] is None and hasattr(target, key):
                    options[key] = getattr(target, key)
            if resolved_priority is None:
                resolved_priority = getattr(target, "priority", None)
            if resolved_dedup is None:
                resolved_dedup = getattr(target, "dedup", None)
            if resolved_payload is None:
                resolved_payload = getattr(target, "payload", None)
            if resolved_atomic is None:
                resolved_atomic = getattr(target, "atomic", None)
            if options["validator"] is None and type(instance).validate is not JobHandler.validate:
                options["validator"] = instance.validate
            origin = f"{target.__module__}.{target.__qualname__}"
            is_async = _is_coroutine_function(instance.execute)
            body_problem = _body_problem(instance.execute, origin)
            func = _as_payload_ctx(instance.execute, origin, is_async)
        elif callable(target):
            origin = f"{target.__module__}.{getattr(target, '__qualname__', repr(target))}"
            is_async = _is_coroutine_function(target)
            body_problem = _body_problem(target, origin)
            func = _as_payload_ctx(target, origin, is_async)
        else:
            raise ConfigurationError(f"@job_handler cannot decorate {target!r}.")
        if not resolved_type:
            raise ConfigurationError(
                f"Handler {origin} has no job type: pass @job_handler('app.name') "
                "or set job_type on the class."
            )
        spec = HandlerSpec(
            job_type=resolved_type, func=func, origin=origin,
            dedup=str(resolved_dedup) if isinstance(resolved_dedup, Dedup) else resolved_dedup,
            priority=0 if resolved_priority is None else resolved_priority,
            schedule_payload=resolved_payload, location=code_location(target),
            is_async=is_async, atomic=True if resolved_atomic is None else resolved_atomic,
            **options,
        )
        spec.problems = check_options(spec)
        if body_problem is not None:
            spec.problems.append((BODY_NEVER_RUNS, body_problem))
        registry.register(spec)
        # A convenience for ``enqueue(handler.job_type, ...)``, where the target takes
        # attributes: a bound method, an object with ``__slots__`` or a builtin takes none, and
        # must neither fail its (valid) registration nor leave it half done.
        with suppress(AttributeError, TypeError):
            target.job_type = resolved_type
        return target

    return decorate
