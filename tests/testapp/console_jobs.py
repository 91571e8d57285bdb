"""Handlers for the operator-console tests: the failures and hangs an operator must diagnose.

Each fails in its own way so the dashboard shows three failure groups, and two run long enough
for a runner to be killed under them.
"""

from __future__ import annotations

import time
from typing import Any

from django_persistent_jobs import JobContext, PermanentJobError, TransientJobError, job_handler
from django_persistent_jobs.backoff import constant


@job_handler("billing.charge_card", queue="billing", max_retries=2, timeout=30)
def charge_card(payload: dict[str, Any]) -> None:
    raise PermanentJobError(f"card declined by issuer for invoice {payload.get('invoice')}",
                            code="CARD_DECLINED")


@job_handler("emails.send_receipt", queue="emails", max_retries=1, backoff=constant(0),
             timeout=30)
def send_receipt(payload: dict[str, Any]) -> None:
    raise TransientJobError("SMTP server smtp.example.com refused the connection",
                            code="SMTP_UNAVAILABLE")


@job_handler("reports.render_pdf", queue="reports", max_retries=0, timeout=30)
def render_pdf(payload: dict[str, Any]) -> None:
    pages = payload.get("pages")
    raise ValueError(f"template 'monthly.html' needs pages, got {pages!r}")


@job_handler("media.transcode", queue="media", max_retries=3, timeout=4)
def transcode(payload: dict[str, Any], ctx: JobContext) -> None:
    """Reports progress, then hangs: the runner will be killed under it."""
    ctx.report_progress({"done": 3, "of": 10, "message": "encoding 1080p"})
    time.sleep(float(payload.get("sleep", 300)))


@job_handler("search.reindex", queue="search", max_retries=3, timeout=600)
def reindex(payload: dict[str, Any], ctx: JobContext) -> None:
    ctx.report_progress(0.6)
    time.sleep(float(payload.get("sleep", 300)))


@job_handler("exports.nightly", queue="exports", timeout=60)
def nightly_export(payload: dict[str, Any]) -> None:
    return None
