"""JSON responses and errors: every answer of the API, errors included, is a JSON object.

An error is ``{"error": {"code": ..., "message": ..., "field": ...}}``: ``code`` is stable for
scripts to branch on, ``message`` is for people, ``field`` (400 only) names the input at fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import wraps
from typing import Any

from django.conf import settings
from django.core.exceptions import BadRequest, RequestDataTooBig, SuspiciousOperation
from django.db import (
    DatabaseError,
    InterfaceError,
    InternalError,
    OperationalError,
    connections,
    transaction,
)
from django.http import HttpRequest, HttpResponse, JsonResponse, RawPostDataException
from django.http.multipartparser import MultiPartParserError
from django.views.decorators.csrf import csrf_exempt

from ..errors import database_error_text
from ..runner.db import sqlstate

logger = logging.getLogger("django_persistent_jobs.api")


class ApiError(Exception):
    """Raised anywhere in a view to answer with a JSON error."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers or {}


def bad_request(field: str, message: str, code: str = "invalid") -> ApiError:
    return ApiError(400, code, message, field=field)


def error_response(error: ApiError) -> JsonResponse:
    body: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.field is not None:
        body["field"] = error.field
    response = JsonResponse({"error": body}, status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def json_response(data: Any, status: int = 200) -> JsonResponse:
    return JsonResponse(data, status=status, safe=False)


def body_too_large() -> ApiError:
    return ApiError(
        413, "body_too_large",
        f"The request body is larger than DATA_UPLOAD_MAX_MEMORY_SIZE "
        f"({settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes); nothing was read or written.",
        field="body")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(text: str | bytes) -> Any:
    """``json.loads`` refusing NaN and Infinity, which are not JSON (Python's parser would
    accept them, and PostgreSQL's jsonb would then refuse the value)."""
    return json.loads(text, parse_constant=_reject_constant)


#: The form encodings a POST body may use besides JSON: what an HTML ``<form>``, ``curl -d`` and
#: Django's test client (``client.post(path, data)``, and ``client.post(path)`` alone: an empty
#: multipart form) send.
FORM_CONTENT_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")

#: The field an HTML form carries its CSRF token in; Django's CSRF check reads it, the API
#: does not (it is no field of any endpoint).
CSRF_FORM_FIELD = "csrfmiddlewaretoken"


@dataclass(frozen=True)
class Body:
    """A POST body's fields. ``form``: they came from a form, so every value is a string (the
    views parse the fields that JSON would carry as numbers or objects, and a blank one counts
    as not given, as an empty input of an HTML form means)."""

    fields: dict[str, Any]
    form: bool


def unreadable_form(request: HttpRequest, exc: Exception) -> ApiError:
    """A 400 for a form Django refused to parse: too many fields or files
    (``DATA_UPLOAD_MAX_NUMBER_FIELDS``/``_FILES``), a malformed multipart body, a charset other
    than UTF-8. Said in JSON, not with Django's HTML 400 page."""
    if isinstance(exc, SuspiciousOperation):
        _log_suspicious(request, exc)
    return ApiError(400, "invalid_form", f"The form could not be read: {exc}", field="body")


def read_body(request: HttpRequest, *, optional: bool = False) -> Body:
    """The POST body's fields: a form's (url-encoded or multipart), else a JSON object's (see
    ``read_json_object``; ``optional``: an empty body counts as no fields)."""
    if request.content_type not in FORM_CONTENT_TYPES:
        return Body(read_json_object(request, optional=optional), form=False)
    try:
        post, files = request.POST, request.FILES
    except RequestDataTooBig:
        raise body_too_large() from None
    except (SuspiciousOperation, MultiPartParserError, BadRequest) as exc:
        raise unreadable_form(request, exc) from None
    for name in files:
        raise ApiError(400, "invalid", f"{name} is a file; no field of this API takes one.",
                       field=name)
    fields: dict[str, str] = {}
    for name, values in post.lists():
        if name == CSRF_FORM_FIELD:
            continue
        if len(values) > 1:
            raise ApiError(400, "invalid", f"Give {name} once; the form has it {len(values)} "
                                           "times.", field=name)
        fields[name] = values[0]
    return Body(fields, form=True)


def read_json_object(request: HttpRequest, *, optional: bool = False) -> dict[str, Any]:
    """The request body as a JSON object; an empty body counts as ``{}`` when ``optional``."""
    try:
        raw = request.body
    except RequestDataTooBig:
        raise body_too_large() from None
    except RawPostDataException:
        # The stream was consumed as a multipart form (by a session's CSRF check), although
        # the body is not declared as one (``read_body`` reads declared forms).
        raise ApiError(400, "invalid_json", "The request body must be a JSON object, or a "
                                            "form declared as one (Content-Type "
                                            f"{' or '.join(FORM_CONTENT_TYPES)}).",
                       field="body") from None
    if not raw.strip():
        if optional:
            return {}
        raise ApiError(400, "invalid_json", "The request body must be a JSON object.",
                       field="body")
    try:
        data = loads_strict(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, "invalid_json", f"The request body is not valid JSON: {exc}",
                       field="body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "The request body must be a JSON object.",
                       field="body")
    return data


View = Callable[..., HttpResponse]

#: Seconds a client is told to wait before trying again when the database is unavailable.
RETRY_AFTER_SECONDS = 15


#: PostgreSQL's read_only_sql_transaction: a write to a database that is (now) read-only, a
#: standby after a failover, or one set ``default_transaction_read_only``. Django raises it
#: as ``InternalError``, the class it shares with errors that are bugs.
READ_ONLY_SQLSTATE = "25006"


def is_unavailable(exc: DatabaseError) -> bool:
    """Whether a database error means the database cannot be used right now (down, restarting,
    failing over, read-only, a lock or statement timeout), not that the request or the code is
    wrong: what the API answers with a 503 a client can retry."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, InternalError) and sqlstate(exc) == READ_ONLY_SQLSTATE


def database_unavailable(exc: BaseException) -> ApiError:
    """A 503 for a database the request could not use (down, restarting, failing over,
    read-only, a lock or statement timeout): a transient condition clients and load balancers
    retry, answered in JSON like every other error instead of Django's HTML 500 page.

    The cause is logged, not returned: psycopg's message names the database's host and port,
    and the caller may not even be authenticated yet (checking a token needs the database).
    Any transaction the request is inside (``ATOMIC_REQUESTS``) is marked for rollback, since
    the failed statement left it unusable.
    """
    _roll_back_requests()
    logger.warning("operator API: database unavailable: %s", str(exc).strip().split("\n")[0],
                   extra={"event": "api_database_unavailable"})
    return ApiError(503, "database_unavailable",
                    "The database is unavailable; nothing was done. Try again shortly.",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def database_refused(exc: BaseException) -> ApiError:
    """A 500 for a statement the database refused (a trigger, a constraint, a table not
    migrated): not retryable as is, and answered in JSON with the database's one-line reason,
    as the ``jobs`` command reports it, instead of Django's HTML 500 page. Logged with its
    traceback; the request's transaction, if any, is rolled back."""
    _roll_back_requests()
    text = database_error_text(exc)
    logger.error("operator API: the database refused the request: %s", text, exc_info=exc,
                 extra={"event": "api_database_error"})
    return ApiError(500, "database_error", text)


def _roll_back_requests() -> None:
    """Mark any transaction the request is inside (``ATOMIC_REQUESTS``) for rollback: the
    failed statement left it unusable."""
    for alias in connections:
        connection = connections[alias]
        if connection.in_atomic_block:
            transaction.set_rollback(True, using=alias)


def _read_query(request: HttpRequest) -> None:
    """Parse the query string up front: past ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` Django refuses
    it (``TooManyFieldsSent``) wherever a view first reads ``request.GET``; said here, naming
    the query, instead of Django's HTML 400 page."""
    try:
        request.GET  # noqa: B018 - parsed (and cached) for its error
    except SuspiciousOperation as exc:
        _log_suspicious(request, exc)
        raise ApiError(400, "invalid", f"The query string could not be read: {exc}",
                       field="query") from None


def _log_suspicious(request: HttpRequest, exc: SuspiciousOperation) -> None:
    """Where Django's own handler would log it (``django.security.<class>``), for the sites
    that watch that logger: answering in JSON must not hide it."""
    logging.getLogger(f"django.security.{type(exc).__name__}").error(
        str(exc), extra={"status_code": 400, "request": request})


def refused(request: HttpRequest, exc: SuspiciousOperation) -> ApiError:
    """A 400 for what Django refuses as suspicious (too many fields or files in a form read
    while checking a session's CSRF token, a disallowed host): JSON, not Django's HTML page."""
    _log_suspicious(request, exc)
    return ApiError(400, "bad_request", f"The request was refused: {exc}")


def json_endpoint(methods: Iterable[str]) -> Callable[[View], View]:
    """Allowed methods answered with JSON 405 otherwise; ``ApiError`` rendered as JSON, a
    database that cannot be used as a JSON 503 (``database_unavailable``), and a statement the
    database refused as a JSON 500 (``database_refused``).

    The view is exempt from the CSRF middleware on purpose: bearer-token requests carry no
    cookie and need no CSRF token, and session requests are checked by ``auth.authenticate``
    instead, which rejects them with a JSON 403 rather than the middleware's HTML page.
    """
    allowed = tuple(m.upper() for m in methods)
    if "GET" in allowed and "HEAD" not in allowed:
        # HTTP: a resource that answers GET answers HEAD with the same status and headers and
        # no body (health checks, link checkers and some proxies send it).
        allowed += ("HEAD",)

    def decorate(view: View) -> View:
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                if request.method not in allowed:
                    raise ApiError(
                        405, "method_not_allowed",
                        f"{request.method} is not allowed here; use {', '.join(allowed)}.",
                        headers={"Allow": ", ".join(allowed)})
                _read_query(request)
                response = view(request, *args, **kwargs)
            except ApiError as error:
                response = error_response(error)
            except SuspiciousOperation as exc:
                response = error_response(refused(request, exc))
            except DatabaseError as exc:
                response = error_response(database_unavailable(exc) if is_unavailable(exc)
                                          else database_refused(exc))
            if request.method == "HEAD":
                length = len(response.content)
                response.content = b""
                response["Content-Length"] = str(length)
            return response

        return csrf_exempt(wrapper)

    return decorate
