"""The lease's periods (``starts.Lease``): a waiting job takes the fast path only while the
lease has been held without a break since it was claimed.

The fault suite shows the whole story with real processes (``tests/faults/test_waiting_jobs.py``:
a runner frozen while its LISTEN session is terminated takes the lease again on thawing, and
must still refuse the jobs it claimed before, which were handed back meanwhile). These pin the
rule itself, including the moment that scenario only hits by chance: the first start after the
lease was taken again.
"""

from __future__ import annotations

import time

from django_persistent_jobs.runner.starts import FRESH_SECONDS, Lease


def test_a_job_claimed_while_the_lease_is_held_starts_fast_while_it_is_fresh() -> None:
    lease = Lease()
    assert lease.period() is None  # never held: jobs claimed now are gated
    lease.held(True)
    claimed_in = lease.period()
    assert claimed_in is not None and lease.fresh(claimed_in)
    lease.held(True)  # heard from again: the same period
    assert lease.period() == claimed_in and lease.fresh(claimed_in)
    assert not lease.fresh(None)


def test_a_lease_lost_and_taken_again_gates_the_jobs_claimed_before() -> None:
    lease = Lease()
    lease.held(True)
    before = lease.period()
    lease.lost()
    assert lease.period() is None and not lease.fresh(before)
    lease.held(True)  # the reconnected session took it again, and was heard from just now
    after = lease.period()
    assert after is not None and after != before
    assert lease.fresh(after)
    assert not lease.fresh(before)
    assert lease.fresh_until(before) == 0.0


def test_a_lease_another_session_holds_is_not_held() -> None:
    lease = Lease()
    lease.held(True)
    first = lease.period()
    lease.held(False)  # our previous session still holds it: not ours until it goes
    assert lease.period() is None and not lease.fresh(first)
    lease.held(True)
    assert lease.period() != first


def test_freshness_runs_from_when_the_session_was_heard_from_not_from_the_report() -> None:
    lease = Lease()
    long_ago = time.monotonic() - 10 * FRESH_SECONDS
    lease.held(True, long_ago)  # e.g. a wait that began before a freeze
    period = lease.period()
    assert period is not None and not lease.fresh(period)
    assert lease.fresh_until(period) == long_ago + FRESH_SECONDS
    lease.held(True, long_ago - 1)  # an older report does not move it back
    assert lease.fresh_until(period) == long_ago + FRESH_SECONDS
    lease.held(True)
    assert lease.fresh(period)


def test_no_fast_start_once_the_last_heartbeat_no_longer_keeps_the_row_safe() -> None:
    """A reaper hands back waiting jobs whatever the lease says: after a freeze longer than the
    stale-lock timeout the LISTEN session may still hold the lease, so the last beat bounds
    the fast path too, and a beat that found the row gone ends the period."""
    lease = Lease()
    lease.held(True)
    period = lease.period()
    lease.beaten(time.monotonic() - 1)  # the last beat's protection ran out a second ago
    assert not lease.fresh(period)
    lease.beaten(time.monotonic() + 30)
    assert lease.fresh(period)
    lease.beaten(time.monotonic() + 30, reregistered=True)  # it had been reaped
    assert not lease.fresh(period) and lease.period() is None
    lease.held(True)
    assert lease.fresh(lease.period()) and not lease.fresh(period)
