"""Lenient readers for the optional fields of a task status, shared by the MCP adapters of both
generations: a value of the wrong type or out of range is read as absent, never as an error."""

from __future__ import annotations

import math
from datetime import datetime


def parse_time(value: object) -> datetime | None:
    """An ISO 8601 timestamp, or None when absent or unreadable."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def non_negative_int(value: object) -> int | None:
    """A finite, non-negative number as an int (milliseconds, counts), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(value)
