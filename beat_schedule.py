"""The beat entries, as plain data. ``workers.app`` installs them; intervals come from the settings."""

from __future__ import annotations

from typing import Any


def beat_schedule(
    *, dispatch_interval_s: float, outbox_interval_s: float, reconcile_interval_s: float
) -> dict[str, dict[str, Any]]:
    # Each entry expires after a few of its own intervals: a beat message that waited that long in a busy
    # queue is superseded by the next one and must not pile up.
    del dispatch_interval_s, reconcile_interval_s  # dispatch_due and reconcile arrive with the executor
    return {
        "longcall.drain_outbox": {
            "task": "longcall.drain_outbox",
            "schedule": outbox_interval_s,
            "options": {"queue": "longcall.outbox", "expires": max(5.0, 4 * outbox_interval_s)},
        },
    }
