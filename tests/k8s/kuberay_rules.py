"""Manifest checks: the KubeRay CRD schemas (structural, strict) and the operator's own rules, in code.

Schema side — `crd_validator(crd)` builds a jsonschema validator from `spec.versions[v1].schema.openAPIV3Schema`:
- `x-kubernetes-int-or-string: true` accepts an integer or a string (quantities like 8 or "120Gi");
- `nullable: true` also accepts null;
- an object schema with `properties` rejects unknown fields unless it carries `x-kubernetes-preserve-unknown-fields`
  (the API server would silently prune them, and `kubectl apply` rejects them under strict field validation);
- `x-kubernetes-validations` (CEL) is not evaluated here, so a manifest setting such a field is reported instead of
  silently passing.

Operator side — `kuberay_errors(doc)` re-implements what the KubeRay operator checks before acting
(`ray-operator/controllers/ray/utils/validation.go`, `constant.go`, and `common/pod.go` in ray-project/kuberay),
plus the rules nightshift relies on:
- names: DNS-1035 labels; RayCluster <= 53 characters, RayJob/RayService <= 47 (the operator appends a suffix);
  group names DNS-1035 and unique, as they become part of pod names;
- `rayStartParams.resources`: the operator trims quotes and JSON-parses it (`getResourcesMap`), the shell running
  `ray start` must keep it one word, and Ray only accepts whole-number node resources — so single-quoted JSON
  with integer values; never both rayStartParams resources and the group `resources` field; no
  `rayStartParams.labels`;
- `minReplicas <= replicas <= maxReplicas`;
- GPU limits (`nvidia.com/gpu`, `amd.com/gpu`) equal `num-gpus`, which must be explicit, and the vendor tag
  (`accelerator:cuda` / `accelerator:rocm`) counts the same GPUs;
- RayJob: `ttlSecondsAfterFinished` only with `shutdownAfterJobFinishes: true`, a cluster to run on, positive
  deadlines;
- `authOptions.mode: token` needs a `rayVersion` of at least 2.52.0 (the first Ray with token authentication).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from typing import Any

import jsonschema
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

RAY_KINDS = ("RayCluster", "RayJob", "RayService")
MAX_RAY_CLUSTER_NAME = 53
MAX_RAY_JOB_OR_SERVICE_NAME = MAX_RAY_CLUSTER_NAME - 6
MAX_GROUP_NAME = 63
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
GPU_VENDOR_TAGS = {"nvidia.com/gpu": "accelerator:cuda", "amd.com/gpu": "accelerator:rocm"}

# --------------------------------------------------------------------------------------------- CRD schema


def _int_or_string(validator, enabled, instance, schema):
    if enabled and not (isinstance(instance, (int, str)) and not isinstance(instance, bool)):
        yield ValidationError(f"{instance!r} is neither an integer nor a string")


def _cel_rules(validator, rules, instance, schema):
    messages = "; ".join(rule.get("message", rule.get("rule", "?")) for rule in rules)
    yield ValidationError(f"field guarded by CEL rules that are not evaluated here: {messages}")


_KubernetesValidator = jsonschema.validators.extend(
    Draft202012Validator,
    {"x-kubernetes-int-or-string": _int_or_string, "x-kubernetes-validations": _cel_rules},
)


_SUBSCHEMA_KEYS = ("items", "additionalProperties", "not")
_SUBSCHEMA_LIST_KEYS = ("allOf", "anyOf", "oneOf")


def structural_schema(schema: Any) -> Any:
    """The OpenAPI v3 structural schema as strict JSON Schema (see the module docstring)."""
    if not isinstance(schema, dict):
        return schema
    # Recurse only into keywords that hold schemas: `default`, `enum` and friends are data.
    converted = dict(schema)
    for key in _SUBSCHEMA_KEYS:
        if isinstance(schema.get(key), dict):
            converted[key] = structural_schema(schema[key])
    for key in _SUBSCHEMA_LIST_KEYS:
        if isinstance(schema.get(key), list):
            converted[key] = [structural_schema(sub) for sub in schema[key]]
    for key in ("properties", "patternProperties"):
        if isinstance(schema.get(key), dict):
            converted[key] = {name: structural_schema(sub) for name, sub in schema[key].items()}
    if schema.get("nullable") and "type" in schema:
        converted["type"] = [schema["type"], "null"]
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        converted["additionalProperties"] = False
    return converted


def crd_validator(crd: dict, version: str = "v1") -> Draft202012Validator:
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _KubernetesValidator(structural_schema(served["schema"]["openAPIV3Schema"]))


def schema_errors(validator: Draft202012Validator, doc: dict) -> list[str]:
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


# --------------------------------------------------------------------------------------------- operator rules


def cluster_specs(doc: dict) -> Iterator[tuple[str, dict]]:
    """(where, RayClusterSpec) pairs in a RayCluster, RayJob or RayService."""
    spec = doc.get("spec") or {}
    if doc.get("kind") == "RayCluster":
        yield "spec", spec
    elif doc.get("kind") == "RayJob" and spec.get("rayClusterSpec"):
        yield "spec.rayClusterSpec", spec["rayClusterSpec"]
    elif doc.get("kind") == "RayService" and spec.get("rayClusterConfig"):
        yield "spec.rayClusterConfig", spec["rayClusterConfig"]


def groups(cluster_spec: dict) -> Iterator[tuple[str, str, dict]]:
    """(where, group name, group spec) for the head and every worker group."""
    yield "headGroupSpec", "head", cluster_spec.get("headGroupSpec") or {}
    for index, group in enumerate(cluster_spec.get("workerGroupSpecs") or []):
        yield f"workerGroupSpecs[{index}]", group.get("groupName", ""), group


def _dns_1035(name: str) -> bool:
    return bool(DNS_1035.fullmatch(name or ""))


def name_errors(doc: dict) -> list[str]:
    name = (doc.get("metadata") or {}).get("name", "")
    limit = MAX_RAY_CLUSTER_NAME if doc.get("kind") == "RayCluster" else MAX_RAY_JOB_OR_SERVICE_NAME
    errors = []
    if not _dns_1035(name):
        errors.append(f"metadata.name {name!r} is not a DNS-1035 label")
    if len(name) > limit:
        errors.append(f"metadata.name {name!r} is longer than {limit} characters")
    for where, spec in cluster_specs(doc):
        seen: set[str] = set()
        for group_where, group_name, _ in groups(spec):
            if group_where == "headGroupSpec":
                continue
            if not _dns_1035(group_name) or len(group_name) > MAX_GROUP_NAME:
                errors.append(f"{where}.{group_where}.groupName {group_name!r} is not a DNS-1035 label")
            if group_name in seen:
                errors.append(f"{where}.{group_where}.groupName {group_name!r} is used twice")
            seen.add(group_name)
    return errors


def parse_ray_start_resources(value: str) -> tuple[dict | None, list[str]]:
    """How KubeRay and the shell read rayStartParams.resources; (parsed, problems)."""
    problems = []
    # KubeRay's getResourcesMap: strings.Trim(value, "'\"` ") then json.Unmarshal.
    try:
        operator_view = json.loads(value.strip("'\"` "))
    except json.JSONDecodeError as exc:
        return None, [f"the operator cannot parse it as JSON after trimming quotes ({exc})"]
    if not isinstance(operator_view, dict):
        return None, ["it is not a JSON object"]
    # The operator pastes the value into `ray start --resources=<value>`, run by a shell.
    try:
        words = shlex.split(f"--resources={value}")
    except ValueError as exc:
        return operator_view, [f"the shell cannot split it ({exc})"]
    if len(words) != 1:
        problems.append(f"the shell splits it into {len(words)} words; quote it as '{{...}}'")
    else:
        try:
            shell_view = json.loads(words[0].removeprefix("--resources="))
        except json.JSONDecodeError:
            shell_view = None
        if shell_view != operator_view:
            problems.append("`ray start` would receive different JSON than the operator parsed")
    for key, quantity in operator_view.items():
        if type(quantity) is not int or quantity < 0:
            problems.append(f"{key!r}: {quantity!r} is not a non-negative integer (Ray wants whole numbers)")
    return operator_view, problems


def ray_start_errors(doc: dict) -> list[str]:
    errors = []
    for where, spec in cluster_specs(doc):
        for group_where, _, group in groups(spec):
            params = group.get("rayStartParams") or {}
            at = f"{where}.{group_where}.rayStartParams"
            if "labels" in params:
                errors.append(f"{at}.labels is not supported by KubeRay; use the group's labels field")
            uses_params = any(params.get(key) for key in ("num-cpus", "num-gpus", "memory", "resources"))
            if uses_params and group.get("resources"):
                errors.append(f"{at}: resources set both in rayStartParams and in the group resources field")
            if "resources" in params:
                _, problems = parse_ray_start_resources(str(params["resources"]))
                errors.extend(f"{at}.resources: {problem}" for problem in problems)
    return errors


def replica_errors(doc: dict) -> list[str]:
    errors = []
    for where, spec in cluster_specs(doc):
        for group_where, _, group in groups(spec):
            if group_where == "headGroupSpec":
                continue
            low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
            replicas = group.get("replicas", low)
            if not low <= replicas <= high:
                errors.append(
                    f"{where}.{group_where}: needs minReplicas <= replicas <= maxReplicas, "
                    f"got {low} <= {replicas} <= {high}"
                )
    return errors


def _gpu_limits(container: dict) -> dict[str, int]:
    limits = (container.get("resources") or {}).get("limits") or {}
    return {key: int(value) for key, value in limits.items() if key.endswith("gpu")}


def gpu_errors(doc: dict) -> list[str]:
    errors = []
    for where, spec in cluster_specs(doc):
        for group_where, _, group in groups(spec):
            at = f"{where}.{group_where}"
            containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or []
            if not containers:
                continue
            ray_container = containers[0]  # KubeRay's RayContainerIndex
            requests = (ray_container.get("resources") or {}).get("requests") or {}
            limits = _gpu_limits(ray_container)
            for key, count in limits.items():
                if key in requests and int(requests[key]) != count:
                    errors.append(f"{at}: {key} requests ({requests[key]}) differ from limits ({count})")
            params = group.get("rayStartParams") or {}
            total = sum(limits.values())
            declared = params.get("num-gpus")
            if total and declared is None:
                errors.append(f"{at}: GPU limits of {total} but no rayStartParams num-gpus")
            elif declared is not None and int(declared) != total:
                errors.append(
                    f"{at}: rayStartParams num-gpus={declared} but the container's GPU limits total {total}"
                )
            tags, _ = (
                parse_ray_start_resources(str(params["resources"])) if "resources" in params else ({}, [])
            )
            for vendor_key, tag in GPU_VENDOR_TAGS.items():
                have, advertised = limits.get(vendor_key, 0), (tags or {}).get(tag, 0)
                if have != advertised:
                    errors.append(
                        f"{at}: {vendor_key} limit {have} but resource tag {tag!r} advertises {advertised}"
                    )
    return errors


def cluster_spec_errors(doc: dict) -> list[str]:
    errors = []
    for where, spec in cluster_specs(doc):
        for group_where, _, group in groups(spec):
            if not ((group.get("template") or {}).get("spec") or {}).get("containers"):
                errors.append(f"{where}.{group_where}: the pod template needs at least one container")
    return errors


def rayjob_errors(doc: dict) -> list[str]:
    if doc.get("kind") != "RayJob":
        return []
    spec, errors = doc.get("spec") or {}, []
    shutdown = bool(spec.get("shutdownAfterJobFinishes", False))
    ttl = spec.get("ttlSecondsAfterFinished", 0)
    if ttl < 0:
        errors.append("spec.ttlSecondsAfterFinished must be non-negative")
    if ttl > 0 and not shutdown:
        errors.append("spec.ttlSecondsAfterFinished needs spec.shutdownAfterJobFinishes: true")
    if spec.get("suspend") and not shutdown:
        errors.append("spec.suspend needs spec.shutdownAfterJobFinishes: true")
    selector = spec.get("clusterSelector") or {}
    if not spec.get("rayClusterSpec") and not selector:
        errors.append("one of spec.rayClusterSpec or spec.clusterSelector must be set")
    if selector and not selector.get("ray.io/cluster"):
        errors.append("spec.clusterSelector needs a non-empty ray.io/cluster")
    if "activeDeadlineSeconds" in spec and spec["activeDeadlineSeconds"] <= 0:
        errors.append("spec.activeDeadlineSeconds must be positive")
    if spec.get("backoffLimit", 0) < 0:
        errors.append("spec.backoffLimit must be non-negative")
    if not str(spec.get("entrypoint", "")).strip():
        errors.append("spec.entrypoint is empty")
    return errors


MIN_TOKEN_AUTH_RAY = (2, 52, 0)


def auth_options_errors(doc: dict) -> list[str]:
    """KubeRay's ValidateRayClusterSpec: token mode needs a parseable rayVersion >= 2.52.0."""
    errors = []
    for where, spec in cluster_specs(doc):
        if (spec.get("authOptions") or {}).get("mode") != "token":
            continue
        version = str(spec.get("rayVersion") or "")
        match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version)
        if not version:
            errors.append(f"{where}: authOptions.mode is 'token' but rayVersion is not set (2.52.0 or later)")
        elif match is None:
            errors.append(f"{where}: authOptions.mode is 'token' but rayVersion {version!r} is not a version")
        elif tuple(int(part or 0) for part in match.groups()) < MIN_TOKEN_AUTH_RAY:
            errors.append(
                f"{where}: authOptions.mode is 'token' but rayVersion {version} is older than 2.52.0"
            )
    return errors


RULES = (
    name_errors,
    ray_start_errors,
    replica_errors,
    gpu_errors,
    cluster_spec_errors,
    rayjob_errors,
    auth_options_errors,
)


def kuberay_errors(doc: dict) -> list[str]:
    """Every operator-side rule violated by one RayCluster / RayJob / RayService document."""
    return [error for rule in RULES for error in rule(doc)]
