"""k8s/rayjob-large-model.yaml is sized as its comments say: every pool's engines fit the 8-GPU pods of its worker
group, one GPU per rank, tensor-parallel ranks inside one pod, pipeline stages over whole pods, and the weights each
GPU holds leave the KV cache the comments promise.

The job file is read with nightshift's own loader (`pipeline.config.load_job_config`, as `nightshift run --config`
reads it), the topologies with `pipeline.topology`, the pods' tags with `cluster.tags` and the memory with the
planner's KV budget; the manifest's schema and lock-down are test_manifests.py's (it takes every file in k8s/).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from pipeline.config import JobConfig, PoolConfig, load_job_config
from pipeline.job_plan import JobPlan
from pipeline.topology import Topology, check_topology

MANIFEST = Path(__file__).resolve().parents[2] / "k8s" / "rayjob-large-model.yaml"
GiB = 1024**3
# nvidia-smi's memory.total of an H100 80GB HBM3, the product the worker group selects.
H100_MEMORY_MIB = 81559

# The parts of each model's config.json (Hugging Face, meta-llama) that decide its sharding and its weights.
_LLAMA_3 = {
    "model_type": "llama",
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
MODEL_CONFIGS = {
    "meta-llama/Llama-3.3-70B-Instruct": {
        **_LLAMA_3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
    },
    "meta-llama/Llama-3.1-405B-Instruct": {
        **_LLAMA_3,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_attention_heads": 128,
        "num_hidden_layers": 126,
        "num_key_value_heads": 8,
    },
}


# ----------------------------------------------------------------------------------------- reading the manifest


@pytest.fixture(scope="module")
def documents() -> dict[str, dict]:
    docs = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    return {doc["kind"]: doc for doc in docs}


@pytest.fixture(scope="module")
def job_text(documents) -> str:
    return documents["ConfigMap"]["data"]["job.yaml"]


@pytest.fixture(scope="module")
def job(job_text, tmp_path_factory) -> JobConfig:
    path = tmp_path_factory.mktemp("job") / "job.yaml"
    path.write_text(job_text)
    return load_job_config(path)


@pytest.fixture(scope="module")
def pools(job) -> list[PoolConfig]:
    return JobPlan.of(job).pool_configs


@pytest.fixture(scope="module")
def group(documents) -> dict:
    (only,) = documents["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return only


def pod_gpus(group: dict) -> int:
    return int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])


def pod_cpus(group: dict) -> float:
    return float(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])


def advertised_tags(group: dict) -> dict[str, int]:
    return json.loads(group["rayStartParams"]["resources"].strip("'"))


def topology(job: JobConfig, pool: PoolConfig) -> Topology:
    """The pool's engine topology: its engine_overrides over the job's engine args, as the launcher merges them."""
    return Topology.of({**job.engine.args().model_dump(), **pool.engine_overrides})


def model_of(job: JobConfig, pool: PoolConfig) -> str:
    return pool.model or job.model


def spans_pods(job: JobConfig, pool: PoolConfig, group: dict) -> bool:
    return topology(job, pool).world > pod_gpus(group)


def sizing_comments(job_text: str) -> dict[str, str]:
    """Pool name -> the comment lines right above its `- name:` line in the job file, joined."""
    found, comments = {}, []
    for line in job_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped.lstrip("# "))
            continue
        named = re.fullmatch(r"- name: (\S+)", stripped)
        if named:
            found[named.group(1)] = " ".join(comments)
        comments = []
    return found


def llama_weight_bytes(config: dict) -> int:
    """A Llama checkpoint's tensor bytes from its config: embeddings and LM head, and per layer the attention
    projections (q, o: hidden × heads × head_dim; k, v: hidden × kv_heads × head_dim), the gated MLP (three
    hidden × intermediate matrices) and two norms; the final norm."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    attention = 2 * hidden * head_dim * (config["num_attention_heads"] + config["num_key_value_heads"])
    layer = attention + 3 * hidden * config["intermediate_size"] + 2 * hidden
    embeddings = (1 if config["tie_word_embeddings"] else 2) * config["vocab_size"] * hidden
    parameters = embeddings + config["num_hidden_layers"] * layer + hidden
    return parameters * {"bfloat16": 2, "float16": 2, "float32": 4}[config["torch_dtype"]]


# ----------------------------------------------------------------------------------------- the pools' topology


def test_the_job_has_a_pool_inside_a_pod_and_a_pool_across_pods(job, pools, group):
    """What the example is for: both kinds of engine on one worker group."""
    assert {spans_pods(job, pool, group) for pool in pools} == {False, True}
    assert all(topology(job, pool).sharded for pool in pools)


def test_each_engine_takes_one_gpu_per_rank(job, pools):
    for pool in pools:
        assert pool.gpus_per_engine == topology(job, pool).world, pool.name


def test_tensor_parallel_ranks_fit_inside_one_pod(job, pools, group):
    """TP ranks are packed into one node, so the pod's GPUs must be a multiple of TP: for an engine inside one
    pod, the pod holds a whole number of engines; for an engine across pods, each stage holds whole pods."""
    gpus = pod_gpus(group)
    for pool in pools:
        shape = topology(job, pool)
        assert gpus % shape.tensor_parallel_size == 0, pool.name
        if spans_pods(job, pool, group):
            assert shape.world % gpus == 0, f"{pool.name}: {shape.world} GPUs is no whole number of pods"
        else:
            assert gpus % shape.world == 0, f"{pool.name}: {gpus % shape.world} GPUs of each pod left idle"


