"""What the worker asks of one protocol version besides its adapter's verbs: its :class:`AdapterSpec`.

Each version package exposes its ``SPEC`` and :func:`adapters.registry.default_registry` registers them,
so a worker never tests a protocol name or reaches into a version's modules: whether a server's tools
suit the protocol (at start), whether a submission's arguments can make its create call (at submit),
whether its tasks are bound to a session, whether its input rounds are answered key by key, how its
HTTP client is made. Adding or retiring a version is a spec added to or dropped from the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx2

from adapters.answer_within import answer_within_transport
from adapters.base import AdapterConfig, InputRequest, Timeouts, ToolAdapter
from adapters.lean_client import LeanClient

__all__ = [
    "DEFAULT_CONNECTIONS",
    "MAX_CONNECTIONS",
    "AdapterFactory",
    "AdapterSpec",
    "ArgumentCheck",
    "ClientMaker",
    "ConfigCheck",
    "KeyedRounds",
    "RequestHook",
    "ToolSettings",
    "accept_any_arguments",
    "accept_any_tools",
    "http_client",
]

AdapterFactory = Callable[[AdapterConfig, httpx2.Client], ToolAdapter]
#: Called with each request before it is sent (an httpx2 ``request`` event hook).
RequestHook = Callable[[httpx2.Request], object]


class ToolSettings(Protocol):
    """What a server's configuration says of one of its tools (the worker's ``ToolConfig`` is one)."""

    @property
    def create(self) -> str | None: ...

    @property
    def request_id_field(self) -> str | None: ...

    @property
    def sync_upper_bound_s(self) -> float | None: ...


#: ``check_config(protocol_version, tools)``: raises ValueError saying what the configuration got wrong.
ConfigCheck = Callable[[str, Mapping[str, ToolSettings]], None]
#: ``check_arguments(tool, arguments)``: why the arguments cannot start the tool (``tool`` is its
#: configuration, None when it has none), or None. Pure: nothing is sent.
ArgumentCheck = Callable[[ToolSettings | None, Mapping[str, Any]], str | None]
#: ``without_answered(request, answered_keys)``: the round without the keys already answered, None when
#: none is left.
KeyedRounds = Callable[[InputRequest, Iterable[str]], InputRequest | None]


#: What the caller puts around the client's transport (the worker counts each request's outcome).
TransportWrapper = Callable[[httpx2.BaseTransport], httpx2.BaseTransport]


class ClientMaker(Protocol):
    """``make_client(timeouts, request_hooks, connections=n)``: the HTTP client one adapter is built on,
    keeping ``connections`` open for reuse (as many as the worker sends to its server at once)."""

    def __call__(
        self,
        timeouts: Timeouts,
        request_hooks: Sequence[RequestHook],
        *,
        connections: int,
        wrap_transport: TransportWrapper | None = None,
    ) -> httpx2.Client: ...


#: The connections a client keeps open by default: httpx2's own default.
DEFAULT_CONNECTIONS = 20
#: The most connections a client opens at once, unless twice its kept connections is more (a request may
#: be sent while another one's stream is read: an answer to a server's request on it).
MAX_CONNECTIONS = 100


def http_client(
    timeouts: Timeouts,
    request_hooks: Sequence[RequestHook] = (),
    *,
    connections: int = DEFAULT_CONNECTIONS,
    wrap_transport: TransportWrapper | None = None,
) -> httpx2.Client:
    """An adapter's client: the per-phase timeouts, ``request_hooks`` called before every request (the
    worker's names the bucket each request was charged to), and ``connections`` kept open between requests:
    as many as are sent at once (a poll batch's members), so each request finds an open connection instead
    of closing one and opening another. Its cookie jar parses only the answers that set a cookie (httpx2's
    own, where httpx parsed every answer), and sends a sticky-session load balancer's cookie back.
    ``wrap_transport``: what goes around the transport that sends the requests (it sees each request and
    its answer, or the error that stood for one)."""
    t = timeouts
    limits = httpx2.Limits(
        max_connections=max(MAX_CONNECTIONS, 2 * connections), max_keepalive_connections=connections
    )
    # Every answer, its head included, within the request's read timeout (``adapters.answer_within``).
    inner = answer_within_transport(limits)
    transport = inner if wrap_transport is None else wrap_transport(inner)
    return LeanClient(
        timeout=httpx2.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
        limits=limits,
        event_hooks={"request": list(request_hooks)},
        transport=transport,
    )


def accept_any_tools(protocol_version: str, tools: Mapping[str, ToolSettings]) -> None:
    """The config check of a spec that has none."""


def accept_any_arguments(tool: ToolSettings | None, arguments: Mapping[str, Any]) -> str | None:
    """The argument check of a spec that has none."""
    return None


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One protocol version as the worker knows it.

    ``factory``: builds the adapter from its config and client. ``check_config``: the version's check of a
    server's tools at start (refused with a ValueError). ``check_arguments``: its pure check of a
    submission's arguments at submit. ``session_bound``: its tasks are read on the session that created
    them, so an operator who finds a task whose create answer was lost must name that session.
    ``without_answered``: set when an input round is a set of keyed requests answered key by key (a key
    answered is never asked, nor sent, twice); None when a round is one request, answered whole.
    ``lookup_may_create``: its lookup by submission key repeats the create (AIP-155's request id), which
    makes the operation when the first create never arrived; so with a cancel recorded, the lookup is not
    made (rule 6: what was never created is never created after its cancel).
    ``make_client``: how the client of each of its adapters is made."""

    protocol: str
    protocol_version: str
    factory: AdapterFactory
    check_config: ConfigCheck = accept_any_tools
    check_arguments: ArgumentCheck = accept_any_arguments
    session_bound: bool = False
    without_answered: KeyedRounds | None = None
    lookup_may_create: bool = False
    make_client: ClientMaker = http_client
