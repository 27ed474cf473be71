"""A test's HTTP server on loopback, served on a thread of its own (unit tests that need a real socket)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: How long stopping a server waits for its thread.
SERVER_STOP_S = 5.0


@contextmanager
def serving(
    server: http.server.ThreadingHTTPServer, *, before_stop: Callable[[], None] | None = None
) -> Iterator[str]:
    """``server``'s URL while it serves; then ``before_stop`` (what lets a request still waiting answer, so
    a failed test does not hang its server), and the server stopped, closed and its thread joined."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        if before_stop is not None:
            before_stop()
        server.shutdown()
        server.server_close()
        thread.join(SERVER_STOP_S)


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A handler on HTTP/1.1 (its connections kept) that logs nothing; :meth:`answer` sends a body whole."""

    protocol_version = "HTTP/1.1"

    def answer(self, status: int, body: bytes, kind: str, *, extra: tuple[tuple[str, str], ...] = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        del format, args
