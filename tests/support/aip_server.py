"""Start and stop the demo AIP-151 server (``demo_server.aip151``) as a child process for a test.

``start_aip_server(log_dir)`` picks a free port, starts the server in its own process group and waits
(bounded) until its control endpoint answers; ``AipServer`` has the API root, the control URL, helpers
for the switches, the request log and the operations, and ``stop``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

from demo_server.aip151_command import command
from tests import support

CONTROL_TIMEOUT_S = 5.0


@dataclass
class AipServer:
    #: The API root: ``{root}/v1/projects/{project}/reports:run`` creates, ``{root}/v1/{name}`` gets.
    root: str
    control: str
    process: support.CeleryProcess

    def run_url(self, project: str = "demo") -> str:
        return f"{self.root}/v1/projects/{project}/reports:run"

    def faults(self, **switches: Any) -> dict[str, Any]:
        """Set the named fault switches (the others stay); returns all of them."""
        response = httpx2.post(f"{self.control}/faults", json=switches, timeout=CONTROL_TIMEOUT_S)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def reset(self) -> None:
        """Every switch back to its start value, no operations, and an empty request log."""
        httpx2.delete(f"{self.control}/faults", timeout=CONTROL_TIMEOUT_S).raise_for_status()
        httpx2.delete(f"{self.control}/operations", timeout=CONTROL_TIMEOUT_S).raise_for_status()
        httpx2.delete(f"{self.control}/log", timeout=CONTROL_TIMEOUT_S).raise_for_status()

    def log(self) -> list[dict[str, Any]]:
        response = httpx2.get(f"{self.control}/log", timeout=CONTROL_TIMEOUT_S)
        response.raise_for_status()
        entries: list[dict[str, Any]] = response.json()["entries"]
        return entries

    def operations(self) -> dict[str, Any]:
        """``{"operations": [...], "expired": [...], "deleted": [...]}`` as the server keeps them."""
        response = httpx2.get(f"{self.control}/operations", timeout=CONTROL_TIMEOUT_S)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def stop(self) -> None:
        self.process.stop(timeout=10)


def start_aip_server(log_dir: Path, *flags: str, timeout: float = 30.0) -> AipServer:
    """A demo AIP-151 server on a free loopback port, answering before this returns (or the test fails)."""
    port = support.free_port()
    process = support.start_celery_like(command(port, *flags), env={}, log_dir=log_dir, name=f"aip151-{port}")
    root = f"http://127.0.0.1:{port}"
    control = f"{root}/_control"

    def up() -> bool:
        if process.proc.poll() is not None:
            raise AssertionError(
                f"the AIP-151 server exited with {process.proc.returncode}:\n{process.log()}"
            )
        try:
            return httpx2.get(f"{control}/faults", timeout=1).status_code == 200
        except httpx2.HTTPError:
            return False

    try:
        support.wait_for("the AIP-151 server to listen", up, timeout=timeout)
    except AssertionError:
        process.kill()
        raise
    return AipServer(root, control, process)


@contextmanager
def aip_server(log_dir: Path, *flags: str) -> Iterator[AipServer]:
    server = start_aip_server(log_dir, *flags)
    try:
        yield server
    finally:
        server.stop()
