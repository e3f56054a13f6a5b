"""One Ray cluster and one warm-engine keeper for the real-engine tests whose point is not an engine's life.

Starting the embedded model's engine costs about 40 s of this box's two cores, most of it three processes importing
vLLM. Tests that check what a job does with its lines (hostile input, every route, S3 in and out, the http engine's
bodies) need an engine, not a fresh one: their jobs join this cluster (`--address`, `--token-file`) and take their
engines from its keeper (`engine.warm_engines`), as the Batch API server's jobs do, so each kind of engine starts once
for all of them. Tests whose subject is an engine's start, stop or death, a first run's output, a killed driver, the
machine's cores or a cluster of their own start their own engines, and say why in their docstring.

    WarmCluster ── node_cluster (`nightshift node start --head`, token auth)
                └─ keeper holder: a small driver process that owns the EngineKeeper (runtime/engines/warm_keeper.py)
                   until the last real-engine test ends, as the server's replica does

The jobs that share engines pass the same engine flags (`ENGINE_FLAGS`, and one engine of one core per pool), so each
asks for the same kind of engine and the keeper hands over the one that is running (runtime/engines/warm_keeper.py: a
kind is model, cores and args). `max_num_seqs` 1 covers every plan (an engine with fewer sequences at once is reused
for any larger plan), and one sequence at a time is what the comparisons with vLLM's own runners need for bit-stable
greedy decoding.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

KEEPER = "e2e-warm-engines"
# Every job on the warm cluster asks for engines of these kinds: the chat model with a tool-call parser (the mixed
# routes need it; other lines carry no tools, so it leaves their bodies alone) and a 512-token context, and the
# embedding model as it comes; one engine of one core each.
ENGINE_FLAGS = ("--max-num-seqs", "1", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
CHAT_CONTEXT = 512
# A job of one pool: one engine of one core. Jobs of several pools give each pool the same in their config.
ONE_ENGINE = ("--num-engines", "1", "--cpus-per-engine", "1")

# The modules whose jobs join the warm cluster, in the order they run: after every other real-engine test (idle, the
# warm engines hold GiBs and a little of a core that the tests starting their own engines need), the chat model's
# users first, then the job of both models, then the embedding model's. The keeper stops idle engines of a kind the
# next job does not ask for (runtime/engines/warm_keeper.py), so in any other order a kind is stopped and started
# again: alphabetically, the embedding engine started twice and the chat engine twice more.
JOIN_ORDER = (
    "tests/e2e/test_hostile_real_engine.py",
    "tests/e2e/test_dataset_real_engine.py",
    "tests/e2e/test_tenant_cache_real_engine.py",
    "tests/e2e/test_http_real_server.py",
    "tests/e2e/test_request_fields_real_engine.py",
    "tests/e2e/test_s3_real_engine.py",
    "tests/e2e/test_server_real_engine.py",
    "tests/e2e/test_mixed_routes_real_engine.py",
    "tests/e2e/test_routes_real_engine.py",
)

# The keeper's owner: joins the cluster, starts the keeper, says so, and holds it until its stdin closes.
_HOLDER = """
import sys
from cluster.auth import driver_environment

address, token_file, name = sys.argv[1:]
with driver_environment(address, token_file):  # before Ray's import: it reads its auth settings once
    import ray
    from pipeline.runtime.engines.warm_keeper import start_keeper

    ray.init(address=address, log_to_driver=False)
    keeper = start_keeper(name, idle_seconds=24 * 3600)
    ray.get(keeper.describe.remote())
    print("ready", flush=True)
    sys.stdin.read()
"""


@dataclass(frozen=True)
class WarmCluster:
    address: str
    token_file: Path
    keeper: str

    def job_args(self, chat: bool = True, pools_in_config: bool = False) -> list[str]:
        """What a `nightshift run` needs to join the cluster and take its warm engines (with `job_file`'s config,
        or a config of the test's own that names the keeper and gives each pool one engine of one core: pools keep one
        engine unless told otherwise)."""
        placement = [] if pools_in_config else list(ONE_ENGINE)
        context = ["--max-model-len", str(CHAT_CONTEXT)] if chat and not pools_in_config else []
        return [
            "--address",
            self.address,
            "--token-file",
            str(self.token_file),
            *ENGINE_FLAGS,
            *context,
            *placement,
        ]

    def one_pool_job(self, directory: Path, chat: bool = True) -> list[str]:
        """`nightshift run` arguments for a one-pool job on the warm engines (its job file written to `directory`)."""
        return ["-c", str(self.job_file(directory)), *self.job_args(chat=chat)]

    def job_file(self, directory: Path) -> Path:
        """A job file naming the keeper (engine.warm_engines has no flag: the server sets it for its jobs)."""
        path = directory / "warm-engines.yaml"
        path.write_text(f"engine:\n  warm_engines: {self.keeper}\n")
        return path


@contextmanager
def warm_cluster(home: Path) -> Iterator[WarmCluster]:
    """A one-node cluster (token auth, NIGHTSHIFT_HOME `home`) with a keeper owned by a holder process."""
    from cluster.cpu_cores import LOCK_DIR_ENV
    from cluster.local import node_cluster
    from tests.integration.storage_fixtures import TEST_CREDENTIALS

    # Four logical CPUs on two cores: the two warm engines (one core each) keep two, and a job's ingest and finalize
    # tasks still find CPUs to run on beside them. The warm engines claim their cores (cluster/cpu_cores.py) in a
    # lock directory of their own: idle between tests, they must not take cores from the engines of the tests
    # that start their own (the prefix test checks which cores its two engines bound).
    # The local S3 endpoint's test credentials too: a job's tasks read S3 with what their Ray workers started with.
    environment = {LOCK_DIR_ENV: str(home / "cpu-locks"), **TEST_CREDENTIALS}
    with node_cluster(home, workers=0, num_cpus=4, environment=environment) as cluster:
        assert cluster.token_file is not None
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, cluster.address, str(cluster.token_file), KEEPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready", (
                cluster.log_tail()
            )
            yield WarmCluster(cluster.address, cluster.token_file, KEEPER)
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
