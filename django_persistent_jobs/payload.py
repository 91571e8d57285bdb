"""Payload checks done before anything is inserted.

A payload must come back from the database exactly as it went in. Python's ``json`` module would
quietly turn tuples into lists, int keys into strings and refuse datetimes only when encoding, so
we walk the value ourselves and name the offending key path in the error.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

from . import bounds, conf
from .errors import PayloadError

_SCALARS = (str, int, float, bool, type(None))


#: Floats at least this large print in exponent form (``1e+16``); PostgreSQL's jsonb stores them
#: as plain integers, so they would come back as ``int`` (and beyond 2**53, a different value).
_EXPONENT_FLOAT = 1e16


def _path(parts: list[str]) -> str:
    return "payload" + "".join(parts)


_text_problem = bounds.text_problem
#: The smallest magnitude with more than ``PAYLOAD_INT_MAX_DIGITS`` decimal digits (compared,
#: not counted: converting a huge int to text to count its digits is itself refused).
_INT_TOO_LARGE = 10**bounds.PAYLOAD_INT_MAX_DIGITS


def _walk(
    value: Any, parts: list[str], depth: int, limits: tuple[int, int], counter: list[int]
) -> None:
    max_depth, max_keys = limits
    if depth > max_depth:
        raise PayloadError(
            f"{_path(parts)} is nested {depth} levels deep; the limit is {max_depth} "
            "(PERSISTENT_JOBS['PAYLOAD_MAX_DEPTH'])."
        )
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise PayloadError(
                    f"{_path(parts)} has a {type(key).__name__} key {bounds.show(key)}; JSON "
                    "object keys "
                    "must be strings (it would come back as a different key)."
                )
            problem = _text_problem(key)
            if problem:
                raise PayloadError(
                    f"{_path(parts)} has a key {bounds.show(key)} containing {problem}.")
            counter[0] += 1
            if counter[0] > max_keys:
                raise PayloadError(
                    f"payload has more than {max_keys} keys (PERSISTENT_JOBS['PAYLOAD_MAX_KEYS'])."
                )
            _walk(item, [*parts, f"[{bounds.show(key)}]"], depth + 1, limits, counter)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _walk(item, [*parts, f"[{index}]"], depth + 1, limits, counter)
    elif isinstance(value, str):
        problem = _text_problem(value)
        if problem:
            raise PayloadError(f"{_path(parts)} contains {problem}.")
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -_INT_TOO_LARGE < value < _INT_TOO_LARGE:
            raise PayloadError(
                f"{_path(parts)} is an integer of more than {bounds.PAYLOAD_INT_MAX_DIGITS} "
                "digits, which could not be read back; store it as a string."
            )
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise PayloadError(f"{_path(parts)} is {value!r}; JSON has no NaN or Infinity.")
        if abs(value) >= _EXPONENT_FLOAT:
            counter[1] = 1  # needs the plain-notation encoder
    elif not isinstance(value, _SCALARS):
        hint = ""
        if isinstance(value, tuple):
            hint = " (a tuple would come back as a list; pass a list)"
        elif isinstance(value, set | frozenset):
            hint = " (pass a sorted list)"
        elif hasattr(value, "_meta") and hasattr(value, "pk"):
            hint = " (pass its primary key instead of the model instance)"
        else:
            hint = (" (convert it to a string or number, or configure "
                    "PERSISTENT_JOBS['JSON_ENCODER'])")
        raise PayloadError(
            f"{_path(parts)} is a {type(value).__name__}, which does not round-trip through "
            f"JSON unchanged{hint}."
        )


def _plain_float(value: float) -> str:
    """A float in plain notation with a decimal point, so jsonb hands a float back."""
    text = float.__repr__(value)
    if "e" in text or "E" in text:
        text = format(Decimal(text), "f")
        if "." not in text:
            text += ".0"
    return text


def _dumps_plain_floats(value: Any) -> str:
    """Compact JSON like ``json.dumps``, but floats never use exponent notation."""
    if isinstance(value, dict):
        return "{" + ",".join(
            json.dumps(k, ensure_ascii=False) + ":" + _dumps_plain_floats(v)
            for k, v in value.items()
        ) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dumps_plain_floats(v) for v in value) + "]"
    if isinstance(value, float):
        return _plain_float(value)
    return json.dumps(value, ensure_ascii=False)


#: ``json.dumps(..., separators=(",", ":"), ensure_ascii=False, allow_nan=False)``, built once:
#: ``json.dumps`` with any non-default argument builds a new encoder on every call.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class PayloadLimits:
    """The payload settings, read once per call of ``enqueue``/``enqueue_many``."""

    __slots__ = ("encoder", "max_bytes", "max_depth", "max_keys")

    def __init__(self) -> None:
        self.max_bytes = conf.settings.PAYLOAD_MAX_BYTES
        self.max_depth = conf.settings.PAYLOAD_MAX_DEPTH
        self.max_keys = conf.settings.PAYLOAD_MAX_KEYS
        self.encoder = conf.settings.JSON_ENCODER


def prepare_payload(payload: Any, limits: PayloadLimits | None = None) -> tuple[Any, str]:
    """Validate ``payload`` and return ``(value_to_store, json_text)``.

    With ``JSON_ENCODER`` configured, the payload is encoded with it first and the handler
    receives the decoded form (for example datetimes become ISO strings); that is documented.
    """
    limits = limits or PayloadLimits()
    max_bytes = limits.max_bytes
    encoder = limits.encoder
    if encoder is not None:
        try:
            payload = json.loads(json.dumps(payload, cls=encoder))
        except (TypeError, ValueError, RecursionError) as exc:
            raise PayloadError(f"payload cannot be encoded by {encoder.__name__}: {exc}") from exc
    state = [0, 0]  # keys seen, floats needing plain notation
    try:
        _walk(payload, [], 0, (limits.max_depth, limits.max_keys), state)
        text = _dumps_plain_floats(payload) if state[1] else _COMPACT.encode(payload)
    except RecursionError:
        # Only reachable with a PAYLOAD_MAX_DEPTH beyond Python's recursion limit.
        raise PayloadError(
            "payload is nested too deeply to serialize; lower PERSISTENT_JOBS"
            "['PAYLOAD_MAX_DEPTH'] or flatten it."
        ) from None
    size = len(text.encode())
    if size > max_bytes:
        raise PayloadError(
            f"payload is {size} bytes serialized; the limit is {max_bytes} bytes "
            "(PERSISTENT_JOBS['PAYLOAD_MAX_BYTES']). Store large data elsewhere and pass a "
            "reference.", code="PAYLOAD_TOO_LARGE",
        )
    return payload, text
