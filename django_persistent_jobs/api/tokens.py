"""API tokens: bearer credentials for the operator API, stored hashed.

A token acts as the Django user it belongs to (it carries exactly that user's permissions, so
revoking a permission from the user revokes it from every token), optionally confined to one
tenant. The user is referenced by primary key, not by a foreign key: a foreign key would make the
app's migrations depend on ``django.contrib.auth``, and the job system itself must install in a
project without it (a worker-only service). A token whose user is gone or inactive authenticates
nobody, and deleting a user deletes its tokens (``apps.py``).

Only a SHA-256 digest of the secret is stored: the secret is 32 random bytes, so a slow
password hash would add nothing against guessing and would cost a hash per request, while a
leaked table still cannot be replayed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
from typing import TYPE_CHECKING, Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import models
from django.db.models.functions import Now
from django.utils import timezone

from .. import bounds

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

#: Every token starts with this, so secret scanners (and people) can recognise one.
TOKEN_PREFIX = "pjt_"
#: Characters of the token kept in clear to tell tokens apart in the admin and in logs.
DISPLAY_CHARS = 12


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class ApiTokenManager(models.Manager["ApiToken"]):
    def create_token(
        self, *, user: AbstractBaseUser, name: str, tenant: str | None = None,
    ) -> tuple[ApiToken, str]:
        """Create a token and return it with its secret, which is shown this once only.

        ``tenant=None`` makes a token that sees every tenant; any other value must be a usable
        tenant name. An empty string is refused rather than read as None: it is what an unset
        variable gives, and reading it as None would hand out an unconfined token.
        """
        problem = bounds.tenant_problem(tenant)
        if problem is not None:
            raise ValueError(f"{problem} Give tenant=None for a token that sees every tenant.")
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token = self.create(user_pk=str(user.pk), name=name, tenant=tenant,
                            key_prefix=secret[:DISPLAY_CHARS], key_hash=hash_token(secret))
        return token, secret

    def authenticate(self, secret: str) -> ApiToken | None:
        """The live token with this secret, or None (unknown, revoked, or inactive user)."""
        if not secret.startswith(TOKEN_PREFIX) or len(secret) > 200:
            return None
        digest = hash_token(secret)
        token = self.filter(key_hash=digest, revoked_at__isnull=True).first()
        # The lookup already matched the digest; the constant-time compare keeps a timing
        # difference in the index lookup from mattering should the query ever change.
        if token is None or not hmac.compare_digest(token.key_hash, digest):
            return None
        user = token.user
        if user is None or not user.is_active:
            return None
        return token


class ApiToken(models.Model):
    """A bearer token for the operator API."""

    name = models.CharField(max_length=100, help_text="What the token is for (who uses it).")
    user_pk = models.CharField(
        max_length=255, db_index=True,
        help_text="Primary key of the user the token acts as; it has exactly that user's "
                  "permissions.",
    )
    tenant = models.CharField(
        max_length=200, null=True, blank=True,
        help_text="If set, every read and action with this token is confined to this tenant.",
    )
    key_prefix = models.CharField(max_length=DISPLAY_CHARS, editable=False)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    objects = ApiTokenManager()

    class Meta:
        app_label = "django_persistent_jobs"
        db_table = "persistent_jobs_api_tokens"
        verbose_name = "API token"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.key_prefix}…)"

    @property
    def user(self) -> AbstractBaseUser | None:
        """The user this token acts as, or None once that user is deleted (or in a project
        without a user model, where a token can authenticate nobody)."""
        cached = self.__dict__.get("_user")
        if cached is None or str(cached.pk) != self.user_pk:
            model = user_model()
            cached = None
            if model is not None:
                # A primary key the user model cannot parse (its type changed) is nobody.
                with contextlib.suppress(ValueError, ValidationError):
                    cached = model._default_manager.filter(pk=self.user_pk).first()
            self.__dict__["_user"] = cached
        return cached

    @user.setter
    def user(self, value: AbstractBaseUser) -> None:
        self.user_pk = str(value.pk)
        self.__dict__["_user"] = value

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None

    def revoke(self) -> None:
        self.revoked_at = timezone.now()
        type(self).objects.filter(pk=self.pk, revoked_at__isnull=True).update(
            revoked_at=self.revoked_at)

    def touch(self) -> None:
        """Record use, at most once a minute per token (each write would otherwise cost a row
        update, and a WAL record, per API request)."""
        now = timezone.now()
        if self.last_used_at is None or (now - self.last_used_at).total_seconds() >= 60:
            self.last_used_at = now
            type(self).objects.filter(pk=self.pk).update(last_used_at=now)


def user_model() -> Any:
    """``AUTH_USER_MODEL``, or None in a project where it is not installed (no
    ``django.contrib.auth`` and no custom user model)."""
    try:
        return get_user_model()
    except ImproperlyConfigured:
        return None


def _delete_tokens_of(sender: Any, instance: Any, **kwargs: Any) -> None:
    ApiToken.objects.filter(user_pk=str(instance.pk)).delete()


def connect_user_cleanup() -> None:
    """Delete a user's tokens with the user (in the same transaction), as a foreign key's
    cascade would have. Nothing to do in a project without a user model."""
    model = user_model()
    if model is not None:
        models.signals.post_delete.connect(
            _delete_tokens_of, sender=model,
            dispatch_uid="django_persistent_jobs.api.tokens.delete_tokens_of_user")
