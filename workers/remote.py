"""One adapter per configured server, per worker process, each on its own httpx client."""

from __future__ import annotations

import threading

import httpx

from adapters import AdapterConfig, AdapterRegistry, Timeouts, ToolAdapter, default_registry
from workers.errors import UnknownServer
from workers.settings import FleetConfig, ServerConfig


class RemotePool:
    def __init__(
        self, fleet: FleetConfig, *, registry: AdapterRegistry | None = None, timeouts: Timeouts | None = None
    ) -> None:
        self._fleet = fleet
        self._registry = registry or default_registry()
        self._timeouts = timeouts or Timeouts()
        self._adapters: dict[str, ToolAdapter] = {}
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()

    def server(self, name: str) -> ServerConfig:
        try:
            return self._fleet.servers[name]
        except KeyError:
            raise UnknownServer(f"server {name!r} is not in LONGCALL_CONFIG") from None

    def adapter(self, name: str) -> ToolAdapter:
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                server = self.server(name)
                config = AdapterConfig(
                    name=name,
                    url=server.url,
                    protocol=server.protocol,
                    protocol_version=server.protocol_version,
                    token_provider=server.token,  # read per request: a rotated token needs no restart
                    timeouts=self._timeouts,
                )
                t = self._timeouts
                client = httpx.Client(
                    timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool)
                )
                self._clients.append(client)
                adapter = self._registry.build(config, client)
                self._adapters[name] = adapter
            return adapter

    def close(self) -> None:
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()
            self._adapters.clear()
