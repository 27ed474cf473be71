"""The Cloud Spanner emulator as a real AIP-151 peer: start it on free loopback ports, stop it.

The emulator (Debian package ``google-cloud-cli-spanner-emulator``, preinstalled with google-cloud-cli on
this machine image) serves Google's own ``google.longrunning.Operations`` over gRPC (``emulator_main``)
and over REST through grpc-gateway (``gateway_main``, which starts ``emulator_main`` itself); see
reference/aip-151.md §5.2. Where the binaries are missing the fixture FAILS naming the package: a peer a
test needs is never skipped. ``LONGCALL_SPANNER_EMULATOR_DIR`` points elsewhere if the package put them
in another folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx2

from tests import support

PACKAGE = "google-cloud-cli-spanner-emulator"
DEFAULT_DIR = Path("/usr/lib/google-cloud-sdk/bin/cloud_spanner_emulator")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def emulator_dir() -> Path:
    return Path(os.environ.get("LONGCALL_SPANNER_EMULATOR_DIR", DEFAULT_DIR))


def binaries() -> tuple[Path, Path]:
    """(gateway_main, emulator_main), or an AssertionError naming the package to install."""
    folder = emulator_dir()
    gateway, emulator = folder / "gateway_main", folder / "emulator_main"
    for binary in (gateway, emulator):
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise AssertionError(
                f"the Cloud Spanner emulator binary {binary} is missing: install the Debian package "
                f"{PACKAGE} (apt-get install {PACKAGE}), or set LONGCALL_SPANNER_EMULATOR_DIR to its "
                f"cloud_spanner_emulator folder"
            )
    return gateway, emulator


@dataclass
class SpannerEmulator:
    """A running emulator: ``rest_root`` is ``http://127.0.0.1:<http_port>`` (the API under ``/v1``)."""

    rest_root: str
    grpc_port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM the process group (the gateway and the emulator it started), then SIGKILL; bounded."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                continue
            # the gateway is gone; its child may linger a moment in the same group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            return
        raise AssertionError(f"the Spanner emulator (pid {self.process.pid}) did not stop")


def start_spanner_emulator(log_dir: Path) -> SpannerEmulator:
    """The emulator on two free loopback ports, answering REST before this returns (else the test fails)."""
    gateway, emulator = binaries()
    grpc_port, http_port = support.free_port(), support.free_port()
    log_path = log_dir / f"spanner-{http_port}.log"
    with log_path.open("wb") as handle:
        process = subprocess.Popen(
            [
                str(gateway),
                "--hostname",
                "127.0.0.1",
                "--grpc_port",
                str(grpc_port),
                "--http_port",
                str(http_port),
                "--grpc_binary",
                str(emulator),
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    started = SpannerEmulator(f"http://127.0.0.1:{http_port}", grpc_port, process, log_path)

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the Spanner emulator exited with {process.returncode}:\n{started.log()}")
        try:
            return (
                httpx2.get(f"{started.rest_root}/v1/projects/probe/instances", timeout=1).status_code == 200
            )
        except httpx2.HTTPError:
            return False

    try:
        support.wait_for("the Spanner emulator's REST gateway to answer", up, timeout=START_TIMEOUT_S)
    except AssertionError:
        started.stop()
        raise
    return started
