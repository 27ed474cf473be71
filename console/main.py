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

import sys
from typing import Any

import click
import psycopg
import sqlalchemy.exc

from console.common import EXIT_CODES, as_unreachable
from console.decisions import gate, reconcile
from console.dev.command import dev
from console.fleet import adapters, migrate, rollback, rollout
from console.listing import list_
from console.metrics import metrics
from console.operations import cancel, input_, inputs, result, status, submit, watch
from console.simulation.command import simulate


class LongcallGroup(click.Group):
    """Every command's connection errors become one line and :data:`EXIT_UNREACHABLE`; a database without
    the ledger's tables is a refusal that says to run ``longcall migrate``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException:
            raise
        except Exception as exc:
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


@click.group(
    cls=LongcallGroup,
    epilog="Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) + ".",
)
@click.version_option(package_name="longcall")
def main() -> None:
    """longcall: long-running tool calls under a terminal-state protocol."""


main.add_command(migrate)
main.add_command(submit)
main.add_command(status)
main.add_command(list_)
main.add_command(result)
main.add_command(cancel)
main.add_command(input_)
main.add_command(reconcile)
main.add_command(watch)
main.add_command(inputs)
main.add_command(gate)
main.add_command(adapters)
main.add_command(rollback)
main.add_command(rollout)
main.add_command(metrics)
main.add_command(dev)
gate.add_command(simulate)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
