"""How many engines a pool runs and how many Ray CPUs each reserves, where the job does not say.

An engine on GPUs needs one CPU for its front end. A CPU engine computes on cores of its own (cluster/cpu_cores.py).
How to cut a node's cores into engines was measured, not guessed (bench/shared_prefix.py, same requests, engine
args and cores for every path): on a 2-core box, two engines of one core each generated 1.09-1.13x the tokens per
second of one engine on both cores (one engine's threads wait on each other at every step, and any other process
on either core stalls both). So by default a CPU pool runs one engine per core of the nodes that can host it — as
many as each node's memory holds — and engines whose count is given share out their nodes' cores instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import structlog

from pipeline.config import PoolConfig
from pipeline.engines.base import EngineSpec, engine_class

log = structlog.get_logger(__name__)

GiB = 1 << 30
# What one CPU engine process needs beside its weights and KV cache (torch, vLLM, the front end), measured as
# about 1 GiB with the embedded model; rounded up.
ENGINE_OVERHEAD_BYTES = 2 * GiB


@dataclass(frozen=True)
class Node:
    cpus: float
    memory_bytes: float  # Ray's `memory` resource: what tasks and actors may use


def cpus_per_engine(engines: int, node_cpus: list[float]) -> float:
    """Whole cores per engine so that `engines` engines fit on nodes of these CPU counts, as evenly as they go
    (the smallest node bounds it: an engine asking for more than a node has could never be placed there)."""
    if not node_cpus:
        return 1.0
    per_node = math.ceil(engines / len(node_cpus))
    return float(max(1, math.floor(min(node_cpus) / per_node)))


def engines_per_core(nodes: list[Node], engine_bytes: int) -> int:
    """One engine per whole core of each node, as many as the node's memory holds (at least one per node)."""
    total = 0
    for node in nodes:
        by_memory = int(node.memory_bytes // engine_bytes) if engine_bytes > 0 else int(node.cpus)
        total += max(1, min(int(node.cpus), by_memory))
    return max(1, total)


def engine_bytes(spec: EngineSpec) -> int:
    """Host memory one CPU engine takes: weights, its KV space, the process itself."""
    from pipeline.planner import weights_bytes

    try:
        weights = weights_bytes(spec.model_path) or 0
    except Exception:  # noqa: BLE001 - an unreadable model is the engine's to report; size without it
        weights = 0
    kv = int(spec.args.get("cpu_kvcache_space_gib") or 2) * GiB
    return weights + kv + ENGINE_OVERHEAD_BYTES


def _nodes(pool: PoolConfig) -> list[Node]:
    """The alive nodes that offer every custom resource the pool's engines need."""
    import ray

    nodes = []
    for node in ray.nodes():
        resources = node.get("Resources", {})
        if node.get("Alive") and all(name in resources for name in pool.resources_per_engine):
            if resources.get("CPU", 0) >= 1:
                nodes.append(Node(float(resources["CPU"]), float(resources.get("memory", 0))))
    return nodes


def place_pool(
    pool: PoolConfig, spec: EngineSpec, engines_given: bool = True, chunks: int | None = None
) -> PoolConfig:
    """The pool with its engine count (when not given; at most one per chunk of work) and each engine's CPU
    reservation decided."""
    cpu_engine = pool.gpus_per_engine == 0 and engine_class(spec.backend).computes_on_cpu_cores
    if not cpu_engine:
        return pool if pool.cpus_per_engine is not None else pool.model_copy(update={"cpus_per_engine": 1.0})
    nodes = _nodes(pool)
    update: dict = {}
    if not engines_given:
        engines = engines_per_core(nodes, engine_bytes(spec))
        if chunks:
            engines = max(1, min(engines, chunks))  # an engine without a chunk only costs its start
        update = {"min_engines": engines, "max_engines": None}
    engines = update.get("min_engines", pool.max_engines or pool.min_engines)
    if pool.cpus_per_engine is None:
        update["cpus_per_engine"] = cpus_per_engine(engines, [node.cpus for node in nodes])
    placed = pool.model_copy(update=update)
    if update:
        log.info(
            "cpu engines placed", pool=pool.name, engines=engines, cpus_per_engine=placed.cpus_per_engine
        )
    return placed
