"""Small enumerations shared by the API, the models and the runner."""

from __future__ import annotations

from enum import StrEnum


class Dedup(StrEnum):
    """What ``enqueue`` does when an active job already holds the same ``(job_type, dedup_key)``.

    SKIP: insert nothing and return the active job (pending, awaiting retry, or running).
    ENQUEUE: no deduplication; the key is stored for search only.
    REPLACE: cancel the waiting duplicate and insert the new job. A running duplicate is never
    interrupted; the new job waits and starts only after the running one ends.
    """

    SKIP = "skip"
    ENQUEUE = "enqueue"
    REPLACE = "replace"
