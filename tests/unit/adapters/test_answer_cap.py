"""The transport's cap on one answer and ``max_result_bytes`` are one limit (issue 19, item 1; DESIGN rule 7):
the cap is derived from the setting (plus an envelope margin for JSON-RPC and SSE framing), an answer over it
is :class:`AnswerTooLarge` with the size seen, and an error answer is never refused for its size."""

from __future__ import annotations

import json

import httpx2
import pytest

from adapters import (
    AdapterConfig,
    AnswerTooLarge,
    ProtocolViolation,
    ToolAdapter,
    Transient,
    default_registry,
)
from adapters.aip151 import AipOperationsAdapter
from adapters.base import (
    DEFAULT_MAX_RESULT_BYTES,
    ENVELOPE_MARGIN_BYTES,
    Limits,
    RemoteRef,
    ToolRoute,
    answer_cap,
)
from adapters.registry import AdapterRegistry
from workers.remote import RemotePool
from workers.runtime import Runtime
from workers.settings import FleetConfig, Settings

SERVERS = {
    "reports": {"protocol": "mcp", "protocol_version": "2025-11-25", "url": "http://127.0.0.1:9/mcp"},
    "exports": {
        "protocol": "aip151",
        "protocol_version": "v1",
        "url": "http://127.0.0.1:9",
        "tools": {
            "run_report": {"create": "POST /v1/projects/{project}/reports:run", "request_id_field": "r"}
        },
    },
}
NAME = "projects/demo/operations/op-1"


def built_configs(max_result_bytes: int | None = None) -> dict[str, AdapterConfig]:
    """The AdapterConfig each server's adapter is built from by a RemotePool."""
    seen: dict[str, AdapterConfig] = {}
    registry = AdapterRegistry()
    pairs = default_registry().keys()
    for protocol, version in pairs:

        def factory(config: AdapterConfig, http: httpx2.Client) -> ToolAdapter:
            seen[config.name] = config
            return default_registry().build(config, http)

        registry.register(protocol, version, factory)
    fleet = FleetConfig.model_validate({"servers": SERVERS})
    if max_result_bytes is None:
        pool = RemotePool(fleet, registry=registry)
    else:
        pool = RemotePool(fleet, registry=registry, max_result_bytes=max_result_bytes)
    try:
        for name in SERVERS:
            pool.adapter(name)
    finally:
        pool.close()
    return seen


def test_the_default_cap_is_the_default_max_result_bytes_and_its_margin() -> None:
    assert Settings().max_result_bytes == DEFAULT_MAX_RESULT_BYTES
    assert Limits().max_body_bytes == answer_cap(DEFAULT_MAX_RESULT_BYTES)
    assert answer_cap(1000) == 1000 + ENVELOPE_MARGIN_BYTES
    assert {c.limits.max_body_bytes for c in built_configs().values()} == {
        answer_cap(DEFAULT_MAX_RESULT_BYTES)
    }


def test_the_pool_derives_every_adapters_cap_from_max_result_bytes() -> None:
    configs = built_configs(12_345)
    assert set(configs) == set(SERVERS)
    assert {c.limits.max_body_bytes for c in configs.values()} == {12_345 + ENVELOPE_MARGIN_BYTES}


def test_a_runtime_builds_its_pool_with_the_settings_max_result_bytes() -> None:
    runtime = Runtime(
        settings=Settings(max_result_bytes=4242), fleet=FleetConfig.model_validate({"servers": {}})
    )
    try:
        assert runtime.remote._limits.max_body_bytes == 4242 + ENVELOPE_MARGIN_BYTES
    finally:
        runtime.close()


def aip(answer: httpx2.Response, limit: int) -> AipOperationsAdapter:
    config = AdapterConfig(
        name="exports",
        url="http://aip.test",
        protocol="aip151",
        protocol_version="v1",
        limits=Limits(max_body_bytes=limit),
        tools={"run_report": ToolRoute(create="POST /v1/x:run", request_id_field="r")},
    )
    return AipOperationsAdapter(config, httpx2.Client(transport=httpx2.MockTransport(lambda _: answer)))


def ref() -> RemoteRef:
    return RemoteRef(NAME, None, "v1", "aip151")


def done_operation(padding: int) -> bytes:
    return json.dumps(
        {"name": NAME, "done": True, "response": {"@type": "t", "padding": "x" * padding}}
    ).encode()


def test_a_done_operation_over_the_cap_is_answer_too_large_with_its_declared_size() -> None:
    body = done_operation(5000)
    with pytest.raises(AnswerTooLarge) as caught:
        aip(httpx2.Response(200, content=body, headers={"content-type": "application/json"}), 4096).get(ref())
    assert (caught.value.declared_bytes, caught.value.read_bytes, caught.value.limit) == (len(body), 0, 4096)
    assert caught.value.size_seen == f"{len(body)} bytes"
    assert isinstance(caught.value, ProtocolViolation)


def test_a_streamed_answer_over_the_cap_says_more_than_the_cap() -> None:
    chunks = [done_operation(5000)[i : i + 1000] for i in range(0, 6000, 1000)]
    answer = httpx2.Response(200, content=iter(chunks), headers={"content-type": "application/json"})
    with pytest.raises(AnswerTooLarge) as caught:
        aip(answer, 4096).get(ref())
    assert caught.value.declared_bytes is None
    assert caught.value.read_bytes > 4096
    assert caught.value.size_seen == "more than 4096 bytes"


def test_a_done_operation_under_the_cap_is_read() -> None:
    body = done_operation(3000)
    status = aip(httpx2.Response(200, content=body), 4096).get(ref())
    assert status.terminal == "completed"


def test_an_error_answer_is_never_refused_for_its_size() -> None:
    """A 500 with a 1 MiB page: a Transient by its status, not a result too large (its body is read only
    for its words, at most 64 KiB of it)."""
    with pytest.raises(Transient) as caught:
        aip(httpx2.Response(500, content=b"<html>" + b"x" * 1024 * 1024), 4096).get(ref())
    assert not isinstance(caught.value, AnswerTooLarge)
