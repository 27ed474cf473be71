"""The command line every demo server shares (``--host``, ``--port``, ``--log-level``) and its start under
uvicorn; each server adds its own options and builds its app from them."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import uvicorn

from demo_server._asgi import App


def run(
    argv: list[str] | None,
    *,
    module: str,
    doc: str | None,
    port: int,
    add_options: Callable[[argparse.ArgumentParser], None],
    build_app: Callable[[argparse.Namespace], App],
) -> None:
    """Parse ``python -m <module>``'s arguments and serve the app they build until uvicorn stops."""
    description = (doc or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    add_options(parser)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    config = uvicorn.Config(
        build_app(args),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    uvicorn.Server(config).run()
