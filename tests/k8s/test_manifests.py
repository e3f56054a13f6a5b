"""Every manifest in k8s/ against the KubeRay v1.7.0 CRD schemas and the operator's own rules.

Each rule has a negative test on a mutated copy of a real manifest, so no check can pass vacuously.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import pytest
import yaml
from kuberay_rules import (
    RAY_KINDS,
    cluster_spec_errors,
    cluster_specs,
    crd_validator,
    gpu_errors,
    kuberay_errors,
    name_errors,
    parse_ray_start_resources,
    ray_start_errors,
    rayjob_errors,
    replica_errors,
    schema_errors,
)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
CRD_DIR = Path(__file__).resolve().parent / "crds"  # KubeRay v1.7.0, Apache-2.0 (LICENSE there)
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def manifest_files() -> list[Path]:
    return sorted(path for path in K8S.glob("*.yaml") if path.name != "kustomization.yaml")


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in manifest_files():
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                found.append((f"{path.name}#{index}:{doc.get('kind')}", doc))
    return found


def ray_documents() -> list[tuple[str, dict]]:
    return [(label, doc) for label, doc in documents() if doc.get("kind") in RAY_KINDS]


def load(name: str) -> dict:
    (doc,) = [doc for label, doc in documents() if label.startswith(f"{name}#")]
    return copy.deepcopy(doc)


@functools.cache
def validator_for(kind: str):
    return crd_validator(yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=_Loader))


def worker(doc: dict, group_name: str) -> dict:
    (_, spec), *_ = cluster_specs(doc)
    (group,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == group_name]
    return group


# ----------------------------------------------------------------------------------------- the real manifests


def test_the_crds_and_their_license_are_in_the_repository():
    assert "Apache License" in (CRD_DIR / "LICENSE").read_text()
    for kind in CRD_FILES:
        assert validator_for(kind) is not None


def test_the_manifests_cover_every_kind():
    kinds = {doc.get("kind") for _, doc in documents()}
    assert {"RayCluster", "RayJob", "ConfigMap"} <= kinds


@pytest.mark.parametrize("label, doc", ray_documents(), ids=[label for label, _ in ray_documents()])
def test_manifest_matches_the_crd_schema(label, doc):
    assert doc["apiVersion"] == "ray.io/v1"
    assert schema_errors(validator_for(doc["kind"]), doc) == []


@pytest.mark.parametrize("label, doc", ray_documents(), ids=[label for label, _ in ray_documents()])
def test_manifest_passes_the_operator_rules(label, doc):
    assert kuberay_errors(doc) == []


def test_kustomization_lists_existing_files():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["resources"], "kustomization lists no resources"
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource


def test_every_cluster_carries_the_same_worker_groups():
    """rayjob.yaml embeds raycluster.yaml's groups; only their replica counts may differ."""

    def shape(doc: dict) -> list[dict]:
        (_, spec), *_ = cluster_specs(doc)
        scaling = {"replicas", "minReplicas", "maxReplicas"}
        return [{k: v for k, v in group.items() if k not in scaling} for group in spec["workerGroupSpecs"]]

    reference = shape(load("raycluster.yaml"))
    assert shape(load("rayjob.yaml")) == reference


def test_ray_version_matches_the_package_and_both_images():
    pinned = re.search(r'"ray\[data\]==([\d.]+)"', (REPO / "pyproject.toml").read_text())
    assert pinned, "pyproject.toml no longer pins ray[data]==X"
    for _, doc in ray_documents():
        for _, spec in cluster_specs(doc):
            assert spec["rayVersion"] == pinned.group(1)
    arguments = {}
    for dockerfile in ("cuda.Dockerfile", "rocm.Dockerfile"):
        text = (K8S / "images" / dockerfile).read_text()
        arguments[dockerfile] = dict(
            re.findall(r"^ARG (RAY_VERSION|PYTHON_VERSION)=(\S+)$", text, re.MULTILINE)
        )
        assert arguments[dockerfile]["RAY_VERSION"] == pinned.group(1), dockerfile
    assert arguments["cuda.Dockerfile"]["PYTHON_VERSION"] == arguments["rocm.Dockerfile"]["PYTHON_VERSION"]


def test_the_rocm_image_never_installs_the_cuda_extra():
    install_lines = [
        line
        for line in (K8S / "images" / "rocm.Dockerfile").read_text().splitlines()
        if "nightshift-batch" in line
    ]
    assert install_lines and not any("cuda" in line for line in install_lines)


