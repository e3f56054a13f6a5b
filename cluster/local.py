"""Multi-node Ray clusters on one machine, for tests and demos of accelerator routing.

Each node is a real raylet (`ray.cluster_utils.Cluster`) that advertises the same custom resources a real node
would (`cluster.tags`), so scheduling by `accelerator:cuda` / `accelerator:rocm` can be exercised on a laptop:

    with mixed_cluster([NodeSpec.cpu("head"), NodeSpec.tagged("gpu-a", "cuda"), NodeSpec.tagged("gpu-b", "rocm")]) as c:
        ray.init(address=c.address)
        ...  # a task with resources={"accelerator:rocm": 1} runs on c.node_ids["gpu-b"]

The first spec is the head. Object stores are kept small so several nodes fit in a CI runner's /dev/shm.
`LocalCluster.kill_node(name)` loses a worker node the hard way (every process of it SIGKILLed at once), as a
machine that loses power or its network would: the failure tests use it.

`node_cluster(...)` starts a cluster the way an operator does instead: each node is `nightshift node start`
(`--head`, then `--address HEAD --token-file FILE`) running `ray start --block` in its own process group, so Ray's
token authentication is set up by the same code path as on real machines:

    with node_cluster(home, workers=1) as cluster:
        ...  # cluster.address, cluster.dashboard_url, cluster.token_file
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
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


# ------------------------------------------------------------------------------------------------ node_cluster


@dataclass
class NodeCluster:
    """A cluster started through `nightshift node start`: where to reach it, and with which token."""

    address: str  # the head's GCS, 127.0.0.1:PORT
    dashboard_url: str  # http://127.0.0.1:PORT
    client_address: str  # ray://127.0.0.1:PORT (Ray Client server)
    token_file: Path | None  # None for a --no-auth cluster
    temp_dir: Path  # Ray's --temp-dir for every node: sessions, logs, sockets
    logs: list[Path] = field(default_factory=list)  # one per node: its `nightshift node start` output
    process_groups: list[int] = field(default_factory=list)  # one per node

    def pids(self) -> list[int]:
        """Every live process of the cluster's nodes (daemons and workers stay in their node's process group)."""
        import psutil

        found = []
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) in self.process_groups:
                    found.append(process.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        return found

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            for log in self.logs
            if log.exists()
        )


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on right now (held open together, so they differ from each other)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _node_environment(home: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH_")}
    env.update(
        NIGHTSHIFT_HOME=str(home),
        # A test cluster stops at once: no graceful drain window on SIGTERM.
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        RAY_USAGE_STATS_ENABLED="0",
    )
    return env


def alive_nodes(address: str, token: str | None) -> int:
    """How many nodes the GCS at `address` counts as alive (one authenticated gRPC call)."""
    import grpc
    from ray.core.generated import gcs_pb2, gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), metadata=metadata, timeout=5)
    return sum(1 for node in reply.node_info_list if node.state == gcs_pb2.GcsNodeInfo.ALIVE)


def _stop(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the node's process group (`ray start --block` then stops its daemons), SIGKILL what outlives it."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        process.poll()  # reap the leader, so an exited group stops answering
        time.sleep(0.2)
    else:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


@contextmanager
def node_cluster(
    home: Path,
    *,
    workers: int = 1,
    num_cpus: int = 1,
    no_auth: bool = False,
    timeout: float = 120.0,
    environment: dict[str, str] | None = None,
) -> Iterator[NodeCluster]:
    """A head and `workers` worker nodes on this machine, each started by `nightshift node start` (with Ray token
    authentication unless `no_auth`), the head's token kept under `home` (its NIGHTSHIFT_HOME), `environment` set
    for every node's processes; yields once every node has joined, and stops them all on exit."""
    from cluster.auth import probe

    if no_auth and workers:
        raise ValueError("a --no-auth cluster is a single node: no worker can join it")
    gcs, dashboard, client, agent, *worker_agents = _free_ports(4 + workers)
    temp_dir = Path(tempfile.mkdtemp(prefix="ns-ray-"))  # short: Ray's socket paths live under it
    env = {**_node_environment(home), **(environment or {})}
    node_command = [sys.executable, "-m", "pipeline", "node", "start"]
    common = [
        f"--num-cpus={num_cpus}",
        f"--object-store-memory={DEFAULT_OBJECT_STORE_BYTES}",
        f"--temp-dir={temp_dir}",
    ]
    token_file = None if no_auth else home / "ray" / "auth_token"
    cluster = NodeCluster(
        address=f"127.0.0.1:{gcs}",
        dashboard_url=f"http://127.0.0.1:{dashboard}",
        client_address=f"ray://127.0.0.1:{client}",
        token_file=token_file,
        temp_dir=temp_dir,
    )

    def launch(name: str, args: list[str]) -> subprocess.Popen:
        log = temp_dir / f"{name}.log"
        cluster.logs.append(log)
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*node_command, *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as one, never by a broad name
            )
        cluster.process_groups.append(process.pid)
        return process

    def wait_for(condition, what: str, processes: list[subprocess.Popen]) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not condition():
            if any(process.poll() is not None for process in processes):
                raise RuntimeError(f"a node exited while waiting for {what}:\n{cluster.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}:\n{cluster.log_tail()}")
            time.sleep(0.3)

    def token() -> str | None:
        return token_file.read_text().strip() if token_file is not None and token_file.exists() else None

    def dashboard_up() -> bool:
        import http.client
        import urllib.request

        try:  # a public path: answers without a token once the dashboard serves
            with urllib.request.urlopen(f"{cluster.dashboard_url}/api/gcs_healthz", timeout=2) as response:
                return response.status == 200
        except (OSError, http.client.HTTPException):  # URLError is an OSError
            return False

    with ExitStack() as stack:
        stack.callback(shutil.rmtree, temp_dir, True)
        head_args = ["--head", *(["--no-auth"] if no_auth else [])]
        head = launch(
            "head",
            [
                *head_args,
                "--",
                "--block",
                f"--port={gcs}",
                f"--dashboard-port={dashboard}",
                f"--ray-client-server-port={client}",
                f"--dashboard-agent-listen-port={agent}",
                *common,
            ],
        )
        stack.callback(_stop, head)
        expected = "open" if no_auth else "accepted"
        wait_for(lambda: probe(cluster.address, token(), timeout=1) == expected, "the head", [head])
        nodes = [head]
        for index, worker_agent in enumerate(worker_agents):
            node = launch(
                f"worker-{index}",
                [
                    "--address",
                    cluster.address,
                    "--token-file",
                    str(token_file),
                    "--",
                    "--block",
                    f"--dashboard-agent-listen-port={worker_agent}",
                    *common,
                ],
            )
            stack.callback(_stop, node)
            nodes.append(node)
        wait_for(lambda: alive_nodes(cluster.address, token()) == 1 + workers, "every node to join", nodes)
        wait_for(dashboard_up, "the dashboard", nodes)
        yield cluster
