"""Placement groups of sharded engines (topology.EngineGroup): one group per engine, reserved before its actor is
created and placed whole — the actor in bundle 0, its ranks in theirs (vLLM's Ray executor finds the group as the
actor's own; the multiprocessing executor's ranks use the cores the group holds on the actor's node).

Runs where engine actors are created: on the driver, for a job's Ray Data pool (`GroupPerActor`, Ray Data's
per-actor remote args, as Ray Data LLM does it), and in the warm-engine keeper. A group lives as long as its engine:
Ray restarts a dead engine actor inside its group (and re-creates the bundles of a lost node elsewhere); the group
is removed when the pool or the keeper lets the engine go.
"""

from __future__ import annotations

import uuid
from typing import Any

from pipeline.config import PoolConfig
from pipeline.engines.base import EngineSpec
from pipeline.topology import EngineGroup, Topology, engine_group


def pool_group(pool: PoolConfig, spec: EngineSpec) -> EngineGroup | None:
    """The group each engine of `pool` reserves (`spec`: the pool's engine spec, its overrides applied); None for
    engines of one rank."""
    return engine_group(
        Topology.of(spec.args),
        cpus_per_engine=pool.cpus_per_engine or 1.0,
        gpus_per_engine=pool.gpus_per_engine,
        resources=pool.resources_per_engine,
        accelerator_type=pool.accelerator_type,
    )


def actor_resources(pool: PoolConfig, group: EngineGroup | None) -> dict[str, Any]:
    """What an engine actor of `pool` asks Ray for: the pool's resources, or for a sharded engine bundle 0's share
    of its group (the rest is its ranks')."""
    if group is not None:
        return group.actor_resources()
    options: dict[str, Any] = {"num_cpus": pool.cpus_per_engine}
    if pool.gpus_per_engine:
        options["num_gpus"] = pool.gpus_per_engine
    if pool.resources_per_engine:
        options["resources"] = dict(pool.resources_per_engine)
    if pool.accelerator_type:
        options["accelerator_type"] = pool.accelerator_type
    return options


def reserve(group: EngineGroup, name: str) -> Any:
    """A new placement group for one engine (pending until the cluster can hold it whole)."""
    from ray.util.placement_group import placement_group

    return placement_group([dict(b) for b in group.bundles], strategy=group.strategy, name=name)


def in_group(placement_group: Any) -> dict[str, Any]:
    """Actor options that put an engine actor in bundle 0 of its group, with everything it starts (vLLM's Ray
    workers) in the same group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group,
            placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True,
        )
    }


def groups_named(prefix: str) -> list[dict[str, Any]]:
    """The live groups whose name starts with `prefix`: id, name, state, and the node of each bundle."""
    from ray.util.placement_group import placement_group_table

    return [
        entry
        for entry in placement_group_table().values()
        if str(entry.get("name", "")).startswith(prefix) and entry.get("state") != "REMOVED"
    ]


def release_named(prefix: str) -> int:
    """Remove every group whose name starts with `prefix` (a pool's, a job's); how many. By name, not by handle:
    Ray Data may copy the function that reserved them."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed = 0
    for entry in groups_named(prefix):
        try:
            remove_placement_group(
                PlacementGroup(ray.PlacementGroupID(bytes.fromhex(entry["placement_group_id"])))
            )
            removed += 1
        except Exception:  # noqa: BLE001 - removed meanwhile (its creator ended)
            pass
    return removed


class GroupPerActor:
    """Ray Data's `ray_remote_args_fn` for a pool of sharded engines: each engine actor the pool creates gets a
    group of its own, named `prefix`-N (Ray 2.60 calls it before each new actor; Ray marks it deprecated from 2.64
    on). `release_named(prefix)` removes them when the pool is done."""

    def __init__(self, group: EngineGroup, prefix: str) -> None:
        self.group = group
        self.prefix = prefix

    def __call__(self) -> dict[str, Any]:
        return in_group(reserve(self.group, f"{self.prefix}{uuid.uuid4().hex[:8]}"))