def test_worker_groups_advertise_the_node_tag_scheme():
    from cluster.tags import accelerator_tag

    doc = load("raycluster.yaml")
    tags = {
        group["groupName"]: parse_ray_start_resources(group["rayStartParams"]["resources"])[0]
        for group in doc["spec"]["workerGroupSpecs"]
    }
    assert tags["nvidia-h100"] == {"accelerator:cuda": 1, "accelerator_model:H100": 1, "gpu_memory_gib:80": 1}
    assert tags["amd-mi300x"] == {
        "accelerator:rocm": 1,
        "accelerator_model:MI300X": 1,
        "gpu_memory_gib:192": 1,
    }
    assert accelerator_tag("cuda") in tags["nvidia-h100"] and accelerator_tag("rocm") in tags["amd-mi300x"]


def test_amd_workers_get_what_rocm_containers_need():
    pod = worker(load("raycluster.yaml"), "amd-mi300x")["template"]["spec"]
    mounts = {mount["mountPath"] for mount in pod["containers"][0]["volumeMounts"]}
    host_paths = {volume["hostPath"]["path"] for volume in pod["volumes"] if "hostPath" in volume}
    assert {"/dev/kfd", "/dev/dri", "/dev/shm"} <= mounts and {"/dev/kfd", "/dev/dri"} <= host_paths
    assert 44 in pod["securityContext"]["supplementalGroups"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "Unconfined"
    env_names = {var["name"] for var in pod["containers"][0].get("env", [])}
    assert "ROCR_VISIBLE_DEVICES" not in env_names  # Ray >= 2.45 refuses it without HIP_VISIBLE_DEVICES


def test_every_pod_has_a_memory_backed_dev_shm():
    for label, doc in ray_documents():
        for _, spec in cluster_specs(doc):
            pods = [spec["headGroupSpec"]["template"]["spec"]] + [
                g["template"]["spec"] for g in spec["workerGroupSpecs"]
            ]
            for pod in pods:
                (shm,) = [
                    m["name"] for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"
                ]
                (volume,) = [v for v in pod["volumes"] if v["name"] == shm]
                assert volume["emptyDir"]["medium"] == "Memory", label


def test_the_job_reads_its_config_from_the_configmap_and_s3_credentials_from_a_secret():
    job = load("rayjob.yaml")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (config_volume,) = [v for v in head["volumes"] if "configMap" in v]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == config_volume["name"]]
    configmap = load("configmap-job.yaml")
    assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert f"--config {mount['mountPath']}/job.yaml" in job["spec"]["entrypoint"]
    assert "job.yaml" in configmap["data"]
    secrets = {
        var["valueFrom"]["secretKeyRef"]["key"]
        for var in head["containers"][0]["env"]
        if "secretKeyRef" in var.get("valueFrom", {})
    }
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= secrets


def test_the_job_config_is_a_valid_nightshift_job_file():
    from pipeline.config import JobConfig

    JobConfig.model_validate(yaml.safe_load(load("configmap-job.yaml")["data"]["job.yaml"]))


# ----------------------------------------------------------------------------------------- negative: the schema


def test_schema_rejects_an_unknown_field():
    doc = load("raycluster.yaml")
    worker(doc, "nvidia-h100")["minReplica"] = 1  # typo of minReplicas
    errors = schema_errors(validator_for("RayCluster"), doc)
    assert any("minReplica" in error for error in errors)


def test_schema_rejects_a_wrong_type():
    doc = load("raycluster.yaml")
    worker(doc, "nvidia-h100")["replicas"] = "one"
    assert any("replicas" in error for error in schema_errors(validator_for("RayCluster"), doc))


