"""Admin for API tokens: create (the secret is shown once), see when each was used, revoke.

Registered from ``PersistentJobsConfig.ready()`` when ``django.contrib.admin`` is installed.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from .tokens import DISPLAY_CHARS, TOKEN_PREFIX, ApiToken, hash_token

if TYPE_CHECKING:
    _Base = admin.ModelAdmin[ApiToken]
else:  # the admin classes are not subscriptable at run time
    _Base = admin.ModelAdmin


@admin.register(ApiToken)
class ApiTokenAdmin(_Base):
    list_display = ("name", "key_prefix", "user", "tenant", "created_at", "last_used_at",
                    "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "key_prefix", "user__username", "tenant")
    readonly_fields = ("key_prefix", "created_at", "last_used_at", "revoked_at")
    raw_id_fields = ("user",)
    actions = ("revoke_tokens",)

    def get_readonly_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> Any:
        # Who a token acts as and what it may reach are fixed at creation: changing them later
        # would silently widen what an already-distributed secret can do.
        if obj is not None:
            return (*self.readonly_fields, "user", "tenant")
        return self.readonly_fields

    def save_model(self, request: HttpRequest, obj: ApiToken, form: Any, change: bool) -> None:
        if not change:
            secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
            obj.key_prefix = secret[:DISPLAY_CHARS]
            obj.key_hash = hash_token(secret)
            super().save_model(request, obj, form, change)
            messages.warning(request, f"The token's secret is {secret} — copy it now: it is "
                                      "stored hashed and cannot be shown again.")
            return
        super().save_model(request, obj, form, change)

    @admin.action(description="Revoke selected tokens")
    def revoke_tokens(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {count} token(s).", messages.SUCCESS)
