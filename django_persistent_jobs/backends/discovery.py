"""Import the modules that define tasks, so a runner knows every task before it claims one.

A runner claims only job types it has handlers for, and a task's handler is registered when the
task is defined. When ``settings.TASKS`` uses ``PersistentJobsBackend``, the app config therefore
imports every installed app's ``tasks`` module, plus the backend's ``OPTIONS["MODULES"]``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from django.conf import settings
from django.utils.module_loading import autodiscover_modules, import_string


def _configured_backends(durable_only: bool) -> list[dict[str, Any]]:
    """The ``settings.TASKS`` entries whose backend is ours (only the durable one, or both)."""
    configured = getattr(settings, "TASKS", None)
    if not isinstance(configured, dict):
        return []
    found = []
    for params in configured.values():
        path = params.get("BACKEND") if isinstance(params, dict) else None
        if not isinstance(path, str):
            continue
        try:
            backend_class = import_string(path)
        except ImportError:
            continue  # Django's own check reports a backend that does not import
        from .inprocess import InProcessBackend
        from .persistent import PersistentJobsBackend

        ours = PersistentJobsBackend if durable_only else (PersistentJobsBackend,
                                                            InProcessBackend)
        if isinstance(backend_class, type) and issubclass(backend_class, ours):
            found.append(params)
    return found


def _durable_backends() -> list[dict[str, Any]]:
    return _configured_backends(durable_only=True)


def uses_our_backends() -> bool:
    """Whether ``settings.TASKS`` names one of our backends (for the checks): one that imports,
    or a path into our ``backends`` package that does not (on Django 5.2 without the backport
    our backends cannot be imported, and that is what the check must say)."""
    if _configured_backends(durable_only=False):
        return True
    configured = getattr(settings, "TASKS", None)
    return isinstance(configured, dict) and any(
        isinstance(params, dict) and isinstance(params.get("BACKEND"), str)
        and params["BACKEND"].startswith("django_persistent_jobs.backends")
        for params in configured.values())


#: ``OPTIONS["MODULES"]`` entries that do not exist, with the import error: the backend's check
#: reports them (``persistent_jobs.E206``) instead of the app registry failing with a traceback.
missing_modules: dict[str, str] = {}


def _is_missing(module: str, exc: ModuleNotFoundError) -> bool:
    """The named module (or a package on its path) does not exist, as opposed to a module that
    exists and fails on an import of its own, which is a bug to show as it is."""
    return exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))


def discover_tasks() -> None:
    backends = _durable_backends()
    if not backends:
        return
    autodiscover_modules("tasks")
    for params in backends:
        options = params.get("OPTIONS")
        modules = (options.get("MODULES") if isinstance(options, dict) else None) or []
        # Anything but a list of strings is reported by the backend's check (E204).
        for module in modules if isinstance(modules, list | tuple) else []:
            if not isinstance(module, str):
                continue
            try:
                import_module(module)
            except ModuleNotFoundError as exc:
                if not _is_missing(module, exc):
                    raise
                missing_modules[module] = str(exc)
