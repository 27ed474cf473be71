"""Rule 10 at the boundary: check an input reply once, before anything is read or written.

Beside the submission check (``workers/submission.py``): what a caller sends through
``longcall.provide_input`` is checked here, and a refusal says exactly what was wrong. Whether the reply
answers the current round, in time and as its schema asks, is the step's to decide
(``workers/steps/input_rounds.py``), against the stored request.
"""

from __future__ import annotations

import logging
from typing import Any

from ledger.digests import canonical_json
from ledger.errors import NotJson
from workers.errors import RequestRefused

log = logging.getLogger("longcall")


def check_reply(op_id: object, input_round: object, response: object, *, max_body_bytes: int) -> None:
    """The boundary check of ``longcall.provide_input``, before anything is read or written: the response
    the protocol's reply body (a JSON object within the body limit), the round a whole number. A reply
    refused for its size (or for not being JSON) is said at WARNING, naming ``op_id`` as it was sent.

    Raises:
        RequestRefused: what was wrong.
    """
    if not isinstance(response, dict):
        raise RequestRefused("response must be the protocol's reply body, a JSON object")
    if isinstance(input_round, bool) or not isinstance(input_round, int):
        raise RequestRefused("input_round must be a whole number")
    too_big = reply_size_refusal(response, max_body_bytes=max_body_bytes)
    if too_big is not None:
        log.warning("longcall.provide_input refused for %s: %s", op_id, too_big)
        raise RequestRefused(too_big)


def reply_size_refusal(response: Any, *, max_body_bytes: int) -> str | None:
    """Why an input reply (``longcall.provide_input``'s ``response``) is refused before anything is
    written: not JSON, or larger than the body limit. None when it may go on."""
    try:
        size = len(canonical_json(response).encode("utf-8"))
    except NotJson as exc:
        return f"response is not JSON: {exc}"
    if size > max_body_bytes:
        return f"response is {size} bytes of JSON; the limit is {max_body_bytes} (LONGCALL_MAX_BODY_BYTES)"
    return None
