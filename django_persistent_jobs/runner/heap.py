"""The garbage collector in a process that exists to run jobs (``runjobs``, a worker process).

Python's cyclic collector walks every container object it tracks, and a full collection walks
all of them: in a Django process, the hundreds of thousands of objects that importing Django,
the project and its apps created, none of which will ever be garbage. In a drain of short jobs
the collections added up to a tenth of the runner's time, and a full one stopped every thread
for about 50 ms. ``settled`` moves what exists after start-up out of the collector's sight
(``gc.freeze``), and lets more allocations pass between young-generation collections: the
runner's own per-job objects are freed by reference counting (they form no cycles), so the
collector only has the handlers' cyclic garbage to find.

Only while a process runs nothing but the job system (``runjobs``, a worker process): a
runner embedded in another application leaves that application's collector alone, and when
``runjobs`` returns (say, ``call_command("runjobs", "--burst")`` in a test or a script) the
collector is given back as it was: unfrozen, with its thresholds.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

#: Allocations (net of frees) between young-generation collections; Python's default is 700.
YOUNG_THRESHOLD = 10_000


@contextmanager
def settled() -> Iterator[None]:
    """Freeze what exists and raise the young generation's threshold; undone on the way out.
    (A process that froze objects itself keeps its own arrangement: ``gc.unfreeze`` cannot
    tell its objects from ours.) No collection first: in a Django process one costs about
    30 ms of the runner's start, to find a few dozen unreachable objects, which stay frozen
    only until the collector is given back."""
    thresholds = gc.get_threshold()
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if ours:
            gc.unfreeze()
