"""The operator API's views: validate input, check the caller, call the service layer.

Nothing here changes a job directly: enqueue goes through ``enqueue``, retry and cancel through
``services``, reads through ``queries``, so the API cannot drift from what the admin and the
``jobs`` command do. Every check that can reject a request runs before the service is called,
so a rejected request writes nothing.
"""

from __future__ import annotations

import json
import logging
import math
import re
from datetime import timedelta
from typing import Any

from django.apps import apps
from django.db import DatabaseError, router, transaction
from django.http import HttpRequest, HttpResponse, QueryDict
from django.views.decorators.csrf import csrf_exempt

from .. import bounds, conf, queries, services, stats
from ..enqueuing import enqueue, enqueue_as_tenant
from ..errors import (
    ConfigurationError,
    DedupKeyTakenError,
    EnqueueError,
    InvalidJobStateError,
    JobNotFoundError,
    PayloadError,
    UnknownJobTypeError,
)
from ..models import PersistentJob
from ..types import Dedup
from . import auth, openapi
from .http import (
    ApiError,
    bad_request,
    error_response,
    json_endpoint,
    json_response,
    loads_strict,
    read_body,
)
from .serialize import job_detail, job_summary

logger = logging.getLogger("django_persistent_jobs.api")

ENQUEUE_FIELDS = ("job_type", "payload", "run_at", "delay", "dedup_key", "dedup", "priority",
                  "queue", "tenant", "max_retries", "timeout")
LIST_PARAMS = ("status", "job_type", "queue", "tenant", "error_code", "created_after",
               "created_before", "limit", "cursor")


def _alias() -> str:
    return conf.settings.DATABASE


def _not_found(exc: Exception) -> ApiError:
    return ApiError(404, "not_found", str(exc))


def _text(data: dict[str, Any], name: str, low: int, high: int) -> str | None:
    value = data.get(name)
    if value is None:
        return None
    if (not isinstance(value, str) or not low <= len(value) <= high
            or bounds.text_problem(value) is not None):
        raise bad_request(name, f"{name} must be a string of {low}..{high} characters without "
                                "NUL bytes or lone surrogates.")
    return value


