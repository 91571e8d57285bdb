"""Payload validation before insert: exact JSON round-trip, size/depth/key limits, the encoder
setting and per-handler validators (at enqueue and at run time)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection

from django_persistent_jobs import (
    JobContext,
    JobHandler,
    PayloadError,
    enqueue,
    enqueue_many,
    job_handler,
)
from django_persistent_jobs.models import JobAttempt, PersistentJob
from django_persistent_jobs.runner import Runner
from tests.core_support import claim_as, pj_settings
from tests.testapp.models import LedgerEntry

CALLS: list[Any] = []


def require_int_n(payload: Any) -> None:
    if not isinstance(payload, dict) or not isinstance(payload.get("n"), int):
        raise ValueError("'n' must be an integer")


@job_handler("core.payload.validated", validator=require_int_n, max_retries=5)
def validated(payload: dict[str, Any], ctx: JobContext) -> None:
    CALLS.append(payload)


@job_handler
class Invoice(JobHandler):
    job_type = "core.payload.invoice"

    def validate(self, payload: Any) -> None:
        if payload.get("amount", 0) <= 0:
            raise ValueError(f"amount must be positive, got {payload.get('amount')!r}")

    def execute(self, payload: Any, ctx: JobContext) -> None:
        CALLS.append(payload)


def nest(levels: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(levels):
        value = {"k": value}
    return value


def same_types(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_types(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_types(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


ROUND_TRIP: dict[str, Any] = {
    "text": "héllo ✓ 😀 \"quoted\" back\\slash\nnew\tline \u2028",
    "int": 42, "neg": -7, "huge_int": 2**70, "zero": 0,
    "float": 0.1, "whole_float": 2.0, "small": 1.5e-10, "subnormal": 5e-324,
    "big_float": 1e16, "bigger_float": 1.5e20, "huge_float": -1e300,
    "true": True, "false": False, "none": None,
    "list": [1, [2, [3, {"x": []}]]], "empty_dict": {}, "empty_list": [],
    "": "empty key", "ключ": "unicode key",
}


@pytest.mark.django_db
def test_payload_round_trips_exactly_through_the_database() -> None:
    job = enqueue("test.noop", ROUND_TRIP)
    assert same_types(job.payload, ROUND_TRIP)
    stored = PersistentJob.objects.get(id=job.id).payload
    assert same_types(stored, ROUND_TRIP), stored
    with connection.cursor() as cursor:
        (claimed,) = claim_as(cursor, "core-payload", 1, None)  # what a handler receives
    assert same_types(claimed.payload, ROUND_TRIP), claimed.payload
    for value in ([1, "two", None], "just a string", 3, 2.5e17, None):
        other = enqueue("test.noop", value)
        expected = {} if value is None else value
        assert same_types(PersistentJob.objects.get(id=other.id).payload, expected)


class Custom:
    pass


REFUSED: list[tuple[Any, str]] = [
    ({"a": {"when": datetime(2030, 1, 1, tzinfo=UTC)}},
     "payload['a']['when'] is a datetime, which does not round-trip through JSON unchanged"),
    ({"day": date(2030, 1, 1)}, "payload['day'] is a date"),
    ({"items": [1, 2, {"price": Decimal("9.99")}]}, "payload['items'][2]['price'] is a Decimal"),
    ({"tags": {"a", "b"}}, "payload['tags'] is a set, which does not round-trip through JSON "
                           "unchanged (pass a sorted list)"),
    ({"frozen": frozenset()}, "payload['frozen'] is a frozenset"),
    ({"point": (1, 2)}, "payload['point'] is a tuple, which does not round-trip through JSON "
                        "unchanged (a tuple would come back as a list; pass a list)"),
    ({"m": {"ok": 1, 7: "x"}},
     "payload['m'] has a key 7 of type int; JSON object keys must be strings"),
    ({True: 1}, "payload has a key True of type bool"),
    ({"x": [1.0, float("nan")]}, "payload['x'][1] is nan; JSON has no NaN or Infinity"),
    ({"x": float("-inf")}, "payload['x'] is -inf; JSON has no NaN or Infinity"),
    ({"s": "a\x00b"}, "payload['s'] contains a NUL character"),
    ({"s": ["ok", "\ud800"]}, "payload['s'][1] contains a lone surrogate"),
    ({"bad\x00key": 1}, "payload has a key 'bad\\x00key' containing a NUL character"),
    ({"blob": b"bytes"}, "payload['blob'] is a bytes"),
    ({"id": uuid.UUID(int=1)}, "payload['id'] is a UUID"),
    ({"obj": Custom()}, "payload['obj'] is a Custom, which does not round-trip through JSON "
                        "unchanged (convert it to a string or number, or configure "
                        "PERSISTENT_JOBS['JSON_ENCODER'])"),
    ({"entry": LedgerEntry(pk=5, job_id=uuid.UUID(int=2))},
     "payload['entry'] is a LedgerEntry, which does not round-trip through JSON unchanged "
     "(pass its primary key instead of the model instance)"),
    ((1, 2), "payload is a tuple"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("payload", "message"), REFUSED,
                         ids=[m.split(" ")[0] + "-" + str(i) for i, (_, m) in enumerate(REFUSED)])
def test_payloads_that_would_not_round_trip_are_refused(payload: Any, message: str) -> None:
    with pytest.raises(PayloadError) as info:
        enqueue("test.noop", payload)
    assert message in str(info.value)
    assert info.value.code == "PAYLOAD_INVALID"
    assert PersistentJob.objects.count() == 0


# ------------------------------------------------------------------ limits

LIMIT = 128 * 1024


@pytest.mark.django_db
def test_serialized_size_limit_is_128_kib_in_utf8_bytes() -> None:
    overhead = len('{"blob":""}')
    enqueue("test.noop", {"blob": "x" * (LIMIT - overhead)})
    with pytest.raises(PayloadError) as info:
        enqueue("test.noop", {"blob": "x" * (LIMIT - overhead + 1)})
    assert info.value.code == "PAYLOAD_TOO_LARGE"
    assert (f"payload is {LIMIT + 1} bytes serialized; the limit is {LIMIT} bytes "
            "(PERSISTENT_JOBS['PAYLOAD_MAX_BYTES'])") in str(info.value)
    with pytest.raises(PayloadError, match="PAYLOAD_MAX_BYTES"):  # é is two bytes in UTF-8
        enqueue("test.noop", {"blob": "é" * ((LIMIT - overhead) // 2 + 1)})
    assert PersistentJob.objects.count() == 1


@pytest.mark.django_db
def test_depth_limit_is_ten_levels() -> None:
    enqueue("test.noop", nest(10, 1))  # a value ten keys deep
    enqueue("test.noop", nest(10, {}))
    enqueue("test.noop", nest(9, [1]))
    path = "payload" + "['k']" * 11
    with pytest.raises(PayloadError) as info:
        enqueue("test.noop", nest(11, 1))
    assert f"{path} is nested 11 levels deep; the limit is 10" in str(info.value)
    assert "PAYLOAD_MAX_DEPTH" in str(info.value)
    with pytest.raises(PayloadError, match=r"\['k'\]\[0\] is nested 11 levels deep"):
        enqueue("test.noop", nest(10, [1]))
    assert PersistentJob.objects.count() == 3


@pytest.mark.django_db
def test_key_limit_is_500_keys_in_total() -> None:
    enqueue("test.noop", {f"k{i}": {f"n{j}": j for j in range(4)} for i in range(100)})  # 500
    with pytest.raises(PayloadError, match=r"more than 500 keys \(PERSISTENT_JOBS\["):
        enqueue("test.noop", {f"k{i}": {f"n{j}": j for j in range(4)} for i in range(100)}
                | {"one_more": 1})
    assert PersistentJob.objects.count() == 1


@pytest.mark.django_db
def test_limits_come_from_settings() -> None:
    with pj_settings(PAYLOAD_MAX_BYTES=20, PAYLOAD_MAX_DEPTH=2, PAYLOAD_MAX_KEYS=3):
        enqueue("test.noop", {"a": {"b": 1}, "c": 2})
        with pytest.raises(PayloadError, match="the limit is 20 bytes"):
            enqueue("test.noop", {"text": "x" * 20})
        with pytest.raises(PayloadError, match="nested 3 levels deep; the limit is 2"):
            enqueue("test.noop", {"a": {"b": [1]}})
        with pytest.raises(PayloadError, match="more than 3 keys"):
            enqueue("test.noop", {"a": 1, "b": 2, "c": 3, "d": 4})
    enqueue("test.noop", {"text": "x" * 20})
    assert PersistentJob.objects.count() == 2


# ------------------------------------------------------------------ JSON_ENCODER

@pytest.mark.django_db
@pytest.mark.parametrize("encoder", ["django.core.serializers.json.DjangoJSONEncoder",
                                     DjangoJSONEncoder])
def test_json_encoder_setting_stores_and_hands_over_the_encoded_form(encoder: Any) -> None:
    key = uuid.UUID(int=3)
    payload = {"when": datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC), "day": date(2030, 1, 2),
               "price": Decimal("9.99"), "id": key, "point": (1, 2), "n": 1}
    expected = {"when": "2030-01-02T03:04:05Z", "day": "2030-01-02", "price": "9.99",
                "id": str(key), "point": [1, 2], "n": 1}
    with pj_settings(JSON_ENCODER=encoder):
        job = enqueue("test.noop", payload)
        assert job.payload == expected  # the returned job shows what the handler will get
        assert PersistentJob.objects.get(id=job.id).payload == expected
        with pytest.raises(PayloadError, match="cannot be encoded by DjangoJSONEncoder"):
            enqueue("test.noop", {"tags": {"a"}})
        with pytest.raises(PayloadError, match=r"payload\['x'\] is nan"):
            enqueue("test.noop", {"x": float("nan")})
        with pytest.raises(PayloadError, match="limit is 10"):  # limits still apply
            enqueue("test.noop", nest(11, 1))
    assert PersistentJob.objects.count() == 1


# ------------------------------------------------------------------ validators

@pytest.mark.django_db
def test_handler_validator_refuses_at_enqueue() -> None:
    with pytest.raises(PayloadError) as info:
        enqueue("core.payload.validated", {"n": "seven"})
    assert info.value.code == "PAYLOAD_INVALID"
    assert str(info.value) == ("payload rejected by the validator of 'core.payload.validated': "
                               "'n' must be an integer")
    with pytest.raises(PayloadError, match="item 1: payload rejected by the validator"):
        enqueue_many([("core.payload.validated", {"n": 1}), ("core.payload.validated", {})])
    with pytest.raises(PayloadError, match="amount must be positive, got -5"):
        enqueue("core.payload.invoice", {"amount": -5})
    assert PersistentJob.objects.count() == 0
    assert enqueue("core.payload.validated", {"n": 7}).payload == {"n": 7}
    assert enqueue("core.payload.invoice", {"amount": 5}).payload == {"amount": 5}


@pytest.mark.django_db(transaction=True)
def test_payload_failing_the_validator_at_run_time_is_dead_lettered(
    start_runner: Callable[..., Runner],
) -> None:
    CALLS.clear()
    # Written by another service (or before the validator changed): enqueue never saw it.
    bad = PersistentJob.objects.create(job_type="core.payload.validated", payload={"n": "x"},
                                       max_retries=5)
    good = enqueue("core.payload.validated", {"n": 1})
    runner = start_runner(burst=True, scheduler=False)
    assert runner.finished.wait(20)
    bad.refresh_from_db()
    assert bad.status == "dead_lettered" and bad.attempts == 1
    assert bad.last_error_code == "PAYLOAD_INVALID"
    assert "'n' must be an integer" in bad.last_error
    (attempt,) = JobAttempt.objects.filter(job_id=bad.id)
    assert (attempt.outcome, attempt.error_code) == ("dead_lettered", "PAYLOAD_INVALID")
    assert PersistentJob.objects.get(id=good.id).status == "completed"
    assert CALLS == [{"n": 1}]  # the handler never saw the invalid payload


def test_plain_float_encoding_keeps_floats_floats() -> None:
    from django_persistent_jobs.payload import prepare_payload

    _, text = prepare_payload({"a": 1e16, "b": [-2.5e30], "c": 1.0, "d": 3})
    assert json.loads(text) == {"a": 1e16, "b": [-2.5e30], "c": 1.0, "d": 3}
    assert '"a":10000000000000000.0' in text and "e+" not in text


def test_the_stored_text_is_compact_json_exactly() -> None:
    """The payload's text is encoded by a C encoder built once (building one per call was half
    the cost of a small payload): for any mix of values it must be exactly what
    ``json.dumps`` with the same options writes."""
    import json
    import random
    import string

    from django_persistent_jobs.payload import prepare_payload

    chooser = random.Random(20261128)
    letters = string.printable + 'éü\u2028"\\\t'

    def value(depth: int = 0) -> Any:
        roll = chooser.random()
        if depth > 3 or roll < 0.5:
            return chooser.choice([
                None, True, False, chooser.randint(-10**12, 10**12),
                chooser.uniform(-1e6, 1e6), chooser.random() * 1e-7,
                "".join(chooser.choice(letters) for _ in range(chooser.randint(0, 12)))])
        if roll < 0.75:
            return [value(depth + 1) for _ in range(chooser.randint(0, 4))]
        return {"".join(chooser.choice(string.ascii_letters + 'é"') for _ in range(
            chooser.randint(0, 5))): value(depth + 1) for _ in range(chooser.randint(0, 4))}

    for _ in range(3000):
        payload = {"v": value()}
        _, text = prepare_payload(payload)
        assert text == json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
