"""Issue 22, item 12: the CLI starts fast and reads well. ``longcall --help`` imports no command module
(nor SQLAlchemy, Celery, psycopg, Redis, pydantic); each command is loaded when it runs; every option says
what it does, and no help text shows reStructuredText markup. (The CPU figures are ``bench/cli_start.py``'s.)
"""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from console.common import EXIT_CODES
from console.main import COMMANDS, EXIT_CODES_TEXT, main
from tests.support.imports import loaded_by

HEAVY = (
    "sqlalchemy",
    "celery",
    "kombu",
    "psycopg",
    "redis",
    "pydantic",
    "rich",
    "ledger",
    "workers",
    "adapters",
)
MARKUP = re.compile(r"``|:(class|meth|func|data|attr|mod):`")


def test_help_lists_every_command_and_imports_none_of_them() -> None:
    help_ = "sys.modules['console.main'].main(['--help'], standalone_mode=False)"
    loaded = loaded_by(["console.main"], then=help_)
    assert sorted(m for m in loaded if m.split(".")[0] in HEAVY) == []
    listed = CliRunner().invoke(main, ["--help"]).output
    for name, (_, _, short) in COMMANDS.items():
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(short[:40])}", listed, re.MULTILINE), name


#: What reading the ledger or the settings costs: a command imports them when it runs, not when it loads.
READING = ("sqlalchemy", "psycopg", "pydantic", "pydantic_settings", "celery", "kombu", "redis", "adapters")


@pytest.mark.parametrize("command", ["status", "list", "watch", "result", "inputs"])
def test_a_reading_command_loads_without_the_libraries_it_reads_with(command: str) -> None:
    """``longcall status --help`` (the command's module loaded, nothing read) imports none of SQLAlchemy,
    psycopg, pydantic, Celery or the adapters: those come when the command runs (bench/cli_start.py)."""
    help_ = f"sys.modules['console.main'].main([{command!r}, '--help'], standalone_mode=False)"
    loaded = loaded_by(["console.main"], then=help_)
    assert COMMANDS[command][0] in loaded  # the command's own module was loaded
    assert sorted(m for m in loaded if m.split(".")[0] in READING) == []


def commands() -> list[tuple[str, click.Command]]:
    """Every command and subcommand, by its path (``gate simulate``)."""
    ctx = click.Context(main)
    found: list[tuple[str, click.Command]] = []
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert command is not None, name
        found.append((name, command))
        if isinstance(command, click.Group):
            sub = click.Context(command)
            found += [
                (f"{name} {n}", c) for n in command.list_commands(sub) if (c := command.get_command(sub, n))
            ]
    return found


def test_each_registered_command_is_the_command_of_its_name() -> None:
    ctx = click.Context(main)
    for name in COMMANDS:
        command = main.get_command(ctx, name)
        assert command is not None
        assert command.name == name
    assert main.get_command(ctx, "no-such-command") is None


def test_every_option_says_what_it_does_without_markup() -> None:
    missing, marked = [], []
    for path, command in commands():
        if MARKUP.search(command.help or ""):
            marked.append(path)
        for param in command.params:
            if isinstance(param, click.Option):
                if not param.help:
                    missing.append(f"{path} {param.opts[0]}")
                elif MARKUP.search(param.help):
                    marked.append(f"{path} {param.opts[0]}")
    assert missing == [], f"options without a help text: {missing}"
    assert marked == [], f"help texts with reStructuredText markup: {marked}"


def test_the_help_s_exit_codes_are_the_cli_s() -> None:
    assert "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) == EXIT_CODES_TEXT
