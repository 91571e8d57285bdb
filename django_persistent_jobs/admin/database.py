"""Where the admin reads: the jobs database, ``PERSISTENT_JOBS["DATABASE"]``.

The job tables live in the alias that setting names, and the services, stats and runners use
it. Django's admin reads through a model's default manager, which without a router goes to
``default``: a project that set another alias saw an empty job list next to a dashboard full
of jobs, and every action on a job answered 404. So every read of the admin goes through
``JobsDatabaseMixin`` (a ModelAdmin's own queryset: its list, filters, actions and pages) or
``objects()`` (any other query), and the alias is looked up per request, as ``conf`` reads
settings. What the admin keeps for itself (users, ``LogEntry`` history) stays where
``django.contrib.admin`` puts it. Parameters with a NUL character, which PostgreSQL refuses in
text, are stopped here too, before they reach a query.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import BadRequest
from django.db.models import Model, QuerySet
from django.http import HttpRequest, QueryDict

from .. import conf

ModelT = TypeVar("ModelT", bound=Model)


def alias() -> str:
    """The database alias holding the job tables."""
    return conf.settings.DATABASE


def objects(model: type[ModelT]) -> QuerySet[ModelT]:
    """All rows of ``model`` in the jobs database."""
    return model._default_manager.using(alias())


def has_nul(request: HttpRequest) -> bool:
    """Whether a query-string or form parameter (name or value) holds a NUL character.

    PostgreSQL text cannot hold NUL: such a value in a filter made the query raise, a 500
    page, where it is only a filter nothing can match.
    """
    return _nul_in(request.GET) or _nul_in(request.POST)


def _nul_in(params: QueryDict) -> bool:
    return any("\x00" in key or any("\x00" in value for value in values)
               for key, values in params.lists())


def refuse_nul(request: HttpRequest) -> None:
    """For the custom views (dashboard, failure group): a NUL in a parameter is a 400."""
    if has_nul(request):
        raise BadRequest("A parameter contains a NUL character, which no job data holds.")


class JobsDatabaseMixin(Generic[ModelT]):
    """A ModelAdmin whose every read (list, sidebar filters, search, actions, the object's
    page, its history) uses the jobs database: they all start from ``get_queryset``.

    Input PostgreSQL cannot compare is refused first: a list filter with a NUL character is a
    bad filter (the admin's usual "?e=1" page), an object id with one finds no object.
    """

    def get_queryset(self, request: HttpRequest) -> QuerySet[ModelT]:
        queryset: QuerySet[ModelT] = super().get_queryset(request)  # type: ignore[misc]
        return queryset.using(alias())

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        if _nul_in(request.GET):
            raise IncorrectLookupParameters("A filter contains a NUL character.")
        return super().get_changelist_instance(request)  # type: ignore[misc]

    def get_object(self, request: HttpRequest, object_id: str,
                   from_field: str | None = None) -> ModelT | None:
        if "\x00" in object_id:
            return None
        found: ModelT | None = super().get_object(  # type: ignore[misc]
            request, object_id, from_field)
        return found
