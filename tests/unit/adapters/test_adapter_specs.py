"""Every protocol question goes to the adapter (issue 20, item 2): each (protocol, protocol_version) has one
:class:`~adapters.AdapterSpec`, the worker asks it, and a version added to a registry is used by the worker's
pool with no change under ``workers/``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import httpx2
import pytest

from adapters import (
    SHIPPED,
    AdapterConfig,
    AdapterRegistry,
    AdapterSpec,
    InputRequest,
    RequestHook,
    Timeouts,
    ToolAdapter,
    TransportWrapper,
    UnknownAdapter,
    aip151,
    default_registry,
    http_client,
    mcp_2025_11_25,
    mcp_2026_07_28,
)
from workers.budget import label_request
from workers.remote import RemotePool
from workers.settings import FleetConfig, ToolConfig

SHIPPED_PAIRS = [("aip151", "v1"), ("mcp", "2025-11-25"), ("mcp", "2026-07-28")]


def test_each_shipped_pair_has_its_version_packages_spec() -> None:
    registry = default_registry()
    assert registry.keys() == SHIPPED_PAIRS == SHIPPED.keys()
    specs = {pair: registry.spec(*pair) for pair in SHIPPED_PAIRS}
    assert specs == {
        ("aip151", "v1"): aip151.SPEC,
        ("mcp", "2025-11-25"): mcp_2025_11_25.SPEC,
        ("mcp", "2026-07-28"): mcp_2026_07_28.SPEC,
    }
    for (protocol, version), spec in specs.items():
        assert (spec.protocol, spec.protocol_version) == (protocol, version)
        assert registry.factory_for(protocol, version) is spec.factory
    assert aip151.SPEC.factory is aip151.AipOperationsAdapter
    assert mcp_2025_11_25.SPEC.factory is mcp_2025_11_25.McpTasksAdapter
    assert mcp_2026_07_28.SPEC.factory is mcp_2026_07_28.McpExtTasksAdapter


def test_the_shipped_specs_answer_the_protocol_questions() -> None:
    """What the worker asked by protocol name before: the session-bound set, the keyed input rounds."""
    assert [pair for pair in SHIPPED_PAIRS if SHIPPED.spec(*pair).session_bound] == [("mcp", "2025-11-25")]
    assert [pair for pair in SHIPPED_PAIRS if SHIPPED.spec(*pair).without_answered is not None] == [
        ("mcp", "2026-07-28")
    ]
    assert SHIPPED.protocols() == ["mcp", "aip151"]  # as the settings' refusal lists them
    assert SHIPPED.default_version("mcp") == "2025-11-25"
    assert SHIPPED.default_version("aip151") == "v1"
    assert {SHIPPED.spec(*pair).make_client for pair in SHIPPED_PAIRS} == {http_client}


@pytest.mark.parametrize(
    ("protocol", "version"), [("mcp", "2026-08-01"), ("mcp", "2025-06-18"), ("aip151", "v2"), ("grpc", "v1")]
)
def test_an_unknown_pair_has_no_spec(protocol: str, version: str) -> None:
    known = r"\(known: aip151 v1, mcp 2025-11-25, mcp 2026-07-28\)"
    assert SHIPPED.find(protocol, version) is None
    with pytest.raises(UnknownAdapter, match=rf"protocol '{protocol}' version '{version}' {known}"):
        SHIPPED.spec(protocol, version)


def test_the_shipped_registry_is_sealed() -> None:
    with pytest.raises(ValueError, match="sealed"):
        SHIPPED.add(AdapterSpec("mcp", "2099-01-01", mcp_2025_11_25.McpTasksAdapter))
    with pytest.raises(ValueError, match="sealed"):
        SHIPPED.register("mcp", "2099-01-01", mcp_2025_11_25.McpTasksAdapter)
    assert SHIPPED.keys() == SHIPPED_PAIRS
    default_registry().register("mcp", "2099-01-01", mcp_2025_11_25.McpTasksAdapter)  # a fresh one is not


def test_a_factory_registered_alone_gets_a_spec_that_asks_nothing() -> None:
    registry = AdapterRegistry()
    registry.register("mcp", "2099-01-01", mcp_2025_11_25.McpTasksAdapter)
    spec = registry.spec("mcp", "2099-01-01")
    assert spec == AdapterSpec("mcp", "2099-01-01", mcp_2025_11_25.McpTasksAdapter)
    spec.check_config("2099-01-01", {"t": ToolConfig(create="POST /v1/x", request_id_field="r")})
    assert spec.check_arguments(ToolConfig(create="POST /v1/{x}"), {}) is None
    assert not spec.session_bound
    assert spec.without_answered is None
    assert spec.make_client is http_client


@pytest.mark.parametrize(
    ("protocol", "version", "tools", "message"),
    [
        ("aip151", "v1", {"t": ToolConfig(create="POST /v1/x")}, "aip151 tool 't' needs request_id_field"),
        ("aip151", "v2", {}, """protocol "aip151" has protocol_version "v1", not 'v2'"""),
        ("mcp", "2026-07-28", {"t": ToolConfig(request_id_field="r")}, "are for aip151 servers"),
        ("mcp", "2099-01-01", {"t": ToolConfig(create="POST /v1/x")}, "are for aip151 servers"),
        ("grpc", "v1", {}, "no adapter for protocol 'grpc'"),
    ],
)
def test_a_servers_tools_are_checked_by_its_versions_spec_or_its_protocols_default(
    protocol: str, version: str, tools: dict[str, ToolConfig], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SHIPPED.check_config(protocol, version, tools)


def test_an_unknown_mcp_version_loads_and_aip151_tools_with_their_routes_do() -> None:
    SHIPPED.check_config("mcp", "2099-01-01", {"t": ToolConfig(sync_upper_bound_s=3)})
    SHIPPED.check_config("aip151", "v1", {"t": ToolConfig(create="POST /v1/{p}:run", request_id_field="r")})


@pytest.mark.parametrize(
    ("arguments", "refusal"),
    [
        ({"p": "demo"}, None),
        ({"p": 7}, None),
        ({}, "the create route 'POST /v1/{p}:run' needs the argument(s) p (its path placeholders)"),
        ({"p": "a/b"}, "cannot be filled: p='a/b' would change the path"),
        ({"p": True}, "cannot be filled: p must be a string or an integer, got bool"),
        ({"p": " "}, "cannot be filled: p must not be empty"),
    ],
)
def test_the_aip151_spec_checks_a_submissions_route_arguments(
    arguments: dict[str, Any], refusal: str | None
) -> None:
    tool = ToolConfig(create="POST /v1/{p}:run", request_id_field="r")
    found = SHIPPED.spec("aip151", "v1").check_arguments(tool, arguments)
    if refusal is None:
        assert found is None
    else:
        assert found is not None
        assert refusal in found
    assert SHIPPED.spec("aip151", "v1").check_arguments(None, arguments) is None  # left to the adapter
    assert SHIPPED.spec("mcp", "2025-11-25").check_arguments(None, arguments) is None


def test_the_keyed_round_spec_leaves_the_answered_keys_out() -> None:
    without_answered = SHIPPED.spec("mcp", "2026-07-28").without_answered
    assert without_answered is not None
    request = InputRequest(
        request_id='["a","b"]',
        method="tasks/update",
        params={"a": {"method": "elicitation/create"}, "b": {"method": "elicitation/create"}},
        schema=None,
        task_id="t",
    )
    left = without_answered(request, ["a"])
    assert left is not None
    assert list(left.params) == ["b"]
    assert without_answered(request, ["a", "b"]) is None


def test_the_plain_client_has_the_timeouts_the_hooks_and_the_connections_kept() -> None:
    def hook(request: httpx2.Request) -> None:
        del request

    timeouts = Timeouts(connect=1.0, read=2.0, write=3.0, pool=4.0)
    with http_client(timeouts, (hook,), connections=64) as client:
        assert client.timeout == httpx2.Timeout(connect=1.0, read=2.0, write=3.0, pool=4.0)
        pool = client._transport._pool  # type: ignore[attr-defined]  # httpx2 keeps its limits only there
        assert (pool._max_keepalive_connections, pool._max_connections) == (64, 128)
        assert client.event_hooks["request"] == [hook]


# --------------------------------------------------------- adding a version touches adapters/ only


@dataclass
class Built:
    """What a fake version's factory was given (it stands for the adapter)."""

    config: AdapterConfig
    http: httpx2.Client
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.config.name


