"""Which MCP generation a server speaks, probed as the 2026-07-28 core says (reference/mcp-tasks-extension.md
§1.1, §3.1) and cached per server with a TTL (in-process).

1. ``server/discover`` with ``MCP-Protocol-Version: 2026-07-28``: a 200 listing 2026-07-28 is the modern
   generation (tasks when ``capabilities.extensions`` holds the tasks extension); a 400 with -32022 whose
   ``data.supported`` lists 2026-07-28 is modern too.
2. Anything else (a 400/404/405 without a modern error: the legacy "Missing session ID"), the 2025-11-25
   ``initialize``: its ``protocolVersion`` answers, tasks when it declares ``tasks.requests.tools.call``
   (the session it opened is ended with a DELETE).
3. Neither: ``unknown``, with what each probe answered.

The configured ``protocol_version`` stays the version an operation is made with (DESIGN §7); this probe
tells, and refuses clearly, when the server does not speak it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx2

from adapters.base import UNMETERED, Limits, RequestBudget, Timeouts
from adapters.errors import AdapterError, Rejected
from adapters.http_answers import Deadline, read_answer
from adapters.jsonrpc import Response
from adapters.mcp_2026_07_28.transport import ExtHttp
from adapters.mcp_2026_07_28.wire import EXTENSION, PROTOCOL_VERSION, UNSUPPORTED_VERSION
from adapters.metering import budget_edge

__all__ = ["DEFAULT_TTL_S", "Generation", "GenerationCache", "detect"]

LEGACY_VERSION = "2025-11-25"
#: How long a detected generation is reused (the era is a property of the server, reference §1.1).
DEFAULT_TTL_S = 300.0

GenerationName = Literal["2026-07-28", "2025-11-25", "unknown"]


@dataclass(frozen=True)
class Generation:
    """What a server speaks: ``generation``, whether it offers tasks in it, and how that was learned."""

    server: str
    generation: GenerationName
    tasks: bool
    detail: str
    checked_at: float

    def speaks(self, version: str) -> bool:
        return self.generation == version

    def to_json(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "generation": self.generation,
            "tasks": self.tasks,
            "detail": self.detail,
        }


def _modern(http: ExtHttp, budget: RequestBudget) -> tuple[bool, bool, str]:
    """(modern, tasks, detail) from ``server/discover``."""
    try:
        result = http.call("server/discover", {}, name=None, idempotent=True, budget=budget)
    except Rejected as exc:
        supported = exc.data.get("supported") if isinstance(exc.data, Mapping) else None
        if exc.code == UNSUPPORTED_VERSION and isinstance(supported, list) and PROTOCOL_VERSION in supported:
            return True, False, f"server/discover: -32022, supported {supported}"
        return False, False, f"server/discover refused: {exc}"
    except AdapterError as exc:
        return False, False, f"server/discover failed: {type(exc).__name__}: {exc}"
    versions = result.get("supportedVersions")
    if not isinstance(versions, list) or PROTOCOL_VERSION not in versions:
        return False, False, f"server/discover lists {versions!r}, not {PROTOCOL_VERSION}"
    capabilities = result.get("capabilities")
    extensions = capabilities.get("extensions") if isinstance(capabilities, Mapping) else None
    tasks = isinstance(extensions, Mapping) and EXTENSION in extensions
    return (
        True,
        tasks,
        f"server/discover lists {versions}; {EXTENSION} {'offered' if tasks else 'not offered'}",
    )


def _legacy(
    client: httpx2.Client, url: str, headers: Mapping[str, str], timeouts: Timeouts, budget: RequestBudget
) -> tuple[bool, bool, str]:
    """(legacy, tasks, detail) from a 2025-11-25 ``initialize``."""
    body = {
        "jsonrpc": "2.0",
        "id": "lc-discover",
        "method": "initialize",
        "params": {
            "protocolVersion": LEGACY_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "longcall-discovery", "version": "1"},
        },
    }
    plain = {k: v for k, v in headers.items() if k not in ("MCP-Protocol-Version", "Mcp-Method", "Mcp-Name")}
    budget.charge()
    session: str | None = None
    try:
        with client.stream("POST", url, json=body, headers=plain, timeout=timeouts.read) as answer:
            session = answer.headers.get("mcp-session-id")
            if answer.status_code != 200:
                return False, False, f"initialize answered HTTP {answer.status_code}"
            exchange = read_answer(
                answer,
                request_id="lc-discover",
                method="initialize",
                session=None,
                idempotent=True,
                deadline=Deadline(timeouts.read),
                max_body_bytes=Limits().max_body_bytes,
                until=None,
                patient=False,
                on_request=None,
            )
    except (AdapterError, httpx2.HTTPError) as exc:
        return False, False, f"initialize failed: {type(exc).__name__}: {exc}"
    finally:
        if session is not None:
            with contextlib.suppress(httpx2.HTTPError):
                budget.charge()
                client.delete(url, headers={**plain, "Mcp-Session-Id": session}, timeout=timeouts.read)
    response = exchange.response
    if not isinstance(response, Response):
        return False, False, "initialize answered no result"
    version = response.result.get("protocolVersion")
    if version != LEGACY_VERSION:
        return False, False, f"initialize negotiated {version!r}, not {LEGACY_VERSION}"
    capabilities = response.result.get("capabilities")
    tasks_cap = capabilities.get("tasks") if isinstance(capabilities, Mapping) else None
    requests = tasks_cap.get("requests") if isinstance(tasks_cap, Mapping) else None
    tools = requests.get("tools") if isinstance(requests, Mapping) else None
    tasks = isinstance(tools, Mapping) and "call" in tools
    declared = "declared" if tasks else "not declared"
    return True, tasks, f"initialize negotiated {LEGACY_VERSION}; task-augmented tools/call {declared}"


@budget_edge
def detect(
    client: httpx2.Client,
    url: str,
    *,
    server: str,
    bearer_token: str | Callable[[], str | None] | None = None,
    timeouts: Timeouts | None = None,
    budget: RequestBudget = UNMETERED,
) -> Generation:
    """Probe ``url``: ``server/discover`` first, then the 2025-11-25 ``initialize``. Never raises for what
    the server answers (``unknown`` says what it was); a budget refusal propagates unchanged."""
    timeouts = timeouts or Timeouts()
    metered = budget
    wire = ExtHttp(client, url, server=server, bearer_token=bearer_token, timeouts=timeouts, limits=Limits())
    modern, tasks, said = _modern(wire, metered)
    if modern:
        return Generation(server, "2026-07-28", tasks, said, time.monotonic())
    headers = wire.headers("initialize", None)
    legacy, tasks, said_legacy = _legacy(
        client, str(httpx2.URL(url).copy_with(username=None, password=None)), headers, timeouts, metered
    )
    if legacy:
        return Generation(server, "2025-11-25", tasks, f"{said}; {said_legacy}", time.monotonic())
    return Generation(server, "unknown", False, f"{said}; {said_legacy}", time.monotonic())


class GenerationCache:
    """Detected generations per server, reused for ``ttl_s`` seconds (in-process, thread-safe); an
    ``unknown`` one (the server could not be asked) is not kept."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._known: dict[tuple[str, str], Generation] = {}
        self._lock = threading.Lock()

    def get(self, server: str, url: str, probe: Callable[[], Generation]) -> Generation:
        key = (server, url)
        with self._lock:
            known = self._known.get(key)
        if known is not None and time.monotonic() - known.checked_at < self._ttl_s:
            return known
        found = probe()
        if found.generation != "unknown":  # a server that could not be asked is asked again next time
            with self._lock:
                self._known[key] = found
        return found

    def forget(self, server: str, url: str) -> None:
        with self._lock:
            self._known.pop((server, url), None)
