"""The fake engine's ranks: what vLLM's Ray executor does for a sharded engine, without a model — one small Ray
actor per rank, each in its own bundle of the engine's placement group (so a group whose stages span nodes puts
them there), told its rank, stage and tensor rank as vLLM tells its workers. A request passes through every stage,
so a rank that is lost (its process, its node) is the engine lost, as it is for vLLM.

Runs inside the engine actor, which sits in bundle 0 of the group (runtime/engines/engine_group.py).
"""

from __future__ import annotations

import asyncio
from typing import Any


class RankLost(RuntimeError):
    """A rank of the engine is gone: the engine with it."""


class FakeRank:
    """One rank: where it runs and what it was told."""

    def __init__(self, rank: int, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        self.rank = rank
        self.tp, self.pp = tensor_parallel_size, pipeline_parallel_size

    def describe(self) -> dict[str, Any]:
        import os

        import ray

        return {
            "rank": self.rank,
            "stage": self.rank // self.tp,
            "tensor_rank": self.rank % self.tp,
            "world": self.tp * self.pp,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def forward(self, tokens: int) -> int:
        return tokens


async def start_ranks(tensor_parallel_size: int, pipeline_parallel_size: int) -> list[Any]:
    """One FakeRank per rank, rank i in bundle i of this actor's placement group (each takes its bundle's GPU, as
    a vLLM worker does); their descriptions once all are up."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_current_placement_group()
    if group is None:
        raise RuntimeError(
            "a sharded fake engine runs in its placement group (runtime/engines/engine_group.py)"
        )
    world = tensor_parallel_size * pipeline_parallel_size
    ranks = []
    for rank in range(world):
        gpus = group.bundle_specs[rank].get("GPU", 0)
        ranks.append(
            ray.remote(FakeRank)
            .options(
                num_cpus=0,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
            )
            .remote(rank, tensor_parallel_size, pipeline_parallel_size)
        )
    return ranks


async def describe(ranks: list[Any]) -> list[dict[str, Any]]:
    """Each rank's description, once all are up; RankLost when one never comes up (its node lost as it
    started)."""
    import ray

    try:
        return list(await asyncio.gather(*(rank.describe.remote() for rank in ranks)))
    except ray.exceptions.RayActorError as exc:
        raise RankLost(f"a rank of the engine did not start: {exc}") from None


async def through_every_stage(ranks: list[Any], tokens: int) -> None:
    """A request's pass through the pipeline; RankLost when a rank is gone."""
    import ray

    try:
        await asyncio.gather(*(rank.forward.remote(tokens) for rank in ranks))
    except ray.exceptions.RayActorError as exc:
        raise RankLost(f"a rank of the engine is gone: {exc}") from None