def test_the_sizing_comments_say_what_the_pools_do(job, pools, group, job_text):
    comments = sizing_comments(job_text)
    gpus = pod_gpus(group)
    for pool in pools:
        shape, comment = topology(job, pool), comments[pool.name]
        stated = re.search(r"Sizing: TP (\d+) × PP (\d+) = (\d+) GPUs per engine", comment)
        assert stated, f"{pool.name}: no sizing comment ({comment!r})"
        tp, pp, world = map(int, stated.groups())
        assert (tp, pp, world) == (shape.tensor_parallel_size, shape.pipeline_parallel_size, shape.world)
        assert world == tp * pp == pool.gpus_per_engine
        if spans_pods(job, pool, group):
            (pods,) = map(int, re.search(r"(\d+) pods per engine", comment).groups())
            assert pods == world // gpus and pods == pp  # each stage fills one pod
        else:
            per_pod, by_tp, engines = map(
                int, re.search(r"(\d+) GPUs per pod ÷ TP (\d+) = (\d+) engines per pod", comment).groups()
            )
            assert (per_pod, by_tp) == (gpus, tp)
            assert engines * tp == gpus


def test_the_models_take_the_tensor_parallel_sizes(job, pools):
    from pipeline.model_shape import shape_from_config

    for pool in pools:
        model = model_of(job, pool)
        assert model in MODEL_CONFIGS, f"{pool.name}: add {model}'s config.json numbers to MODEL_CONFIGS"
        check_topology(shape_from_config(MODEL_CONFIGS[model]), topology(job, pool), model)


# ----------------------------------------------------------------------------------------- what the pods offer


def test_the_pods_advertise_what_nightshift_node_start_would(group):
    from cluster.inventory import Accelerator
    from cluster.tags import resource_tags

    devices = [
        Accelerator(vendor="cuda", index=i, model="NVIDIA H100 80GB HBM3", memory_mib=H100_MEMORY_MIB)
        for i in range(pod_gpus(group))
    ]
    assert advertised_tags(group) == resource_tags("cuda", devices)
    assert group["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


def test_each_rank_asks_for_one_of_each_tag_the_pods_offer(job, pools, group):
    """resources_per_engine is shared out over the engine's one-GPU bundles: one unit of each per-GPU tag each."""
    offered = advertised_tags(group)
    for pool in pools:
        assert pool.resources_per_engine, pool.name
        for tag, count in pool.resources_per_engine.items():
            assert tag in offered, f"{pool.name}: no pod offers {tag}"
            assert count == pool.gpus_per_engine, (
                f"{pool.name}: {tag} {count} for {pool.gpus_per_engine} GPUs"
            )


def test_the_pods_have_the_cpus_their_engines_reserve(job, pools, group):
    gpus, cpus = pod_gpus(group), pod_cpus(group)
    for pool in pools:
        world = topology(job, pool).world
        if spans_pods(job, pool, group):
            per_pod = pool.cpus_per_engine * gpus / world
        else:
            per_pod = pool.cpus_per_engine * gpus // world
        assert per_pod <= cpus, f"{pool.name}: {per_pod} CPUs per pod, the pod has {cpus}"


def test_the_worker_group_grows_to_every_pool_at_its_largest(job, pools, group):
    gpus = pod_gpus(group)
    pods = 0
    for pool in pools:
        world = topology(job, pool).world
        engines = pool.max_engines or pool.min_engines
        pods += engines * world // gpus if world > gpus else math.ceil(engines / (gpus // world))
    assert pods <= group["maxReplicas"]


def test_the_gpu_pods_have_a_memory_backed_dev_shm_for_nccl(group):
    pod = group["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    # Far above a container's default 64 MiB, and inside the memory limit it counts against.
    size = volume["emptyDir"]["sizeLimit"]
    assert size.endswith("Gi") and 16 <= int(size[:-2])
    limit = pod["containers"][0]["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(size[:-2]) < int(limit[:-2])


# ----------------------------------------------------------------------------------------- memory per device


def test_the_weights_per_gpu_leave_the_kv_cache_the_comments_say(job, pools, job_text):
    """Each GPU holds 1/(TP × PP) of the weights; the planner's budget for one device gives what is left."""
    from pipeline.planner import DeviceBudget, kv_budget

    comments = sizing_comments(job_text)
    for pool in pools:
        weights = llama_weight_bytes(MODEL_CONFIGS[model_of(job, pool)])
        world = topology(job, pool).world
        per_gpu = weights / world
        budget = DeviceBudget.gpu(H100_MEMORY_MIB * 1024**2, job.engine.vllm.gpu_memory_utilization)
        left, _, warnings = kv_budget(budget, int(per_gpu))
        assert not warnings and left > 16 * GiB, f"{pool.name}: {left / GiB:.1f} GiB left for the KV cache"
        stated = re.search(
            r"Weights ≈ (\d+) GiB ÷ (\d+) ≈ (\d+) GiB per GPU; ≈ (\d+) GiB per GPU left for the KV cache",
            comments[pool.name],
        )
        assert stated, f"{pool.name}: no memory comment"
        total, ranks, each, kv = map(int, stated.groups())
        assert abs(total - weights / GiB) < 1 and ranks == world, pool.name
        assert abs(each - per_gpu / GiB) < 1 and abs(kv - left / GiB) < 1, pool.name


def test_one_pod_cannot_hold_the_model_that_spans_two(job, pools, group):
    """Why the 405B pool spans pods: on one pod's GPUs its weights leave no KV cache."""
    from pipeline.planner import DeviceBudget, kv_budget

    budget = DeviceBudget.gpu(H100_MEMORY_MIB * 1024**2, job.engine.vllm.gpu_memory_utilization)
    for pool in pools:
        if spans_pods(job, pool, group):
            weights = llama_weight_bytes(MODEL_CONFIGS[model_of(job, pool)])
            left, _, warnings = kv_budget(budget, weights // pod_gpus(group))
            assert left == 0 and warnings, pool.name
