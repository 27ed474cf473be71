"""The AIP-151 demo server's requests read and checked at its boundary: a bad one is INVALID_ARGUMENT."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from demo_server.aip151_model import Outcome, invalid

MAX_PAGE_SIZE = 1000
MAX_SECONDS = 86_400.0
#: AIP-155's example: "Restricted to 36 ASCII characters. A random UUID is recommended."
MAX_REQUEST_ID = 36
OUTCOMES: tuple[Outcome, ...] = ("response", "error", "empty", "none")


@dataclass(frozen=True)
class RunRequest:
    """A RunReport body: ``body`` as sent (what a repeated requestId is compared with)."""

    seconds: float
    outcome: Outcome
    request_id: str | None
    body: dict[str, Any]


def json_object(body: bytes, *, required: bool) -> dict[str, Any]:
    """The body as a JSON object; an empty body is ``{}`` where none is ``required``."""
    if not body.strip() and not required:
        return {}
    try:
        value = json.loads(body)
    except ValueError:
        raise invalid("the body must be JSON") from None
    if not isinstance(value, dict):
        raise invalid("the body must be a JSON object")
    return value


def parse_run(raw: bytes) -> RunRequest:
    body = json_object(raw, required=True)
    unknown = set(body) - {"seconds", "outcome", "requestId"}
    if unknown:
        raise invalid(f"unknown fields: {sorted(unknown)}")
    seconds = body.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= MAX_SECONDS:
        raise invalid(f"seconds must be a number from 0 to {MAX_SECONDS:.0f}")
    outcome = body.get("outcome", "response")
    chosen = next((o for o in OUTCOMES if o == outcome), None)
    if chosen is None:
        raise invalid(f"outcome must be one of {', '.join(OUTCOMES)}")
    request_id = body.get("requestId")
    if request_id is not None and (
        not isinstance(request_id, str)
        or not 0 < len(request_id) <= MAX_REQUEST_ID
        or not request_id.isascii()
    ):
        raise invalid(f"requestId must be 1 to {MAX_REQUEST_ID} ASCII characters")
    return RunRequest(float(seconds), chosen, request_id, body)


def parse_page(query_string: bytes, default_size: int) -> tuple[int, int]:
    """ListOperations' ``pageToken`` and ``pageSize`` as (first index, page size); ``filter`` is refused."""
    query = {k: v[-1] for k, v in parse_qs(query_string.decode("latin-1")).items()}
    unknown = set(query) - {"pageSize", "pageToken", "filter"}
    if unknown:
        raise invalid(f"unknown query parameters: {sorted(unknown)}")
    if query.get("filter"):
        raise invalid("filter is not supported by this server")
    try:
        size = int(query.get("pageSize", "0"))
    except ValueError:
        raise invalid("pageSize must be an integer") from None
    if size < 0:
        raise invalid("pageSize must not be negative")
    return page_offset(query.get("pageToken", "")), min(size or default_size, MAX_PAGE_SIZE)


def page_token(offset: int) -> str:
    """An opaque ``nextPageToken``."""
    return base64.urlsafe_b64encode(f"offset:{offset}".encode()).decode()


def page_offset(token: str) -> int:
    if not token:
        return 0
    try:
        text = base64.urlsafe_b64decode(token.encode()).decode()
        prefix, _, number = text.partition(":")
        offset = int(number)
    except ValueError:
        raise invalid("pageToken is not one this server gave") from None
    if prefix != "offset" or offset < 0:
        raise invalid("pageToken is not one this server gave")
    return offset
