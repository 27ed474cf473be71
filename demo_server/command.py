"""The command line that starts the demo MCP server, built in one place for every Python caller.

The end-to-end fleet, the conformance peers, the demo server's own tests and the lifecycle benchmark all
start ``python -m demo_server.mcp`` as a child process; docker-compose.yml writes the same line as text
and a test compares it with :func:`command`. Importing this module does not import the server.
"""

from __future__ import annotations

import sys

MODULE = "demo_server.mcp"


def command(
    port: int,
    *flags: str,
    host: str = "127.0.0.1",
    poll_interval_ms: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The argv of a demo server on ``host:port``; ``flags`` are passed on as written (e.g. ``--stateless``).

    ``poll_interval_ms`` is the ``pollInterval`` the server suggests to its clients; ``None`` leaves the
    server's default. ``python`` is the interpreter to run (the compose file says plain ``python``).
    """
    argv = [python, "-m", MODULE, "--host", host, "--port", str(port)]
    if poll_interval_ms is not None:
        argv += ["--poll-interval-ms", str(poll_interval_ms)]
    return [*argv, *flags]
