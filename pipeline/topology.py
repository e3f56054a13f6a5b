"""An engine's topology: the ranks one engine is sharded into (tensor × pipeline parallel, vLLM's names), what a
model lets them be, and the resources each rank takes.

Pure: arithmetic on the model's shape (pipeline.model_shape) and the pool's settings; neither Ray nor vLLM.
The rules are vLLM's own, checked before any work so a job refused for its topology is refused at once with
what would work, instead of dying in an engine actor minutes later:
- tensor parallelism splits every layer: the query heads, the key/value heads (or replicates them when there are
  fewer KV heads than ranks, which then must be a multiple of them) and the MLP widths must divide evenly
  (vllm/config/model.py `verify_with_parallel_config`, QKVParallelLinear and the column-parallel MLP);
- pipeline parallelism splits the layers into stages, unevenly if need be: at most one stage per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.model_shape import ModelShape

# How far `tensor_parallel_sizes` looks: past 64 ranks one engine spans more than eight 8-GPU nodes.
MAX_TENSOR_PARALLEL = 64


class TopologyError(ValueError):
    """A topology the model or the pool cannot take; the message says what would work."""


class Topology(BaseModel):
    """How one engine is sharded: `tensor_parallel_size` ranks per pipeline stage, `pipeline_parallel_size`
    stages. Ranks are numbered stage-major (rank = stage × TP + tensor rank), as vLLM numbers them."""

    model_config = ConfigDict(frozen=True)

    tensor_parallel_size: int = Field(default=1, ge=1, description="Ranks that split every layer.")
    pipeline_parallel_size: int = Field(default=1, ge=1, description="Stages the layers are split into.")

    @classmethod
    def of(cls, args: Mapping[str, Any]) -> Topology:
        """The topology engine args ask for (vLLM's names; missing or None: 1)."""
        return cls(
            tensor_parallel_size=int(args.get("tensor_parallel_size") or 1),
            pipeline_parallel_size=int(args.get("pipeline_parallel_size") or 1),
        )

    @property
    def world(self) -> int:
        """Ranks (worker processes, devices) one engine has."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def __str__(self) -> str:
        return f"TP={self.tensor_parallel_size} PP={self.pipeline_parallel_size}"


def tensor_parallel_problem(shape: ModelShape, tp: int) -> str | None:
    """Why `tp` ranks cannot split this model (None: they can)."""
    if shape.attention_heads % tp:
        return f"its {shape.attention_heads} attention heads do not divide by {tp}"
    kv = shape.kv_heads
    if (tp < kv and kv % tp) or (tp >= kv and tp % kv):
        return f"its {kv} key/value heads neither divide by {tp} nor divide {tp}"
    for width in shape.mlp_sizes:
        if width % tp:
            return f"its MLP width {width} does not divide by {tp}"
    return None


def tensor_parallel_sizes(shape: ModelShape, up_to: int = MAX_TENSOR_PARALLEL) -> list[int]:
    """Every tensor_parallel_size this model takes, up to `up_to`."""
    return [tp for tp in range(1, up_to + 1) if tensor_parallel_problem(shape, tp) is None]


def check_topology(shape: ModelShape, topology: Topology, model: str) -> None:
    """Raises TopologyError when the model cannot be sharded so, naming the values that would work."""
    tp, pp = topology.tensor_parallel_size, topology.pipeline_parallel_size
    problem = tensor_parallel_problem(shape, tp)
    if problem is not None:
        valid = ", ".join(str(n) for n in tensor_parallel_sizes(shape))
        raise TopologyError(
            f"{model}: tensor_parallel_size {tp} cannot shard this model: {problem}. "
            f"It takes tensor_parallel_size {valid}"
        )
    if pp > shape.layers:
        raise TopologyError(
            f"{model}: pipeline_parallel_size {pp} is more stages than its {shape.layers} layers; "
            f"use at most {shape.layers}"
        )


def check_pool_resources(
    pool: str, topology: Topology, gpus_per_engine: float, cpus_per_engine: float | None, cpu_cores: bool
) -> None:
    """Raises TopologyError when a pool's per-engine resources cannot be shared out over its engines' ranks: a
    GPU engine takes one GPU per rank; a CPU engine that computes on cores of its own gives each rank the same
    whole number of them."""
    world = topology.world
    if not topology.sharded:
        return
    if gpus_per_engine > 0:
        if gpus_per_engine != world:
            raise TopologyError(
                f"pools[{pool}]: {topology} is {world} ranks of one GPU each: set gpus_per_engine: {world} "
                f"(it is {gpus_per_engine:g})"
            )
        return
    if cpu_cores and cpus_per_engine is not None and (cpus_per_engine % world or cpus_per_engine < world):
        raise TopologyError(
            f"pools[{pool}]: cpus_per_engine {cpus_per_engine:g} cannot be shared out over the {world} ranks of "
            f"{topology} (each computes on whole cores of its own): give a multiple of {world}"
        )


class EngineGroup(BaseModel):
    """The Ray placement group one sharded engine reserves: a bundle per rank, placed together as a whole.

    - A GPU engine: one GPU per bundle, and vLLM's Ray executor puts each rank's worker in its own bundle (as Ray
      Data LLM does): the group is what makes "one GPU per rank" true, and it lets pipeline stages sit on
      different nodes. Tensor-parallel ranks talk at every layer, so an engine without pipeline stages is packed
      strictly on one node; with stages, Ray packs them as tightly as the nodes allow.
    - A CPU engine: vLLM's CPU backend runs sharded engines only with its multiprocessing executor (it has no Ray
      executor), so every rank is a process of the engine actor's own and all of them share its node: the group
      reserves the cores of each rank there, strictly packed.
    The engine actor sits in bundle 0 with the front-end CPUs; the pool's custom resources are shared out over the
    bundles so every rank lands on a node that offers them."""

    model_config = ConfigDict(frozen=True)

    bundles: tuple[dict[str, float], ...] = Field(description="One per rank, rank order.")
    strategy: Literal["STRICT_PACK", "PACK"] = Field(description="Ray's placement strategy for the bundles.")
    executor: Literal["mp", "ray"] = Field(
        description="vLLM's distributed_executor_backend: its worker processes (one node) or Ray actors."
    )

    @property
    def one_node(self) -> bool:
        return self.strategy == "STRICT_PACK"

    def actor_resources(self) -> dict[str, float]:
        """What the engine actor itself asks of bundle 0 (Ray's num_cpus; the ranks' GPUs stay in the bundles)."""
        return {"num_cpus": self.bundles[0].get("CPU", 0.0)}


def engine_group(
    topology: Topology,
    *,
    cpus_per_engine: float,
    gpus_per_engine: float,
    resources: Mapping[str, float],
    accelerator_type: str | None = None,
) -> EngineGroup | None:
    """The placement group of one engine of `topology` (None: one rank, placed as one actor). `cpus_per_engine`:
    a GPU engine's front-end CPUs, or a CPU engine's cores over all its ranks (check_pool_resources has checked
    they share out)."""
    if not topology.sharded:
        return None
    world = topology.world
    shared = {name: amount / world for name, amount in resources.items()}
    if accelerator_type:  # Ray's own accelerator_type constraint, asked of every rank's node
        shared[f"accelerator_type:{accelerator_type}"] = 0.001
    if gpus_per_engine > 0:
        bundles = [{"GPU": 1.0, **shared} for _ in range(world)]
        bundles[0]["CPU"] = cpus_per_engine
        strategy = "PACK" if topology.pipeline_parallel_size > 1 else "STRICT_PACK"
        return EngineGroup(bundles=tuple(bundles), strategy=strategy, executor="ray")
    per_rank = cpus_per_engine / world
    bundles = [{"CPU": per_rank, **shared} for _ in range(world)]
    return EngineGroup(bundles=tuple(bundles), strategy="STRICT_PACK", executor="mp")


def stage_layers(layers: int, pipeline_parallel_size: int) -> list[int]:
    """Layers on each pipeline stage, split as vLLM splits them (vllm/distributed/utils.py `get_pp_indices`).

    Evenly where they divide; the remainder goes one layer each to the stages before the last, from the
    second-to-last backwards: the last stage carries the final norm and the LM head, the first the embeddings, so
    extra layers land in the middle first (30 layers over 4 stages: 7, 8, 8, 7). vLLM's VLLM_PP_LAYER_PARTITION
    environment override is not modelled.
    """
    if not 1 <= pipeline_parallel_size <= layers:
        raise TopologyError(f"cannot split {layers} layers into {pipeline_parallel_size} stages")
    per_stage, remainder = divmod(layers, pipeline_parallel_size)
    split = [per_stage] * pipeline_parallel_size
    for stage in range(2, remainder + 2):
        split[-stage] += 1
    return split


def kv_heads_per_rank(shape: ModelShape, tensor_parallel_size: int) -> int:
    """KV heads each tensor-parallel rank caches (vllm/config/model.py `get_num_kv_heads`): the model's KV heads
    divided among the ranks, at least one, so with more ranks than KV heads each head is replicated on
    tensor_parallel_size / kv_heads ranks. MLA caches one latent per layer on every rank, whatever the split."""
    if shape.is_mla:
        return 1
    return max(1, shape.kv_heads // tensor_parallel_size)
