"""The parts of the chaos scenario (tests/integration/fleet/test_chaos.py): a TCP path to the MCP server that
can be cut, a seeded schedule of faults, and the fleet's processes as a supervisor keeps them.

Nothing here knows longcall: the fleet is started by ``tests.support.fleet`` and driven by task name."""

from __future__ import annotations

import contextlib
import random
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tests import support

#: The fault kinds the schedule draws from.
FAULTS = ("kill_worker", "kill_pool", "kill_beat", "crash_redis", "stop_postgres", "cut_server")


class CuttablePath:
    """A TCP forwarder from a local port to ``target``: while cut, nothing listens on its port (a connect
    is refused) and every connection through it is closed, as when the server's host drops off the
    network; then it listens again on the same port. One thread moves the bytes of every connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = support.free_port()
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self.cuts = 0
        self._listen()
        self._thread = threading.Thread(target=self._run, name="cuttable path", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        listener.setblocking(False)
        with self._lock:
            self._listener = listener
            self._selector.register(listener, selectors.EVENT_READ)

    def cut(self, seconds: float) -> None:
        """Close the listener and every connection now; listen again ``seconds`` later (in the background)."""
        with self._lock:
            self.cuts += 1
            if self._listener is not None:
                self._selector.unregister(self._listener)
                self._listener.close()
                self._listener = None
            for sock in list(self._pairs):
                self._close(sock)

        def heal() -> None:
            if not self._stop.wait(seconds):
                self._listen()

        threading.Thread(target=heal, name="cuttable path heals", daemon=True).start()

    def _close(self, sock: socket.socket) -> None:
        peer = self._pairs.pop(sock, None)
        for each in (sock, peer):
            if each is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(each)
            self._pairs.pop(each, None)
            with contextlib.suppress(OSError):
                each.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._selector.select(timeout=0.2)
            except (OSError, ValueError):
                continue
            for key, _ in events:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                with self._lock:
                    if sock is self._listener:
                        self._accept(sock)
                    elif sock in self._pairs:
                        self._pump(sock)

    def _accept(self, listener: socket.socket) -> None:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
        self._pairs[client] = upstream
        self._pairs[upstream] = client

    def _pump(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(sock)
            return
        peer = self._pairs[sock]
        try:
            peer.setblocking(True)
            peer.settimeout(5)
            peer.sendall(data)
            peer.setblocking(False)
        except OSError:
            self._close(sock)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for sock in list(self._pairs):
                self._close(sock)
            if self._listener is not None:
                self._listener.close()
                self._listener = None


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    target: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        what = f"{self.kind}[{self.target}]" if self.kind in ("kill_worker", "kill_pool") else self.kind
        return f"{self.at_s:5.1f}s {what}" + (f" for {self.seconds:.1f}s" if self.seconds else "")


def schedule(seed: int, *, span_s: float, workers: int) -> list[Fault]:
    """A seeded schedule over ``span_s``: every fault kind at least once, then more at random, spaced so
    that the fleet is never down for good (a fault starts at least 4 s after the one before)."""
    rng = random.Random(seed)
    kinds = [*FAULTS, *(rng.choice(FAULTS) for _ in range(3))]
    rng.shuffle(kinds)
    faults: list[Fault] = []
    at = 3.0
    step = (span_s - at) / len(kinds)
    for kind in kinds:
        at += rng.uniform(0.6 * step, step)
        seconds = 0.0
        if kind == "stop_postgres":
            seconds = rng.uniform(3.0, 8.0)
        elif kind == "cut_server":
            seconds = rng.uniform(2.0, 5.0)
        elif kind == "crash_redis":
            seconds = rng.uniform(0.5, 3.0)
        faults.append(Fault(round(at, 1), kind, rng.randrange(workers), round(seconds, 1)))
    return faults


@dataclass
class Clock:
    """Seconds since the scenario started."""

    started: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return time.monotonic() - self.started

    def until(self, at_s: float, tick: Callable[[], None], *, interval_s: float = 0.2) -> None:
        """Run ``tick`` every ``interval_s`` until ``at_s`` (the scenario's other duties while it waits)."""
        while self.now() < at_s:
            tick()
            time.sleep(min(interval_s, max(0.0, at_s - self.now())))


@contextlib.contextmanager
def cuttable_path(target: tuple[str, int]) -> Iterator[CuttablePath]:
    path = CuttablePath(target)
    try:
        yield path
    finally:
        path.close()
