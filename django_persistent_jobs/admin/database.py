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

The list pages accept only the filter parameters the console itself writes (``allowed_lookups``):
Django's admin otherwise takes any lookup on a model's own fields, JSON key lookups included,
which let a view-only operator read a redacted payload value back prefix by prefix
(``?payload__api_token__startswith=s3``) and let hand-written lookups reach PostgreSQL with
values it refuses (a 500). A parameter holding a time is read here too (``time_lookups``): one a
UTC timestamp cannot hold is a bad filter, not an overflow while the page renders.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time
from typing import Any, Generic, TypeVar

from django.contrib import messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import BadRequest, ValidationError
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, QueryDict
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

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


def parse_time(name: str, value: str) -> datetime:
    """A time from a filter parameter, aware: an ISO 8601 time (naive ones are in the current
    time zone, as Django reads them) or a date (its midnight).

    Raises ``IncorrectLookupParameters`` (the admin's "?e=1" page) for text that is no time, and
    for a time whose UTC value is outside years 1 to 9999: Python cannot convert it (an
    ``OverflowError`` while the page rendered, a 500) and PostgreSQL would not compare it.
    """
    try:
        moment = parse_datetime(value)
        if moment is None and (day := parse_date(value)) is not None:
            moment = datetime.combine(day, time())
    except ValueError:  # well formed but no such time: 2024-13-45
        moment = None
    if moment is None:
        raise IncorrectLookupParameters(f"{name} must be an ISO 8601 time, got {value!r}.")
    try:
        if timezone.is_naive(moment):
            moment = timezone.make_aware(moment)
        moment.astimezone(UTC)
    except (OverflowError, ValueError) as exc:
        raise IncorrectLookupParameters(
            f"{name} {value!r} is outside the times a timestamp can hold "
            f"({date.min.year} to {date.max.year} in UTC).") from exc
    return moment


class FilterParametersMixin:
    """A ModelAdmin whose list takes only the filter parameters in ``allowed_lookups``
    (``lookup_allowed``: any other is refused as Django refuses a disallowed lookup, a 400), and
    reads those in ``time_lookups`` as times first (``check_time_lookups``). The job console's
    lists have it through ``JobsDatabaseMixin``; the API token list has it too."""

    #: The filter parameters the list accepts: exactly those its own sidebar filters, links
    #: (dashboard, job page, runner page) and the changelist write. Search (``q``), ordering and
    #: paging are not lookups and need no entry.
    allowed_lookups: frozenset[str] = frozenset()
    #: Of ``allowed_lookups``, those holding a time (checked by ``parse_time``).
    time_lookups: frozenset[str] = frozenset()

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None,
                       ) -> bool:
        return lookup in self.allowed_lookups

    def check_time_lookups(self, request: HttpRequest) -> None:
        """A time a filter cannot use is the admin's "?e=1" page, not a 500 while it renders."""
        for name in self.time_lookups:
            for value in request.GET.getlist(name):
                parse_time(name, value)


class JobsDatabaseMixin(FilterParametersMixin, Generic[ModelT]):
    """A ModelAdmin whose every read (list, sidebar filters, search, actions, the object's
    page, its history) uses the jobs database: they all start from ``get_queryset``.

    Input PostgreSQL cannot compare is refused first: a list filter with a NUL character is a
    bad filter (the admin's usual "?e=1" page), an object id with one finds no object. A filter
    parameter not in ``allowed_lookups`` is refused as Django refuses a disallowed lookup (a
    400), and a bulk action's selected id that is no id of the model is a message, not a 500.
    """

    def get_queryset(self, request: HttpRequest) -> QuerySet[ModelT]:
        queryset: QuerySet[ModelT] = super().get_queryset(request)  # type: ignore[misc]
        return queryset.using(alias())

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        if _nul_in(request.GET):
            raise IncorrectLookupParameters("A filter contains a NUL character.")
        self.check_time_lookups(request)
        return super().get_changelist_instance(request)  # type: ignore[misc]

    def response_action(self, request: HttpRequest, queryset: QuerySet[ModelT], *args: Any,
                        **kwargs: Any) -> HttpResponse | None:
        """A selected id the primary key cannot hold (a hand-made or stale form) raised a
        ``ValidationError`` while the action read its rows: a 500. It is now said, and nothing
        is done, as for any refused action."""
        pk_field = queryset.model._meta.pk
        assert pk_field is not None
        for selected in request.POST.getlist(ACTION_CHECKBOX_NAME):
            try:
                pk_field.to_python(selected)
            except (ValidationError, ValueError, TypeError):
                self.message_user(  # type: ignore[attr-defined]
                    request, f"{selected!r} is not the id of any "
                    f"{queryset.model._meta.verbose_name}: no action was taken.",
                    messages.ERROR)
                return HttpResponseRedirect(request.get_full_path())
        response: HttpResponse | None = super().response_action(  # type: ignore[misc]
            request, queryset, *args, **kwargs)
        return response

    def get_object(self, request: HttpRequest, object_id: str,
                   from_field: str | None = None) -> ModelT | None:
        if "\x00" in object_id:
            return None
        found: ModelT | None = super().get_object(  # type: ignore[misc]
            request, object_id, from_field)
        return found
