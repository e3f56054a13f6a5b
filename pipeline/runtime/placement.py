"""How many Ray CPUs each engine actor reserves, when the job does not say.

An engine on GPUs needs one CPU for its front end. A CPU engine computes on cores of its own (cluster/cpu_cores.py):
the more it gets, the faster it runs, and on a CPU box one engine on every core beat one engine per core
(bench/shared_prefix.py, same requests and cores). So by default a CPU engine takes the cores of the node it lands
on, shared out evenly among the engines the pool has to place on such nodes.
"""

from __future__ import annotations

import math

import structlog

from pipeline.config import PoolConfig
from pipeline.engines.base import engine_class

log = structlog.get_logger(__name__)


def cpus_per_engine(engines: int, node_cpus: list[float]) -> float:
    """Whole cores per engine so that `engines` engines fit on nodes of these CPU counts, as evenly as they go
    (the smallest node bounds it: an engine asking for more than a node has could never be placed there)."""
    if not node_cpus:
        return 1.0
    per_node = math.ceil(engines / len(node_cpus))
    return float(max(1, math.floor(min(node_cpus) / per_node)))


def _node_cpus(pool: PoolConfig) -> list[float]:
    """CPU counts of the alive nodes that offer every custom resource the pool's engines need."""
    import ray

    counts = []
    for node in ray.nodes():
        resources = node.get("Resources", {})
        if node.get("Alive") and all(name in resources for name in pool.resources_per_engine):
            counts.append(float(resources.get("CPU", 0)))
    return [c for c in counts if c >= 1]


def place_pool(pool: PoolConfig, backend: str) -> PoolConfig:
    """The pool with its engines' CPU reservation decided (a given value is kept)."""
    if pool.cpus_per_engine is not None:
        return pool
    if pool.gpus_per_engine > 0 or not engine_class(backend).computes_on_cpu_cores:
        cpus = 1.0
    else:
        cpus = cpus_per_engine(pool.max_engines or pool.min_engines, _node_cpus(pool))
        log.info("cpu engines take whole cores of their nodes", pool=pool.name, cpus_per_engine=cpus)
    return pool.model_copy(update={"cpus_per_engine": cpus})
