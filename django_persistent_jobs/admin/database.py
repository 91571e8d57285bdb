"""Where the admin reads: the jobs database, ``PERSISTENT_JOBS["DATABASE"]``.

The job tables live in the alias that setting names, and the services, stats and runners use
it. Django's admin reads through a model's default manager, which without a router goes to
``default``: a project that set another alias saw an empty job list next to a dashboard full
of jobs, and every action on a job answered 404. So every read of the admin goes through
``JobsDatabaseMixin`` (a ModelAdmin's own queryset: its list, filters, actions and pages) or
``objects()`` (any other query), and the alias is looked up per request, as ``conf`` reads
settings. What the admin keeps for itself (users, ``LogEntry`` history) stays where
``django.contrib.admin`` puts it.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from django.db.models import Model, QuerySet
from django.http import HttpRequest

from .. import conf

ModelT = TypeVar("ModelT", bound=Model)


def alias() -> str:
    """The database alias holding the job tables."""
    return conf.settings.DATABASE


def objects(model: type[ModelT]) -> QuerySet[ModelT]:
    """All rows of ``model`` in the jobs database."""
    return model._default_manager.using(alias())


class JobsDatabaseMixin(Generic[ModelT]):
    """A ModelAdmin whose every read (list, sidebar filters, search, actions, the object's
    page, its history) uses the jobs database: they all start from ``get_queryset``."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[ModelT]:
        queryset: QuerySet[ModelT] = super().get_queryset(request)  # type: ignore[misc]
        return queryset.using(alias())
