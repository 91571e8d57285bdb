"""``Flag``, the lazily built event every job carries twice (taken over, cancel requested)."""

from __future__ import annotations

import threading
import time

from django_persistent_jobs._flag import Flag


def test_a_flag_set_before_anyone_waits_is_seen_at_once() -> None:
    flag = Flag()
    assert not flag.is_set()
    flag.set()
    assert flag.is_set()
    assert flag.wait(0) is True


def test_a_wait_times_out_on_a_flag_nobody_sets() -> None:
    flag = Flag()
    began = time.monotonic()
    assert flag.wait(0.05) is False
    assert time.monotonic() - began >= 0.05


def test_a_waiter_wakes_when_another_thread_sets_the_flag() -> None:
    flag = Flag()
    waiting = threading.Event()
    woke: list[bool] = []

    def waiter() -> None:
        waiting.set()
        woke.append(flag.wait(10))

    thread = threading.Thread(target=waiter)
    thread.start()
    waiting.wait(5)
    flag.set()
    thread.join(5)
    assert woke == [True]


def test_set_and_wait_racing_never_lose_the_wake_up() -> None:
    """Many flags set by one thread while another waits on each: every wait returns True."""
    flags = [Flag() for _ in range(2000)]
    results: list[bool] = []

    def waiter() -> None:
        results.extend(flag.wait(5) for flag in flags)

    thread = threading.Thread(target=waiter)
    thread.start()
    for flag in flags:
        flag.set()
    thread.join(30)
    assert results == [True] * len(flags)
