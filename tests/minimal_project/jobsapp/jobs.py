"""The minimal project's one handler: it records its payload on the job's result."""

from __future__ import annotations

from typing import Any

from django_persistent_jobs import job_handler


@job_handler("minimal.echo")
def echo(payload: dict[str, Any]) -> dict[str, Any]:
    return {"echo": payload}
