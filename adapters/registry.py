"""Adapters by protocol *version*: (protocol, protocol_version) -> :class:`~adapters.spec.AdapterSpec`.

The key is the declared protocol and version, never the URL: two servers on similar URLs that speak
different protocols get different adapters, and an unknown pair is refused, not guessed. Each spec says
what the worker asks of its version (its factory, config and argument checks, session, input rounds and
HTTP client), so adding or retiring a version is a line of :func:`default_registry`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import httpx2

from adapters import aip151, mcp_2025_11_25, mcp_2026_07_28
from adapters.base import AdapterConfig, ToolAdapter
from adapters.errors import UnknownAdapter
from adapters.spec import AdapterFactory, AdapterSpec, ToolSettings

__all__ = ["SHIPPED", "AdapterFactory", "AdapterRegistry", "default_registry"]


class AdapterRegistry:
    """A registry of adapter specs keyed by (protocol, protocol_version)."""

    def __init__(self) -> None:
        self._specs: dict[tuple[str, str], AdapterSpec] = {}
        self._sealed = False

    def add(self, spec: AdapterSpec) -> None:
        """Register a spec. The first one of a protocol is its default (:meth:`default_version`).

        Raises:
            ValueError: the pair is registered already, or the registry is sealed.
        """
        key = (spec.protocol, spec.protocol_version)
        if self._sealed:
            raise ValueError(f"this registry is sealed: {spec.protocol} {spec.protocol_version} not added")
        if key in self._specs:
            raise ValueError(f"an adapter for {spec.protocol} {spec.protocol_version} is registered already")
        self._specs[key] = spec

    def register(self, protocol: str, protocol_version: str, factory: AdapterFactory) -> None:
        """Register a factory alone: its spec checks nothing, its tasks are bound to no session, its input
        rounds are answered whole and its client is :func:`~adapters.spec.http_client`'s.

        Raises:
            ValueError: the pair is registered already, or the registry is sealed.
        """
        self.add(AdapterSpec(protocol, protocol_version, factory))

    def seal(self) -> AdapterRegistry:
        """Refuse every later registration (a registry shared by a whole process); returns the registry."""
        self._sealed = True
        return self

    def keys(self) -> list[tuple[str, str]]:
        return sorted(self._specs)

    def protocols(self) -> list[str]:
        """The protocols, in the order their first specs were added."""
        return list(dict.fromkeys(protocol for protocol, _ in self._specs))

    def find(self, protocol: str, protocol_version: str) -> AdapterSpec | None:
        """The spec of exactly this pair, None when nothing is registered for it."""
        return self._specs.get((protocol, protocol_version))

    def spec(self, protocol: str, protocol_version: str) -> AdapterSpec:
        """The spec of exactly this pair.

        Raises:
            UnknownAdapter: nothing is registered for it.
        """
        spec = self.find(protocol, protocol_version)
        if spec is None:
            known = ", ".join(f"{p} {v}" for p, v in self.keys()) or "none"
            raise UnknownAdapter(
                f"no adapter for protocol {protocol!r} version {protocol_version!r} (known: {known})"
            )
        return spec

    def factory_for(self, protocol: str, protocol_version: str) -> AdapterFactory:
        """The factory for exactly this pair.

        Raises:
            UnknownAdapter: nothing is registered for it.
        """
        return self.spec(protocol, protocol_version).factory

    def build(self, config: AdapterConfig, http: httpx2.Client) -> ToolAdapter:
        """Build the adapter for ``config.protocol`` and ``config.protocol_version``.

        Raises:
            UnknownAdapter: nothing is registered for the pair.
        """
        return self.factory_for(config.protocol, config.protocol_version)(config, http)

    def default_version(self, protocol: str) -> str:
        """The protocol's default version: that of its first spec.

        Raises:
            UnknownAdapter: nothing is registered for the protocol.
        """
        for protocol_, version in self._specs:  # in the order they were added
            if protocol_ == protocol:
                return version
        raise UnknownAdapter(f"no adapter for protocol {protocol!r} (known: {', '.join(self.protocols())})")

    def check_config(self, protocol: str, protocol_version: str, tools: Mapping[str, ToolSettings]) -> None:
        """A server's configuration checked by its version's spec at start. A version with no spec is
        checked by the protocol's default spec, which decides whether it may load (MCP's: it is refused
        at submit, :meth:`spec`) or not (AIP-151's).

        Raises:
            ValueError: what is wrong; a protocol with no spec at all is wrong too.
        """
        spec = self.find(protocol, protocol_version)
        if spec is None:
            try:
                spec = self.spec(protocol, self.default_version(protocol))
            except UnknownAdapter as exc:
                raise ValueError(str(exc)) from None
        spec.check_config(protocol_version, tools)


def default_registry() -> AdapterRegistry:
    """A registry holding every adapter this package ships."""
    registry = AdapterRegistry()
    registry.add(mcp_2025_11_25.SPEC)
    registry.add(mcp_2026_07_28.SPEC)
    registry.add(aip151.SPEC)
    return registry


#: The shipped specs, one sealed registry per process: what a worker asks when it has no pool at hand (a
#: server's configuration at start, a submission's arguments, an operation's session and input rounds).
SHIPPED: Final = default_registry().seal()
