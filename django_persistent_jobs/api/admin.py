"""Admin for API tokens: create (the secret is shown once), see when each was used, revoke.

Registered from ``PersistentJobsConfig.ready()`` when ``django.contrib.admin`` is installed.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from ..admin.database import FilterParametersMixin
from .auth import ADD, CANCEL, RETRY, VIEW
from .tokens import DISPLAY_CHARS, TOKEN_PREFIX, ApiToken, hash_token, user_model

#: What a token can do with the jobs: the permissions the API checks.
JOB_PERMISSIONS = (VIEW, ADD, RETRY, CANCEL)

if TYPE_CHECKING:
    _Base = admin.ModelAdmin[ApiToken]
else:  # the admin classes are not subscriptable at run time
    _Base = admin.ModelAdmin


class ApiTokenForm(forms.ModelForm):  # type: ignore[type-arg]
    """Chooses the token's user from the user model (the token stores only its primary key)."""

    user = forms.ModelChoiceField(
        queryset=get_user_model()._default_manager.all(),
        help_text="The token acts as this user and has exactly this user's permissions.")

    class Meta:
        model = ApiToken
        fields = ("name", "tenant")

    #: Who is filling the form in (set by ``ApiTokenAdmin.get_form``).
    requester: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None and "user" in self.fields:
            self.fields["user"].initial = self.instance.user

    def clean_user(self) -> Any:
        """Refuse an inactive user, and a user with a job permission the requester lacks (or a
        superuser, for a requester who is not one): the token would act as that user, so whoever
        may add tokens could otherwise do through the API what the admin refuses them."""
        user = self.cleaned_data["user"]
        if not getattr(user, "is_active", True):
            # Django grants an inactive user no permission, so the comparison below would pass
            # for one; reactivated, the account's token would act with all it may do then.
            raise forms.ValidationError(
                f"{user} is inactive: a token for them could authenticate nobody now, and would "
                "act with whatever the account may do once it is reactivated. Reactivate the "
                "account first, then create its token.")
        requester = self.requester
        if requester is None or requester.is_superuser or user.pk == requester.pk:
            return user
        if user.is_superuser:
            raise forms.ValidationError(
                "Only a superuser can create a token for a superuser: the token would have "
                "every permission.")
        lacking = [p for p in JOB_PERMISSIONS if user.has_perm(p) and not requester.has_perm(p)]
        if lacking:
            raise forms.ValidationError(
                f"{user} has the permission {lacking[0]!r}, which you do not have; the token "
                "would act with it. Ask someone who has it to create this token.")
        return user

    def save(self, commit: bool = True) -> ApiToken:
        if "user" in self.cleaned_data:
            self.instance.user = self.cleaned_data["user"]
        return super().save(commit)  # type: ignore[no-any-return]


@admin.register(ApiToken)
class ApiTokenAdmin(FilterParametersMixin, _Base):
    form = ApiTokenForm
    list_display = ("name", "key_prefix", "user", "tenant", "created_at", "last_used_at",
                    "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "key_prefix", "user_pk", "tenant")
    readonly_fields = ("key_prefix", "created_at", "last_used_at", "revoked_at")
    actions = ("revoke_tokens",)
    #: The filter parameters the list accepts: those of its "revoked at" filter. Django's admin
    #: otherwise takes any lookup on the token's fields, ``key_hash__startswith`` included (the
    #: stored digests, read back prefix by prefix), and values PostgreSQL refuses (a 500).
    allowed_lookups = frozenset({"revoked_at__gte", "revoked_at__lt", "revoked_at__isnull"})
    time_lookups = frozenset({"revoked_at__gte", "revoked_at__lt"})

    def get_form(self, request: HttpRequest, obj: ApiToken | None = None, change: bool = False,
                 **kwargs: Any) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        return type(form.__name__, (form,), {"requester": request.user})

    def get_readonly_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> Any:
        # Who a token acts as and what it may reach are fixed at creation: changing them later
        # would silently widen what an already-distributed secret can do.
        if obj is not None:
            return (*self.readonly_fields, "user", "tenant")
        return self.readonly_fields

    def get_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> Any:
        if obj is None:
            return ("name", "user", "tenant")
        return ("name", "user", "tenant", *self.readonly_fields)

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

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """Each row shows its token's user: read the users of the page in one query, not one
        per row (``ApiToken.user`` reads its own when not given)."""
        self.check_time_lookups(request)
        changelist = super().get_changelist_instance(request)
        tokens = list(changelist.result_list)
        model = user_model()
        if model is not None and tokens:
            pk_field = model._meta.pk
            keys = set()
            for token in tokens:
                with contextlib.suppress(ValidationError, ValueError, TypeError):
                    keys.add(pk_field.to_python(token.user_pk))
            users = {str(u.pk): u for u in model._default_manager.filter(pk__in=keys)}
            for token in tokens:
                if token.user_pk in users:
                    token.user = users[token.user_pk]
        return changelist

    # Revoking changes the token: who may only view tokens may not revoke them.
    @admin.action(description="Revoke selected tokens", permissions=["change"])
    def revoke_tokens(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {count} token(s).", messages.SUCCESS)
