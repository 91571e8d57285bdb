"""What both task backends share: the task class with our options, argument and result encoding.

``@task(...)`` passes keyword arguments it does not know itself to the backend's ``task_class``,
so ``PersistentTask`` declares our options (``max_retries``, ``timeout``, ...) as extra fields of
Django's ``Task``. Unknown options are refused when the module defining the task is imported.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.utils.module_loading import import_string

from ..errors import EnqueueError, PayloadError, PermanentJobError
from ..payload import PayloadLimits, prepare_payload
from ..types import Dedup
from .compat import InvalidTask, Task, normalize_json

#: Our options, in the order the docs list them.
OPTION_NAMES = ("max_retries", "timeout", "backoff", "dedup", "dedup_key", "cron", "interval",
                "timezone")


class ResultError(PermanentJobError):
    """A task returned a value that cannot be stored as JSON unchanged.

    Permanent: the same code would return the same kind of value on every retry.
    """

    default_code = "RESULT_INVALID"


class TaskArgumentsError(EnqueueError, TypeError):
    """A task was enqueued with arguments its function cannot take (one missing, one too many,
    one given twice, an unknown keyword).

    Refused at enqueue, writing nothing: accepted, the call would fail the same way on every
    attempt until the task was dead-lettered. A ``TypeError`` as a direct call would raise, and
    an ``EnqueueError`` as every other refused enqueue.
    """


if TYPE_CHECKING:
    from .compat import AnyTask
    from .compat import AnyTask as _TaskBase
else:  # not subscriptable at run time
    _TaskBase = Task


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistentTask(_TaskBase):
    """A ``django.tasks`` Task with django-persistent-jobs' options.

    ``max_retries``, ``timeout`` (seconds), ``backoff`` (``attempt -> seconds``) and ``dedup``
    mean what they mean for ``@job_handler``; ``dedup_key`` is a string, or a callable given the
    task's arguments that returns one; ``cron``/``interval`` (with ``timezone``) make a task
    without arguments recurring. ``None`` means "the PERSISTENT_JOBS default".
    """

    max_retries: int | None = None
    timeout: float | None = None
    backoff: Callable[[int], float] | None = None
    dedup: Dedup | str | None = None
    dedup_key: str | Callable[..., str] | None = None
    cron: str | None = None
    interval: timedelta | None = None
    timezone: str | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> PersistentTask:
        # The dataclass would say only "unexpected keyword argument"; name the valid options.
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            func = kwargs.get("func")
            where = f" on {func.__module__}.{func.__qualname__}" if callable(func) else ""
            raise TypeError(
                f"Unknown @task option(s) {', '.join(map(repr, unknown))}{where}. "
                f"django-persistent-jobs accepts {', '.join(OPTION_NAMES)} besides Django's "
                "priority, queue_name, backend and takes_context."
            )
        return object.__new__(cls)

    def options(self) -> dict[str, Any]:
        """Our options as given (None for those not set)."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the module-level task's path plus Django's per-call fields.

        Django 6.1 pickles a Task with every field's value, but ours can be callables pickle
        cannot carry (a ``backoff`` closure, a ``dedup_key`` lambda), so pickling a task, or a
        ``TaskResult`` holding one, failed. ``using()`` cannot change our options, so they are
        taken back from the module-level task when unpickled (this also makes tasks pickle on
        the Django 5.2 backport, which has no ``__reduce__`` of its own).
        """
        django_fields = {f.name: getattr(self, f.name) for f in fields(Task) if f.name != "func"}
        return (_unpickle_task, (self.module_path, django_fields))


def _unpickle_task(module_path: str, django_fields: dict[str, Any]) -> AnyTask:
    """The task at ``module_path`` with the pickled per-call fields (validated again)."""
    try:
        declared = import_string(module_path)
    except ImportError as exc:
        raise ValueError(f"Expected {module_path!r} to point to a Task instance.") from exc
    if not isinstance(declared, Task):
        raise ValueError(f"Expected {module_path!r} to point to a Task instance.")
    return replace(declared, **django_fields)


def task_options(task: AnyTask) -> dict[str, Any]:
    """Our options of any Task (a plain ``Task`` has none set)."""
    if isinstance(task, PersistentTask):
        return task.options()
    return dict.fromkeys(OPTION_NAMES)


def required_parameters(task: AnyTask) -> list[str]:
    """Parameters a caller must pass (the ``context`` of a context-taking task excluded)."""
    params = list(inspect.signature(task.func).parameters.values())
    if task.takes_context and params:
        params = params[1:]
    return [
        p.name for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def refuse_generators(task: AnyTask) -> None:
    if inspect.isgeneratorfunction(task.func) or inspect.isasyncgenfunction(task.func):
        raise InvalidTask(
            f"Task {task.module_path} is a generator function: its body would not run. "
            "Return a value instead of yielding."
        )


def check_arguments(task: AnyTask, args: Any, kwargs: Any) -> None:
    """``TaskArgumentsError`` unless the task's function can be called with ``args`` and
    ``kwargs`` (after the context, for a task that takes one). A function whose signature
    cannot be read is not checked."""
    try:
        signature = inspect.signature(task.func)
    except (TypeError, ValueError):
        return
    context = (None,) if task.takes_context else ()
    try:
        signature.bind(*context, *args, **kwargs)
    except TypeError as exc:
        raise TaskArgumentsError(
            f"task {task.module_path} cannot be called with these arguments: {exc} (its "
            f"parameters: {_shown_parameters(signature, task.takes_context)})."
        ) from None


def _shown_parameters(signature: inspect.Signature, takes_context: bool) -> str:
    params = list(signature.parameters.values())
    if takes_context and params:
        params = params[1:]  # the backend passes the context
    return f"({', '.join(str(p.replace(annotation=p.empty)) for p in params)})"


def encode_arguments(task: AnyTask, args: Any, kwargs: Any) -> dict[str, Any]:
    """The job payload for a call: Django's JSON normalisation, then our payload checks.

    The arguments must fit the function (``check_arguments``). Django normalises arguments (a
    tuple becomes a list) before a task sees them; values JSON cannot carry (a datetime, a model
    instance) are refused here with the argument named, so the enqueue fails instead of the
    task.
    """
    check_arguments(task, args, kwargs)
    raw = {"args": list(args), "kwargs": dict(kwargs)}
    try:
        payload = {"args": normalize_json(list(args)), "kwargs": normalize_json(dict(kwargs))}
    except (TypeError, ValueError) as exc:
        # Our walker names the offending argument; fall back to Django's message.
        prepare_payload(raw)
        raise PayloadError(
            f"the arguments of task {task.module_path} cannot be stored as JSON: {exc}"
        ) from exc
    prepare_payload(payload)
    return payload


def encode_result(
    task: AnyTask, value: Any, limits: PayloadLimits | None = None
) -> tuple[Any, str]:
    """``(stored value, JSON text)`` for a task's return value, or ``ResultError``.

    Validated like a payload (size, depth, keys, strings PostgreSQL can store) after Django's
    JSON normalisation, so ``TaskResult.return_value`` gives back exactly what was stored.
    """
    try:
        normalized = normalize_json(value)
    except (TypeError, ValueError) as exc:
        raise ResultError(
            f"task {task.module_path} returned a value that cannot be stored as JSON ({exc}); "
            "return a dict with string keys, a list, a string, a number, a bool or None."
        ) from exc
    try:
        return prepare_payload(normalized, limits)
    except PayloadError as exc:
        message = str(exc).replace("payload", "return value", 1)
        raise ResultError(f"task {task.module_path}: {message}") from exc


def dedup_key_for(task: AnyTask, args: list[Any], kwargs: dict[str, Any]) -> str | None:
    key = task_options(task)["dedup_key"]
    if key is None or isinstance(key, str):
        return key
    value = key(*args, **kwargs)
    if not isinstance(value, str):
        raise PayloadError(
            f"the dedup_key callable of task {task.module_path} returned {value!r}; it must "
            "return a string."
        )
    return value
