"""Control of the fleet as a whole: ``migrate`` (the ledger's tables), ``adapters`` (disable or enable a
protocol version, probe the servers' generations), ``rollback`` (a new execution epoch and its owner) and
``rollout`` (admission, the canary past the launch gate, shadow mode, the audit). Every change is kept
with its actor and reason in the ledger."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click
import httpx2

from adapters import NoBearerToken, detect_generation
from console import output
from console.common import acting_operator, as_unreachable, cli_settings, console, open_ledger
from console.launch_gate import evaluate_gate
from ledger import migrate as migrations
from ledger.records import ControlState
from ledger.repository import Ledger
from workers.auth import TokenProviders, describe_auth
from workers.budget import label_request
from workers.errors import NoToken
from workers.rollout import FIRST_CANARY_PERCENT, RolloutState, plain_percent, side_effect_free_tools
from workers.runtime import Runtime
from workers.settings import Settings
from workers.steps.context import StepContext, spread, utc_now
from workers.submission import ADAPTERS


@click.command()
def migrate() -> None:
    """Create or upgrade the ledger tables in LONGCALL_DATABASE_URL (Alembic, to head)."""
    settings = cli_settings()
    try:
        if migrations.ensure_database(settings.database_url):
            console.print("created the ledger database")
        migrations.upgrade(settings.database_url)
    except Exception as exc:
        if as_unreachable(exc, settings) is not None:
            raise
        raise click.ClickException(f"migration failed: {exc}") from exc
    console.print(f"ledger at head ({', '.join(migrations.current_heads(settings.database_url))})")


REASON_HELP = "Why (kept with the change in executor_control_audit)."


@click.command()
@click.option(
    "--disable",
    "disable",
    default=None,
    metavar="PROTOCOL/VERSION",
    help="Refuse new operations on this adapter (e.g. mcp/2025-11-25); those in flight finish.",
)
@click.option(
    "--enable",
    "enable",
    default=None,
    metavar="PROTOCOL/VERSION",
    help="Take new operations on this adapter again.",
)
@click.option(
    "--detect",
    is_flag=True,
    help="also probe each configured MCP server's generation (server/discover, initialize)",
)
@click.option("--reason", default=None, help=REASON_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def adapters(
    disable: str | None, enable: str | None, as_json: bool, detect: bool = False, reason: str | None = None
) -> None:
    """Adapters by protocol version: in-flight operations, and disabling one for new operations (rule 14).

    A disabled adapter refuses new submissions; query, cancel and reconciliation of its operations keep
    working until the last one is final.
    """
    with open_ledger() as ledger:
        for key, disabled in ((disable, True), (enable, False)):
            if key is not None:
                protocol, _, version = key.partition("/")
                if (protocol, version) not in ADAPTERS:
                    known = ", ".join(f"{p}/{v}" for p, v in sorted(ADAPTERS))
                    raise click.BadParameter(f"no adapter {key!r} (known: {known})")
                ledger.set_adapter_disabled(
                    protocol, version, disabled=disabled, actor=acting_operator(), reason=reason
                )
        control = ledger.control()
        in_flight = ledger.in_flight_by_adapter()
    settings = cli_settings()
    rows = output.adapter_rows(ADAPTERS, control.disabled_adapters, in_flight)
    servers = _detected_generations(settings) if detect else None
    if as_json:
        # The plain list stays as it was (scripts read it); with --detect, an object that says who owns
        # the epoch too (``longcall status --json`` always does).
        answer: Any = rows
        if servers is not None:
            epoch = output.ownership_json(control, settings.executor_id)
            answer = {"adapters": rows, "servers": servers, "epoch": epoch}
        click.echo(json.dumps(answer, indent=2))
        return
    console.print(output.adapters_table(rows))
    console.print(output.epoch_line(control, settings.executor_id))
    for server in servers or []:
        if not server["probed"]:
            console.print(f"{server['server']}: not probed: {server['detail']}")
            continue
        speaks = "" if server["speaks_configured"] else "  (does NOT speak the configured version)"
        console.print(
            f"{server['server']}: configured {server['configured']}, detected {server['generation']}"
            f"{' with tasks' if server['tasks'] else ''}{speaks} - {server['detail']}"
        )
        console.print(f"  auth: {output.auth_line(server['auth'])}", highlight=False)


def _detected_generations(settings: Settings) -> list[dict[str, Any]]:
    """Each configured MCP server's generation as probed now (the MCP tasks extension's discovery), each
    request charged to the server's control budget as a step's are (rule 4: a control token per request,
    the request named ``Longcall-Budget: control`` and counted for ``longcall metrics``). Without a token
    the probe of that server stops there, and says so: never a request over the budget."""
    found: list[dict[str, Any]] = []
    runtime = Runtime.from_settings(settings)
    ctx = StepContext(runtime, jitter=spread, clock=utc_now)
    tokens = TokenProviders()
    try:
        with httpx2.Client(timeout=5.0, event_hooks={"request": [label_request]}) as client:
            for name, server in sorted(runtime.fleet.servers.items()):
                auth = describe_auth(name, server, tokens)
                if server.protocol != "mcp":
                    continue
                configured = server.protocol_version
                try:
                    generation = detect_generation(
                        client,
                        server.url,
                        server=name,
                        bearer_token=tokens.provider(name, server),
                        budget=ctx.budget.per_request(name, "control"),
                    ).to_json()
                except (NoToken, NoBearerToken) as refused:
                    detail = (
                        f"no control token (the next in {refused.wait_s:.1f} s; control_qps "
                        f"{server.control_qps:g}): nothing more is sent to it now, within its control budget"
                        if isinstance(refused, NoToken)
                        else f"no bearer token, nothing sent: {refused}"
                    )
                    generation = {"server": name, "generation": "unknown", "tasks": False, "detail": detail}
                    found.append(
                        {
                            **generation,
                            "configured": configured,
                            "speaks_configured": False,
                            "probed": False,
                            "auth": auth,
                        }
                    )
                    continue
                speaks = generation["generation"] == configured
                found.append(
                    {
                        **generation,
                        "configured": configured,
                        "speaks_configured": speaks,
                        "probed": True,
                        "auth": auth,
                    }
                )
    finally:
        tokens.close()
        runtime.close()
    return found


@click.command()
@click.option(
    "--owner",
    default=None,
    metavar="EXECUTOR_ID",
    help="The executor identity (LONGCALL_EXECUTOR_ID) of the fleet that owns the new epoch; by default "
    "this environment's.",
)
@click.option("--any-owner", is_flag=True, help="The new epoch is every fleet's (no owner).")
@click.option("--reason", default=None, help=REASON_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def rollback(owner: str | None, any_owner: bool, reason: str | None, as_json: bool) -> None:
    """Close admission and bump the execution epoch (rule 13), owned by one executor identity (this
    environment's LONGCALL_EXECUTOR_ID unless --owner or --any-owner): the fleet running under it takes over
    the in-flight operations on its next claim; every write of the old epoch is refused from then on, and a
    fleet of any other identity claims nothing and sends nothing (stop it; a later rollback can hand it an
    epoch). "longcall rollout" then opens admission again."""
    if any_owner and owner is not None:
        raise click.UsageError("--owner names the new epoch's owner, --any-owner gives it none: choose one")
    if owner is not None and not owner.strip():
        raise click.UsageError(
            "--owner needs an executor identity (LONGCALL_EXECUTOR_ID of the fleet to keep)"
        )
    settings = cli_settings()
    actor = acting_operator()
    with open_ledger(settings) as ledger:
        ledger.set_admission(open_=False, actor=actor, reason=reason)
        control = ledger.bump_epoch(
            actor=actor, reason=reason, owner=None if any_owner else (owner or settings.executor_id)
        )
    owned = output.owned_by_text(control, settings.executor_id)
    _print_control(
        control, as_json, f"admission closed; execution epoch now {control.execution_epoch}, {owned}"
    )


@click.command()
@click.option(
    "--percent",
    type=click.FloatRange(0, 100),
    default=None,
    help=f"The canary: the share of call nodes routed to longcall (first {FIRST_CANARY_PERCENT}; a raise "
    "asks the launch gate; lowering is always allowed).",
)
@click.option("--shadow", type=click.Choice(["on", "off"]), default=None, help="Shadow mode on or off.")
@click.option("--force", is_flag=True, help="Raise the percentage although the gate fails (needs --reason).")
@click.option("--reason", default=None, help=REASON_HELP)
@click.option("--history", is_flag=True, help="List the audited control changes, newest first.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def rollout(
    percent: float | None, shadow: str | None, force: bool, reason: str | None, history: bool, as_json: bool
) -> None:
    """Open admission of new operations (after a rollback, once the executor to keep runs); with
    --percent or --shadow, change the rollout instead (workers/rollout.py); --history shows the audit.

    Raising the canary's percentage is refused (exit 1, naming the failing criteria) while the launch gate
    fails, unless --force with a --reason (audited as force_canary_percent)."""
    if history:
        if percent is not None or shadow is not None or force:
            raise click.UsageError("--history only lists; give it alone (with --json)")
        _print_history(as_json)
        return
    if force and (percent is None or not reason):
        raise click.UsageError("--force needs --percent and a --reason (kept in the audit)")
    actor = acting_operator()
    if percent is None and shadow is None:
        with open_ledger() as ledger:
            control = ledger.set_admission(open_=True, actor=actor, reason=reason)
        _print_control(control, as_json, f"admission open; execution epoch {control.execution_epoch}")
        return
    settings = cli_settings()
    with open_ledger(settings) as ledger:
        if shadow == "on" and not side_effect_free_tools(settings.fleet()):
            raise click.ClickException(
                "shadow mode runs only tools marked side_effect_free = true in LONGCALL_CONFIG "
                "([servers.NAME.tools.TOOL]); none is: refused"
            )
        # The gate is asked before anything changes: a refused raise changes nothing.
        decided = None if percent is None else _canary_decision(ledger, settings, percent, force, reason)
        if shadow is not None:
            control = ledger.set_shadow(on=shadow == "on", actor=actor, reason=reason)
        if percent is not None and decided is not None:
            action, why = decided
            control = ledger.set_canary_percent(
                plain_percent(percent), actor=actor, reason=why, action=action
            )
    state = RolloutState.from_control(control.rollout)
    canary = "not set (everything routed)" if state.canary_percent is None else f"{state.canary_percent}%"
    _print_control(control, as_json, f"canary {canary}; shadow {'on' if state.shadow else 'off'}")


def _canary_decision(
    ledger: Ledger, settings: Settings, percent: float, force: bool, reason: str | None
) -> tuple[str, str | None]:
    """The audit action and reason of setting the canary to ``percent``; a raise past a failing launch
    gate is refused (naming the failing criteria) unless forced."""
    current = RolloutState.from_control(ledger.control().rollout).canary_percent
    if percent <= (current if current is not None else FIRST_CANARY_PERCENT):
        return "set_canary_percent", reason  # lowering (or the first step) is always allowed
    report = evaluate_gate(ledger, settings)
    if report.passed:
        return "set_canary_percent", reason
    if not force:
        failing = "; ".join(f"{c.name} ({c.measured}, target {c.target})" for c in report.failing)
        raise click.ClickException(
            f"the launch gate refuses raising the canary from {current}% to {plain_percent(percent)}%: "
            f"failing {failing}. longcall gate shows what is behind each; --force --reason overrides"
        )
    names = ", ".join(c.name for c in report.failing)
    return "force_canary_percent", f"forced past the launch gate (failing: {names}): {reason}"


def _print_history(as_json: bool) -> None:
    with open_ledger() as ledger:
        changes = ledger.control_history()
    if as_json:
        click.echo(json.dumps([c.to_json() for c in changes], indent=2))
        return
    if not changes:
        console.print("no control change recorded")
        return
    for change in changes:
        console.print(
            f"{change.at:%Y-%m-%d %H:%M:%S} {change.actor} {change.action}: {change.reason or '(no reason)'}",
            soft_wrap=True,
        )


def _print_control(control: ControlState, as_json: bool, text: str) -> None:
    if as_json:
        click.echo(json.dumps(output.jsonable(dataclasses.asdict(control)), indent=2))
    else:
        console.print(text)
