"""Helpers for the operator API tests: users with given permissions, tokens, staged jobs."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import Permission, User

from django_persistent_jobs import enqueue
from django_persistent_jobs.api.tokens import ApiToken
from django_persistent_jobs.models import PersistentJob

ALL_PERMS = ("view_persistentjob", "add_persistentjob", "retry_persistentjob",
             "cancel_persistentjob")


def make_user(username: str, *perms: str, password: str = "pw-123456",
              staff: bool = False) -> User:
    user = User.objects.create_user(username, password=password, is_staff=staff)
    if perms:
        user.user_permissions.set(Permission.objects.filter(
            content_type__app_label="django_persistent_jobs", codename__in=perms))
    return user


def make_token(user: User, tenant: str | None = None, name: str = "test") -> str:
    _, secret = ApiToken.objects.create_token(user=user, name=name, tenant=tenant)
    return secret


def bearer(secret: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {secret}"}


def stage(job_type: str = "test.noop", payload: Any = None, *, tenant: str | None = None,
          status: str | None = None, error_code: str = "", queue: str | None = None,
          **fields: Any) -> PersistentJob:
    """A job put in a given state directly, as the admin tests do: the runner's paths to those
    states are tested elsewhere; here only the API's view of them matters."""
    job = enqueue(job_type, payload if payload is not None else {}, queue=queue)
    updates: dict[str, Any] = dict(fields)
    if tenant is not None:
        updates["tenant"] = tenant
    if status is not None:
        updates["status"] = status
    if error_code:
        updates["last_error_code"] = error_code
    if updates:
        PersistentJob.objects.filter(pk=job.pk).update(**updates)
    return PersistentJob.objects.get(pk=job.pk)


def table_fingerprint() -> tuple[Any, ...]:
    """Everything a rejected request must leave as it was."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT (SELECT count(*) FROM persistent_jobs), "
            "(SELECT max(updated_at) FROM persistent_jobs), "
            "(SELECT md5(coalesce(string_agg(id::text || status || attempts::text || "
            "max_retries::text || next_run_at::text, ',' ORDER BY id), '')) "
            "FROM persistent_jobs), "
            "(SELECT count(*) FROM persistent_jobs_attempts)"
        )
        return tuple(cursor.fetchone())
