"""Job ids: UUIDv7, unique and in creation order, also across a fork."""

from __future__ import annotations

import os
import sys

import pytest

from django_persistent_jobs.ids import uuid7


def test_ids_are_unique_and_sorted_in_creation_order():
    ids = [uuid7() for _ in range(20_000)]  # several blocks of buffered random bits
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert {i.version for i in ids} == {7}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_reuse_the_parents_random_bits():
    uuid7()  # the parent now holds buffered random bits a child would copy
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.write(write_end, b"".join(uuid7().bytes for _ in range(100)))
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    data = b""
    while chunk := os.read(read_end, 4096):
        data += chunk
    os.close(read_end)
    child = {data[i + 8:i + 16] for i in range(0, len(data), 16)}
    parent = {uuid7().bytes[8:] for _ in range(100)}
    assert len(child) == 100
    assert not child & parent, sys.platform


def test_ids_made_without_uuids_checks_are_uuids_in_every_way() -> None:
    """Ids are built without ``UUID.__init__`` (its checks were most of an id's cost): each one
    must be what ``UUID(int=...)`` would have made, for every use a caller or Django puts it
    to (comparison, hashing, text, pickling, the database adapter's ``hex``)."""
    import copy
    import pickle
    import uuid

    from django_persistent_jobs import ids

    assert ids._make_uuid is ids._unchecked_uuid  # CPython: the fast maker is the one in use
    for made in ids.uuid7_many(300):
        checked = uuid.UUID(int=made.int)
        assert type(made) is uuid.UUID
        assert made == checked and hash(made) == hash(checked)
        assert (str(made), made.hex, made.bytes, made.version, made.variant) == (
            str(checked), checked.hex, checked.bytes, 7, uuid.RFC_4122)
        assert made.is_safe is checked.is_safe
        assert pickle.loads(pickle.dumps(made)) == checked == copy.deepcopy(made)
        assert {made: 1}[checked] == 1
