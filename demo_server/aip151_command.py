"""The command line that starts the demo AIP-151 server, for every Python caller (tests, the benchmark).

Importing this module does not import the server.
"""

from __future__ import annotations

import sys

MODULE = "demo_server.aip151"


def command(port: int, *flags: str, host: str = "127.0.0.1", python: str = sys.executable) -> list[str]:
    """The argv of a demo AIP-151 server on ``host:port``; ``flags`` are passed on as written (e.g.
    ``--envelope grpc_gateway``)."""
    return [python, "-m", MODULE, "--host", host, "--port", str(port), *flags]
