"""Reading jobs for operators: list filters and cursor pagination, shared by the API and ``jobs``.

Both front ends parse their input into a ``JobFilter`` here, so a filter means the same thing
whether it arrived as a query string or as command-line options, and both get the same errors
(``QueryError`` names the offending field).

Pages are ordered newest first by id. Ids are UUID v7, so that order is creation order, and it is
total (ids are unique), so a keyset cursor ("ids below this one") never skips or repeats a row
while jobs are being inserted or updated, unlike an offset.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db.models import CharField, QuerySet, Value
from django.db.models.functions import Cast, Replace
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from . import bounds, conf
from .errors import JobNotFoundError
from .models import JobAttempt, JobStatus, PersistentJob

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
#: Longest accepted filter value; longer than any column it is compared with.
FILTER_TEXT_MAX_LENGTH = 255


class QueryError(ValueError):
    """A filter value is unusable; ``field`` names it so a caller can point at it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class JobFilter:
    """What an operator asked to see. Empty tuples and ``None`` mean "no restriction"."""

    statuses: tuple[str, ...] = ()
    job_types: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()
    error_codes: tuple[str, ...] = ()
    created_after: datetime | None = None
    created_before: datetime | None = None

    def apply(self, qs: QuerySet[PersistentJob]) -> QuerySet[PersistentJob]:
        if self.statuses:
            qs = qs.filter(status__in=self.statuses)
        if self.job_types:
            qs = qs.filter(job_type__in=self.job_types)
        if self.queues:
            qs = qs.filter(queue__in=self.queues)
        if self.tenants:
            qs = qs.filter(tenant__in=self.tenants)
        if self.error_codes:
            qs = qs.filter(last_error_code__in=self.error_codes)
        if self.created_after is not None:
            qs = qs.filter(created_at__gte=self.created_after)
        if self.created_before is not None:
            qs = qs.filter(created_at__lt=self.created_before)
        # (Exactly ``created_at``: bounding the id by its UUID v7 time as well would read less
        # of a long history, but miss a job whose id time is far from its ``created_at``: a
        # long transaction, a skewed clock, a row written by hand with another kind of id.)
        return qs

    @property
    def is_empty(self) -> bool:
        return not (self.statuses or self.job_types or self.queues or self.tenants
                    or self.error_codes or self.created_after or self.created_before)


def _texts(name: str, values: Iterable[str]) -> tuple[str, ...]:
    """Accept repeated values and comma-separated lists alike (``status=a,b`` = ``a`` + ``b``)."""
    out: list[str] = []
    for value in values:
        parts = [part.strip() for part in str(value).split(",")]
        if not any(parts):
            # "" or "," would otherwise filter on nothing, i.e. match every job: a bulk
            # cancel built on it would reach far more than asked.
            raise QueryError(name, f"{name} must name at least one value.")
        for part in parts:
            if not part:
                continue
            if len(part) > FILTER_TEXT_MAX_LENGTH or bounds.text_problem(part) is not None:
                raise QueryError(name, f"{name} values must be 1..{FILTER_TEXT_MAX_LENGTH} "
                                       "characters without NUL bytes or lone surrogates.")
            out.append(part)
    return tuple(dict.fromkeys(out))


def parse_when(name: str, value: str | None) -> datetime | None:
    """An ISO 8601 date-time with a time zone (a naive one would be read in an unknown zone)."""
    if value is None:
        return None
    try:
        parsed = parse_datetime(value.strip())
    except ValueError:
        parsed = None
    if parsed is None:
        raise QueryError(name, f"{name} must be an ISO 8601 date-time, got {value!r}.")
    if timezone.is_naive(parsed):
        raise QueryError(name, f"{name} must include a time zone (e.g. 2026-01-31T12:00:00Z).")
    if not datetime(1, 1, 2, tzinfo=parsed.tzinfo) < parsed < datetime(9999, 12, 31,
                                                                        tzinfo=parsed.tzinfo):
        raise QueryError(name, f"{name} is out of range.")
    # In UTC: Python accepts any offset under 24 hours, PostgreSQL only up to 15:59, and
    # Django sends the value as text with its offset.
    return parsed.astimezone(UTC)


