"""Recurring scheduler loop (cron and interval schedules)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .supervisor import Runner


def scheduler_loop(runner: Runner) -> None:
    runner.halt.wait()
