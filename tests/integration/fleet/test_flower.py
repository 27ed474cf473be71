"""Flower behind basic auth, seen through a real browser (issue 9): Debian's Chromium, headless, driven by
Playwright on the system binary (``scripts/ensure-browser`` installs it; never a browser of Playwright's
own). A missing browser fails the test.

Flower runs the Celery way (``celery -A workers.app flower --basic-auth=user:password``) on the fleet's
environment; it sees the workers' task events (``worker_send_task_events``), so after a short run every
operation's task is listed by its ``longcall.*`` name, and none of beat's ticks (they send no events).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from playwright.sync_api import BrowserContext, Page, expect, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from tests import support
from tests.support.fleet import Fleet, free_port

CHROMIUM = "/usr/bin/chromium"
USER, PASSWORD = "longcall-ops", "flower-test-password"
#: As root in a container: no sandbox, no GPU, and nothing that reaches out (QUIC, sync, updates).
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: What the tasks page must list after the run: the operations' steps.
EXPECTED_TASKS = ("longcall.submit", "longcall.poll")
#: What it must not: beat's ticks, four and more a second, which would flood it.
TICKS = ("longcall.dispatch_due", "longcall.drain_outbox", "longcall.reconcile")


class Flower:
    def __init__(self, fleet: Fleet) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = support.start_celery(
            [
                "-A",
                "workers.app",
                "flower",
                "--address=127.0.0.1",
                f"--port={self.port}",
                f"--basic-auth={USER}:{PASSWORD}",
            ],
            env=fleet.env,
            log_dir=fleet.log_dir,
            name="flower",
            ready_marker="Visit me at",
        )

    def task_names(self, **params: Any) -> list[str]:
        """The tasks Flower's task table would show (its own data endpoint, with credentials)."""
        answer = httpx2.get(
            f"{self.url}/tasks/datatable",
            params={
                "draw": 1,
                "start": 0,
                "length": 100,
                "search[value]": "",
                "order[0][column]": 0,
                "columns[0][data]": "received",
                "order[0][dir]": "desc",
                **params,
            },
            auth=(USER, PASSWORD),
            timeout=10,
        )
        answer.raise_for_status()
        return [row["name"] for row in answer.json()["data"]]


@pytest.fixture
def flower(fleet: Fleet) -> Iterator[Flower]:
    flower = Flower(fleet)
    try:
        yield flower
    finally:
        flower.process.stop()


def chromium_context(playwright: Any, profile: Path, **options: Any) -> BrowserContext:
    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} is missing: run scripts/ensure-browser (make browser)"
    context: BrowserContext = playwright.chromium.launch_persistent_context(
        str(profile),  # a fresh --user-data-dir
        executable_path=CHROMIUM,
        headless=True,
        chromium_sandbox=False,
        args=CHROMIUM_FLAGS,
        **options,
    )
    return context


def listed(page: Page, name: str) -> None:
    """The tasks page, filtered by name as a user would (``/tasks?name=...``), shows a row of ``name``."""
    response = page.goto(f"{page.url.split('/tasks')[0]}/tasks?name={name}")
    assert response is not None
    assert response.status == 200
    row = page.locator("#tasks-table tbody tr", has_text=name).first
    row.wait_for(state="visible", timeout=30_000)


def test_flower_asks_for_credentials_and_lists_the_longcall_tasks(
    fleet: Fleet, flower: Flower, tmp_path: Path
) -> None:
    # No credentials, or wrong ones: 401, with a basic-auth challenge.
    bare = httpx2.get(f"{flower.url}/tasks", timeout=10)
    assert bare.status_code == 401
    assert bare.headers["www-authenticate"].lower().startswith("basic")
    assert httpx2.get(f"{flower.url}/tasks", auth=(USER, "wrong"), timeout=10).status_code == 401

    # Flower records what happens from the moment its event receiver is connected: send a cheap task (a
    # cancel of a call node never submitted: recorded, nothing else) until it sees one, then run.
    warm = iter(range(1000))

    def flower_sees_events() -> bool:
        if "longcall.cancel" in flower.task_names():
            return True
        fleet.send_nowait("longcall.cancel", call_node_id=f"f/warm-{next(warm)}")
        return False

    support.wait_for("Flower to see the fleet's task events", flower_sees_events, timeout=60, interval=0.5)
    fleet.submit("f/quick", "slow_report", {"seconds": 0.5})
    fleet.submit("f/second", "slow_report", {"seconds": 1})
    fleet.wait_receipt("f/quick")
    fleet.wait_receipt("f/second")
    support.wait_for("every receipt delivered", fleet.settled)
    seen = set(flower.task_names(length=1000))
    assert not seen & set(TICKS), seen

    with sync_playwright() as playwright:
        # A browser with no credentials is challenged (401) and gets no page.
        anonymous = chromium_context(playwright, tmp_path / "profile-anonymous")
        try:
            page = anonymous.new_page()
            statuses: list[int] = []
            page.on("response", lambda r: statuses.append(r.status))
            with pytest.raises(PlaywrightError, match="ERR_INVALID_AUTH_CREDENTIALS"):
                page.goto(f"{flower.url}/tasks")
            assert statuses == [401]
        finally:
            anonymous.close()

        context = chromium_context(
            playwright,
            tmp_path / "profile",
            http_credentials={"username": USER, "password": PASSWORD},
        )
        try:
            page = context.new_page()
            response = page.goto(f"{flower.url}/tasks")
            assert response is not None
            assert response.status == 200
            # The unfiltered page: rows appear, each one a longcall task.
            first = page.locator("#tasks-table tbody tr", has_text="longcall.").first
            first.wait_for(state="visible", timeout=30_000)
            names = page.locator("#tasks-table tbody tr td").all_inner_texts()
            assert any(n.startswith("longcall.") for n in names)
            for name in EXPECTED_TASKS:
                listed(page, name)
                if name == "longcall.submit":  # one per submitted call node, both succeeded
                    rows = page.locator("#tasks-table tbody tr", has_text=name)
                    expect(rows).to_have_count(2, timeout=30_000)
                    expect(rows.filter(has_text="SUCCESS")).to_have_count(2, timeout=30_000)
        finally:
            context.close()
