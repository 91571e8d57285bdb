"""The garbage collector in a process that exists to run jobs (``runjobs``, a worker process).

Python's cyclic collector walks every container object it tracks, and a full collection walks
all of them: in a Django process, the hundreds of thousands of objects that importing Django,
the project and its apps created, none of which will ever be garbage. In a drain of short jobs
the collections added up to a tenth of the runner's time, and a full one stopped every thread
for about 50 ms. ``settle`` moves what exists after start-up out of the collector's sight
(``gc.freeze``), and lets more allocations pass between young-generation collections: the
runner's own per-job objects are freed by reference counting (they form no cycles), so the
collector only has the handlers' cyclic garbage to find.

Only for processes the job system owns: a runner embedded in another application leaves that
application's collector alone.
"""

from __future__ import annotations

import gc

#: Allocations (net of frees) between young-generation collections; Python's default is 700.
YOUNG_THRESHOLD = 10_000


def settle() -> None:
    """Collect once, then freeze what survived and raise the young generation's threshold."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