def _integer(data: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(name, f"{name} must be an integer in {low}..{high}.")
    return value


def _seconds(data: dict[str, Any], name: str, *, positive: bool) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    # (An integer beyond any float comes back as inf: refused by the bound below.)
    seconds = bounds.seconds_of(value)
    if seconds is None or (isinstance(value, float) and not math.isfinite(value)):
        raise bad_request(name, f"{name} must be a number of seconds.")
    if seconds < 0 or (positive and seconds == 0) or seconds > bounds.MAX_SECONDS:
        bound = "> 0" if positive else ">= 0"
        raise bad_request(name, f"{name} must be {bound} and at most {bounds.MAX_SECONDS:.0f} "
                                "seconds.")
    return seconds


#: The enqueue fields JSON carries as numbers: a form carries them as text.
_FORM_NUMBERS = frozenset({"priority", "max_retries", "delay", "timeout"})
#: A JSON number, in ASCII digits: what a form's number field may hold (so ``1_000`` or
#: full-width digits, which Python's ``int()`` would take, are refused as in JSON).
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?", re.ASCII)


def _from_form(fields: dict[str, Any]) -> dict[str, Any]:
    """A form's fields as the JSON body would carry them, for the same checks to apply.

    A blank field counts as not given (an HTML form sends its empty inputs); ``payload`` is
    JSON text; the number fields are parsed when they are JSON numbers and otherwise left as
    text, which their check then refuses with its usual message.
    """
    data: dict[str, Any] = {}
    for name, text in fields.items():
        if text == "":
            continue
        if name == "payload":
            try:
                data[name] = loads_strict(text)
            except (ValueError, RecursionError) as exc:
                raise bad_request("payload", f"payload must be JSON text in a form (an object "
                                             f'such as {{"to": "a@example.com"}}, or any JSON '
                                             f"value): {exc}", code="invalid_json") from None
        elif name in _FORM_NUMBERS and _JSON_NUMBER.fullmatch(text):
            try:
                data[name] = json.loads(text)
            except ValueError:  # more digits than Python converts: refused as text below
                data[name] = text
        else:
            data[name] = text
    return data


def _field_of(exc: EnqueueError) -> str:
    """Which input an ``enqueue`` refusal is about (its messages start with the option name)."""
    if isinstance(exc, UnknownJobTypeError):
        return "job_type"
    if isinstance(exc, PayloadError):
        return "payload"
    first = str(exc).split(" ", 1)[0].strip(":,.")
    return first if first in ENQUEUE_FIELDS else "body"


def _refuse_query(request: HttpRequest, allowed: tuple[str, ...] = ()) -> None:
    """Unknown query parameters are an error, not ignored: ``retry?mode=reset`` must not
    quietly do a plain retry (``mode`` belongs in the body), nor a typo widen a list."""
    unknown = sorted(set(request.GET) - set(allowed))
    if unknown:
        where = f"allowed: {', '.join(allowed)}" if allowed else "this endpoint takes none"
        hint = " (give it in the body)" if request.method == "POST" else ""
        raise bad_request(unknown[0], f"Unknown query parameter {unknown[0]!r}{hint}; {where}.")


def _actor(caller: auth.Caller) -> str:
    """Who acted, for the service layer's log line and the job's cancel message."""
    name = caller.user.get_username()
    if caller.token is not None:
        return f"{name} (API token {caller.token.name!r})"
    return f"{name} (API)"


def _record_in_history(caller: auth.Caller, job: PersistentJob, action: str) -> None:
    """Put a retry or cancel on the job's admin *History*, as the admin's own buttons do
    (``admin.actions``, same wording), naming the user and the token: operators look there
    for who did what to a job. Only when the admin is installed.

    The action has committed by now: a failure to record it is logged, not answered as an
    error, since a client told "failed" would do it again.
    """
    if not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.models import CHANGE, LogEntry
    from django.contrib.contenttypes.models import ContentType

    from ..admin.actions import ACTIONS

    message = f"{ACTIONS[action].history_message(job)} Through the HTTP API by {_actor(caller)}."
    try:
        with transaction.atomic(using=router.db_for_write(LogEntry)):
            LogEntry.objects.create(
                user_id=caller.user.pk,
                content_type_id=ContentType.objects.get_for_model(job).pk,
                object_id=str(job.pk), object_repr=str(job)[:200], action_flag=CHANGE,
                change_message=message)
    except DatabaseError:
        logger.exception("job %s: the API could not record %r in the admin history", job.id,
                         action, extra={"event": "api_history_failed", "job_id": str(job.id)})


def _enqueue(request: HttpRequest, caller: auth.Caller) -> HttpResponse:
    caller.require(auth.ADD)
    _refuse_query(request)
    body = read_body(request)
    data = body.fields
    unknown = sorted(set(data) - set(ENQUEUE_FIELDS))
    if unknown:
        raise bad_request(unknown[0], f"Unknown field {unknown[0]!r}; allowed: "
                                      f"{', '.join(ENQUEUE_FIELDS)}.")
    if body.form:
        data = _from_form(data)
    job_type = _text(data, "job_type", 1, bounds.JOB_TYPE_MAX_LENGTH)
    if job_type is None:
        raise bad_request("job_type", "job_type is required.")
    options: dict[str, Any] = {
        "dedup_key": _text(data, "dedup_key", 1, bounds.DEDUP_KEY_MAX_LENGTH),
        "queue": _text(data, "queue", 1, bounds.QUEUE_MAX_LENGTH),
        "priority": _integer(data, "priority", bounds.PRIORITY_MIN, bounds.PRIORITY_MAX),
        "max_retries": _integer(data, "max_retries", 0, bounds.MAX_RETRIES_LIMIT),
        "timeout": _seconds(data, "timeout", positive=True),
        "delay": _seconds(data, "delay", positive=False),
    }
    raw_run_at = data.get("run_at")
    if raw_run_at is not None:
        if not isinstance(raw_run_at, str):
            raise bad_request("run_at", "run_at must be an ISO 8601 date-time string.")
        try:
            options["run_at"] = queries.parse_when("run_at", raw_run_at)
        except queries.QueryError as exc:
            raise bad_request(exc.field, exc.message) from None
    if options.get("run_at") is not None and options["delay"] is not None:
        raise bad_request("delay", "Give run_at or delay, not both.")
    dedup = data.get("dedup")
    if dedup is not None and dedup not in [d.value for d in Dedup]:
        raise bad_request("dedup", f"dedup must be one of {[d.value for d in Dedup]}.")
    options["dedup"] = dedup
    tenant = _text(data, "tenant", 1, bounds.TENANT_MAX_LENGTH)
    if caller.tenant is not None:
        if tenant is not None and tenant != caller.tenant:
            raise ApiError(403, "tenant_forbidden",
                           f"This token is bound to tenant {caller.tenant!r}.", field="tenant")
        tenant = caller.tenant
    if tenant is not None:
        options["tenant"] = tenant
    payload = data.get("payload", {})
    given = {k: v for k, v in options.items() if v is not None}
    try:
        with transaction.atomic(using=_alias()):
            if caller.tenant is not None:
                # Dedup keys are shared by all tenants: this refuses one held outside it.
                given.pop("tenant", None)
                job = enqueue_as_tenant(job_type, payload, tenant=caller.tenant, **given)
            else:
                job = enqueue(job_type, payload, **given)
        # False when Skip dedup returned the active job that holds the key.
        created = bool(getattr(job, "_pj_created", True))
    except DedupKeyTakenError as exc:
        raise ApiError(409, "dedup_key_taken", str(exc), field="dedup_key") from None
    except EnqueueError as exc:
        raise bad_request(_field_of(exc), str(exc), code=exc.code.lower()) from None
    except ConfigurationError as exc:
        raise bad_request("job_type", str(exc), code="configuration_error") from None
    return json_response({"created": created, "job": job_detail(job)},
                         status=201 if created else 200)


def _list(request: HttpRequest, caller: auth.Caller) -> HttpResponse:
    caller.require(auth.VIEW)
    params = request.GET
    _refuse_query(request, LIST_PARAMS)
    try:
        job_filter = queries.build_filter({name: params.getlist(name) for name in params})
        limit = queries.parse_limit(_single(params, "limit"))
        page = queries.list_jobs(job_filter, limit=limit, cursor=_single(params, "cursor"),
                                 tenant=caller.tenant)
    except queries.QueryError as exc:
        raise bad_request(exc.field, exc.message) from None
    return json_response({"results": [job_summary(j) for j in page.jobs],
                          "next_cursor": page.next_cursor})


def _single(params: QueryDict, name: str) -> str | None:
    values = params.getlist(name)
    if len(values) > 1:
        raise queries.QueryError(name, f"give {name} at most once.")
    return values[0] if values else None


@json_endpoint(["GET", "POST"])
def jobs_view(request: HttpRequest) -> HttpResponse:
    """``GET``: list jobs; ``POST``: enqueue one."""
    caller = auth.authenticate(request)
    if request.method == "POST":
        return _enqueue(request, caller)
    return _list(request, caller)


@json_endpoint(["GET"])
def job_view(request: HttpRequest, job_id: str) -> HttpResponse:
    caller = auth.authenticate(request)
    caller.require(auth.VIEW)
    _refuse_query(request)
    try:
        job = queries.get_job(job_id, tenant=caller.tenant)
    except JobNotFoundError as exc:
        raise _not_found(exc) from None
    return json_response(job_detail(job, queries.attempts_of(job)))


@json_endpoint(["POST"])
def retry_view(request: HttpRequest, job_id: str) -> HttpResponse:
    caller = auth.authenticate(request)
    caller.require(auth.RETRY)
    _refuse_query(request)
    body = read_body(request, optional=True)
    data = body.fields
    unknown = sorted(set(data) - {"mode"})
    if unknown:
        raise bad_request(unknown[0], f"Unknown field {unknown[0]!r}; allowed: mode.")
    mode = data.get("mode", "now")
    if body.form and mode == "":
        mode = "now"  # a blank form field counts as not given
    if mode not in services.RETRY_MODES:
        raise bad_request("mode", f"mode must be one of {', '.join(services.RETRY_MODES)}.")
    try:
        job = queries.get_job(job_id, tenant=caller.tenant)
        job = services.retry_job(job.id, mode, actor=_actor(caller))
    except JobNotFoundError as exc:
        raise _not_found(exc) from None
    except InvalidJobStateError as exc:
        raise ApiError(409, "invalid_state", str(exc)) from None
    except ConfigurationError as exc:
        raise ApiError(409, "configuration_error", str(exc)) from None
    _record_in_history(caller, job, f"retry_{mode}")
    return json_response(job_detail(job))


@json_endpoint(["POST"])
def cancel_view(request: HttpRequest, job_id: str) -> HttpResponse:
    caller = auth.authenticate(request)
    caller.require(auth.CANCEL)
    _refuse_query(request)
    data = read_body(request, optional=True).fields
    if data:
        field = sorted(data)[0]
        raise bad_request(field, f"Unknown field {field!r}; cancel takes no fields.")
    try:
        job = queries.get_job(job_id, tenant=caller.tenant)
        job = services.cancel_job(job.id, actor=_actor(caller))
    except JobNotFoundError as exc:
        raise _not_found(exc) from None
    except InvalidJobStateError as exc:
        raise ApiError(409, "invalid_state", str(exc)) from None
    _record_in_history(caller, job, "cancel")
    return json_response(job_detail(job))


@json_endpoint(["GET"])
def stats_view(request: HttpRequest) -> HttpResponse:
    caller = auth.authenticate(request)
    caller.require(auth.VIEW)
    _refuse_query(request, ("window",))
    try:
        # Once at most, as the list's parameters: the last of two would win silently.
        raw = _single(request.GET, "window")
    except queries.QueryError as exc:
        raise bad_request(exc.field, exc.message) from None
    window = timedelta(hours=24)
    if raw is not None:
        try:
            seconds = int(raw)
        except ValueError:
            seconds = -1
        if not stats.WINDOW_MIN_SECONDS <= seconds <= stats.WINDOW_MAX_SECONDS:
            raise bad_request("window", f"window must be whole seconds in "
                                        f"{stats.WINDOW_MIN_SECONDS}..{stats.WINDOW_MAX_SECONDS}.")
        window = timedelta(seconds=seconds)
    return json_response(stats.dashboard_stats(window=window, tenant=caller.tenant).to_dict())


@json_endpoint(["GET"])
def openapi_view(request: HttpRequest) -> HttpResponse:
    """The OpenAPI 3 document; public, like any API description (it holds no data). Unknown
    query parameters are 400 here too, as on every endpoint (docs/api.md)."""
    _refuse_query(request)
    return json_response(openapi.document(request.path.rsplit("/", 1)[0] or "/"))


@csrf_exempt
def unknown_route_view(request: HttpRequest, rest: str) -> HttpResponse:
    """Any other path under the API's prefix: a JSON 404 naming the routes, instead of Django's
    HTML page (a client that appends a slash, ``<id>/``, learns why it missed).

    CSRF-exempt like the endpoints (it changes nothing): otherwise the CSRF middleware would
    answer a bearer client's POST to ``<id>/retry/`` with its HTML 403 instead of this 404.
    """
    from ..urls import urlpatterns  # (the routes import this module)

    prefix = request.path[:len(request.path) - len(rest)]
    slash = " Only the collection's path ends in a slash." if rest.endswith("/") else ""
    routes = ", ".join(prefix + str(p.pattern).replace("<str:job_id>", "<id>")
                       for p in urlpatterns if p.name is not None)
    return error_response(ApiError(
        404, "not_found", f"No API endpoint at {request.path!r}.{slash} Endpoints: {routes}."))
