from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from hypothesis import given
from hypothesis import strategies as st

import adapters
from adapters import (
    AdapterConfig,
    AdapterRegistry,
    InputRequest,
    McpTasksAdapter,
    RemoteRef,
    ToolAdapter,
    UnknownAdapter,
    default_registry,
)
from adapters.aip151 import AipOperationsAdapter

PACKAGE = Path(adapters.__file__).parent


def config(protocol: str = "mcp", version: str = "2025-11-25", url: str = "http://h/mcp") -> AdapterConfig:
    return AdapterConfig(name="reports", url=url, protocol=protocol, protocol_version=version)


def test_the_default_registry_builds_the_mcp_2025_11_25_adapter() -> None:
    registry = default_registry()
    assert registry.keys() == [("aip151", "v1"), ("mcp", "2025-11-25"), ("mcp", "2026-07-28")]
    with httpx2.Client() as client:
        adapter = registry.build(config(), client)
    assert isinstance(adapter, McpTasksAdapter)
    assert isinstance(adapter, ToolAdapter)
    assert (adapter.protocol, adapter.protocol_version, adapter.adapter_version) == (
        "mcp",
        "2025-11-25",
        "mcp-2025-11-25/1",
    )


@pytest.mark.parametrize(
    ("protocol", "version"), [("mcp", "2026-08-01"), ("mcp", "2025-06-18"), ("aip151", "v2")]
)
def test_unknown_pairs_are_refused_clearly(protocol: str, version: str) -> None:
    known = r"\(known: aip151 v1, mcp 2025-11-25, mcp 2026-07-28\)"
    with pytest.raises(UnknownAdapter, match=rf"protocol '{protocol}' version '{version}' {known}"):
        default_registry().factory_for(protocol, version)


def test_the_same_url_never_makes_two_protocols_the_same_adapter() -> None:
    registry = default_registry()
    with httpx2.Client() as client:
        aip = registry.build(config(protocol="aip151", version="v1", url="http://h/mcp"), client)
        mcp = registry.build(config(url="http://h/mcp"), client)
        with pytest.raises(UnknownAdapter):
            registry.build(config(protocol="aip151", version="2025-11-25", url="http://h/mcp"), client)
    assert isinstance(aip, AipOperationsAdapter)
    assert isinstance(mcp, McpTasksAdapter)


def test_a_pair_cannot_be_registered_twice() -> None:
    registry = AdapterRegistry()
    registry.register("mcp", "2025-11-25", McpTasksAdapter)
    with pytest.raises(ValueError, match="registered already"):
        registry.register("mcp", "2025-11-25", McpTasksAdapter)


def test_the_mcp_adapter_refuses_a_config_for_another_version() -> None:
    with httpx2.Client() as client, pytest.raises(ValueError, match="2026-07-28"):
        McpTasksAdapter(config(version="2026-07-28"), client)


def test_remote_ref_round_trips_through_json() -> None:
    ref = RemoteRef(remote_id="abc:123", session_ref="9d02", protocol_version="2025-11-25")
    assert RemoteRef.from_json(json.loads(json.dumps(ref.to_json()))) == ref
    stateless = RemoteRef(remote_id="abc", session_ref=None, protocol_version="2025-11-25")
    assert RemoteRef.from_json(json.loads(json.dumps(stateless.to_json()))) == stateless


@pytest.mark.parametrize(
    "data",
    [
        {"remote_id": "", "session_ref": None, "protocol_version": "2025-11-25", "protocol": "mcp"},
        {"remote_id": "a", "session_ref": 5, "protocol_version": "2025-11-25", "protocol": "mcp"},
        {"remote_id": "a", "session_ref": None, "protocol": "mcp"},
    ],
)
def test_a_damaged_stored_reference_is_refused(data: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        RemoteRef.from_json(data)


def test_input_request_round_trips_through_json() -> None:
    request = InputRequest(
        request_id="task-x-1",
        method="elicitation/create",
        params={"message": "ok?", "_meta": {"io.modelcontextprotocol/related-task": {"taskId": "x"}}},
        schema={"type": "object"},
        task_id="x",
    )
    assert InputRequest.from_json(json.loads(json.dumps(request.to_json()))) == request
    numeric = InputRequest(request_id=3, method="sampling/createMessage", params={}, schema=None, task_id="x")
    assert InputRequest.from_json(json.loads(json.dumps(numeric.to_json()))) == numeric


def test_a_damaged_stored_input_request_is_refused() -> None:
    with pytest.raises(ValueError, match="request_id"):
        InputRequest.from_json(
            {"request_id": True, "method": "m", "params": {}, "schema": None, "task_id": "x"}
        )


def test_the_package_exports_a_sorted_all() -> None:
    assert adapters.__all__ == sorted(adapters.__all__)
    assert all(hasattr(adapters, name) for name in adapters.__all__)


def test_adapters_import_nothing_of_the_ledger_the_workers_or_celery() -> None:
    forbidden = {"ledger", "workers", "celery", "kombu", "redis", "sqlalchemy", "psycopg"}
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert not roots & forbidden, f"{path.name} imports {roots & forbidden}"


def test_importing_adapters_loads_no_celery_ledger_or_workers_module() -> None:
    probe = (
        "import sys, adapters; "
        "roots = {'celery', 'kombu', 'ledger', 'workers'}; "
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in roots)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == ""


_json_text = st.text(max_size=20)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _json_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_json_text, inner, max_size=3),
    max_leaves=10,
)


@given(
    remote_id=st.text(min_size=1, max_size=40),
    session_ref=st.none() | st.text(min_size=1, max_size=40),
)
def test_any_remote_ref_round_trips_through_json(remote_id: str, session_ref: str | None) -> None:
    ref = RemoteRef(remote_id=remote_id, session_ref=session_ref, protocol_version="2025-11-25")
    assert RemoteRef.from_json(json.loads(json.dumps(ref.to_json()))) == ref


@given(
    request_id=st.text(min_size=1, max_size=30) | st.integers(-(2**53), 2**53),
    params=st.dictionaries(_json_text, _json_values, max_size=4),
    schema=st.none() | st.dictionaries(_json_text, _json_values, max_size=3),
)
def test_any_input_request_round_trips_through_json(
    request_id: str | int, params: dict[str, object], schema: dict[str, object] | None
) -> None:
    request = InputRequest(
        request_id=request_id, method="elicitation/create", params=params, schema=schema, task_id="t"
    )
    assert InputRequest.from_json(json.loads(json.dumps(request.to_json()))) == request
