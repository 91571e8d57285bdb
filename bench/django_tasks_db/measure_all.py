"""Measure the django-tasks-db behaviours that docs/django-tasks.md compares (see README.md)."""

import os
import signal
import subprocess
import sys
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
django.setup()

from django.db import transaction  # noqa: E402
from django.tasks import TaskResultStatus, task  # noqa: E402
from measure.tasks import fails, sleeps  # noqa: E402


def worker(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "manage.py", "db_worker", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def batch() -> None:
    subprocess.run([sys.executable, "manage.py", "db_worker", "--batch", "--interval", "0.1"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# 1. An exception: retried?
r = fails.enqueue()
batch()
r.refresh()
print("exception: status", r.status, "attempts", r.attempts, "errors", len(r.errors))

# 2. Options our backend adds.
for option in ("max_retries", "timeout", "cron"):
    try:
        task(**{option: 1})(sleeps.func)
        print(f"option {option}: accepted")
    except Exception as exc:
        print(f"option {option}: {type(exc).__name__}: {exc}")

# 3. Concurrency of one worker: four one-second tasks.
results = [sleeps.enqueue(1) for _ in range(4)]
start = time.monotonic()
batch()
print(f"4 x 1s tasks, one db_worker --batch: {time.monotonic() - start:.1f}s")

# 4. Rescue: SIGKILL the worker running a task, then run another worker for 45 s.
r = sleeps.enqueue(30)
first = worker("--interval", "0.1")
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    r.refresh()
    if r.status == TaskResultStatus.RUNNING:
        break
    time.sleep(0.1)
first.send_signal(signal.SIGKILL)
first.wait()
second = worker("--interval", "0.1")
time.sleep(45)
r.refresh()
second.terminate()
second.wait()
print("after SIGKILL and a new worker for 45 s: status", r.status, "attempts", r.attempts)

# 5. Transactional enqueue.
try:
    with transaction.atomic():
        gone = sleeps.enqueue(0)
        raise RuntimeError
except RuntimeError:
    pass
try:
    sleeps.get_result(gone.id)
    print("rolled-back enqueue: the task still exists")
except Exception as exc:
    print("rolled-back enqueue:", type(exc).__name__)
