"""The ``longcall`` command: the click group, its error mapping, and every command wired under it.

The commands live by what they do: ``console.operations`` (one operation and what waits on it),
``console.decisions`` (reconcile, the launch gate), ``console.fleet`` (migrate, adapters, rollback,
rollout), ``console.metrics``, ``console.dev`` and ``console.simulation``; what they print is built in
``console.output``, what they share (the exit codes, :data:`~console.common.EXIT_CODES`, stable: scripts
rely on them) in ``console.common``. A service that cannot be reached is one line on stderr naming it
(credentials masked), never a traceback: :class:`LongcallGroup` maps the connection errors of every
command, and the CLI's own connections time out within seconds.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

#: Every command: its module, the attribute in it, and the line ``longcall --help`` shows for it. A command's
#: module is imported when the command runs (or its own ``--help`` is asked for), never for another one:
#: ``longcall --help`` imports none of them, and ``longcall status`` imports what status needs.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "dev": ("console.dev.command", "dev", "Run the whole fleet locally, on embedded defaults."),
    "migrate": ("console.fleet", "migrate", "Create or upgrade the ledger's tables."),
    "submit": ("console.operations", "submit", "Submit one call (longcall.submit, through a worker)."),
    "list": ("console.listing", "list_", "List the operations in flight (or, filtered, those that ended)."),
    "status": ("console.operations", "status", "Show one operation, or the fleet without one."),
    "watch": ("console.operations", "watch", "Follow one operation's events until it is final."),
    "result": ("console.operations", "result", "Show the result of one operation's receipt."),
    "cancel": ("console.operations", "cancel", "Request the cancel of one operation."),
    "input": ("console.operations", "input_", "Answer an operation's input request."),
    "inputs": ("console.operations", "inputs", "List what waits for input (the approval gate)."),
    "reconcile": ("console.decisions", "reconcile", "List or decide what waits for an operator."),
    "gate": ("console.decisions", "gate", "The launch gate: the rollout criteria over the live ledger."),
    "adapters": ("console.fleet", "adapters", "Show, disable or enable adapters by protocol version."),
    "rollback": ("console.fleet", "rollback", "Close admission and bump the execution epoch."),
    "rollout": ("console.fleet", "rollout", "Open admission, or set the canary percentage."),
    "metrics": ("console.metrics", "metrics", "Serve Prometheus metrics read from the ledger and Redis."),
}


class LongcallGroup(click.Group):
    """Loads each command when it is asked for (:data:`COMMANDS`); every command's connection errors become
    one line and :data:`~console.common.EXIT_UNREACHABLE`; a database without the ledger's tables is a
    refusal that says to run ``longcall migrate``."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attribute, _ = COMMANDS[cmd_name]
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module}.{attribute} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands' list as click writes it, from :data:`COMMANDS` (no command module imported)."""
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own ends: a refusal, an exit code (a command's --help too), Ctrl-C
        except Exception as exc:
            # Only on a failure: these imports cost more than --help does in all.
            import psycopg  # noqa: PLC0415
            import sqlalchemy.exc  # noqa: PLC0415

            from console.common import as_unreachable  # noqa: PLC0415

            unreachable = as_unreachable(exc)
            if unreachable is not None:
                raise unreachable from None
            if isinstance(exc, sqlalchemy.exc.ProgrammingError) and isinstance(
                exc.orig, psycopg.errors.UndefinedTable
            ):
                missing = str(exc.orig).splitlines()[0]
                raise click.ClickException(
                    f"the ledger has no tables yet ({missing}): run longcall migrate"
                ) from None
            raise


#: ``longcall``'s exit codes (``console.common.EXIT_CODES``, written out here so that ``--help`` imports
#: nothing else; ``tests/unit/test_cli_start.py`` checks they agree).
EXIT_CODES_TEXT = (
    "0 ok; 1 refused (the reason on stderr); 2 usage error; 3 the database, Redis or the broker cannot be"
    " reached; 4 timed out waiting for a worker (or, for watch, for a final state)"
)


@click.group(cls=LongcallGroup, epilog=f"Exit codes: {EXIT_CODES_TEXT}.")
@click.version_option(package_name="longcall")
def main() -> None:
    """longcall: long-running tool calls under a terminal-state protocol."""


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
