"""The handler registry: which code runs for which ``job_type``, and with what options.

Handlers are registered at import time by ``@job_handler``; the app config imports every
installed app's ``jobs`` module, so a runner and a web process see the same registry. Option
errors are collected rather than raised at import, so that ``manage.py check`` can list all of
them with ids; the runner refuses to start while any remain.
"""

from __future__ import annotations

import inspect
import math
import threading
import zoneinfo
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, overload

from . import bounds, conf
from .errors import ConfigurationError, DuplicateHandlerError
from .types import Dedup

if TYPE_CHECKING:
    from .context import JobContext

BackoffFn = Callable[[int], float]
Validator = Callable[[Any], Any]
_UNSET: Any = object()


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
    timeout: float | None = None
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
    errors: list[str] = field(default_factory=list)
    #: ``file:line`` of the handler's code; tells a harmless re-registration of the same code
    #: from a second handler that happens to share the origin (two lambdas, a factory).
    location: str | None = None

    @property
    def is_recurring(self) -> bool:
        return self.cron is not None or self.interval is not None

    # Merged configuration: the handler's value over settings.PERSISTENT_JOBS over the default.
    def effective_max_retries(self) -> int:
        return self.max_retries if self.max_retries is not None else int(conf.get("MAX_RETRIES"))

    def effective_timeout(self) -> float:
        return self.timeout if self.timeout is not None else conf.seconds(conf.get("TIMEOUT"))

    def effective_dedup(self) -> Dedup:
        return Dedup(self.dedup if self.dedup is not None else conf.get("DEDUP"))

    def effective_queue(self) -> str:
        return self.queue if self.queue is not None else str(conf.get("DEFAULT_QUEUE"))

    def effective_backoff(self) -> BackoffFn:
        if self.backoff is not None:
            return self.backoff
        return global_backoff()


def global_backoff() -> BackoffFn:
    from .backoff import default_backoff

    configured = conf.get("BACKOFF")
    if configured is None:
        return default_backoff
    return conf.resolve_callable(configured, "BACKOFF")


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
            if conf.get("ALLOW_UNREGISTERED"):
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


