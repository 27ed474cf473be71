"""Conformance peer: an MCP resource server that accepts only tokens from oauth_as.py (MCP SDK 1.30 auth).

Run with the oauth-sdk-py venv from scripts/install-peers:
    python oauth_rs.py --port N --issuer URL --introspection-url URL --introspection-client-id ID
    (the introspection client secret comes in $OAUTH_RS_INTROSPECTION_SECRET, not on the command line)

The MCP server is sdk_py_v1.py's (same SDK pin, imported from beside this file, so its tools, its
2025-11-25 tasks and its workarounds come along: `slow_report`, `quick_lookup`, `ask_approval`).
FastMCP 1.30 has auth but no tasks, so the app is put together here from the SDK auth parts exactly as
`FastMCP.streamable_http_app` does: Starlette's `AuthenticationMiddleware` with the SDK's
`BearerAuthBackend` (checking the token's RFC 8707 resource, `validate_token_resource=True`),
`AuthContextMiddleware`, `RequireAuthMiddleware` in front of /mcp and the RFC 9728 route from
`create_protected_resource_routes`. The `TokenVerifier` introspects at the authorization server (RFC 7662).

Test control, JSON over HTTP, loopback only:
    POST   /_control/fail-once {"method": "tasks/get"}   the next request carrying that JSON-RPC method is
                                                         answered 401 invalid_token, however good its token
    GET    /_control/log              {method, client_id, status} of each authenticated request
    DELETE /_control/log
    DELETE /_control/faults
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from mcp.server.auth.middleware.auth_context import AuthContextMiddleware
from mcp.server.auth.middleware.bearer_auth import (
    AuthenticatedUser,
    BearerAuthBackend,
    RequireAuthMiddleware,
)
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.routes import build_resource_metadata_url, create_protected_resource_routes
from mcp.server.auth.settings import AuthSettings
from pydantic import AnyHttpUrl
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sdk_py_v1 import App  # a sibling program, not a package

LOOPBACK = {"127.0.0.1", "::1"}
INTROSPECTION_TIMEOUT_S = 5.0


class IntrospectionVerifier:
    """An `mcp.server.auth.provider.TokenVerifier` asking the authorization server (RFC 7662)."""

    def __init__(self, url: str, client_id: str, client_secret: str, issuer: str) -> None:
        self.url = url
        self.auth = (client_id, client_secret)
        self.issuer = issuer

    async def verify_token(self, token: str) -> AccessToken | None:
        async with httpx.AsyncClient(timeout=INTROSPECTION_TIMEOUT_S) as client:
            try:
                response = await client.post(self.url, data={"token": token}, auth=self.auth)
            except httpx.HTTPError:
                return None
        if response.status_code != 200:
            return None
        answer = response.json()
        if answer.get("active") is not True or answer.get("iss") != self.issuer:
            return None
        audience = answer.get("aud")
        if isinstance(audience, list):  # a token for several resources: the backend compares one
            audience = audience[0] if len(audience) == 1 else None
        return AccessToken(
            token=token,
            client_id=answer["client_id"],
            scopes=str(answer.get("scope", "")).split(),
            expires_at=answer.get("exp"),
            resource=audience,
            subject=answer.get("sub"),
            claims={"iss": answer["iss"]},
        )


class Faults:
    def __init__(self) -> None:
        self.fail_once: list[str] = []
        self.log: list[dict[str, Any]] = []


class FaultGate:
    """Between `RequireAuthMiddleware` and the MCP transport: arms 401s per JSON-RPC method and logs."""

    def __init__(self, app: Any, faults: Faults, resource_metadata_url: str) -> None:
        self.app = app
        self.faults = faults
        self.resource_metadata_url = resource_metadata_url

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        methods = self._methods(body)
        user = scope.get("user")
        client_id = user.access_token.client_id if isinstance(user, AuthenticatedUser) else None
        armed = next((method for method in methods if method in self.faults.fail_once), None)
        if armed is not None:
            self.faults.fail_once.remove(armed)
            self.faults.log.append({"method": armed, "client_id": client_id, "status": 401, "fault": True})
            await self._invalid_token(send)
            return
        status: list[int] = []

        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:  # later reads wait for the disconnect, as the transport expects
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, replay, watch)
        finally:
            for method in methods or [scope["method"]]:
                self.faults.log.append(
                    {"method": method, "client_id": client_id, "status": status[0] if status else None}
                )

    @staticmethod
    def _methods(body: bytes) -> list[str]:
        try:
            message = json.loads(body) if body else None
        except ValueError:
            return []
        messages = message if isinstance(message, list) else [message]
        return [item["method"] for item in messages if isinstance(item, dict) and "method" in item]

    async def _invalid_token(self, send: Send) -> None:
        # The header as the SDK's RequireAuthMiddleware writes it, so the fault looks like the real thing.
        description = "test fault: token refused once"
        header = (
            f'Bearer error="invalid_token", error_description="{description}", '
            f'resource_metadata="{self.resource_metadata_url}"'
        )
        body = json.dumps({"error": "invalid_token", "error_description": description}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", header.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def build_app(settings: AuthSettings, verifier: IntrospectionVerifier, *, json_response: bool) -> Starlette:
    mcp = App(json_response=json_response, stateless=False)
    faults = Faults()
    assert settings.resource_server_url is not None
    metadata_url = build_resource_metadata_url(settings.resource_server_url)

    async def transport(scope: Scope, receive: Receive, send: Send) -> None:
        await mcp.manager.handle_request(scope, receive, send)

    async def control(request: Request) -> Response:
        if request.client is None or request.client.host not in LOOPBACK:
            return JSONResponse({"error": "forbidden"}, status_code=403)
        what = request.path_params["what"]
        if (what, request.method) == ("fail-once", "POST"):
            faults.fail_once.append(str((await request.json())["method"]))
        elif (what, request.method) == ("log", "GET"):
            return JSONResponse(faults.log)
        elif (what, request.method) == ("log", "DELETE"):
            faults.log.clear()
        elif (what, request.method) == ("faults", "DELETE"):
            faults.fail_once.clear()
        else:
            return JSONResponse({"error": "unknown control"}, status_code=404)
        return JSONResponse({"ok": True})

    gate = FaultGate(transport, faults, str(metadata_url))
    routes = [
        Route(
            "/mcp",
            endpoint=RequireAuthMiddleware(gate, settings.required_scopes or [], metadata_url),
        ),
        *create_protected_resource_routes(
            resource_url=settings.resource_server_url,
            authorization_servers=[settings.issuer_url],
            scopes_supported=settings.required_scopes,
        ),
        Route("/_control/{what}", control, methods=["GET", "POST", "DELETE"]),
    ]
    middleware = [
        Middleware(
            AuthenticationMiddleware,
            backend=BearerAuthBackend(verifier, resource_server_url=settings.resource_server_url),
        ),
        Middleware(AuthContextMiddleware),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with mcp.running():
            yield

    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--issuer", required=True)
    parser.add_argument("--introspection-url", required=True)
    parser.add_argument("--introspection-client-id", required=True)
    parser.add_argument("--required-scope", action="append", default=[])
    parser.add_argument("--json-response", action="store_true")
    args = parser.parse_args()
    if args.host not in LOOPBACK:
        parser.error("a test peer listens on loopback only")
    secret = os.environ.get("OAUTH_RS_INTROSPECTION_SECRET")
    if not secret:
        parser.error("OAUTH_RS_INTROSPECTION_SECRET is not set")
    settings = AuthSettings(
        issuer_url=AnyHttpUrl(args.issuer),
        resource_server_url=AnyHttpUrl(f"http://{args.host}:{args.port}/mcp"),
        required_scopes=args.required_scope or None,
        validate_token_resource=True,
    )
    verifier = IntrospectionVerifier(
        args.introspection_url, args.introspection_client_id, secret, issuer=args.issuer
    )
    app = build_app(settings, verifier, json_response=args.json_response)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
