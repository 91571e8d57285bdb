"""django-persistent-jobs: PostgreSQL-backed persistent jobs for Django.

The public names are imported lazily: this package is listed in ``INSTALLED_APPS``, so importing
it must not touch models before the app registry is ready.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "enqueue": ".enqueue",
    "enqueue_many": ".enqueue",
    "job_handler": ".registry",
    "JobHandler": ".registry",
    "registry": ".registry",
    "JobContext": ".context",
    "JobError": ".errors",
    "TransientJobError": ".errors",
    "PermanentJobError": ".errors",
    "JobCancelledError": ".errors",
    "EnqueueError": ".errors",
    "PayloadError": ".errors",
    "UnknownJobTypeError": ".errors",
    "ConfigurationError": ".errors",
    "InvalidJobStateError": ".errors",
    "JobNotFoundError": ".errors",
    "Dedup": ".types",
    "retry_job": ".services",
    "cancel_job": ".services",
    "Runner": ".runner",
}

__all__ = [
    "ConfigurationError",
    "Dedup",
    "EnqueueError",
    "InvalidJobStateError",
    "JobCancelledError",
    "JobContext",
    "JobError",
    "JobHandler",
    "JobNotFoundError",
    "PayloadError",
    "PermanentJobError",
    "Runner",
    "TransientJobError",
    "UnknownJobTypeError",
    "cancel_job",
    "enqueue",
    "enqueue_many",
    "job_handler",
    "registry",
    "retry_job",
]

if TYPE_CHECKING:
    from .context import JobContext
    from .enqueue import enqueue, enqueue_many
    from .errors import (
        ConfigurationError,
        EnqueueError,
        InvalidJobStateError,
        JobCancelledError,
        JobError,
        JobNotFoundError,
        PayloadError,
        PermanentJobError,
        TransientJobError,
        UnknownJobTypeError,
    )
    from .registry import JobHandler, job_handler, registry
    from .runner import Runner
    from .services import cancel_job, retry_job
    from .types import Dedup


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value
