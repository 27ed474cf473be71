"""The beat entries, as plain data. ``workers.app`` installs them; intervals come from the settings."""

from __future__ import annotations

from typing import Any


def beat_schedule(
    *, dispatch_interval_s: float, outbox_interval_s: float, reconcile_interval_s: float
) -> dict[str, dict[str, Any]]:
    # Each entry expires after a few of its own intervals: a tick that waited that long in a busy queue is
    # superseded by the next one and must not pile up behind it.
    return {
        "longcall.dispatch_due": {
            "task": "longcall.dispatch_due",
            "schedule": dispatch_interval_s,
            "options": {"queue": "longcall.control", "expires": max(1.0, 4 * dispatch_interval_s)},
        },
        "longcall.drain_outbox": {
            "task": "longcall.drain_outbox",
            "schedule": outbox_interval_s,
            "options": {"queue": "longcall.outbox", "expires": max(5.0, 4 * outbox_interval_s)},
        },
        "longcall.reconcile": {
            "task": "longcall.reconcile",
            "schedule": reconcile_interval_s,
            "options": {"queue": "longcall.control", "expires": max(10.0, 2 * reconcile_interval_s)},
        },
    }
