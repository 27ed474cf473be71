"""One adapter per configured server and protocol version, per worker process, each on its own httpx2 client.

An operation is followed by the adapter of the protocol and version recorded on its row at submit (DESIGN
rule 14), not by the server's current configuration: when the configuration moves a server to another
version, the operations in flight keep theirs (the URL, the token and the budgets are the server's).
"""

from __future__ import annotations

import functools
import threading

import httpx2

from adapters import (
    DEFAULT_CONNECTIONS,
    DEFAULT_MAX_RESULT_BYTES,
    AdapterConfig,
    AdapterRegistry,
    Limits,
    Timeouts,
    ToolAdapter,
    ToolRoute,
    default_registry,
)
from workers.auth import TokenProviders
from workers.budget import label_request
from workers.errors import UnknownServer
from workers.request_outcomes import CountingTransport, RequestOutcomes
from workers.settings import FleetConfig, ServerConfig


class RemotePool:
    """The adapters of one worker process, each made as its version's spec in ``registry`` says (its
    ``factory``, on a client of its ``make_client``). ``max_result_bytes`` (``Settings.max_result_bytes``)
    sets the transport's cap on every answer (:func:`adapters.base.answer_cap`: the limit plus an envelope
    margin), so the largest result the fleet stores is the largest one it reads, and a larger answer is
    refused at its first read (:class:`~adapters.errors.AnswerTooLarge`). ``connections``: how many
    connections each client keeps open, as many as the process sends to one server at once (a poll batch's
    members, ``Settings.poll_batch``): the next batch finds them open. ``outcomes``: where each request's
    outcome is counted (``workers.request_outcomes``)."""

    def __init__(
        self,
        fleet: FleetConfig,
        *,
        registry: AdapterRegistry | None = None,
        timeouts: Timeouts | None = None,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        connections: int = DEFAULT_CONNECTIONS,
        outcomes: RequestOutcomes | None = None,
    ) -> None:
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
                outcomes = self._outcomes
                client = spec.make_client(
                    self._timeouts,
                    (label_request,),
                    connections=self._connections,
                    # every request counted with its outcome, for longcall metrics
                    wrap_transport=None
                    if outcomes is None
                    else functools.partial(CountingTransport, server=name, outcomes=outcomes),
                )
                self._clients.append(client)
                adapter = spec.factory(config, client)
                self._adapters[key] = adapter
            return adapter

    def close(self) -> None:
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()
            self._adapters.clear()
        self._tokens.close()
