"""Every manifest in k8s/ against the KubeRay v1.7.0 CRD schemas and the operator's own rules, and what nightshift
locks down (`security_rules`): token authentication, a NetworkPolicy per cluster, unprivileged containers, S3
credentials from a Secret.

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
    groups,
    kuberay_errors,
    name_errors,
    parse_ray_start_resources,
    ray_start_errors,
    rayjob_errors,
    replica_errors,
    schema_errors,
)
from security_rules import (
    auth_errors,
    container_errors,
    credential_errors,
    egress_errors,
    identity_errors,
    network_policy_errors,
    pod_templates,
    pod_user,
    read_only_errors,
    sandbox_errors,
    service_account_errors,
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


@functools.cache
def _parsed() -> tuple[tuple[str, dict], ...]:
    found = []
    for path in manifest_files():
        for index, doc in enumerate(yaml.load_all(path.read_text(), Loader=_Loader)):
            if doc:
                found.append((f"{path.name}#{index}:{doc.get('kind')}", doc))
    return tuple(found)


def documents() -> list[tuple[str, dict]]:
    """Every document of every manifest, parsed once; each call gets its own copies to mutate."""
    return copy.deepcopy(list(_parsed()))


def ray_documents() -> list[tuple[str, dict]]:
    return [(label, doc) for label, doc in documents() if doc.get("kind") in RAY_KINDS]


def file_documents(name: str) -> list[dict]:
    return [copy.deepcopy(doc) for label, doc in documents() if label.startswith(f"{name}#")]


def load(name: str, kind: str | None = None) -> dict:
    """The document of `kind` in file `name`; without `kind`, its Ray document (or its only document)."""
    docs = file_documents(name)
    if kind is not None:
        (doc,) = [doc for doc in docs if doc.get("kind") == kind]
        return doc
    ray = [doc for doc in docs if doc.get("kind") in RAY_KINDS]
    (doc,) = ray or docs
    return doc


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
    assert {"RayCluster", "RayJob", "RayService", "ConfigMap", "NetworkPolicy"} <= kinds


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
    """rayjob.yaml and rayservice.yaml embed raycluster.yaml's groups; only their replica counts may differ."""

    def shape(doc: dict) -> list[dict]:
        (_, spec), *_ = cluster_specs(doc)
        scaling = {"replicas", "minReplicas", "maxReplicas"}
        groups = [{k: v for k, v in group.items() if k not in scaling} for group in spec["workerGroupSpecs"]]
        for (
            group
        ) in groups:  # each cluster's pods carry their own instance label (its NetworkPolicy selects it)
            group["template"]["metadata"]["labels"].pop("app.kubernetes.io/instance")
        return groups

    reference = shape(load("raycluster.yaml"))
    assert shape(load("rayjob.yaml")) == reference
    assert shape(load("rayservice.yaml")) == reference


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


RAYJOB_FILES = sorted({label.split("#")[0] for label, doc in ray_documents() if doc["kind"] == "RayJob"})
JOB_CONFIGMAPS = sorted(
    label
    for label, doc in documents()
    if doc.get("kind") == "ConfigMap" and "job.yaml" in doc.get("data", {})
)


def configmap_named(name: str) -> dict:
    (doc,) = [
        doc for _, doc in documents() if doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == name
    ]
    return doc


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_the_job_reads_its_config_from_the_configmap_and_s3_credentials_from_a_secret(name):
    job = load(name, "RayJob")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (config_volume,) = [v for v in head["volumes"] if "configMap" in v]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == config_volume["name"]]
    configmap = configmap_named(config_volume["configMap"]["name"])
    assert f"--config {mount['mountPath']}/job.yaml" in job["spec"]["entrypoint"]
    assert "job.yaml" in configmap["data"]
    secrets = {
        var["valueFrom"]["secretKeyRef"]["key"]
        for var in head["containers"][0]["env"]
        if "secretKeyRef" in var.get("valueFrom", {})
    }
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= secrets


def test_the_rayjob_reads_the_configmap_job_file():
    head = load("rayjob.yaml")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (config_volume,) = [v for v in head["volumes"] if "configMap" in v]
    assert config_volume["configMap"]["name"] == load("configmap-job.yaml")["metadata"]["name"]


