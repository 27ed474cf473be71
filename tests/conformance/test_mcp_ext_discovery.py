"""Generation detection against real peers: ``server/discover`` first, then the 2025-11-25 ``initialize``
(reference/mcp-tasks-extension.md §3.1); the extension adapter refuses, clearly, a server that speaks the
other generation."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import pytest

from adapters import AdapterConfig, Rejected, default_registry
from adapters.mcp_2026_07_28.adapter import GENERATIONS
from adapters.mcp_2026_07_28.discovery import Generation, GenerationCache, detect
from tests.conformance.conftest import PEERS_BY_NAME, McpPeer, start_peer
from tests.conformance.test_mcp_ext_adapter import PEER, Counter


@pytest.fixture(scope="module")
def modern_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpPeer]:
    yield from start_peer(PEER, tmp_path_factory.mktemp("peer-ext-discover"))


@pytest.fixture(scope="module", params=["fastmcp-3.4", "longcall-stateful"])
def legacy_peer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[McpPeer]:
    spec = PEERS_BY_NAME[request.param]
    yield from start_peer(spec, tmp_path_factory.mktemp(f"peer-{spec.name}-discover"))


def test_the_dual_era_fastmcp_4_peer_is_detected_as_2026_07_28_with_tasks(modern_peer: McpPeer) -> None:
    budget = Counter()
    with httpx2.Client() as client:
        found = detect(client, modern_peer.url, server="m", budget=budget)
    assert (found.generation, found.tasks) == ("2026-07-28", True)
    assert budget.requests == 1  # server/discover answered: no initialize sent


def test_a_2025_11_25_server_is_detected_by_initialize(legacy_peer: McpPeer) -> None:
    budget = Counter()
    with httpx2.Client() as client:
        found = detect(client, legacy_peer.url, server="l", budget=budget)
    assert (found.generation, found.tasks) == ("2025-11-25", True)
    assert "server/discover" in found.detail
    assert budget.requests >= 2  # the probe, then initialize (and the DELETE of its session)


def test_the_extension_adapter_refuses_a_2025_11_25_server_clearly(legacy_peer: McpPeer) -> None:
    GENERATIONS.forget("legacy", legacy_peer.url)
    config = AdapterConfig(name="legacy", url=legacy_peer.url, protocol="mcp", protocol_version="2026-07-28")
    with httpx2.Client() as client:
        adapter = default_registry().build(config, client)
        with pytest.raises(Rejected, match=r'speaks MCP 2025-11-25.*protocol_version = "2025-11-25"'):
            adapter.capabilities("slow_report")


def test_a_detected_generation_is_reused_until_its_ttl(modern_peer: McpPeer) -> None:
    cache = GenerationCache(ttl_s=60)
    budget = Counter()
    with httpx2.Client() as client:
        first = cache.get(
            "m", modern_peer.url, lambda: detect(client, modern_peer.url, server="m", budget=budget)
        )
        again = cache.get(
            "m", modern_peer.url, lambda: detect(client, modern_peer.url, server="m", budget=budget)
        )
        assert again is first
        assert budget.requests == 1
        expired = GenerationCache(ttl_s=0)
        expired.get("m", modern_peer.url, lambda: detect(client, modern_peer.url, server="m", budget=budget))
        expired.get("m", modern_peer.url, lambda: detect(client, modern_peer.url, server="m", budget=budget))
        assert budget.requests == 3


def test_nothing_listening_is_unknown_not_an_error() -> None:
    with httpx2.Client() as client:
        found = detect(client, "http://127.0.0.1:9/mcp", server="none")
    assert found.generation == "unknown"
    assert "NotSent" in found.detail
    cache, probes = GenerationCache(ttl_s=60), [0]

    def probe() -> Generation:
        probes[0] += 1
        return found

    for _ in range(2):
        cache.get("none", "http://127.0.0.1:9/mcp", probe)
    assert probes == [2]  # a server that could not be asked is asked again, not remembered as unknown
