"""Multi-node Ray clusters on one machine, for tests and demos of accelerator routing.

Each node is a real raylet (`ray.cluster_utils.Cluster`) that advertises the same custom resources a real node
would (`cluster.tags`), so scheduling by `accelerator:cuda` / `accelerator:rocm` can be exercised on a laptop:

    with mixed_cluster([NodeSpec.cpu("head"), NodeSpec.tagged("gpu-a", "cuda"), NodeSpec.tagged("gpu-b", "rocm")]) as c:
        ray.init(address=c.address)
        ...  # a task with resources={"accelerator:rocm": 1} runs on c.node_ids["gpu-b"]

The first spec is the head. Object stores are kept small so several nodes fit in a CI runner's /dev/shm.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from cluster.inventory import Accelerator, Vendor
from cluster.tags import resource_tags

# Ray refuses object stores under 75 MiB; a little above keeps three nodes well inside a small /dev/shm.
DEFAULT_OBJECT_STORE_BYTES = 100 * 1024**2


class NodeSpec(BaseModel):
    """One simulated node: a name, its CPUs and GPUs, and the custom resources it advertises."""

    name: str = Field(description="Name used to look the node up in LocalCluster.node_ids.")
    num_cpus: int = Field(default=1, ge=0, description="Logical CPUs the node offers.")
    num_gpus: int = Field(
        default=0, ge=0, description="Logical GPUs the node offers (no hardware behind them on a laptop)."
    )
    resources: dict[str, int] = Field(
        default_factory=dict, description="Custom resources, e.g. accelerator tags."
    )
    object_store_memory: int = Field(
        default=DEFAULT_OBJECT_STORE_BYTES, description="Object store size in bytes."
    )

    @classmethod
    def cpu(cls, name: str, num_cpus: int = 1) -> NodeSpec:
        """A CPU node tagged as `cluster.node` would tag it."""
        return cls(name=name, num_cpus=num_cpus, resources=resource_tags("cpu", []))

    @classmethod
    def tagged(
        cls,
        name: str,
        vendor: Vendor,
        *,
        gpus: int = 1,
        model: str = "simulated GPU",
        memory_mib: int | None = None,
        num_cpus: int = 1,
        num_gpus: int = 0,
    ) -> NodeSpec:
        """A node carrying the tags of `gpus` devices of one vendor/model (logical GPUs only if num_gpus > 0)."""
        if vendor == "cpu":
            return cls.cpu(name, num_cpus)
        devices = [
            Accelerator(vendor=vendor, index=index, model=model, memory_mib=memory_mib)
            for index in range(gpus)
        ]
        return cls(name=name, num_cpus=num_cpus, num_gpus=num_gpus, resources=resource_tags(vendor, devices))


@dataclass
class LocalCluster:
    """A running local cluster: where to connect, and which Ray node id each spec became."""

    address: str
    node_ids: dict[str, str] = field(default_factory=dict)


def _node_args(spec: NodeSpec) -> dict:
    return {
        "num_cpus": spec.num_cpus,
        "num_gpus": spec.num_gpus,
        "resources": dict(spec.resources),
        "object_store_memory": spec.object_store_memory,
    }


@contextmanager
def mixed_cluster(nodes: Sequence[NodeSpec]) -> Iterator[LocalCluster]:
    """Start one raylet per spec (the first is the head), wait until all joined, yield, then tear everything down."""
    from ray.cluster_utils import Cluster

    if not nodes:
        raise ValueError("mixed_cluster needs at least one node (the head)")
    names = [spec.name for spec in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"node names must be unique: {names}")

    head, *workers = nodes
    cluster = Cluster(initialize_head=True, head_node_args={**_node_args(head), "include_dashboard": False})
    try:
        node_ids = {head.name: cluster.head_node.node_id}
        for spec in workers:
            node_ids[spec.name] = cluster.add_node(**_node_args(spec)).node_id
        cluster.wait_for_nodes()
        yield LocalCluster(address=cluster.address, node_ids=node_ids)
    finally:
        # Shut down even when the body failed: leaked raylets would poison the next test's cluster.
        cluster.shutdown()
