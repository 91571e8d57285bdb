"""The API's OpenAPI 3.1 document, written by hand next to the views it describes.

Tests hold it true: every route is documented and every documented route exists, example
responses of each endpoint validate against it, and a schemathesis fuzz run checks that no input
the document allows (or forbids) gets a response it does not describe.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from datetime import datetime, timedelta
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from ..bounds import (
    DEDUP_KEY_MAX_LENGTH,
    JOB_TYPE_MAX_LENGTH,
    MAX_RETRIES_LIMIT,
    MAX_SECONDS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    QUEUE_MAX_LENGTH,
    TENANT_MAX_LENGTH,
)
from ..models import AttemptOutcome, JobStatus
from ..queries import DEFAULT_LIMIT, FILTER_TEXT_MAX_LENGTH, MAX_LIMIT
from ..stats import WINDOW_MAX_SECONDS, WINDOW_MIN_SECONDS
from ..types import Dedup

OPENAPI_VERSION = "3.1.0"


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    kind = schema["type"]
    return {**schema, "type": [kind, "null"]}


_TIME = {"type": "string", "format": "date-time"}
_TIME_OR_NULL = _nullable(_TIME)
_ANY: dict[str, Any] = {}  # any JSON value, null included


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": _ref("Error")}}}


def _ok(description: str, schema: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


_E400 = _error("Bad input; `error.field` names it.")
_E401 = {**_error("Not authenticated, or the token is unknown or revoked."),
         "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}}}
_E403 = _error("Missing permission, CSRF failure (session), or outside the token's tenant.")
_E404 = _error("No such job (or not visible to a tenant-bound token).")
_E409 = _error("The job's state does not allow this action.")
_E413 = _error("The body is larger than the site's DATA_UPLOAD_MAX_MEMORY_SIZE.")
_E500 = _error("The database refused the statement (a trigger, a constraint, tables not "
               "migrated): `error.code` is `database_error` and `error.message` the "
               "database's reason; nothing was changed.")
_E503 = {**_error("The database is unavailable (down, restarting, read-only, a lock or "
                  "statement timeout); nothing was done. Try again after `Retry-After` "
                  "seconds."),
         "headers": {"Retry-After": {"schema": {"type": "string"}}}}

_SUMMARY_PROPERTIES: dict[str, Any] = {
    "id": {"type": "string", "format": "uuid"},
    "job_type": {"type": "string"},
    "status": {"type": "string", "enum": list(JobStatus.values)},
    "queue": {"type": "string"},
    "priority": {"type": "integer"},
    "tenant": {"type": ["string", "null"]},
    "attempts": {"type": "integer", "minimum": 0},
    "max_retries": {"type": "integer", "minimum": 0},
    "dedup_key": {"type": ["string", "null"]},
    "last_error_code": {"type": "string"},
    "next_run_at": _TIME_OR_NULL,
    "created_at": _TIME_OR_NULL,
    "updated_at": _TIME_OR_NULL,
    "finished_at": _TIME_OR_NULL,
}
_DETAIL_PROPERTIES: dict[str, Any] = {
    "payload": _ANY,
    "dedup": {"type": "string", "enum": [d.value for d in Dedup]},
    "timeout_seconds": {"type": ["number", "null"]},
    "locked_by": {"type": ["string", "null"]},
    "last_error": {"type": "string"},
    "progress": _ANY,
    "result": _ANY,
    "cancel_requested": {"type": "boolean"},
    "schedule": _ANY,
    "handbacks": {"type": "integer", "minimum": 0},
}

_FILTER_PARAMETERS: list[dict[str, Any]] = [
    {"name": "status", "in": "query", "style": "form", "explode": True,
     "description": "Only jobs in these statuses (repeat, or separate with commas).",
     "schema": {"type": "array", "items": {"type": "string", "enum": list(JobStatus.values)}}},
    *({"name": name, "in": "query", "style": "form", "explode": True, "description": text,
       "schema": {"type": "array", "items": {"type": "string", "minLength": 1,
                                             "maxLength": FILTER_TEXT_MAX_LENGTH}}}
      for name, text in (("job_type", "Only these job types."), ("queue", "Only these queues."),
                         ("tenant", "Only these tenants (a tenant-bound token sees only its own "
                                    "whatever this says)."),
                         ("error_code", "Only jobs whose last error code is one of these."))),
    {"name": "created_after", "in": "query", "schema": _TIME,
     "description": "Created at or after this instant (ISO 8601 with a time zone)."},
    {"name": "created_before", "in": "query", "schema": _TIME,
     "description": "Created before this instant (ISO 8601 with a time zone)."},
]


#: Form media types a POST body may use besides JSON (``http.FORM_CONTENT_TYPES``).
_FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
_CSRF_FIELD: dict[str, Any] = {
    "type": "string",
    "description": "A session's CSRF token, as an HTML form sends it (instead of the "
                   "X-CSRFToken header); not a field of the request, and ignored with a token."}
#: A form's text for a JSON number (ASCII digits), or blank: not given.
_NUMBER_TEXT = r"^(-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?)?$"
_INTEGER_TEXT = r"^(-?(0|[1-9][0-9]*))?$"


def _body(json_schema: dict[str, Any], form_schema: dict[str, Any],
          required: bool) -> dict[str, Any]:
    """A request body: a JSON object, or the same fields as a form (either encoding)."""
    return {"required": required, "content": {
        "application/json": {"schema": json_schema},
        **{media_type: {"schema": form_schema} for media_type in _FORM_TYPES}}}


def _form_schemas() -> dict[str, Any]:
    """The form bodies: every value is text; a blank one counts as not given."""
    def text(max_length: int) -> dict[str, Any]:
        return {"type": "string", "maxLength": max_length}

    return {
        "EnqueueForm": {
            "type": "object", "additionalProperties": False, "required": ["job_type"],
            "description": "`EnqueueRequest`'s fields as a form: each value is text and a blank "
                           "one counts as not given; numbers are JSON numbers in ASCII digits "
                           "(`5`, `-3`, `1.5`), `payload` is JSON text (blank: `{}`).",
            "properties": {
                "job_type": {"type": "string", "minLength": 1,
                             "maxLength": JOB_TYPE_MAX_LENGTH},
                "payload": {"type": "string", "contentMediaType": "application/json"},
                "run_at": {"type": "string", "anyOf": [{"format": "date-time"},
                                                       {"maxLength": 0}]},
                "delay": {"type": "string", "pattern": _NUMBER_TEXT},
                "dedup_key": text(DEDUP_KEY_MAX_LENGTH),
                "dedup": {"type": "string", "enum": [*(d.value for d in Dedup), ""]},
                "priority": {"type": "string", "pattern": _INTEGER_TEXT},
                "queue": text(QUEUE_MAX_LENGTH),
                "tenant": text(TENANT_MAX_LENGTH),
                "max_retries": {"type": "string", "pattern": _INTEGER_TEXT},
                "timeout": {"type": "string", "pattern": _NUMBER_TEXT},
                "csrfmiddlewaretoken": _CSRF_FIELD,
            },
        },
        "RetryForm": {
            "type": "object", "additionalProperties": False,
            "properties": {"mode": {"type": "string", "enum": ["now", "later", "reset", ""],
                                    "default": "now"},
                           "csrfmiddlewaretoken": _CSRF_FIELD},
        },
        "CancelForm": {
            "type": "object", "additionalProperties": False,
            "properties": {"csrfmiddlewaretoken": _CSRF_FIELD},
        },
    }


def document(base_path: str = "/jobs") -> dict[str, Any]:
    """The OpenAPI document for the API mounted at ``base_path``."""
    job_id = {"name": "job_id", "in": "path", "required": True,
              "schema": {"type": "string", "format": "uuid"}}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "django-persistent-jobs operator API",
            "version": "1",
            "description": (
                "Enqueue, inspect, retry and cancel persistent jobs. Authenticate with "
                "`Authorization: Bearer <token>` (an API token; it has its user's permissions "
                "and may be bound to one tenant) or a Django session, which must send the CSRF "
                "token (X-CSRFToken, or a form's csrfmiddlewaretoken) on POST. POST bodies are "
                "JSON or the same fields as a form."
            ),
        },
        "servers": [{"url": base_path.rstrip("/") or "/"}],
        "security": [{"bearerAuth": []}, {"sessionAuth": []}],
        "paths": {
            "/": {
                "get": {
                    "operationId": "listJobs",
                    "summary": "List jobs, newest first, a page at a time.",
                    "parameters": [
                        *_FILTER_PARAMETERS,
                        {"name": "limit", "in": "query",
                         "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT,
                                    "default": DEFAULT_LIMIT}},
                        {"name": "cursor", "in": "query", "schema": {"type": "string"},
                         "description": "`next_cursor` of the previous page."},
                    ],
                    "responses": {"200": _ok("A page of jobs.", "JobPage"), "400": _E400,
                                  "401": _E401, "403": _E403, "500": _E500, "503": _E503},
                },
                "post": {
                    "operationId": "enqueueJob",
                    "summary": "Enqueue a job (permission `add_persistentjob`).",
                    "requestBody": _body(_ref("EnqueueRequest"), _ref("EnqueueForm"),
                                         required=True),
                    "responses": {
                        "201": _ok("The job was created.", "EnqueueResult"),
                        "200": _ok("Skip dedup: an active job holds the dedup key; it is "
                                   "returned and nothing was created.", "EnqueueResult"),
                        "400": _E400, "401": _E401, "403": _E403,
                        "409": _error("A tenant-bound token named a dedup key that an active "
                                      "job outside its tenant holds; nothing was written."),
                        "413": _E413, "500": _E500, "503": _E503,
                    },
                },
            },
            "/{job_id}": {
                "get": {
                    "operationId": "getJob",
                    "summary": "One job with its attempts.",
                    "parameters": [job_id],
                    "responses": {"200": _ok("The job.", "Job"), "400": _E400, "401": _E401,
                                  "403": _E403, "404": _E404, "500": _E500, "503": _E503},
                },
            },
            "/{job_id}/retry": {
                "post": {
                    "operationId": "retryJob",
                    "summary": "Put a failed, dead-lettered, cancelled or pending job back in "
                               "play (permission `retry_persistentjob`).",
                    "parameters": [job_id],
                    "requestBody": _body(_ref("RetryRequest"), _ref("RetryForm"),
                                         required=False),
                    "responses": {"200": _ok("The retried job.", "Job"), "400": _E400,
                                  "401": _E401, "403": _E403, "404": _E404, "409": _E409,
                                  "413": _E413, "500": _E500, "503": _E503},
                },
            },
            "/{job_id}/cancel": {
                "post": {
                    "operationId": "cancelJob",
                    "summary": "Cancel a waiting job, or ask a running one to stop (permission "
                               "`cancel_persistentjob`).",
                    "parameters": [job_id],
                    "requestBody": _body({"type": "object", "maxProperties": 0},
                                         _ref("CancelForm"), required=False),
                    "responses": {"200": _ok("The job, cancelled or with its cancellation "
                                             "requested.", "Job"),
                                  "400": _E400, "401": _E401, "403": _E403, "404": _E404,
                                  "409": _E409, "413": _E413, "500": _E500, "503": _E503},
                },
            },
            "/stats": {
                "get": {
                    "operationId": "getStats",
                    "summary": "The dashboard's numbers (confined to the token's tenant).",
                    "parameters": [{"name": "window", "in": "query",
                                    "description": "Seconds of history the rates cover.",
                                    "schema": {"type": "integer",
                                               "minimum": WINDOW_MIN_SECONDS,
                                               "maximum": WINDOW_MAX_SECONDS}}],
                    "responses": {"200": _ok("Statistics.", "Stats"), "400": _E400,
                                  "401": _E401, "403": _E403, "500": _E500, "503": _E503},
                },
            },
            "/openapi.json": {
                "get": {
                    "operationId": "getOpenApi",
                    "summary": "This document.",
                    "security": [],
                    "responses": {"200": {"description": "The OpenAPI document.", "content": {
                        "application/json": {"schema": {"type": "object"}}}},
                        "400": _E400},
                },
            },
        },
        "components": {
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer",
                               "description": "An API token (`pjt_...`)."},
                "sessionAuth": {"type": "apiKey", "in": "cookie", "name": "sessionid",
                                "description": "A Django session; POST needs X-CSRFToken."},
            },
            "schemas": {
                "Error": {
                    "type": "object", "required": ["error"], "additionalProperties": False,
                    "properties": {"error": {
                        "type": "object", "required": ["code", "message"],
                        "additionalProperties": False,
                        "properties": {"code": {"type": "string"},
                                       "message": {"type": "string"},
                                       "field": {"type": "string"}},
                    }},
                },
                "JobSummary": {
                    "type": "object", "additionalProperties": False,
                    "required": list(_SUMMARY_PROPERTIES), "properties": _SUMMARY_PROPERTIES,
                },
                "Job": {
                    "type": "object", "additionalProperties": False,
                    "required": [*_SUMMARY_PROPERTIES, *_DETAIL_PROPERTIES],
                    "properties": {
                        **_SUMMARY_PROPERTIES, **_DETAIL_PROPERTIES,
                        "attempt_history": {"type": "array", "items": _ref("Attempt")},
                    },
                },
                "Attempt": {
                    "type": "object", "additionalProperties": False,
                    "required": ["attempt", "runner_id", "outcome", "started_at",
                                 "finished_at", "duration_seconds", "error_code",
                                 "error_class", "error_message", "traceback"],
                    "properties": {
                        "attempt": {"type": "integer", "minimum": 1},
                        "runner_id": {"type": "string"},
                        "outcome": {"type": "string", "enum": list(AttemptOutcome.values)},
                        "started_at": _TIME_OR_NULL,
                        "finished_at": _TIME_OR_NULL,
                        "duration_seconds": {"type": ["number", "null"]},
                        "error_code": {"type": "string"},
                        "error_class": {"type": "string"},
                        "error_message": {"type": "string"},
                        "traceback": {"type": "string"},
                    },
                },
                "JobPage": {
                    "type": "object", "additionalProperties": False,
                    "required": ["results", "next_cursor"],
                    "properties": {
                        "results": {"type": "array", "items": _ref("JobSummary")},
                        "next_cursor": {"type": ["string", "null"]},
                    },
                },
                "EnqueueRequest": {
                    "type": "object", "additionalProperties": False, "required": ["job_type"],
                    "properties": {
                        "job_type": {"type": "string", "minLength": 1,
                                     "maxLength": JOB_TYPE_MAX_LENGTH},
                        "payload": _ANY,
                        "run_at": _TIME_OR_NULL,
                        "delay": {"type": ["number", "null"], "minimum": 0,
                                  "maximum": MAX_SECONDS},
                        "dedup_key": {"type": ["string", "null"], "minLength": 1,
                                      "maxLength": DEDUP_KEY_MAX_LENGTH},
                        "dedup": {"enum": [*(d.value for d in Dedup), None]},
                        "priority": {"type": ["integer", "null"], "minimum": PRIORITY_MIN,
                                     "maximum": PRIORITY_MAX},
                        "queue": {"type": ["string", "null"], "minLength": 1,
                                  "maxLength": QUEUE_MAX_LENGTH},
                        "tenant": {"type": ["string", "null"], "minLength": 1,
                                   "maxLength": TENANT_MAX_LENGTH},
                        "max_retries": {"type": ["integer", "null"], "minimum": 0,
                                        "maximum": MAX_RETRIES_LIMIT},
                        "timeout": {"type": ["number", "null"], "exclusiveMinimum": 0,
                                    "maximum": MAX_SECONDS},
                    },
                },
                "EnqueueResult": {
                    "type": "object", "additionalProperties": False,
                    "required": ["created", "job"],
                    "properties": {"created": {"type": "boolean"}, "job": _ref("Job")},
                },
                "RetryRequest": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"mode": {"type": "string", "enum": ["now", "later", "reset"],
                                            "default": "now"}},
                },
                **_form_schemas(),
                **stats_schemas(),
            },
        },
    }


def _type_schema(hint: Any, components: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for a type hint of the stats dataclasses, as ``to_dict`` renders it."""
    origin = get_origin(hint)
    args = get_args(hint)
    if origin in (Union, UnionType):
        others = [a for a in args if a is not type(None)]
        inner = _type_schema(others[0], components) if len(others) == 1 else {}
        if "$ref" in inner:
            return {"anyOf": [inner, {"type": "null"}]}
        if "type" in inner:
            return {**inner, "type": [inner["type"], "null"]}
        return inner
    if is_dataclass(hint) and isinstance(hint, type):
        name = hint.__name__
        if name not in components:
            components[name] = {}  # placeholder: recursion guard
            components[name] = _dataclass_schema(hint, components)
        return _ref(name)
    if origin in (list, tuple):
        return {"type": "array", "items": _type_schema(args[0], components) if args else {}}
    if origin is dict:
        return {"type": "object",
                "additionalProperties": _type_schema(args[1], components) if args else {}}
    simple: dict[Any, dict[str, Any]] = {
        str: {"type": "string"}, bool: {"type": "boolean"}, int: {"type": "integer"},
        float: {"type": "number"}, datetime: {"type": "string", "format": "date-time"},
        timedelta: {"type": "number", "description": "seconds"},
    }
    return dict(simple.get(hint, {}))


def _dataclass_schema(cls: type, components: dict[str, Any]) -> dict[str, Any]:
    hints = get_type_hints(cls)
    props = {f.name: _type_schema(hints[f.name], components) for f in fields(cls)}
    return {"type": "object", "additionalProperties": False, "required": list(props),
            "properties": props}


def stats_schemas() -> dict[str, Any]:
    """Schemas of ``GET stats``, derived from the ``stats`` dataclasses so they cannot drift."""
    from ..stats import DashboardStats

    components: dict[str, Any] = {}
    root = _dataclass_schema(DashboardStats, components)
    return {"Stats": {**root, "description": "The dashboard's numbers (see docs/api.md)."},
            **components}
