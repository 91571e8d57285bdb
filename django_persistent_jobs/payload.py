"""Payload checks done before anything is inserted.

A payload must come back from the database exactly as it went in. Python's ``json`` module would
quietly turn tuples into lists, int keys into strings and refuse datetimes only when encoding, so
we walk the value ourselves and name the offending key path in the error.
"""

from __future__ import annotations

import json
import math
from typing import Any

from . import conf
from .errors import PayloadError

_SCALARS = (str, int, float, bool, type(None))


def _path(parts: list[str]) -> str:
    return "payload" + "".join(parts)


def _walk(value: Any, parts: list[str], depth: int, limits: tuple[int, int], counter: list[int]) -> None:
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
                    f"{_path(parts)} has a {type(key).__name__} key {key!r}; JSON object keys "
                    "must be strings (it would come back as a different key)."
                )
            counter[0] += 1
            if counter[0] > max_keys:
                raise PayloadError(
                    f"payload has more than {max_keys} keys (PERSISTENT_JOBS['PAYLOAD_MAX_KEYS'])."
                )
            _walk(item, [*parts, f"[{key!r}]"], depth + 1, limits, counter)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _walk(item, [*parts, f"[{index}]"], depth + 1, limits, counter)
    elif isinstance(value, str):
        if "\x00" in value:
            raise PayloadError(f"{_path(parts)} contains a NUL character, which PostgreSQL "
                               "cannot store in jsonb.")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise PayloadError(f"{_path(parts)} is {value!r}; JSON has no NaN or Infinity.")
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


def prepare_payload(payload: Any) -> tuple[Any, str]:
    """Validate ``payload`` and return ``(value_to_store, json_text)``.

    With ``JSON_ENCODER`` configured, the payload is encoded with it first and the handler
    receives the decoded form (for example datetimes become ISO strings); that is documented.
    """
    max_bytes = int(conf.get("PAYLOAD_MAX_BYTES"))
    limits = (int(conf.get("PAYLOAD_MAX_DEPTH")), int(conf.get("PAYLOAD_MAX_KEYS")))
    encoder_setting = conf.get("JSON_ENCODER")
    if encoder_setting is not None:
        encoder = conf.resolve_encoder(encoder_setting)
        try:
            payload = json.loads(json.dumps(payload, cls=encoder))
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"payload cannot be encoded by {encoder.__name__}: {exc}") from exc
    _walk(payload, [], 0, limits, [0])
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    size = len(text.encode())
    if size > max_bytes:
        raise PayloadError(
            f"payload is {size} bytes serialized; the limit is {max_bytes} bytes "
            "(PERSISTENT_JOBS['PAYLOAD_MAX_BYTES']). Store large data elsewhere and pass a "
            "reference.", code="PAYLOAD_TOO_LARGE",
        )
    return payload, text
