"""Issue 22, item 10: the README's first screen says what longcall is, the two commands and what to do next,
in under 60 lines; every link in it and in the user's guides under docs/ leads somewhere; the guides speak
to users (no rule numbers, no "seed" criteria). ``longcall dev`` itself runs to its end in
``tests/integration/fleet/test_dev.py``; ``make test`` is what CI runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from console.main import COMMANDS
from tests import support
from workers import client

REPO = Path(support.REPO)
README = REPO / "README.md"
GUIDES = [
    REPO / "docs" / name
    for name in (
        "getting-started.md",
        "pipeline.md",
        "operating.md",
        "configuration.md",
        "durability.md",
        "rollout.md",
        "scaling.md",
        "development.md",
    )
]
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def test_the_first_screen_is_under_sixty_lines_with_the_two_commands_and_what_next() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 60
    [commands, *_] = code_blocks(text, "sh")
    lines = [line.split("#")[0].strip() for line in commands.strip().splitlines()]
    assert lines == [
        "python3 -m venv .venv && .venv/bin/pip install -e '.[demo]' && .venv/bin/longcall dev",
        "make test",
    ]
    assert "dev" in COMMANDS
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "demo" in extras
    assert re.search(r"^test:", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert "## What next" in text


def test_the_readme_s_pipeline_example_compiles_and_names_what_the_client_has() -> None:
    [example] = code_blocks(README.read_text(), "python")
    compile(example, "README.md", "exec")
    for name in re.findall(r"client\.(\w+)", example):
        assert hasattr(client, name), name


@pytest.mark.parametrize("document", [README, *GUIDES], ids=lambda p: p.name)
def test_every_link_leads_somewhere(document: Path) -> None:
    for target in LINK.findall(document.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        assert linked.exists(), f"{document.name}: {target}"
        if anchor:
            headings = [
                re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                for line in linked.read_text().splitlines()
                if line.startswith("#")
            ]
            assert anchor in headings, f"{document.name}: {target} (headings: {headings})"


@pytest.mark.parametrize("document", [README, *GUIDES], ids=lambda p: p.name)
def test_the_guides_speak_to_users(document: Path) -> None:
    text = document.read_text()
    assert not re.search(r"\brules? \d+\b", text, re.IGNORECASE), document.name
    assert "the seed's" not in text, document.name
