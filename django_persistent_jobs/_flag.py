"""``Flag``: a ``threading.Event`` that costs nothing until somebody waits on it.

Every job carries two of these (the supervisor taking it over, an operator cancelling it), and
nearly every job ends with neither set nor waited on. A ``threading.Event`` builds a
``Condition`` and a lock when it is created; at thousands of jobs a second that is a measurable
share of a no-op job's cost. A ``Flag`` is a boolean until ``wait`` is called.
"""

from __future__ import annotations

import threading

# Creating the event of a flag happens once per waited-on flag: one lock for all of them is
# enough, and keeps a ``Flag`` to two slots.
_CREATE = threading.Lock()


class Flag:
    """The part of ``threading.Event``'s interface jobs use: ``set``, ``is_set``, ``wait``.

    ``set`` then ``wait`` and ``wait`` then ``set`` both wake: ``wait`` creates the event and
    looks at the boolean under a lock; ``set`` sets the boolean, then looks for an event under
    the same lock, so one of the two always sees the other.
    """

    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        # Read under the lock ``wait`` creates the event with, so the two cannot miss each
        # other without relying on the GIL's ordering (``set`` is rare: a take-over, a cancel).
        with _CREATE:
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        event = self._event
        if event is None:
            with _CREATE:
                event = self._event
                if event is None:
                    event = self._event = threading.Event()
                if self._set:  # set before the event existed
                    event.set()
        return event.wait(timeout)
