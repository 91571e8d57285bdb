"""API tokens reference their user by primary key: the user's deletion still ends the token.

There is no foreign key (the app must migrate in a project without ``django.contrib.auth``), so
what a cascade gave for free is checked here: deleting a user deletes its tokens in the same
transaction, and a token whose user disappeared some other way (raw SQL, a restore, a user
primary key that no longer parses) authenticates nobody.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import Client

from django_persistent_jobs.api.tokens import ApiToken
from tests.api_support import bearer, make_token, make_user

pytestmark = pytest.mark.django_db


def test_deleting_a_user_deletes_its_tokens_and_only_its_own(client: Client) -> None:
    alice, bob = make_user("alice", "view_persistentjob"), make_user("bob", "view_persistentjob")
    alice_secret = make_token(alice, name="a1")
    make_token(alice, name="a2")
    bob_secret = make_token(bob, name="b1")
    assert client.get("/jobs/", **bearer(alice_secret)).status_code == 200

    alice.delete()

    assert list(ApiToken.objects.values_list("name", flat=True)) == ["b1"]
    assert client.get("/jobs/", **bearer(alice_secret)).status_code == 401
    assert client.get("/jobs/", **bearer(bob_secret)).status_code == 200
    # A bulk delete goes through the same signal.
    User.objects.filter(pk=bob.pk).delete()
    assert not ApiToken.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_user_deletion_that_rolls_back_keeps_the_tokens() -> None:
    user = make_user("carol", "view_persistentjob")
    secret = make_token(user)
    with pytest.raises(RuntimeError), transaction.atomic():
        user.delete()
        assert not ApiToken.objects.exists()  # gone inside the transaction...
        raise RuntimeError("roll back")
    token = ApiToken.objects.authenticate(secret)  # ...and back with the user
    assert token is not None and token.user == User.objects.get(username="carol")


def test_a_token_whose_user_vanished_without_the_signal_authenticates_nobody(
    client: Client,
) -> None:
    user = make_user("dave", "view_persistentjob")
    secret = make_token(user)
    assert client.get("/jobs/", **bearer(secret)).status_code == 200
    with connection.cursor() as cursor:  # as a restore or a raw delete would: no signal
        cursor.execute("DELETE FROM auth_user_user_permissions WHERE user_id = %s", [user.pk])
        cursor.execute("DELETE FROM auth_user WHERE id = %s", [user.pk])
    assert ApiToken.objects.filter(user_pk=str(user.pk)).exists()
    assert ApiToken.objects.authenticate(secret) is None
    assert client.get("/jobs/", **bearer(secret)).status_code == 401
    assert ApiToken.objects.get().user is None


def test_a_token_with_an_unparseable_user_key_authenticates_nobody(client: Client) -> None:
    user = make_user("erin", "view_persistentjob")
    secret = make_token(user)
    ApiToken.objects.update(user_pk="not-a-number")
    assert ApiToken.objects.get().user is None
    assert ApiToken.objects.authenticate(secret) is None
    assert client.get("/jobs/", **bearer(secret)).status_code == 401


def test_an_inactive_user_s_token_authenticates_nobody(client: Client) -> None:
    user = make_user("frank", "view_persistentjob")
    secret = make_token(user)
    User.objects.filter(pk=user.pk).update(is_active=False)
    assert ApiToken.objects.authenticate(secret) is None
    assert client.get("/jobs/", **bearer(secret)).status_code == 401