@pytest.mark.parametrize("label", JOB_CONFIGMAPS)
def test_the_job_config_is_a_valid_nightshift_job_file(label, tmp_path):
    """Read as `nightshift run --config` reads it, its pools checked as the job checks them."""
    from pipeline.config import load_job_config
    from pipeline.job_plan import JobPlan

    (configmap,) = [doc for found, doc in documents() if found == label]
    path = tmp_path / "job.yaml"
    path.write_text(configmap["data"]["job.yaml"])
    assert JobPlan.of(load_job_config(path)).pools


# ----------------------------------------------------------------------------------------- locked down


def policy_context(name: str) -> list[dict]:
    """What a Ray document of file `name` is checked against: the file's own documents (applying it alone must lock
    its cluster down) and the other files' clusters (a policy must not admit their pods)."""
    others = [doc for label, doc in ray_documents() if not label.startswith(f"{name}#")]
    return file_documents(name) + copy.deepcopy(others)


def security_errors(name: str, doc: dict | None = None, context: list[dict] | None = None) -> list[str]:
    """Every lock-down problem of the Ray document of file `name` (or of a mutated `doc` in a mutated `context`)."""
    doc = load(name) if doc is None else doc
    context = policy_context(name) if context is None else context
    everything = [d for _, d in documents()]
    return (
        auth_errors(doc)
        + container_errors(doc)
        + credential_errors([doc] + [d for d in everything if d.get("kind") == "ConfigMap"])
        + network_policy_errors(doc, context)
        + egress_errors(doc, context)
        + read_only_errors(doc)
        + identity_errors(doc)
        + sandbox_errors(doc)
        + service_account_errors(doc)
    )


RAY_FILES = sorted({label.split("#")[0] for label, _ in ray_documents()})


def _group_names(name: str) -> list[str]:
    """The head ("head") and every worker group of the Ray document of file `name`."""
    (_, spec), *_ = cluster_specs(load(name))
    return [group_name for _, group_name, _ in groups(spec)]


# (file, group) for every group of every Ray file: each file is checked on its own groups.
RAY_GROUPS = [(name, group) for name in RAY_FILES for group in _group_names(name)]
RAY_WORKER_GROUPS = [(name, group) for name, group in RAY_GROUPS if group != "head"]


@pytest.mark.parametrize("name", RAY_FILES)
def test_every_cluster_is_locked_down(name):
    assert security_errors(name) == []


def test_no_configmap_holds_credentials():
    assert credential_errors([doc for _, doc in documents() if doc.get("kind") == "ConfigMap"]) == []


def test_kustomize_applies_the_policy_of_the_cluster_it_applies():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        docs = file_documents(resource)
        for doc in docs:
            if doc.get("kind") in RAY_KINDS:
                assert network_policy_errors(doc, policy_context(resource)) == [], resource


@pytest.mark.parametrize("name", RAY_FILES)
@pytest.mark.parametrize("mode", [None, "disabled"])
def test_a_cluster_without_token_auth_fails(name, mode):
    doc = load(name)
    for _, spec in cluster_specs(doc):
        if mode is None:
            del spec["authOptions"]
        else:
            spec["authOptions"]["mode"] = mode
    assert any("authOptions.mode" in error for error in security_errors(name, doc))


@pytest.mark.parametrize("variable", ["RAY_AUTH_TOKEN", "RAY_AUTH_MODE"])
def test_the_token_is_left_to_the_operator(variable):
    doc = load("raycluster.yaml")
    doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": variable, "value": "disabled" if variable == "RAY_AUTH_MODE" else "a-token-in-a-manifest"}
    )
    assert any(f"sets {variable}" in error for error in auth_errors(doc))


@pytest.mark.parametrize(
    "version, problem",
    [("2.51.1", "older than 2.52.0"), ("", "not set"), ("latest", "not a version")],
)
def test_token_auth_needs_ray_2_52(version, problem):
    doc = load("raycluster.yaml")
    doc["spec"]["rayVersion"] = version
    assert any(problem in error for error in kuberay_errors(doc))


def _first_container(doc: dict, group: str) -> dict:
    (_, spec), *_ = cluster_specs(doc)
    pod = spec["headGroupSpec"] if group == "head" else worker(doc, group)
    return pod["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name, group", RAY_GROUPS)
