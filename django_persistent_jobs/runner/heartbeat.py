"""Heartbeat loop: proves this runner is alive, relays cancel requests, rescues dead runners' jobs.

Rescue follows liveness, not elapsed time: a job is put back in play only when the runner that
holds it has stopped heartbeating for ``STALE_LOCK_TIMEOUT`` by the database clock (its row is
then deleted), so a live runner's long job is never taken away from it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..registry import registry
from . import store
from .db import run_with_retry
from .execute import Outcome, _backoff_for, log_transition

if TYPE_CHECKING:
    from .supervisor import Runner

logger = logging.getLogger("django_persistent_jobs.runner")

CANCEL_POLL_SECONDS = 0.5


def heartbeat_loop(runner: Runner) -> None:
    settings = runner.settings
    next_beat = 0.0
    while not runner.halt.is_set():
        now = time.monotonic()
        if now >= next_beat:
            beat(runner)
            rescue(runner)
            next_beat = now + settings.heartbeat_interval
        if runner.pool.busy:
            relay_cancel_requests(runner)
        runner.halt.wait(min(CANCEL_POLL_SECONDS, settings.heartbeat_interval))


def beat(runner: Runner) -> None:
    def do(cursor: Any) -> bool:
        alive = store.heartbeat(cursor, runner.runner_id)
        if not alive:
            runner.register(cursor)
        return alive

    alive = run_with_retry(runner.alias, do, what="heartbeat", interrupt=runner.halt)
    if alive is False:
        logger.warning(
            "runner %s was presumed dead by another runner (heartbeat too old); its jobs were "
            "rescued and it has registered again", runner.runner_id,
            extra={"event": "runner_reregistered", "runner_id": runner.runner_id},
        )


def relay_cancel_requests(runner: Runner) -> None:
    ids = run_with_retry(
        runner.alias, lambda c: store.cancel_requests(c, runner.runner_id),
        what="reading cancel requests", interrupt=runner.halt,
    )
    for job_id in ids or ():
        item = runner.pool.in_flight.get(job_id)
        if item is not None and not item.ctx.cancel_requested:
            item.ctx._cancel_event.set()
            logger.info("job %s: cancellation requested by an operator", job_id,
                        extra={"event": "cancel_requested", "job_id": str(job_id)})


def rescue(runner: Runner) -> int:
    """Delete runners that stopped heartbeating, then release every job no live runner holds."""
    stale = runner.settings.stale_lock_timeout
    dead = run_with_retry(
        runner.alias, lambda c: store.reap_dead_runners(c, stale),
        what="reaping dead runners", interrupt=runner.halt,
    ) or []
    for runner_id, last_beat in dead:
        logger.warning("runner %s presumed dead (last heartbeat %s)", runner_id, last_beat,
                       extra={"event": "runner_dead", "dead_runner_id": runner_id})
    orphans = run_with_retry(runner.alias, store.orphaned_jobs, what="finding orphaned jobs",
                             interrupt=runner.halt) or []
    rescued = 0
    for job_id, token, job_type, attempts, locked_by in orphans:
        spec = registry.get(job_type)
        outcome = Outcome(
            "retry", "RUNNER_LOST",
            f"runner {locked_by} stopped heartbeating while running attempt {attempts}; "
            "rescued by " + runner.runner_id,
            delay=_backoff_for(spec, attempts),
        )

        def apply(cursor: Any, job_id: Any = job_id, token: int = token,
                  outcome: Outcome = outcome) -> str | None:
            return store.transition(
                cursor, job_id, token, kind="retry", code=outcome.code,
                message=outcome.message, delay=outcome.delay, outcome="rescued",
            )

        status = run_with_retry(runner.alias, apply, what=f"rescuing job {job_id}",
                                interrupt=runner.halt)
        if status is None:
            continue
        rescued += 1
        logger.warning(
            "job %s rescued from runner %s -> %s", job_id, locked_by, status,
            extra={"event": "rescue", "job_id": str(job_id), "job_type": job_type,
                   "dead_runner_id": locked_by, "status": status, "attempt": attempts},
        )
    return rescued


__all__ = ["heartbeat_loop", "log_transition", "rescue"]
