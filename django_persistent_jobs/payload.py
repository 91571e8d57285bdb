"""Payload checks done before anything is inserted.

A payload must come back from the database exactly as it went in. Python's ``json`` module would
quietly turn tuples into lists, int keys into strings and refuse datetimes only when encoding, so
we walk the value ourselves and name the offending key path in the error.
"""

from __future__ import annotations

import json
import json.encoder as json_encoder
import math
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from . import bounds, conf
from .errors import PayloadError

_SCALARS = (str, int, float, bool, type(None))


#: Floats at least this large print in exponent form (``1e+16``); PostgreSQL's jsonb stores them
#: as plain integers, so they would come back as ``int`` (and beyond 2**53, a different value).
_EXPONENT_FLOAT = 1e16


#: Where a value sits in the payload, built only for an error message: ``None`` for the payload
#: itself, else ``(parent, key)`` with a dict's key or a list's index. Building the path text
#: for every key walked cost more than the checks themselves.
_Where = tuple[Any, Any] | None


def _path(where: _Where) -> str:
    parts: list[str] = []
    while where is not None:
        where, key = where
        parts.append(f"[{key}]" if type(key) is int else f"[{bounds.show(key)}]")
    return "payload" + "".join(reversed(parts))


_text_problem = bounds.text_problem
#: The smallest magnitude with more than ``PAYLOAD_INT_MAX_DIGITS`` decimal digits (compared,
#: not counted: converting a huge int to text to count its digits is itself refused).
_INT_TOO_LARGE = 10**bounds.PAYLOAD_INT_MAX_DIGITS


def _walk(value: Any, where: _Where, depth: int, limits: tuple[int, int],
          counter: list[int]) -> None:
    max_depth, max_keys = limits
    if depth > max_depth:
        raise PayloadError(
            f"{_path(where)} is nested {depth} levels deep; the limit is {max_depth} "
            "(PERSISTENT_JOBS['PAYLOAD_MAX_DEPTH'])."
        )
    kind = type(value)
    if kind is dict or (kind is not list and isinstance(value, dict)):
        # Plain strings, ints, True/False and None are checked here rather than by a call of
        # their own (most payloads are flat): the same checks as below.
        nested = depth < max_depth
        for key, item in value.items():
            if type(key) is not str and not isinstance(key, str):
                raise PayloadError(
                    f"{_path(where)} has a key {bounds.show(key)} of type {type(key).__name__}; "
                    "JSON object keys must be strings (it would come back as a different key)."
                )
            problem = _text_problem(key)
            if problem:
                raise PayloadError(
                    f"{_path(where)} has a key {bounds.show(key)} containing {problem}.")
            counter[0] += 1
            if counter[0] > max_keys:
                raise PayloadError(
                    f"payload has more than {max_keys} keys (PERSISTENT_JOBS['PAYLOAD_MAX_KEYS'])."
                )
            item_kind = type(item)
            if nested and (item is None or item_kind is bool or (
                    item_kind is str and not _text_problem(item)) or (
                    item_kind is int and -_INT_TOO_LARGE < item < _INT_TOO_LARGE)):
                continue
            _walk(item, (where, key), depth + 1, limits, counter)
    elif kind is list or isinstance(value, list):
        for index, item in enumerate(value):
            _walk(item, (where, index), depth + 1, limits, counter)
    elif isinstance(value, str):
        problem = _text_problem(value)
        if problem:
            raise PayloadError(f"{_path(where)} contains {problem}.")
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -_INT_TOO_LARGE < value < _INT_TOO_LARGE:
            raise PayloadError(
                f"{_path(where)} is an integer of more than {bounds.PAYLOAD_INT_MAX_DIGITS} "
                "digits, which could not be read back; store it as a string."
            )
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise PayloadError(f"{_path(where)} is {value!r}; JSON has no NaN or Infinity.")
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
            f"{_path(where)} is a {type(value).__name__}, which does not round-trip through "
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


def _compact_encoder() -> Callable[[Any], str]:
    """``_COMPACT.encode``, but with the C encoder it builds on every call built once: that
    construction was half of encoding a small payload. No circular-reference markers: ``_walk``
    has checked the payload first, and a cycle ends there at ``PAYLOAD_MAX_DEPTH``."""
    make = getattr(json_encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - a Python without the C accelerator
        return _COMPACT.encode
    chunks = make(None, _COMPACT.default, json_encoder.encode_basestring, None, ":", ",",
                  False, False, False)

    def encode(value: Any) -> str:
        return "".join(chunks(value, 0))

    return encode


_encode_compact = _compact_encoder()


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
        _walk(payload, None, 0, (limits.max_depth, limits.max_keys), state)
        text = _dumps_plain_floats(payload) if state[1] else _encode_compact(payload)
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