@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda c: c.pop("securityContext"), "allowPrivilegeEscalation must be false"),
        (lambda c: c["securityContext"].update(allowPrivilegeEscalation=True), "allowPrivilegeEscalation"),
        (lambda c: c["securityContext"].update(privileged=True), "must not be privileged"),
        (lambda c: c["securityContext"]["capabilities"].update(drop=["NET_RAW"]), "drop must include ALL"),
        (lambda c: c["securityContext"]["capabilities"].update(add=["SYS_PTRACE"]), "['SYS_PTRACE']"),
    ],
)
def test_a_container_with_privileges_fails(name, group, change, problem):
    doc = load(name)
    change(_first_container(doc, group))
    assert any(problem in error for error in container_errors(doc)), (name, container_errors(doc))


@pytest.mark.parametrize("name", RAY_FILES)
def test_the_autoscaler_container_is_unprivileged_too(name):
    doc = load(name)
    for _, spec in cluster_specs(doc):
        del spec["autoscalerOptions"]["securityContext"]
    assert any("autoscaler container" in error for error in container_errors(doc))


def test_the_job_submitter_is_unprivileged_and_admitted():
    doc = load("rayjob.yaml")
    submitter = doc["spec"]["submitterPodTemplate"]
    del submitter["spec"]["containers"][0]["securityContext"]
    assert any("submitterPodTemplate" in error for error in container_errors(doc))
    doc = load("rayjob.yaml")
    doc["spec"]["submitterPodTemplate"]["metadata"]["labels"]["app.kubernetes.io/instance"] = "someone-else"
    assert any("could not reach its head" in error for error in security_errors("rayjob.yaml", doc))


@pytest.mark.parametrize(
    "variable",
    [
        {"name": "AWS_SECRET_ACCESS_KEY", "value": "not-a-real-secret"},
        {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "k"}}},
        {"name": "AWS_SESSION_TOKEN", "value": "not-a-real-token"},
    ],
)
def test_s3_credentials_outside_a_secret_fail(variable):
    doc = load("raycluster.yaml")
    env = worker(doc, "nvidia-h100")["template"]["spec"]["containers"][0]["env"]
    env[:] = [var for var in env if var["name"] != variable["name"]] + [variable]
    assert any(f"{variable['name']} must come from a Secret" in error for error in credential_errors([doc]))


def test_a_ray_container_without_the_secret_fails():
    doc = load("rayjob.yaml")
    worker(doc, "amd-mi300x")["template"]["spec"]["containers"][0]["env"] = []
    errors = credential_errors([doc])
    assert any("AWS_SECRET_ACCESS_KEY is not taken from a Secret" in error for error in errors)


def test_credentials_in_a_configmap_fail():
    configmap = load("configmap-job.yaml")
    configmap["data"]["job.yaml"] += "aws_secret_access_key: not-a-real-secret\n"
    assert any("belong in a Secret" in error for error in credential_errors([configmap]))


def _pod_spec(doc: dict, group: str) -> dict:
    (_, spec), *_ = cluster_specs(doc)
    pod = spec["headGroupSpec"] if group == "head" else worker(doc, group)
    return pod["template"]["spec"]


@pytest.mark.parametrize("name, group", RAY_GROUPS)
@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda p: p["securityContext"].pop("runAsNonRoot"), "runAsNonRoot must be true"),
        (lambda p: p["securityContext"].update(runAsUser=0), "runAsUser must be the image's non-root uid"),
        (lambda p: p["securityContext"].pop("fsGroup"), "fsGroup must be set"),
        (lambda p: p["containers"][0]["securityContext"].update(runAsUser=0), "runs as root"),
        (lambda p: p["containers"][0]["securityContext"].update(runAsNonRoot=False), "runs as root"),
        (lambda p: p.pop("automountServiceAccountToken"), "automountServiceAccountToken must be false"),
        (lambda p: p.update(automountServiceAccountToken=True), "automountServiceAccountToken must be false"),
    ],
)
def test_a_pod_that_runs_as_root_or_gets_the_api_token_fails(name, group, change, problem):
    doc = load(name)
    change(_pod_spec(doc, group))
    assert any(problem in error for error in security_errors(name, doc)), (name, group)


@pytest.mark.parametrize("name", RAY_FILES)
def test_only_the_autoscaler_gets_the_api_token(name):
    doc = load(name)
    _pod_spec(doc, "head")["containers"][0]["volumeMounts"].append(
        {"name": "kube-api-token", "mountPath": "/x"}
    )
    assert any("mounts the Kubernetes API token" in error for error in security_errors(name, doc))
    doc = load(name)
    for _, spec in cluster_specs(doc):
        del spec["autoscalerOptions"]["volumeMounts"]
    assert any("the autoscaler calls the Kubernetes API" in error for error in security_errors(name, doc))
    doc = load(name)
    for _, spec in cluster_specs(doc):
        del spec["autoscalerOptions"]["securityContext"]["runAsNonRoot"]
    assert any("(the autoscaler container)" in error for error in security_errors(name, doc))


