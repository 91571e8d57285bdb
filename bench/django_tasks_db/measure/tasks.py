"""Two tasks: one that raises, one that sleeps."""

import time

from django.tasks import task


@task()
def fails() -> None:
    raise ValueError("boom")


@task()
def sleeps(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
