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