def test_the_job_submitter_is_not_root_and_gets_no_token():
    doc = load("rayjob.yaml")
    del doc["spec"]["submitterPodTemplate"]["spec"]["securityContext"]
    errors = security_errors("rayjob.yaml", doc)
    assert any("submitterPodTemplate.spec.securityContext.runAsNonRoot" in error for error in errors)
    doc = load("rayjob.yaml")
    doc["spec"]["submitterPodTemplate"]["spec"]["automountServiceAccountToken"] = True
    assert any(
        "submitterPodTemplate.spec.automount" in error for error in security_errors("rayjob.yaml", doc)
    )


def image_user(dockerfile: str) -> int | str | None:
    """The user the image's processes run as: its last USER (ARG defaults substituted; a uid as int), or None
    (root) without one."""
    arguments = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.MULTILINE))
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
    if not users:
        return None
    user = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: arguments.get(m[1] or m[2], ""), users[-1]).split(":")[0]
    return int(user) if user.isdigit() else user


def test_the_images_run_as_the_non_root_user_the_pods_run_as():
    uids = {pod_user(template) for _, doc in ray_documents() for _, template in pod_templates(doc)}
    (uid,) = uids  # one user in every pod of every manifest
    assert isinstance(uid, int) and uid > 0
    for dockerfile in ("cuda.Dockerfile", "rocm.Dockerfile"):
        text = (K8S / "images" / dockerfile).read_text()
        assert image_user(text) == uid, dockerfile
        # The image creates that user (or keeps its base's) with a home for the engines' caches.
        assert re.search(r"useradd --uid \"\$\{NIGHTSHIFT_UID\}\".*--create-home", text), dockerfile
        assert image_user(text + "USER root\n") == "root" and image_user(text.replace("USER ", "# ")) is None


@pytest.mark.parametrize("name", RAY_FILES)
def test_a_cluster_without_its_network_policy_fails(name):
    context = [doc for doc in policy_context(name) if doc.get("kind") != "NetworkPolicy"]
    assert any("no NetworkPolicy selects" in error for error in security_errors(name, load(name), context))


def _policy_and_context(name: str) -> tuple[dict, list[dict]]:
    context = policy_context(name)
    (policy,) = [doc for doc in context if doc.get("kind") == "NetworkPolicy"]
    return policy, context


