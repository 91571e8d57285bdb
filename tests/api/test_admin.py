"""The API token admin: a new token's secret is shown once and works; revoking stops it."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import User
from django.test import Client

from django_persistent_jobs.api.tokens import ApiToken
from tests.api_support import bearer, make_user

pytestmark = pytest.mark.django_db


def test_create_in_admin_shows_the_secret_once_and_revoke_stops_it(client: Client):
    User.objects.create_superuser("root", password="pw-123456")
    client.login(username="root", password="pw-123456")
    owner = make_user("ci-bot", "view_persistentjob")
    response = client.post("/admin/django_persistent_jobs/apitoken/add/",
                           {"name": "ci", "user": owner.pk, "tenant": "acme"}, follow=True)
    assert response.status_code == 200
    page = response.content.decode()
    match = re.search(r"pjt_[A-Za-z0-9_\-]+", page)
    assert match, page[:2000]
    secret = match.group(0)
    token = ApiToken.objects.get()
    assert (token.name, token.user, token.tenant) == ("ci", owner, "acme")
    assert secret not in (token.key_hash, token.key_prefix) and secret.startswith(
        token.key_prefix)
    # The change page never shows the secret again, and user/tenant are read-only there.
    change = client.get(f"/admin/django_persistent_jobs/apitoken/{token.pk}/change/")
    assert secret not in change.content.decode()
    assert 'name="tenant"' not in change.content.decode()
    api = Client()
    assert api.get("/jobs/", **bearer(secret)).status_code == 200
    client.post("/admin/django_persistent_jobs/apitoken/",
                {"action": "revoke_tokens", "_selected_action": [token.pk]}, follow=True)
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert api.get("/jobs/", **bearer(secret)).status_code == 401


def test_renaming_a_token_keeps_its_user_and_tenant(client: Client):
    User.objects.create_superuser("root", password="pw-123456")
    client.login(username="root", password="pw-123456")
    owner = make_user("ci-bot", "view_persistentjob")
    token, secret = ApiToken.objects.create_token(user=owner, name="ci", tenant="acme")

    listing = client.get("/admin/django_persistent_jobs/apitoken/")
    assert listing.status_code == 200 and "ci-bot" in listing.content.decode()
    response = client.post(f"/admin/django_persistent_jobs/apitoken/{token.pk}/change/",
                           {"name": "ci-renamed", "user": "", "tenant": "other"})
    assert response.status_code == 302, response.content.decode()[:3000]
    token.refresh_from_db()
    assert (token.name, token.user, token.tenant) == ("ci-renamed", owner, "acme")
    assert ApiToken.objects.authenticate(secret) == token


def test_a_token_never_carries_job_permissions_its_creator_lacks(client: Client):
    """A token acts as the user chosen for it. Staff allowed to add tokens but not to retry
    jobs (or not a superuser) must not mint a token for a user who may: that token would let
    them do through the API what the admin refuses them. They may make tokens for themselves
    and for users with no job permission they lack; a superuser for anyone."""
    from django.contrib.auth.models import Permission

    root = User.objects.create_superuser("root", password="pw-123456")
    oncall = make_user("oncall", "view_persistentjob", "retry_persistentjob",
                       "cancel_persistentjob")
    viewer = make_user("viewer-bot", "view_persistentjob")
    clerk = make_user("clerk", "view_persistentjob", staff=True)
    clerk.user_permissions.add(*Permission.objects.filter(
        content_type__app_label="django_persistent_jobs", codename__endswith="_apitoken"))
    assert client.login(username="clerk", password="pw-123456")
    for target in (root, oncall):
        response = client.post("/admin/django_persistent_jobs/apitoken/add/",
                               {"name": "mine-now", "user": target.pk, "tenant": ""})
        assert response.status_code == 200, target  # the form again, with the error
        assert "permission" in response.content.decode()
        assert not ApiToken.objects.exists()
    for target in (clerk, viewer):
        response = client.post("/admin/django_persistent_jobs/apitoken/add/",
                               {"name": f"for-{target.username}", "user": target.pk,
                                "tenant": ""})
        assert response.status_code == 302, response.content.decode()[:2000]
    assert sorted(t.user.username for t in ApiToken.objects.all()) == ["clerk", "viewer-bot"]



def quick_user(username: str, *perms: str, staff: bool = False) -> User:
    """``make_user`` without a password (no slow hashing): these tests log in with
    ``force_login``."""
    from django.contrib.auth.models import Permission

    user = User.objects.create_user(username, is_staff=staff)
    user.user_permissions.set(Permission.objects.filter(
        content_type__app_label="django_persistent_jobs", codename__in=perms))
    return user


def test_a_view_only_user_cannot_revoke_tokens(client: Client):
    """Revoking changes a token: a user who may only view tokens is not offered the action and
    a hand-made POST of it revokes nothing."""
    from django.contrib.auth.models import Permission

    owner = quick_user("ci-bot", "view_persistentjob")
    token, secret = ApiToken.objects.create_token(user=owner, name="ci")
    viewer = quick_user("viewer", staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_apitoken"))
    client.force_login(viewer)
    listing = client.get("/admin/django_persistent_jobs/apitoken/")
    assert listing.status_code == 200 and "revoke_tokens" not in listing.content.decode()
    client.post("/admin/django_persistent_jobs/apitoken/",
                {"action": "revoke_tokens", "_selected_action": [token.pk]})
    token.refresh_from_db()
    assert token.revoked_at is None
    assert Client().get("/jobs/", **bearer(secret)).status_code == 200


def test_no_token_is_made_for_an_inactive_user(client: Client):
    """An inactive user has no permission (``has_perm`` is False), so the check that a token
    carries no permission its creator lacks passed for one; once the account was reactivated,
    the token acted with permissions the creator never had. A token for an inactive user is
    refused, for everyone: it could authenticate nobody until then anyway."""
    from django.contrib.auth.models import Permission

    dormant = quick_user("dormant", "view_persistentjob", "retry_persistentjob",
                        "cancel_persistentjob")
    dormant.is_active = False
    dormant.save()
    clerk = quick_user("clerk", "view_persistentjob", staff=True)
    clerk.user_permissions.add(*Permission.objects.filter(
        content_type__app_label="django_persistent_jobs", codename__endswith="_apitoken"))
    root = User.objects.create_superuser("root", password=None)
    for requester in (clerk, root):
        client.force_login(requester)
        response = client.post("/admin/django_persistent_jobs/apitoken/add/",
                               {"name": "sneaky", "user": dormant.pk, "tenant": ""})
        assert response.status_code == 200, requester  # the form again, with the error
        assert "inactive" in response.content.decode(), requester
        assert not ApiToken.objects.exists()


def test_the_token_list_reads_the_users_of_a_page_in_one_query(client: Client):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.force_login(User.objects.create_superuser("root", password=None))
    counts = []
    for tokens in (1, 21):
        while ApiToken.objects.count() < tokens:
            ApiToken.objects.create_token(
                user=User.objects.create(username=f"u{ApiToken.objects.count()}"), name="t")
        with CaptureQueriesContext(connection) as queries:
            listing = client.get("/admin/django_persistent_jobs/apitoken/")
        assert listing.status_code == 200
        assert f"u{tokens - 1}" in listing.content.decode()
        counts.append(len(queries.captured_queries))
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("query", ["key_hash__startswith=a", "user_pk__regex=%28",
                                   "revoked_at__year=99999"])
def test_the_token_list_takes_only_its_own_filters(client: Client, query: str):
    """As on the job pages: a lookup the list does not write (here one that would read the
    stored secret digests back prefix by prefix) is a bad request, and a time outside what UTC
    holds is the invalid-filter page."""
    from django.contrib.auth.models import Permission

    ApiToken.objects.create_token(user=quick_user("ci-bot"), name="ci")
    viewer = quick_user("viewer", staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_apitoken"))
    client.force_login(viewer)
    assert client.get(f"/admin/django_persistent_jobs/apitoken/?{query}").status_code == 400
    assert client.get("/admin/django_persistent_jobs/apitoken/?revoked_at__isnull=True"
                      ).status_code == 200
    late = client.get("/admin/django_persistent_jobs/apitoken/"
                      "?revoked_at__gte=0001-01-01T00:00:00%2B05:00")
    assert late.status_code == 302 and late["Location"].endswith("?e=1")
