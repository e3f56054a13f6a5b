"""An engine's topology: the ranks one engine is sharded into (tensor × pipeline parallel, vLLM's names), what a
model lets them be, and the resources each rank takes.

Pure: arithmetic on the model's config.json (planner.ModelShape) and the pool's settings; neither Ray nor vLLM.
The rules are vLLM's own, checked before any work so a job refused for its topology is refused at once with
what would work, instead of dying in an engine actor minutes later:
- tensor parallelism splits every layer: the query heads, the key/value heads (or replicates them when there are
  fewer KV heads than ranks, which then must be a multiple of them) and the MLP widths must divide evenly
  (vllm/config/model.py `verify_with_parallel_config`, QKVParallelLinear and the column-parallel MLP);
- pipeline parallelism splits the layers into stages, unevenly if need be: at most one stage per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.planner import ModelShape

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
