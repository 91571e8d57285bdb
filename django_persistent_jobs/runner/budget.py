"""The database sessions a runner will open, checked against what the server allows before the
runner opens any of them.

Every handler thread (a *lane*) keeps its own connection, and the runner's duties keep a few
more. A runner asked for more than the server's ``max_connections`` can never work: its lanes
fail to connect and retry, while the sessions it did get leave none for anyone else (the web
processes, other runners, ``psql``), and with a large enough ``--concurrency`` the process runs
out of threads first. So that case stops the runner at start-up with a message that says what
to change; a runner that fits the server but not what is free right now only gets a warning
(other clients come and go, and lanes that cannot connect yet keep trying).

The count is a floor: the sessions opened at once by an idle runner, measured (threads: the
lanes plus 6 with the liveness sidecar; worker processes: each worker's lanes plus its batch
writer, and 5 for the supervisor), minus one. A session opened only now and then (progress
reports, an operator's cancel relay) is not counted, so a runner is never refused for one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import DatabaseError, connections

from ..errors import ConfigurationError

logger = logging.getLogger("django_persistent_jobs.runner")

#: Sessions of the runner's own duties, beyond the lanes (see the module's docstring).
THREAD_RUNNER_OWN = 5
SUPERVISOR_OWN = 4
PER_WORKER_OWN = 1

_SERVER_LIMITS = """
SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int,
       coalesce(current_setting('reserved_connections', true), '0')::int,
       coalesce((SELECT rolsuper FROM pg_roles WHERE rolname = current_user), false),
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int
"""


def sessions_needed(processes: int, concurrency: int) -> int:
    """The floor of the sessions a runner with these settings opens."""
    if processes:
        return SUPERVISOR_OWN + processes * (concurrency + PER_WORKER_OWN)
    return THREAD_RUNNER_OWN + concurrency


@dataclass(frozen=True)
class ServerRoom:
    """What the server allows this role: ``limit`` sessions in all, ``free`` of them now."""

    limit: int
    free: int
    max_connections: int
    reserved: int = 0  # of ``max_connections``, not for this role

    def verdict(self, needed: int, described: str) -> tuple[str, str] | None:
        """``("error", text)`` if ``needed`` sessions can never fit, ``("warning", text)`` if
        they do not fit now, None if they do."""
        change = ("Lower --concurrency or --processes (PERSISTENT_JOBS['CONCURRENCY'], "
                  "['PROCESSES']), or raise the server's max_connections.")
        if needed > self.limit:
            return ("error",
                    f"this runner would open at least {needed} database connections "
                    f"({described}), more than the {self.limit} the server allows this role "
                    f"(max_connections = {self.max_connections}"
                    f"{f', less {self.reserved} reserved' if self.reserved else ''}). "
                    + change)
        if needed > self.free:
            return ("warning",
                    f"this runner opens at least {needed} database connections ({described}); "
                    f"only {self.free} of the server's {self.limit} are free now. Handler "
                    "threads that cannot connect keep trying, and other clients may be refused "
                    "meanwhile. " + change)
        return None


def server_room(alias: str) -> ServerRoom:
    """Read the server's limits on this thread's connection (which the count includes: it is
    one of the runner's own)."""
    with connections[alias].cursor() as cursor:
        cursor.execute(_SERVER_LIMITS)
        row = cursor.fetchone()
    assert row is not None
    max_connections, superuser_reserved, reserved, superuser, in_use = row
    withheld = 0 if superuser else superuser_reserved + reserved
    limit = max_connections - withheld
    return ServerRoom(limit=limit, free=limit - max(0, in_use - 1),
                      max_connections=max_connections, reserved=withheld)


def check(alias: str, processes: int, concurrency: int, runner_id: str) -> None:
    """Refuse a runner the server can never hold (``ConfigurationError``); warn about one it
    cannot hold now."""
    needed = sessions_needed(processes, concurrency)
    described = (f"{processes} worker process(es) x {concurrency} threads, plus their own"
                 if processes else f"{concurrency} handler threads, plus the runner's own")
    try:
        room = server_room(alias)
    except DatabaseError as exc:
        # A server that will not say (a proxy in front of it, a restricted catalog): the
        # runner starts as it always did; this check only ever spares a confusing failure.
        logger.debug("runner %s: could not read the server's connection limits: %s",
                     runner_id, exc)
        return
    verdict = room.verdict(needed, described)
    if verdict is None:
        return
    kind, text = verdict
    if kind == "error":
        raise ConfigurationError(f"runner {runner_id}: {text}")
    logger.warning("runner %s: %s", runner_id, text,
                   extra={"event": "connections_short", "runner_id": runner_id})
