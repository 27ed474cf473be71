"""The extension's HTTP requests: one POST per JSON-RPC request, no session, the version header always
sent with ``Mcp-Method`` and (where the core or the extension asks for it) ``Mcp-Name``.

The answer is read by :func:`adapters.http_answers.read_answer` (JSON or SSE, bounded in size and time)
and mapped at this edge; a JSON-RPC error in a 4xx body (the extension's -32602, -32021, -32601) is read
from the body and mapped by method (:func:`adapters.mcp_2026_07_28.wire.error_for`), as one in a 200.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import httpx2

from adapters.base import Limits, RequestBudget, Timeouts, redact_url
from adapters.credentials import BearerToken, Credentials
from adapters.errors import AdapterError, OutcomeUnknown, ProtocolViolation, Transient
from adapters.http_answers import (
    Deadline,
    ReadBudgetExceeded,
    Resume,
    read_answer,
    read_error_body,
)
from adapters.jsonrpc import ErrorResponse, Response, classify_http_status
from adapters.mcp_2026_07_28.wire import PROTOCOL_VERSION, error_for, header_value, request_meta
from adapters.streamable_http import ACCEPT, RequestTimeouts, encode_message, map_transport_error

__all__ = ["ExtHttp"]


def _rpc_error_in(body: bytes) -> tuple[int, str, object] | None:
    """The JSON-RPC error a 4xx body carries, if it carries one."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    error = value.get("error") if isinstance(value, dict) else None
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        return None
    return code, str(error.get("message", "")), error.get("data")


class ExtHttp:
    """Posts the extension's requests to one endpoint; knows nothing of task states."""

    def __init__(
        self,
        http: httpx2.Client,
        url: str,
        *,
        server: str,
        bearer_token: BearerToken,
        timeouts: Timeouts,
        limits: Limits,
    ) -> None:
        self._http = http
        self._server = server
        self._url = redact_url(url)
        self._endpoint, self._credentials = Credentials.of(httpx2.URL(url), bearer_token)
        self._timeouts = timeouts
        self._limits = limits
        # Built once, read, never changed: what every request sends whatever it asks.
        self._constant_headers = {
            "Accept": ACCEPT,
            "Content-Type": "application/json",
            "MCP-Protocol-Version": PROTOCOL_VERSION,
        }
        self._request_timeouts = RequestTimeouts(timeouts)

    @property
    def url(self) -> str:
        return self._url

    def headers(self, method: str, name: str | None) -> dict[str, str]:
        """The headers of one POST: both answer types, the version, ``Mcp-Method``, ``Mcp-Name``, the
        credentials as they are now.

        Raises:
            Transient: the token provider failed; nothing was sent.
        """
        headers = {**self._constant_headers, "Mcp-Method": method}
        if name is not None:
            headers["Mcp-Name"] = header_value(name)
        return headers | self._credentials.headers()

    def call(
        self,
        method: str,
        params: Mapping[str, Any],
        *,
        name: str | None,
        idempotent: bool,
        budget: RequestBudget,
        opt_in: bool = True,
        read_timeout: float | None = None,
    ) -> Mapping[str, Any]:
        """POST ``method`` with ``params`` (``_meta`` added) and return its ``result``.

        Raises:
            CapabilityRefused (-32021), NotFound (-32602 on tasks/*), Rejected: the server's JSON-RPC
                error or a 4xx; TooManyRequests (429), RateLimited (503 to a read); OutcomeUnknown: a
                request with an effect whose answer is lost or unreadable; Transient, ProtocolViolation.
            Whatever ``budget.charge()`` raises.
        """
        body = {
            "jsonrpc": "2.0",
            "id": f"lc-{uuid.uuid4().hex}",
            "method": method,
            "params": {**params, "_meta": request_meta(opt_in=opt_in)},
        }
        headers = self.headers(method, name)
        read_s = read_timeout if read_timeout is not None else self._timeouts.read
        deadline = Deadline(read_s)
        timeout = self._request_timeouts.extension(read_s)
        budget.charge()
        try:
            with self._http.stream(
                "POST", self._endpoint, content=encode_message(body), headers=headers, extensions=timeout
            ) as answer:
                if 400 <= answer.status_code < 500 and answer.status_code != 429:
                    raw = read_error_body(answer)
                    error = _rpc_error_in(raw)
                    # A 401 or 403 is the credentials' refusal whatever its body (a gateway's JSON-RPC error
                    # included): renewed once, or waited out, never the server's answer to the request.
                    if error is not None and answer.status_code not in (401, 403):
                        raise error_for(method, *error, server=self._server)
                    refusal = classify_http_status(
                        answer.status_code, headers=answer.headers, body=raw, idempotent=idempotent
                    )
                    raise self._credentials.refused(refusal, headers)
                exchange = read_answer(
                    answer,
                    request_id=str(body["id"]),
                    method=method,
                    session=None,
                    idempotent=idempotent,
                    deadline=deadline,
                    max_body_bytes=self._limits.max_body_bytes,
                    until=None,
                    patient=False,
                    on_request=None,
                )
        except AdapterError:
            raise
        except Resume as exc:
            # 2026-07-28 has no stream resumption: a stream that ends before its response lost the answer.
            text = f"{method}: event stream closed without a response"
            raise (Transient(text) if idempotent else OutcomeUnknown(text)) from exc
        except ReadBudgetExceeded as exc:
            text = f"{method}: no answer within {read_s:g}s"
            raise (
                Transient(text) if idempotent else OutcomeUnknown(f"may have reached the server, {text}")
            ) from exc
        except httpx2.HTTPError as exc:
            raise map_transport_error(exc, idempotent=idempotent, method=method) from exc
        except UnicodeDecodeError as exc:
            raise ProtocolViolation(f"{method}: answer is not UTF-8") from exc
        response = exchange.response
        if isinstance(response, ErrorResponse):
            raise error_for(method, response.code, response.message, response.data, server=self._server)
        if not isinstance(response, Response):
            raise ProtocolViolation(f"server {self._server!r}: {method} answered nothing")
        return response.result