def test_schema_checks_int_or_string_quantities():
    doc = load("raycluster.yaml")
    limits = worker(doc, "amd-mi300x")["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits["amd.com/gpu"] = [1]
    assert any(
        "neither an integer nor a string" in error
        for error in schema_errors(validator_for("RayCluster"), doc)
    )


def test_schema_rejects_rayStartParams_that_are_not_strings():
    doc = load("raycluster.yaml")
    worker(doc, "nvidia-h100")["rayStartParams"]["num-gpus"] = 1
    assert any("num-gpus" in error for error in schema_errors(validator_for("RayCluster"), doc))


def test_schema_reports_fields_guarded_by_unevaluated_cel_rules():
    doc = load("rayjob.yaml")
    doc["spec"]["managedBy"] = "ray.io/kuberay-operator"
    assert any("CEL" in error for error in schema_errors(validator_for("RayJob"), doc))


# ----------------------------------------------------------------------------------------- negative: operator rules


@pytest.mark.parametrize(
    "value, problem",
    [
        (
            '"{\\"accelerator:cuda\\": 1}"',
            "cannot parse",
        ),  # the escaped form: fine for a shell, not the operator
        (
            '{"accelerator:cuda": 1, "accelerator_model:H100": 1}',
            "splits it into",
        ),  # unquoted: the shell splits it
        ("'{\"accelerator:cuda\": 1.5}'", "not a non-negative integer"),
        ('\'{"accelerator:cuda": "1"}\'', "not a non-negative integer"),
        ("'{\"accelerator:cuda\": true}'", "not a non-negative integer"),
        ("'[1]'", "not a JSON object"),
    ],
)
def test_custom_resources_must_be_integer_json_the_operator_and_shell_agree_on(value, problem):
    doc = load("raycluster.yaml")
    worker(doc, "nvidia-h100")["rayStartParams"]["resources"] = value
    assert any(problem in error for error in ray_start_errors(doc)), ray_start_errors(doc)


def test_resources_in_both_rayStartParams_and_the_group_field_are_refused():
    doc = load("raycluster.yaml")
    worker(doc, "nvidia-h100")["resources"] = {"accelerator:cuda": "1"}
    assert any("both in rayStartParams" in error for error in ray_start_errors(doc))


def test_rayStartParams_labels_are_refused():
    doc = load("raycluster.yaml")
    worker(doc, "amd-mi300x")["rayStartParams"]["labels"] = "vendor=amd"
    assert any("labels is not supported" in error for error in ray_start_errors(doc))


@pytest.mark.parametrize(
    "replicas, low, high",
    [(9, 0, 8), (0, 1, 8), (1, 3, 2)],
)
def test_replicas_must_sit_between_min_and_max(replicas, low, high):
    doc = load("raycluster.yaml")
    worker(doc, "nvidia-h100").update(replicas=replicas, minReplicas=low, maxReplicas=high)
    assert replica_errors(doc)


@pytest.mark.parametrize("name", ["Nightshift", "1nightshift", "night_shift", "nightshift-", "n" * 54])
def test_cluster_names_must_be_short_dns_1035_labels(name):
    doc = load("raycluster.yaml")
    doc["metadata"]["name"] = name
    assert name_errors(doc)


def test_rayjob_names_leave_room_for_the_operator_suffix():
    doc = load("rayjob.yaml")
    doc["metadata"]["name"] = "j" * 48
    assert any("longer than 47" in error for error in name_errors(doc))


@pytest.mark.parametrize("group_name", ["NVIDIA-H100", "gpu.workers", "amd-mi300x"])
def test_group_names_must_be_unique_dns_1035_labels(group_name):
    doc = load("raycluster.yaml")
    worker(doc, "nvidia-h100")["groupName"] = group_name  # "amd-mi300x" duplicates the other group
    assert name_errors(doc)


def test_num_gpus_must_match_the_gpu_limits():
    doc = load("raycluster.yaml")
    worker(doc, "nvidia-h100")["rayStartParams"]["num-gpus"] = "2"
    assert any("num-gpus=2" in error for error in gpu_errors(doc))


def test_gpu_limits_need_an_explicit_num_gpus():
    doc = load("raycluster.yaml")
    del worker(doc, "amd-mi300x")["rayStartParams"]["num-gpus"]
    assert any("no rayStartParams num-gpus" in error for error in gpu_errors(doc))


def test_gpu_requests_must_equal_limits():
    doc = load("raycluster.yaml")
    worker(doc, "nvidia-h100")["template"]["spec"]["containers"][0]["resources"]["requests"][
        "nvidia.com/gpu"
    ] = 2
    assert any("differ from limits" in error for error in gpu_errors(doc))


def test_the_vendor_tag_must_count_the_vendors_gpus():
    doc = load("raycluster.yaml")
    group = worker(doc, "amd-mi300x")
    group["rayStartParams"]["resources"] = (
        "'" + json.dumps({"accelerator:cuda": 1}) + "'"
    )  # AMD pod tagged cuda
    errors = gpu_errors(doc)
    assert any("amd.com/gpu limit 1" in error for error in errors)
    assert any("nvidia.com/gpu limit 0" in error for error in errors)


def test_a_group_without_containers_is_refused():
    doc = load("rayjob.yaml")
    worker(doc, "nvidia-h100")["template"]["spec"]["containers"] = []
    assert cluster_spec_errors(doc)


def test_ttl_needs_shutdown_after_job_finishes():
    doc = load("rayjob.yaml")
    doc["spec"]["shutdownAfterJobFinishes"] = False
    assert any("needs spec.shutdownAfterJobFinishes" in error for error in rayjob_errors(doc))


@pytest.mark.parametrize(
    "mutation, problem",
    [
        ({"ttlSecondsAfterFinished": -1}, "non-negative"),
        ({"activeDeadlineSeconds": 0}, "must be positive"),
        ({"backoffLimit": -1}, "backoffLimit"),
        ({"entrypoint": " "}, "entrypoint is empty"),
        ({"rayClusterSpec": None}, "must be set"),
        ({"rayClusterSpec": None, "clusterSelector": {"app": "x"}}, "ray.io/cluster"),
    ],
)
def test_rayjob_spec_rules(mutation, problem):
    doc = load("rayjob.yaml")
    doc["spec"].update(mutation)
    assert any(problem in error for error in rayjob_errors(doc)), rayjob_errors(doc)
