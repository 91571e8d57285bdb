"""Worker processes: the supervisor hands claimed jobs to them and runs no job code itself.

``protocol`` names the messages exchanged over each worker's pipe, ``main`` is what runs inside
a worker process, ``manager`` (``ProcessExecutor``) is the supervisor's side: it starts, feeds,
watches, recycles and replaces the workers. Nothing here is imported at package import time, so
a freshly spawned worker can import ``main`` before Django is set up.
"""