def test_a_version_added_to_a_registry_is_built_by_the_pool_with_no_change_in_workers() -> None:
    """A new MCP version (its spec only: a factory and a client maker) in a registry the pool is given:
    the pool makes its client as the spec says (with the worker's request hook, the pool's timeouts and the
    connections it keeps) and builds its adapter with the spec's factory; closing the pool closes the
    client."""
    clients: list[tuple[Timeouts, Sequence[RequestHook], int, httpx2.Client]] = []

    def make_client(
        timeouts: Timeouts,
        request_hooks: Sequence[RequestHook],
        *,
        connections: int,
        wrap_transport: TransportWrapper | None = None,
    ) -> httpx2.Client:
        client = httpx2.Client()
        clients.append((timeouts, request_hooks, connections, client))
        return client

    def factory(config: AdapterConfig, http: httpx2.Client) -> ToolAdapter:
        return cast(ToolAdapter, Built(config, http))

    registry = default_registry()
    registry.add(AdapterSpec("mcp", "2099-01-01", factory, make_client=make_client))
    fleet = FleetConfig.model_validate(
        {
            "servers": {
                "future": {
                    "protocol": "mcp",
                    "protocol_version": "2099-01-01",
                    "url": "http://127.0.0.1:9/mcp",
                },
                "exports": {
                    "protocol": "aip151",
                    "protocol_version": "v1",
                    "url": "http://127.0.0.1:9",
                    "tools": {"run": {"create": "POST /v1/{p}:run", "request_id_field": "r"}},
                },
            }
        }
    )
    timeouts = Timeouts(connect=1.5)
    pool = RemotePool(fleet, registry=registry, timeouts=timeouts, connections=7)
    try:
        built = pool.adapter("future")
        assert isinstance(built, Built)
        assert pool.adapter("future") is built  # one per server and version
        assert (built.config.protocol, built.config.protocol_version) == ("mcp", "2099-01-01")
        assert built.config.timeouts is timeouts
        [(given_timeouts, hooks, connections, client)] = clients
        assert given_timeouts is timeouts
        assert connections == 7
        assert list(hooks) == [label_request]
        assert built.http is client
        exports = pool.adapter("exports")  # a shipped version beside it, as before
        assert isinstance(exports, aip151.AipOperationsAdapter)
        assert exports.name == "exports"
        with pytest.raises(UnknownAdapter):
            pool.adapter("future", protocol_version="2099-02-02")
    finally:
        pool.close()
    assert client.is_closed