def build_filter(values: Mapping[str, Iterable[str]]) -> JobFilter:
    """Turn raw filter values (lists of strings, keyed by the API's parameter names) into a
    ``JobFilter``, or raise ``QueryError`` naming the bad parameter."""

    def get(name: str) -> tuple[str, ...]:
        return _texts(name, values.get(name, ()))

    statuses = get("status")
    unknown = [s for s in statuses if s not in JobStatus.values]
    if unknown:
        raise QueryError("status", f"unknown status {unknown[0]!r}; one of "
                                   f"{', '.join(JobStatus.values)}.")

    def one(name: str) -> str | None:
        given = list(values.get(name, ()))
        if len(given) > 1:
            raise QueryError(name, f"give {name} at most once.")
        return given[0] if given else None

    after = parse_when("created_after", one("created_after"))
    before = parse_when("created_before", one("created_before"))
    if after and before and after >= before:
        raise QueryError("created_before", "created_before must be later than created_after.")
    return JobFilter(
        statuses=statuses, job_types=get("job_type"), queues=get("queue"),
        tenants=get("tenant"), error_codes=get("error_code"),
        created_after=after, created_before=before,
    )


def parse_limit(value: str | int | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except (TypeError, ValueError):
        raise QueryError("limit", f"limit must be an integer, got {value!r}.") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise QueryError("limit", f"limit must be between 1 and {MAX_LIMIT}, got {limit}.")
    return limit


def encode_cursor(job_id: uuid.UUID) -> str:
    """Opaque to clients (so the ordering key can change without breaking them)."""
    return base64.urlsafe_b64encode(job_id.bytes).decode("ascii").rstrip("=")


def decode_cursor(cursor: str | None) -> uuid.UUID | None:
    if cursor is None or cursor == "":
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        if len(raw) != 16:
            raise ValueError
        return uuid.UUID(bytes=raw)
    except (ValueError, binascii.Error, UnicodeEncodeError):
        raise QueryError("cursor", "cursor is not one this API issued; pass next_cursor from "
                                   "the previous page unchanged.") from None


@dataclass(frozen=True)
class Page:
    jobs: list[PersistentJob]
    next_cursor: str | None


def jobs_queryset() -> QuerySet[PersistentJob]:
    return PersistentJob.objects.using(conf.settings.DATABASE)


def list_jobs(
    job_filter: JobFilter, *, limit: int = DEFAULT_LIMIT, cursor: str | None = None,
    tenant: str | None = None,
) -> Page:
    """One page of jobs matching ``job_filter``, newest first.

    ``tenant`` confines the page to one tenant whatever the filter says (a tenant-bound caller);
    a filter naming other tenants then simply matches nothing of theirs.
    """
    after = decode_cursor(cursor)
    qs = job_filter.apply(jobs_queryset())
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    if after is not None:
        qs = qs.filter(id__lt=after)
    rows = list(qs.order_by("-id").defer("payload", "result", "progress")[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, encode_cursor(rows[-1].id) if more and rows else None)


def iter_matching(job_filter: JobFilter, *, tenant: str | None = None,
                  batch: int = 500) -> Iterable[uuid.UUID]:
    """Every matching job id, newest first, fetched a page at a time (bulk operator actions)."""
    after: uuid.UUID | None = None
    while True:
        qs = job_filter.apply(jobs_queryset())
        if tenant is not None:
            qs = qs.filter(tenant=tenant)
        if after is not None:
            qs = qs.filter(id__lt=after)
        ids = list(qs.order_by("-id").values_list("id", flat=True)[:batch])
        yield from ids
        if len(ids) < batch:
            return
        after = ids[-1]


def ids_ending_with(qs: QuerySet[PersistentJob], digits: str) -> QuerySet[Any, Any]:
    """The ids in ``qs`` whose hex digits end with ``digits``: the short id the admin lists is
    the tail of an id (``admin.display.short_id``; the head of a UUID v7 is a timestamp that
    jobs enqueued together share). Read from the ids, hyphens left out, so a tail longer than
    the id's last group matches too. The admin's search and ``jobs show`` both find by it."""
    return qs.annotate(pj_hex=Replace(Cast("id", CharField()), Value("-"), Value(""))).filter(
        pj_hex__endswith=digits.lower()).values("id")


def get_job(job_id: uuid.UUID | str, *, tenant: str | None = None) -> PersistentJob:
    """One job by id; another tenant's job is reported as missing, not as forbidden, so a
    tenant-bound caller learns nothing about jobs it may not see."""
    try:
        key = job_id if isinstance(job_id, uuid.UUID) else uuid.UUID(str(job_id))
    except (ValueError, AttributeError, TypeError):
        raise JobNotFoundError(f"{job_id!r} is not a job id (a UUID).") from None
    qs = jobs_queryset().filter(pk=key)
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    job = qs.first()
    if job is None:
        raise JobNotFoundError(f"No job with id {key}.")
    return job


def attempts_of(job: PersistentJob) -> list[JobAttempt]:
    return list(job.attempt_set.using(conf.settings.DATABASE).order_by("attempt", "id"))
