"""AIP-151's lookup by key (AIP-155: the create repeated with the same request id) proves "never created"
only with the server's own word for it: an HTTP 404 whose body is a google.rpc.Status NOT_FOUND, in the
AIP-193 envelope (``{"error": {"code": 404, "status": "NOT_FOUND", ...}}``) or grpc-gateway's bare Status
(``{"code": 5, ...}``, the Spanner emulator's). A plain 404 (a proxy's page, a wrong route, a JSON body that
is no google.rpc.Status) proves nothing: ``unprovable``, an operator decides (issue 19, item 4)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from adapters import AdapterConfig, LookupResult, Rejected
from adapters.aip151 import AipOperationsAdapter
from adapters.base import ToolRoute

CREATE = "/v1/projects/demo/reports:run"
TOOLS = {
    "run_report": ToolRoute(create="POST /v1/projects/{project}/reports:run", request_id_field="requestId")
}
ARGUMENTS = {"project": "demo", "seconds": 1}


def adapter(answer: Callable[[httpx2.Request], httpx2.Response]) -> AipOperationsAdapter:
    config = AdapterConfig(
        name="exports", url="http://aip.test", protocol="aip151", protocol_version="v1", tools=TOOLS
    )
    return AipOperationsAdapter(config, httpx2.Client(transport=httpx2.MockTransport(answer)))


def lookup(answer: httpx2.Response) -> LookupResult:
    def handler(request: httpx2.Request) -> httpx2.Response:
        assert (request.method, request.url.path) == ("POST", CREATE)
        return answer

    return adapter(handler).lookup_by_key(str(uuid.uuid4()), tool="run_report", arguments=ARGUMENTS)


def json_404(body: Any) -> httpx2.Response:
    return httpx2.Response(
        404, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )


PLAIN_404S = {
    "proxy-text": httpx2.Response(404, text="404 page not found\n"),
    "proxy-html": httpx2.Response(
        404,
        text="<html><body><h1>404 Not Found</h1>nginx</body></html>",
        headers={"content-type": "text/html"},
    ),
    "empty": httpx2.Response(404),
    "json-no-status": json_404({"error": {"code": 404, "message": "Not Found"}}),
    "json-string-error": json_404({"error": "not found"}),
    "json-other-status": json_404({"error": {"code": 404, "status": "UNIMPLEMENTED", "message": "no route"}}),
    "json-code-mismatch": json_404({"error": {"code": 400, "status": "NOT_FOUND", "message": "?"}}),
    "json-not-a-status": json_404({"detail": "Not Found"}),
    "grpc-gateway-other-code": json_404({"code": 12, "message": "Not Implemented"}),
}


@pytest.mark.parametrize("name", sorted(PLAIN_404S))
def test_a_plain_404_to_the_repeated_create_is_unprovable(name: str) -> None:
    found = lookup(PLAIN_404S[name])
    assert (found.proof, found.ref) == ("unprovable", None), found
    assert "404" in found.detail, found.detail


PROOFS = {
    "aip193": json_404(
        {"error": {"code": 404, "status": "NOT_FOUND", "message": "Project demo not found", "details": []}}
    ),
    "aip193-without-code": json_404({"error": {"status": "NOT_FOUND", "message": "Project demo not found"}}),
    "grpc-gateway": json_404({"code": 5, "message": "Project demo not found", "details": []}),
}


@pytest.mark.parametrize("name", sorted(PROOFS))
def test_a_google_rpc_status_not_found_to_the_repeated_create_is_the_proof(name: str) -> None:
    found = lookup(PROOFS[name])
    assert (found.proof, found.ref) == ("never_created", None), found


@pytest.mark.parametrize("name", sorted(PLAIN_404S))
def test_a_plain_404_to_the_first_create_is_still_a_refusal(name: str) -> None:
    """The first create is not a lookup: any 404 to it is a refusal, as before (nothing to prove)."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        del request
        return PLAIN_404S[name]

    with pytest.raises(Rejected) as refused:
        adapter(handler).create("run_report", ARGUMENTS, submission_key=str(uuid.uuid4()), ttl_ms=1)
    assert refused.value.http_status == 404
