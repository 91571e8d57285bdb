"""Validate an API response body against the OpenAPI document (JSON Schema 2020-12)."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import jsonschema_rs

from django_persistent_jobs.api.openapi import document

BASE = "/jobs"


@cache
def _doc() -> dict[str, Any]:
    return document(BASE)


def _template_for(path: str) -> str:
    path = path.split("?", 1)[0]
    assert path.startswith(BASE), path
    rest = path[len(BASE):] or "/"
    for template in _doc()["paths"]:
        pattern = "^" + re.sub(r"\{[^/]+\}", "[^/]+", re.escape(template).replace(
            r"\{", "{").replace(r"\}", "}")) + "$"
        if template == rest:
            return template
        if "{" in template and re.match(pattern, rest) and rest.strip("/") not in (
                t.strip("/") for t in _doc()["paths"] if "{" not in t):
            return template
    raise AssertionError(f"{path} is not in the OpenAPI document")


def assert_matches_schema(method: str, path: str, status: int, body: Any) -> None:
    """``body`` must be a response the document declares for this operation and status."""
    operation = _doc()["paths"][_template_for(path)].get(method.lower())
    if operation is None:
        assert status == 405, f"{method} {path} is undocumented but answered {status}"
        schema: dict[str, Any] = {"$ref": "#/components/schemas/Error"}
    else:
        responses = operation["responses"]
        assert str(status) in responses, f"{method} {path}: status {status} is undocumented"
        schema = responses[str(status)]["content"]["application/json"]["schema"]
    root = {**schema, "components": _doc()["components"]}
    errors = [str(e) for e in jsonschema_rs.Draft202012Validator(root).iter_errors(body)]
    assert not errors, f"{method} {path} {status}: {errors[:3]}\n{body}"
