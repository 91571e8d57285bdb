"""What the runner's loops are given instead of the runner: its lifecycle events and narrow views.

The supervisor (``supervisor.Runner``) is the composition root: it builds these objects and hands
each loop only the ones it uses. No loop imports the supervisor, so a loop can be read, tested
and reasoned about on its own, and the dependency arrows point one way: supervisor -> loops ->
(lifecycle, store, executor interface).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..conf import RunnerSettings


def _event() -> threading.Event:
    return threading.Event()


@dataclass(eq=False)
class Lifecycle:
    """The events that tell the loops what phase the runner is in.

    A shutdown goes ``stopping`` (no new claims, no new schedule runs) -> the grace period ->
    ``halt`` (every loop ends). ``forced`` cuts the grace period short. ``wake`` asks the claim
    loop to look for due jobs now; ``listening`` is set while the LISTEN connection is up.
    """

    stopping: threading.Event = field(default_factory=_event)
    halt: threading.Event = field(default_factory=_event)
    forced: threading.Event = field(default_factory=_event)
    wake: threading.Event = field(default_factory=_event)
    listening: threading.Event = field(default_factory=_event)


class Beating(Protocol):
    """What deciding whether a heartbeat is fresh needs: the last good beat and the settings
    that say how old is too old (``heartbeat.Liveness`` has them, and so does the runner)."""

    @property
    def last_beat(self) -> float | None: ...

    @property
    def settings(self) -> RunnerSettings: ...