@pytest.mark.parametrize("name", RAY_FILES)
@pytest.mark.parametrize(
    "rule, problem",
    [
        ({"ports": [{"port": 8265}]}, "admits every source"),
        ({}, "admits every source"),
        (
            {"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 6379}]},
            "only this cluster's pods",
        ),
        ({"from": [{"namespaceSelector": {}}], "ports": [{"port": 10001}]}, "only this cluster's pods"),
        (
            {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nightshift"}}}]},
            "only this cluster's pods",  # matches the other cluster's pods too
        ),
        (
            {
                "from": [
                    {
                        "namespaceSelector": {},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
                    }
                ]
            },
            "opens every port to the operator",
        ),
    ],
)
def test_a_policy_that_opens_the_head_fails(name, rule, problem):
    policy, context = _policy_and_context(name)
    policy["spec"]["ingress"].append(rule)
    errors = security_errors(name, load(name), context)
    assert any(problem in error for error in errors), errors


@pytest.mark.parametrize("name", RAY_FILES)
@pytest.mark.parametrize(
    "rule, problem",
    [
        ({}, "reaches 169.254.169.254"),  # every destination
        ({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 80}]}, "reaches 169.254.169.254"),
        ({"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]}, "reaches 169.254.169.254"),
    ],
)
def test_an_egress_rule_that_reaches_instance_metadata_fails(name, rule, problem):
    policy, context = _policy_and_context(name)
    policy["spec"]["egress"].append(rule)
    errors = security_errors(name, load(name), context)
    assert any(problem in error for error in errors), errors


@pytest.mark.parametrize("name", RAY_FILES)
@pytest.mark.parametrize("change", ["writable root", "no /tmp", "no HOME"])
def test_a_container_that_may_write_its_image_or_has_nowhere_to_write_fails(name, change):
    doc = load(name)
    (_, template), *_ = pod_templates(doc)
    container = template["spec"]["containers"][0]
    if change == "writable root":
        container["securityContext"]["readOnlyRootFilesystem"] = False
        problem = "readOnlyRootFilesystem must be true"
    elif change == "no /tmp":
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != "/tmp"]
        problem = "emptyDir mounted at /tmp"
    else:
        container["env"] = [e for e in container["env"] if e["name"] != "HOME"]
        problem = "HOME set to an emptyDir"
    errors = security_errors(name, doc)
    assert any(problem in error for error in errors), errors


@pytest.mark.parametrize("name", RAY_FILES)
def test_a_cluster_whose_egress_no_policy_limits_fails(name):
    policy, context = _policy_and_context(name)
    policy["spec"]["policyTypes"] = ["Ingress"]
    errors = security_errors(name, load(name), context)
    assert any("no NetworkPolicy limits the egress" in error for error in errors), errors


@pytest.mark.parametrize("name", RAY_FILES)
def test_an_egress_policy_without_dns_or_the_clusters_own_pods_fails(name):
    policy, context = _policy_and_context(name)
    rules = policy["spec"]["egress"]
    policy["spec"]["egress"] = [
        rule for rule in rules if "ports" in rule
    ]  # no rule to the cluster's own pods
    errors = security_errors(name, load(name), context)
    assert any("may not reach the cluster's other pods" in error for error in errors), errors
    policy["spec"]["egress"] = [
        rule for rule in rules if 53 not in {p["port"] for p in rule.get("ports", [])}
    ]
    errors = security_errors(name, load(name), context)
    assert any("may not reach DNS" in error for error in errors), errors


@pytest.mark.parametrize("name, group", RAY_WORKER_GROUPS)
def test_a_worker_the_policy_does_not_admit_fails(name, group):
    doc = load(name)
    worker(doc, group)["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] = "elsewhere"
    assert any("could not reach its head" in error for error in security_errors(name, doc))


@pytest.mark.parametrize("name", RAY_FILES)
def test_a_policy_that_misses_the_head_fails(name):
    doc = load(name)
    (_, spec), *_ = cluster_specs(doc)
    spec["headGroupSpec"]["template"]["metadata"]["labels"] = {"app.kubernetes.io/name": "nightshift"}
    assert any("no NetworkPolicy selects" in error for error in security_errors(name, doc))


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


@pytest.mark.parametrize("name, group", RAY_GROUPS)
@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile.type is None"),
        (
            lambda p: p["containers"][0]["resources"]["limits"].pop("ephemeral-storage"),
            "resources.limits has no ephemeral-storage",
        ),
        (
            lambda p: p["containers"][0]["resources"]["requests"].pop("ephemeral-storage"),
            "resources.requests has no ephemeral-storage",
        ),
    ],
)
def test_a_pod_without_the_default_sandbox_or_a_disk_bound_fails(name, group, change, problem):
    doc = load(name)
    change(_pod_spec(doc, group))
    assert any(problem in error for error in security_errors(name, doc)), (name, group)


@pytest.mark.parametrize("name, group", [(n, g) for n, g in RAY_GROUPS if not g.startswith("amd")])
def test_only_a_pod_of_amd_gpus_may_run_unconfined(name, group):
    doc = load(name)
    _pod_spec(doc, group)["securityContext"]["seccompProfile"] = {"type": "Unconfined"}
    assert any("RuntimeDefault" in error for error in security_errors(name, doc)), (name, group)


@pytest.mark.parametrize("dockerfile", sorted((K8S / "images").glob("*.Dockerfile")), ids=lambda p: p.name)
def test_an_image_builds_from_a_pinned_base_never_latest(dockerfile):
    """A base image given as `latest` (or with no tag) moves under a build: two builds of one Dockerfile would run
    different vLLMs. Every FROM and base-image default names a version or has no default at all."""
    text = dockerfile.read_text()
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] not in ("FROM", "ARG"):
            continue
        if words[0] == "ARG" and ("IMAGE" not in words[1] or "=" not in words[1]):
            continue  # not a base image, or one the build must name
        value = words[1].split("=", 1)[1] if words[0] == "ARG" else words[1]
        if value.startswith("$"):
            continue
        assert ":" in value and not value.endswith(":latest"), f"{dockerfile.name}: {line!r}"
