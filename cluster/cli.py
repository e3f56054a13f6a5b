"""`nightshift node ...`: inspect this node's accelerators and join it to a Ray cluster with matching tags."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from cluster.inventory import NodeInventory

node_app = typer.Typer(
    help="Detect this node's accelerators (NVIDIA, AMD or CPU) and start Ray on it with matching resource tags.",
    no_args_is_help=True,
)


@node_app.command("detect")
def detect_command(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the inventory as JSON instead of a table.")
    ] = False,
) -> None:
    """Show the accelerators on this node, the engine stack each needs, and the tags Ray would get."""
    from cluster.detect import detect_node
    from cluster.node import advertised_resources
    from cluster.stacks import engine_stack_for
    from cluster.visibility import VisibilityError

    inventory = detect_node()
    try:
        resources = advertised_resources(inventory)
    except VisibilityError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if as_json:
        devices = [
            {
                **device.model_dump(mode="json"),
                "engine_stack": engine_stack_for(device).model_dump(mode="json"),
            }
            for device in inventory.accelerators
        ]
        document = {
            **inventory.model_dump(mode="json"),
            "accelerators": devices,
            "engine_stack": engine_stack_for(None).model_dump(mode="json")
            if inventory.vendor == "cpu"
            else None,
            "resources": resources,
        }
        typer.echo(json.dumps(document, indent=2))
        return
    _print_inventory_table(inventory, resources)


def _print_inventory_table(inventory: NodeInventory, resources: dict[str, int]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from cluster.stacks import engine_stack_for

    console = Console(soft_wrap=True)
    table = Table(title=f"{inventory.vendor} node ({inventory.source}), {inventory.cpu_count} CPUs")
    for column in ("GPU", "model", "memory", "arch", "engine stack"):
        table.add_column(column)
    for device in inventory.accelerators:
        stack = engine_stack_for(device)
        table.add_row(
            str(device.index),
            escape(device.model),
            f"{device.memory_gib} GiB" if device.memory_gib is not None else "?",
            device.compute_capability or device.gfx_target or "?",
            stack.stack or "[red]none[/red]",
        )
    if not inventory.accelerators:
        memory = f"{inventory.memory_bytes / 1024**3:.0f} GiB RAM" if inventory.memory_bytes else "?"
        table.add_row("-", f"{inventory.cpu_count} CPU cores", memory, "-", engine_stack_for(None).stack)
    console.print(table)
    console.print(f"tags: {json.dumps(resources, sort_keys=True)}")
    for warning in inventory.warnings:
        console.print(f"[yellow]warning[/yellow]: {escape(warning)}")


@node_app.command("start")
def start_command(
    head: Annotated[
        bool, typer.Option("--head", help="Start a new cluster with this node as its head.")
    ] = False,
    address: Annotated[
        str | None, typer.Option("--address", help="Join the cluster whose head is at HOST:PORT.")
    ] = None,
    token_file: Annotated[
        str | None,
        typer.Option(
            "--token-file",
            help="File holding the cluster's Ray token. Head: created (mode 0600) if missing; default "
            "$NIGHTSHIFT_HOME/ray/auth_token. Worker: a copy of the head's; default RAY_AUTH_TOKEN, "
            "RAY_AUTH_TOKEN_PATH, then $NIGHTSHIFT_HOME/ray/auth_token.",
        ),
    ] = None,
    no_auth: Annotated[
        bool,
        typer.Option(
            "--no-auth",
            help="No token authentication, for a laptop-only cluster: a single node bound to 127.0.0.1, on "
            "which any local user or process can run code.",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the `ray start` command and tags; run nothing.")
    ] = False,
    extra_args: Annotated[
        list[str] | None,
        typer.Argument(
            help="More `ray start` arguments after `--` (e.g. -- --block --port=6380); they win over ours."
        ),
    ] = None,
) -> None:
    """Run `ray start` with --num-gpus and --resources tags that match this node's accelerators, and Ray's token
    authentication (RAY_AUTH_MODE=token, the token read from a file that stays off the command line)."""
    from cluster.auth import AuthError
    from cluster.node import NodeStartError, start_node
    from cluster.visibility import VisibilityError

    try:
        code = start_node(
            head=head,
            address=address,
            dry_run=dry_run,
            extra_args=list(extra_args or []),
            token_file=token_file,
            no_auth=no_auth,
        )
    except (NodeStartError, VisibilityError, AuthError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)
