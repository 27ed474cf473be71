"""Canonical JSON and the digests the ledger compares (request digest, result digest, schema digest).

A receipt's ``result_digest`` is :func:`digest` of the receipt's ``result`` exactly as the downstream task
receives it (the value stored in the ledger, see :mod:`ledger.results`). A consumer checks it without
longcall's code::

    canonical = json.dumps(receipt["result"], sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False, allow_nan=False)
    assert receipt["result_digest"] == "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ledger.errors import NotJson


def canonical_json(value: Any) -> str:
    """One spelling per JSON value: sorted keys, no spaces, UTF-8 kept; NaN, infinities and strings that
    are not Unicode text (a lone surrogate) refused."""
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        raise NotJson(str(exc)) from exc
    return text


def digest(value: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``value``."""
    return "sha256:" + hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def request_digest(*, server: str, tool: str, arguments: Any) -> str:
    """What makes two submissions of one call node "the same request" (rule 1)."""
    return digest({"server": server, "tool": tool, "arguments": arguments})