def _code_location(target: Any) -> str | None:
    code = getattr(target, "__code__", None)
    if code is None and isinstance(target, type):
        code = getattr(getattr(target, "execute", None), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else None


def _positional_arity(func: Callable[..., Any]) -> int:
    params = [
        p for p in inspect.signature(func).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(params)


def _check_options(spec: HandlerSpec) -> list[str]:
    """Human-readable problems with a handler's options (reported by the system check)."""
    problems: list[str] = []
    name = f"handler {spec.job_type!r} ({spec.origin})"
    if not spec.job_type or not isinstance(spec.job_type, str) or len(spec.job_type) > 200:
        problems.append(f"{name}: job_type must be a non-empty string of at most 200 characters.")
    if spec.max_retries is not None and (
        isinstance(spec.max_retries, bool) or not isinstance(spec.max_retries, int)
        or not 0 <= spec.max_retries <= conf.MAX_RETRIES_LIMIT
    ):
        problems.append(f"{name}: max_retries must be an integer >= 0 (at most "
                        f"{conf.MAX_RETRIES_LIMIT}), got {spec.max_retries!r}.")
    if spec.timeout is not None and (
        isinstance(spec.timeout, bool) or not isinstance(spec.timeout, int | float)
        or not math.isfinite(spec.timeout) or spec.timeout <= 0
    ):
        problems.append(f"{name}: timeout must be a number of seconds > 0, got {spec.timeout!r}.")
    if spec.dedup is not None and spec.dedup not in conf.DEDUP_CHOICES:
        problems.append(f"{name}: dedup must be one of {conf.DEDUP_CHOICES}, got {spec.dedup!r}.")
    if spec.backoff is not None and not callable(spec.backoff):
        problems.append(f"{name}: backoff must be a callable attempt -> seconds.")
    if spec.validator is not None and not callable(spec.validator):
        problems.append(f"{name}: validator must be callable.")
    if spec.queue is not None and (not isinstance(spec.queue, str) or not spec.queue):
        problems.append(f"{name}: queue must be a non-empty string, got {spec.queue!r}.")
    if isinstance(spec.priority, bool) or not isinstance(spec.priority, int) or not (
        -32768 <= spec.priority <= 32767
    ):
        problems.append(f"{name}: priority must be an integer in -32768..32767.")
    if spec.cron is not None and spec.interval is not None:
        problems.append(f"{name}: give either cron or interval, not both.")
    if spec.cron is not None:
        from .schedules import cron_problem

        problem = cron_problem(spec.cron)
        if problem:
            problems.append(f"{name}: {problem}")
    if spec.interval is not None and (
        not isinstance(spec.interval, timedelta) or spec.interval <= timedelta(0)
    ):
        problems.append(f"{name}: interval must be a positive timedelta, got {spec.interval!r}.")
    if spec.timezone is not None:
        try:
            zoneinfo.ZoneInfo(spec.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
            problems.append(f"{name}: unknown time zone {spec.timezone!r}.")
    if spec.tenant is not None:
        problem = bounds.tenant_problem(spec.tenant)
        if problem:
            problems.append(f"{name}: {problem}")
        elif not spec.is_recurring:
            problems.append(f"{name}: tenant is the tenant of the scheduled runs; give cron or "
                            "interval, or pass tenant= to enqueue().")
    return problems


@overload
def job_handler[T](job_type: type[T], /) -> type[T]: ...
@overload
def job_handler[T](
    job_type: str | None = None, *, max_retries: int | None = None,
    timeout: float | None = None, dedup: Dedup | str | None = None,
    backoff: BackoffFn | None = None, queue: str | None = None, priority: int | None = None,
    validator: Validator | None = None, cron: str | None = None,
    interval: timedelta | None = None, payload: Any = None, timezone: str | None = None,
    tenant: str | None = None,
) -> Callable[[T], T]: ...


def job_handler(
    job_type: Any = None, *, max_retries: int | None = None, timeout: float | None = None,
    dedup: Dedup | str | None = None, backoff: BackoffFn | None = None,
    queue: str | None = None, priority: int | None = None, validator: Validator | None = None,
    cron: str | None = None, interval: timedelta | None = None, payload: Any = None,
    timezone: str | None = None, tenant: str | None = None,
) -> Any:
    """Register a function ``(payload[, ctx])`` or a ``JobHandler`` subclass for a job type.

    ``cron``/``interval`` make the handler recurring; ``payload``, ``timezone`` and ``tenant``
    then set the payload of each scheduled run, the zone the cron expression is read in and the
    tenant each run is enqueued for.
    """
    if isinstance(job_type, type):  # bare @job_handler on a JobHandler subclass
        return job_handler()(job_type)

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
        if isinstance(target, type):
            if not issubclass(target, JobHandler):
                raise ConfigurationError(
                    f"@job_handler can decorate a function or a JobHandler subclass, "
                    f"not {target!r}."
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
            if options["validator"] is None and type(instance).validate is not JobHandler.validate:
                options["validator"] = instance.validate
            func: Callable[[Any, JobContext], Any] = instance.execute
            origin = f"{target.__module__}.{target.__qualname__}"
        elif callable(target):
            origin = f"{target.__module__}.{getattr(target, '__qualname__', repr(target))}"
            arity = _positional_arity(target)
            if arity == 1:
                one_arg: Callable[[Any], Any] = target

                def func(payload: Any, ctx: JobContext, _f: Callable[[Any], Any] = one_arg) -> Any:
                    return _f(payload)
            elif arity == 2:
                func = target
            else:
                raise ConfigurationError(
                    f"Handler {origin} must accept (payload) or (payload, ctx); "
                    f"it takes {arity} positional parameters."
                )
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
            schedule_payload=resolved_payload, location=_code_location(target), **options,
        )
        spec.errors = _check_options(spec)
        registry.register(spec)
        target.job_type = resolved_type
        return target

    return decorate
