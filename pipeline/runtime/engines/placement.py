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
from dataclasses import dataclass, field

import structlog

from pipeline.config import PoolConfig
from pipeline.engines.base import EngineSpec, engine_class
from pipeline.runtime.engines.engine_group import pool_group
from pipeline.runtime.preflight import PreflightError
from pipeline.topology import EngineGroup, Topology

log = structlog.get_logger(__name__)

GiB = 1 << 30
# What one CPU engine process needs beside its weights and KV cache (torch, vLLM, the front end), measured as
# about 1 GiB with the embedded model; rounded up.
ENGINE_OVERHEAD_BYTES = 2 * GiB


@dataclass(frozen=True)
class Node:
    cpus: float
    memory_bytes: float  # Ray's `memory` resource: what tasks and actors may use
    resources: dict[str, float] = field(default_factory=dict)  # every resource the node offers, by Ray's name
    node_id: str = ""


def cpus_per_engine(engines: int, node_cpus: list[float], ranks: int = 1) -> float:
    """Whole cores per engine so that `engines` engines of `ranks` ranks each fit on nodes of these CPU counts, as
    evenly as they go (the smallest node bounds it: an engine asking for more than a node has could never be placed
    there); every rank gets the same whole cores."""
    if not node_cpus:
        return float(ranks)
    per_node = math.ceil(engines / len(node_cpus))
    return float(ranks * max(1, math.floor(min(node_cpus) / (per_node * ranks))))


def engines_per_core(nodes: list[Node], engine_bytes: int, ranks: int = 1) -> int:
    """One engine per `ranks` whole cores of each node, as many as the node's memory holds (at least one per
    node)."""
    total = 0
    for node in nodes:
        by_cores = int(node.cpus) // ranks
        by_memory = int(node.memory_bytes // engine_bytes) if engine_bytes > 0 else by_cores
        total += max(1, min(by_cores, by_memory))
    return max(1, total)


def engine_bytes(spec: EngineSpec) -> int:
    """Host memory one CPU engine takes: weights, the KV space of each rank, each rank's process."""
    from pipeline.model_shape import weights_bytes

    try:
        weights = weights_bytes(spec.model_path) or 0
    except Exception:  # noqa: BLE001 - an unreadable model is the engine's to report; size without it
        weights = 0
    ranks = Topology.of(spec.args).world
    kv = int(spec.args.get("cpu_kvcache_space_gib") or 2) * GiB
    return weights + ranks * (kv + ENGINE_OVERHEAD_BYTES)


def _nodes(pool: PoolConfig) -> list[Node]:
    """The alive nodes that offer every custom resource the pool's engines need."""
    import ray

    nodes = []
    for node in ray.nodes():
        resources = node.get("Resources", {})
        if node.get("Alive") and all(name in resources for name in pool.resources_per_engine):
            if resources.get("CPU", 0) >= 1:
                nodes.append(
                    Node(
                        float(resources["CPU"]),
                        float(resources.get("memory", 0)),
                        {k: float(v) for k, v in resources.items()},
                        node.get("NodeID", ""),
                    )
                )
    return nodes


def group_problem(group: EngineGroup, nodes: list[Node]) -> str | None:
    """Why no engine of this group could ever be placed on these nodes (their whole resources, not what is free
    now); None when one could."""

    def fits(need: dict[str, float], node: Node) -> bool:
        return all(node.resources.get(name, 0.0) + 1e-9 >= amount for name, amount in need.items())

    def total(bundles: tuple[dict[str, float], ...] | list[dict[str, float]]) -> dict[str, float]:
        summed: dict[str, float] = {}
        for bundle in bundles:
            for name, amount in bundle.items():
                summed[name] = summed.get(name, 0.0) + amount
        return summed

    def offered(node: Node) -> str:
        shown = {
            k: v for k, v in node.resources.items() if not k.startswith(("node:", "object_store", "memory"))
        }
        return f"{node.node_id[:8] or 'a node'}: " + ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items()))

    need = total(group.bundles)
    listed = "; ".join(offered(node) for node in nodes) or "no node offers the pool's resources"
    wanted = ", ".join(f"{k} {v:g}" for k, v in sorted(need.items()))
    if group.one_node:
        if any(fits(need, node) for node in nodes):
            return None
        return f"an engine needs {wanted} on one node ({len(group.bundles)} ranks packed together); nodes: {listed}"
    if not all(any(fits(bundle, node) for node in nodes) for bundle in group.bundles):
        return f"a rank's bundle fits no node; nodes: {listed}"
    across = total([node.resources for node in nodes])
    if not all(across.get(name, 0.0) + 1e-9 >= amount for name, amount in need.items()):
        return f"an engine needs {wanted} in all; the nodes together offer less: {listed}"
    return None


def check_pool_fits(pool: PoolConfig, spec: EngineSpec, nodes: list[Node]) -> None:
    """Raises PreflightError when an engine of the pool can never be placed on these nodes: which resources are
    missing, on which nodes (instead of Ray Data waiting for it for minutes)."""
    group = pool_group(pool, spec)
    if group is None:
        return
    problem = group_problem(group, nodes)
    if problem is not None:
        raise PreflightError(
            f"pool {pool.name}: its engines ({Topology.of(spec.args)}) cannot be placed on this cluster: {problem}"
        )


def place_pool(
    pool: PoolConfig, spec: EngineSpec, engines_given: bool = True, chunks: int | None = None
) -> PoolConfig:
    """The pool with its engine count (when not given; at most one per chunk of work) and each engine's CPU
    reservation decided; an engine that could never be placed is refused here. The cluster is read once."""
    nodes = _nodes(pool)
    placed = _place(pool, spec, engines_given, chunks, nodes)
    check_pool_fits(placed, spec, nodes)
    return placed


def _place(
    pool: PoolConfig, spec: EngineSpec, engines_given: bool, chunks: int | None, nodes: list[Node]
) -> PoolConfig:
    cpu_engine = pool.gpus_per_engine == 0 and engine_class(spec.backend).computes_on_cpu_cores
    if not cpu_engine:
        return pool if pool.cpus_per_engine is not None else pool.model_copy(update={"cpus_per_engine": 1.0})
    ranks = Topology.of(spec.args).world
    update: dict = {}
    if not engines_given:
        engines = engines_per_core(nodes, engine_bytes(spec), ranks)
        if chunks:
            engines = max(1, min(engines, chunks))  # an engine without a chunk only costs its start
        update = {"min_engines": engines, "max_engines": None}
    engines = update.get("min_engines", pool.max_engines or pool.min_engines)
    if pool.cpus_per_engine is None:
        update["cpus_per_engine"] = cpus_per_engine(engines, [node.cpus for node in nodes], ranks)
    placed = pool.model_copy(update=update)
    if update:
        log.info(
            "cpu engines placed",
            pool=pool.name,
            engines=engines,
            cpus_per_engine=placed.cpus_per_engine,
            ranks=ranks,
        )
    return placed
