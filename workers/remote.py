"""One adapter per configured server and protocol version, per worker process, each on its own httpx2 client.

An operation is followed by the adapter of the protocol and version recorded on its row at submit (DESIGN
rule 14), not by the server's current configuration: when the configuration moves a server to another
version, the operations in flight keep theirs (the URL, the token and the budgets are the server's).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import httpx2

from adapters import (
    DEFAULT_CONNECTIONS,
    DEFAULT_MAX_RESULT_BYTES,
    MAX_CONNECTIONS,
    AdapterConfig,
    AdapterRegistry,
    LeanClient,
    Limits,
    LoopTransport,
    SocketTransport,
    Timeouts,
    ToolAdapter,
    ToolRoute,
    default_registry,
)
from workers.auth import TokenProviders
from workers.budget import BUDGET_HEADER, label_request, take_label
from workers.errors import UnknownServer
from workers.request_outcomes import CountingTransport, RequestOutcomes
from workers.settings import FleetConfig, ServerConfig

#: The transports the status reads of the polls may go on apart (``Settings.status_reads``), by name; with
#: ``httpx2`` they go on httpx2's own transport, as every other request does.
READS_TRANSPORTS: dict[str, type[SocketTransport] | type[LoopTransport]] = {
    "httptools": SocketTransport,
    "aiohttp": LoopTransport,
}
STATUS_READS = (*READS_TRANSPORTS, "httpx2")


class StatusReadsApart(httpx2.BaseTransport):
    """The requests a poll's budget paid for (``Longcall-Budget: poll``: the status reads of the polls,
    most of what a worker sends) go to ``reads`` (``adapters.socket_transport.SocketTransport`` or
    ``adapters.loop_transport.LoopTransport``), every other one to ``inner`` (httpx2's own transport:
    creates, results, cancels, input replies), so a fault of the reads' transport can never be taken for a
    create that was not sent."""

    def __init__(self, inner: httpx2.BaseTransport, reads: httpx2.BaseTransport) -> None:
        self._inner = inner
        self._reads = reads

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.headers.get(BUDGET_HEADER) == "poll":
            return self._reads.handle_request(request)
        return self._inner.handle_request(request)

    def close(self) -> None:
        try:
            self._reads.close()
        finally:
            self._inner.close()

    def __enter__(self) -> StatusReadsApart:
        self._inner.__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        self.close()


class StatusReadsRoute:
    """The requests a poll's budget paid for, sent by the adapter's client itself on ``transport``
    (:class:`adapters.lean_client.LeanRoute`), each counted with its outcome under ``poll`` as
    :class:`~workers.request_outcomes.CountingTransport` counts the others."""

    def __init__(self, transport: SocketTransport, server: str, outcomes: RequestOutcomes | None) -> None:
        self._transport = transport
        self._server = server
        self._outcomes = outcomes

    @property
    def transport(self) -> SocketTransport:
        return self._transport

    def label(self) -> str | None:
        return take_label("poll")

    def counted(self, status: int | None) -> None:
        if self._outcomes is not None:
            self._outcomes.answered(self._server, "poll", status)


class RemotePool:
    """The adapters of one worker process, each made as its version's spec in ``registry`` says (its
    ``factory``, on a client of its ``make_client``). ``max_result_bytes`` (``Settings.max_result_bytes``)
    sets the transport's cap on every answer (:func:`adapters.base.answer_cap`: the limit plus an envelope
    margin), so the largest result the fleet stores is the largest one it reads, and a larger answer is
    refused at its first read (:class:`~adapters.errors.AnswerTooLarge`). ``connections``: how many
    connections each client keeps open, as many as the process sends to one server at once (a poll batch's
    members, ``Settings.poll_batch``): the next batch finds them open. ``outcomes``: where each request's
    outcome is counted (``workers.request_outcomes``). ``status_reads``: what sends the polls' status reads
    (``Settings.status_reads``: apart, by :class:`StatusReadsApart`, unless ``httpx2``)."""

    def __init__(
        self,
        fleet: FleetConfig,
        *,
        registry: AdapterRegistry | None = None,
        timeouts: Timeouts | None = None,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        connections: int = DEFAULT_CONNECTIONS,
        outcomes: RequestOutcomes | None = None,
        status_reads: str = "httptools",
    ) -> None:
        if status_reads not in STATUS_READS:
            raise ValueError(f"status_reads is one of {', '.join(STATUS_READS)}, not {status_reads!r}")
        self._status_reads = status_reads
        self._fleet = fleet
        self._outcomes = outcomes
        self._registry = registry or default_registry()
        self._timeouts = timeouts or Timeouts()
        self._limits = Limits.for_results(max_result_bytes)
        self._connections = connections
        self._tokens = TokenProviders(outcomes)
        self._adapters: dict[tuple[str, str, str], ToolAdapter] = {}
        self._clients: list[httpx2.Client] = []
        self._lock = threading.Lock()

    def server(self, name: str) -> ServerConfig:
        try:
            return self._fleet.servers[name]
        except KeyError:
            raise UnknownServer(f"server {name!r} is not in LONGCALL_CONFIG") from None

    def adapter(
        self, name: str, *, protocol: str | None = None, protocol_version: str | None = None
    ) -> ToolAdapter:
        """The adapter for server ``name`` speaking ``protocol`` ``protocol_version`` (an operation's
        recorded pair; by default the server's configured one).

        Raises:
            UnknownServer: ``name`` is not configured.
            UnknownAdapter: no adapter is registered for the pair.
        """
        server = self.server(name)
        key = (name, protocol or server.protocol, protocol_version or server.protocol_version)
        with self._lock:
            adapter = self._adapters.get(key)
            if adapter is None:
                spec = self._registry.spec(key[1], key[2])  # no client made for an unknown pair
                config = AdapterConfig(
                    name=name,
                    url=server.url,
                    protocol=key[1],
                    protocol_version=key[2],
                    # called per request: a rotated token needs no restart, an OAuth token is renewed
                    token_provider=self._tokens.provider(name, server),
                    timeouts=self._timeouts,
                    limits=self._limits,
                    tools={
                        tool: ToolRoute(create=config.create, request_id_field=config.request_id_field)
                        for tool, config in server.tools.items()
                    },
                )
                # label_request names the bucket each request was charged to
                made: list[httpx2.BaseTransport] = []
                client = spec.make_client(
                    self._timeouts,
                    (label_request,),
                    connections=self._connections,
                    wrap_transport=functools.partial(self._wrap, name, made),
                )
                reads = made[0] if made else None
                if isinstance(client, LeanClient) and isinstance(reads, SocketTransport):
                    # the status reads sent by the client itself, on the same sockets (adapters.lean_client)
                    client.route = StatusReadsRoute(reads, name, self._outcomes)
                self._clients.append(client)
                adapter = spec.factory(config, client)
                self._adapters[key] = adapter
            return adapter

    def _wrap(
        self, server: str, made: list[httpx2.BaseTransport], inner: httpx2.BaseTransport
    ) -> httpx2.BaseTransport:
        """What sends the requests of ``server``'s client: the status reads apart as ``status_reads`` says
        (on sockets parsed by httptools, or on the process's event loop; the transport made for them put in
        ``made``), every request counted with its outcome, for ``longcall metrics``."""
        transport = inner
        reads_type = READS_TRANSPORTS.get(self._status_reads)
        if reads_type is not None:
            reads = reads_type(max_connections=max(MAX_CONNECTIONS, 2 * self._connections))
            made.append(reads)
            transport = StatusReadsApart(inner, reads)
        if self._outcomes is not None:
            transport = CountingTransport(transport, server=server, outcomes=self._outcomes)
        return transport

    def close(self) -> None:
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()
            self._adapters.clear()
        self._tokens.close()
