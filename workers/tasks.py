"""Thin tasks: decode the arguments, call one function, map the typed outcome to a Celery action."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from ledger.errors import AdapterDisabled, AdmissionClosed, CallNodeConflict
from workers.delivery import publisher
from workers.runtime import RuntimeHolder
from workers.submission import InvalidSubmission, operation_summary, parse_submit_kwargs, record_submission

log = logging.getLogger("longcall")


class SubmissionRefused(Exception):
    """``longcall.submit`` refused the call; the message says why. Nothing was written."""


def register_tasks(app: Celery, holder: RuntimeHolder) -> None:
    @app.task(name="longcall.submit", acks_late=True)
    def submit(**kwargs: Any) -> dict[str, Any]:
        try:
            request = parse_submit_kwargs(kwargs)
            submission = record_submission(holder.get(), request)
        except (InvalidSubmission, CallNodeConflict, AdmissionClosed, AdapterDisabled) as exc:
            log.warning("longcall.submit refused: %s", exc)
            raise SubmissionRefused(str(exc)) from None
        return operation_summary(submission.operation, created=submission.created)

    @app.task(name="longcall.drain_outbox", acks_late=True)
    def drain_outbox(limit: int = 200) -> dict[str, int]:
        report = holder.get().ledger.drain_outbox(publisher(app), limit=limit)
        if report.failed:
            log.warning("outbox rows %s could not be published; they stay ready", list(report.failed))
        return {"dispatched": len(report.dispatched), "failed": len(report.failed)}
