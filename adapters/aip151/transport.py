"""The thin I/O half of the AIP-151 adapter: one REST request over the injected ``httpx2.Client``.

Each request is charged to the caller's budget immediately before it is sent; its answer is read whole,
bounded in size and in time; every httpx2 exception and every error answer is mapped here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx2

from adapters.aip151.wire import classify_error
from adapters.base import AdapterConfig, RequestBudget
from adapters.credentials import Credentials
from adapters.errors import OutcomeUnknown, ProtocolViolation, Rejected, Transient
from adapters.http_answers import Deadline, ReadBudgetExceeded, read_bounded, read_error_body
from adapters.streamable_http import RequestTimeouts, map_transport_error

__all__ = ["Answer", "RestClient", "decode_json", "query_value"]


@dataclass(frozen=True)
class Answer:
    """A 2xx answer, read whole."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class RestClient:
    """Sends REST requests to one server's base URL with its credentials and timeouts."""

    def __init__(self, http: httpx2.Client, config: AdapterConfig) -> None:
        self._http = http
        self._config = config
        token = config.token_provider if config.token_provider is not None else config.bearer_token
        url, self._credentials = Credentials.of(httpx2.URL(config.url.rstrip("/")), token)
        self._base = str(url)
        self._request_timeouts = RequestTimeouts(config.timeouts)

    def _headers(self) -> dict[str, str]:
        return {"Accept": "application/json", **self._credentials.headers()}

    def send(
        self,
        method: str,
        path: str,
        *,
        what: str,
        effect: bool,
        budget: RequestBudget,
        json_body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> Answer:
        """One request, charged to ``budget`` first; a 2xx answer read whole (bounded), anything else
        raised as the error it means."""
        headers = self._headers()
        budget.charge()
        deadline = Deadline(self._config.timeouts.read)
        started = time.monotonic()
        try:
            # A GET with neither body nor query (a status read) is one a LeanClient may send itself.
            with self._http.stream(
                method,
                self._base + path,
                json=json_body,
                params=params,
                headers=headers,
                extensions=self._request_timeouts.extension(),
            ) as answer:
                ok = 200 <= answer.status_code < 300
                if ok:
                    body = read_bounded(answer, self._config.limits.max_body_bytes, deadline, what=what)
                else:
                    body = read_error_body(answer)
            if ok:
                return Answer(answer.status_code, answer.headers, body)
        except ReadBudgetExceeded:
            taken = time.monotonic() - started
            message = f"{what}: the answer took over {deadline.seconds:.1f} s ({taken:.1f} s)"
            raise (OutcomeUnknown(message) if effect else Transient(message)) from None
        except httpx2.HTTPError as exc:
            raise map_transport_error(exc, idempotent=not effect, method=what) from exc
        _, error = classify_error(answer.status_code, answer.headers, body, effect=effect, what=what)
        raise self._credentials.refused(error, headers)


def decode_json(body: bytes, what: str) -> object:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolViolation(f"{what}: the answer is not JSON") from exc


def query_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise Rejected(f"a query parameter must be a string, number or boolean, got {value!r:.100}")
