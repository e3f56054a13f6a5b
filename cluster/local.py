"""Multi-node Ray clusters on one machine, for tests and demos of accelerator routing.

Each node is a real raylet (`ray.cluster_utils.Cluster`) that advertises the same custom resources a real node
would (`cluster.tags`), so scheduling by `accelerator:cuda` / `accelerator:rocm` can be exercised on a laptop:

    with mixed_cluster([NodeSpec.cpu("head"), NodeSpec.tagged("gpu-a", "cuda"), NodeSpec.tagged("gpu-b", "rocm")]) as c:
        ray.init(address=c.address)
        ...  # a task with resources={"accelerator:rocm": 1} runs on c.node_ids["gpu-b"]

The first spec is the head. Object stores are kept small so several nodes fit in a CI runner's /dev/shm.
`LocalCluster.kill_node(name)` loses a worker node the hard way (every process of it SIGKILLed at once), as a
machine that loses power or its network would: the failure tests use it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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
    _cluster: Any = field(default=None, repr=False)  # ray.cluster_utils.Cluster
    _nodes: dict[str, Any] = field(default_factory=dict, repr=False)  # name -> ray._private.node.Node

    def kill_node(self, name: str) -> list[int]:
        """Lose worker node `name` abruptly: SIGKILL its raylet, every worker process under it (engine actors and
        their children) and its other daemons, all at once, with no chance to drain or say goodbye; then drop it
        from the cluster's books. Returns the pids killed. The head cannot be killed (the driver is attached to it).
        """
        import os
        import signal

        import psutil

        node = self._nodes.get(name)
        if node is None or node is self._cluster.head_node:
            raise ValueError(f"{name!r} is not a worker node of this cluster")
        pids = {info.process.pid for infos in node.all_processes.values() for info in infos if info.process}
        for pid in list(pids):
            try:
                pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Reaps what was killed and forgets the node (nothing is left to shut down gracefully).
        self._cluster.remove_node(node, allow_graceful=False)
        del self._nodes[name]
        return sorted(pids)


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
        nodes = {head.name: cluster.head_node}
        for spec in workers:
            nodes[spec.name] = cluster.add_node(**_node_args(spec))
        cluster.wait_for_nodes()
        node_ids = {name: node.node_id for name, node in nodes.items()}
        yield LocalCluster(address=cluster.address, node_ids=node_ids, _cluster=cluster, _nodes=nodes)
    finally:
        # Shut down even when the body failed: leaked raylets would poison the next test's cluster.
        cluster.shutdown()
