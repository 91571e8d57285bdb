"""Who is calling: a bearer token or a Django session, and what they may do.

Either way the caller acts as a Django user and is allowed exactly that user's permissions. A
token may also be bound to one tenant; ``Caller.tenant`` is then set and every query and action
the views perform is confined to it. Session requests that change anything must carry a valid
CSRF token (the same check Django's middleware makes); token requests need none, since a browser
never attaches a bearer token by itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user
from django.core.exceptions import BadRequest, RequestDataTooBig, SuspiciousOperation
from django.db import DatabaseError, connections, router, transaction
from django.http import HttpRequest
from django.http.multipartparser import MultiPartParserError
from django.middleware.csrf import CsrfViewMiddleware

from .http import ApiError, body_too_large, unreadable_form
from .tokens import ApiToken

APP = "django_persistent_jobs"
VIEW = f"{APP}.view_persistentjob"
ADD = f"{APP}.add_persistentjob"
RETRY = f"{APP}.retry_persistentjob"
CANCEL = f"{APP}.cancel_persistentjob"

logger = logging.getLogger("django_persistent_jobs.api")

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="persistent-jobs"'}


@dataclass(frozen=True)
class Caller:
    user: Any
    token: ApiToken | None
    tenant: str | None

    def require(self, permission: str) -> None:
        if not self.user.has_perm(permission):
            raise ApiError(403, "permission_denied",
                           f"Permission {permission!r} is required for this request.")

    def require_unconfined(self) -> None:
        if self.tenant is not None:
            raise ApiError(403, "tenant_forbidden",
                           "This token is bound to one tenant; this endpoint covers all tenants.")


class _CsrfCheck(CsrfViewMiddleware):
    """Django's own CSRF check, returning the failure reason instead of an HTML response."""

    def _reject(self, request: HttpRequest, reason: str) -> Any:
        return reason


def _no_response(request: HttpRequest) -> Any:  # pragma: no cover - never called
    return None


def _check_csrf(request: HttpRequest) -> None:
    check = _CsrfCheck(_no_response)
    check.process_request(request)
    try:
        reason = check.process_view(request, None, (), {})  # type: ignore[arg-type]
    except RequestDataTooBig:
        # Without an X-CSRFToken header the check reads a form body for csrfmiddlewaretoken.
        raise body_too_large() from None
    except (SuspiciousOperation, MultiPartParserError, BadRequest) as exc:
        # Reading that form failed (too many fields or files, a malformed multipart body, a
        # charset other than UTF-8): Django would answer with its HTML 400 page.
        raise unreadable_form(request, exc) from None
    if reason:
        raise ApiError(403, "csrf_failed", f"CSRF check failed: {reason}. Send the csrftoken "
                                           "cookie's value in the X-CSRFToken header.")


def _record_use(token: ApiToken) -> None:
    """``token.touch()``, best-effort: recording when a token was last used must not decide
    whether the request is served. A database that refuses the write (read-only after a
    failover, a lock or statement timeout on the token's row) would otherwise fail every
    request, reads included; the savepoint keeps a request's own transaction
    (``ATOMIC_REQUESTS``) usable after the refusal. Logged, and the request goes on.

    If the connection is left unusable (the savepoint could not even be rolled back: the
    database went away), the error is raised after all, for the caller's 503.
    """
    alias = router.db_for_write(ApiToken)
    try:
        with transaction.atomic(using=alias):
            token.touch()
    except DatabaseError as exc:
        if connections[alias].needs_rollback:
            raise
        logger.warning("API token %r: could not record its use: %s", token.name,
                       str(exc).strip().split("\n")[0],
                       extra={"event": "api_token_touch_failed"})


def authenticate(request: HttpRequest) -> Caller:
    header = request.headers.get("Authorization")
    if header is not None:
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise ApiError(401, "authentication_failed",
                           "The Authorization header must be 'Bearer <token>'.",
                           headers=_CHALLENGE)
        token = ApiToken.objects.authenticate(secret.strip())
        if token is None:
            raise ApiError(401, "authentication_failed",
                           "The token is unknown or revoked, or its user is inactive.",
                           headers=_CHALLENGE)
        _record_use(token)
        return Caller(user=token.user, token=token, tenant=token.tenant)
    user = getattr(request, "user", None)
    if user is None and hasattr(request, "session"):
        user = get_user(request)  # sessions without the authentication middleware
    if user is None or not user.is_authenticated:
        raise ApiError(401, "not_authenticated",
                       "Authenticate with a bearer token or a logged-in session.",
                       headers=_CHALLENGE)
    if request.method not in ("GET", "HEAD", "OPTIONS", "TRACE"):
        _check_csrf(request)
    return Caller(user=user, token=None, tenant=None)
