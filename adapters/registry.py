"""Adapters by protocol *version*: (protocol, protocol_version) -> factory.

The key is the declared protocol and version, never the URL: two servers on similar URLs that speak
different protocols get different adapters, and an unknown pair is refused, not guessed.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from adapters import aip151
from adapters.base import AdapterConfig, ToolAdapter
from adapters.errors import UnknownAdapter
from adapters.mcp_2025_11_25 import PROTOCOL, PROTOCOL_VERSION, McpTasksAdapter
from adapters.mcp_2026_07_28 import PROTOCOL_VERSION as EXT_PROTOCOL_VERSION
from adapters.mcp_2026_07_28 import McpExtTasksAdapter

__all__ = ["AdapterFactory", "AdapterRegistry", "default_registry"]

AdapterFactory = Callable[[AdapterConfig, httpx.Client], ToolAdapter]


class AdapterRegistry:
    """A registry of adapter factories keyed by (protocol, protocol_version)."""

    def __init__(self) -> None:
        self._factories: dict[tuple[str, str], AdapterFactory] = {}

    def register(self, protocol: str, protocol_version: str, factory: AdapterFactory) -> None:
        """Register a factory.

        Raises:
            ValueError: the pair is registered already.
        """
        key = (protocol, protocol_version)
        if key in self._factories:
            raise ValueError(f"an adapter for {protocol} {protocol_version} is registered already")
        self._factories[key] = factory

    def keys(self) -> list[tuple[str, str]]:
        return sorted(self._factories)

    def factory_for(self, protocol: str, protocol_version: str) -> AdapterFactory:
        """The factory for exactly this pair.

        Raises:
            UnknownAdapter: nothing is registered for it.
        """
        try:
            return self._factories[(protocol, protocol_version)]
        except KeyError:
            known = ", ".join(f"{p} {v}" for p, v in self.keys()) or "none"
            raise UnknownAdapter(
                f"no adapter for protocol {protocol!r} version {protocol_version!r} (known: {known})"
            ) from None

    def build(self, config: AdapterConfig, http: httpx.Client) -> ToolAdapter:
        """Build the adapter for ``config.protocol`` and ``config.protocol_version``.

        Raises:
            UnknownAdapter: nothing is registered for the pair.
        """
        return self.factory_for(config.protocol, config.protocol_version)(config, http)


def default_registry() -> AdapterRegistry:
    """A registry holding every adapter this package ships."""
    registry = AdapterRegistry()
    registry.register(PROTOCOL, PROTOCOL_VERSION, McpTasksAdapter)
    registry.register(PROTOCOL, EXT_PROTOCOL_VERSION, McpExtTasksAdapter)
    registry.register(aip151.PROTOCOL, aip151.PROTOCOL_VERSION, aip151.AipOperationsAdapter)
    return registry
