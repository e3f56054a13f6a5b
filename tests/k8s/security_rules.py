"""What nightshift's manifests must lock down, as checks on the parsed YAML (each returns a list of problems):

- `auth_errors`: every Ray cluster (RayCluster, RayJob's rayClusterSpec, RayService's rayClusterConfig) runs with
  Ray token authentication, `authOptions: {mode: token}`, and leaves RAY_AUTH_MODE / RAY_AUTH_TOKEN to the operator
  (a container setting them would override the token KubeRay generates, or put one in the manifest);
- `container_errors`: every container — Ray's, the job submitter's, and the autoscaler the operator adds (through
  `autoscalerOptions.securityContext`) — runs with `allowPrivilegeEscalation: false`, not privileged, with
  capabilities `drop: [ALL]` and none added beyond `ALLOWED_CAPABILITIES`;
- `credential_errors`: S3 credentials reach containers only through `secretKeyRef` (never a literal value or a
  ConfigMap), every Ray container gets them that way, and no ConfigMap holds anything that looks like one;
- `network_policy_errors`: a NetworkPolicy selects each cluster's head and admits its GCS, dashboard and Ray Client
  ports only from that cluster's own pods and the KubeRay operator, and lets every pod of the cluster (workers, job
  submitter) reach the head;
- `egress_errors`: a NetworkPolicy also limits what each cluster's pods reach: every pod of the cluster is selected by
  a policy with Egress, which lets them reach each other and DNS, and no egress rule reaches link-local addresses
  (169.254.0.0/16: the cloud's instance metadata and its credentials) — no rule without destinations, no ipBlock
  holding 169.254.169.254 without excepting it;
- `read_only_errors`: every container of a cluster and every job submitter runs on a read-only root filesystem
  (`readOnlyRootFilesystem: true`), with the places it writes on volumes of its pod: `/tmp` (Ray's session dir, temp
  files) and its `HOME` (the engines' caches) on emptyDirs, so a process cannot alter the image it runs. (The
  autoscaler the operator adds is the operator's image and keeps its own settings.)
- `identity_errors`: every pod runs as a user other than root (`runAsNonRoot: true`, a non-zero `runAsUser`, an
  `fsGroup` for its volumes), and no container — nor the autoscaler — turns that back;
- `sandbox_errors`: every pod runs under the container runtime's default seccomp profile (`RuntimeDefault`), except
  a pod of AMD GPUs, which may run `Unconfined` as AMD documents for ROCm containers; no container loosens its pod's
  profile; and every container bounds what it may write to the node's disk (`ephemeral-storage` requested and
  limited: Ray's logs and spill, the model cache), so one pod cannot fill a node's disk and evict its neighbours;
- `service_account_errors`: no pod gets the Kubernetes API token mounted (`automountServiceAccountToken: false`);
  where the in-tree autoscaler runs (the one container that calls the API), the head's projected service-account
  token is mounted into it alone, through `autoscalerOptions.volumeMounts`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

from kuberay_rules import cluster_specs, groups

# What the containers may add back after dropping ALL: nothing (GPU access is device nodes and groups).
ALLOWED_CAPABILITIES: frozenset[str] = frozenset()
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
REQUIRED_IN_RAY_CONTAINERS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}
HEAD_PORTS = {6379: "GCS", 8265: "dashboard", 10001: "Ray Client"}
_CREDENTIAL_WORDS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token", "secret_access_key")


def pod_templates(doc: dict) -> Iterator[tuple[str, dict]]:
    """(where, pod template) for every group of every cluster in a Ray document, and a RayJob's submitter."""
    for where, spec in cluster_specs(doc):
        for group_where, _, group in groups(spec):
            yield f"{where}.{group_where}", group.get("template") or {}
    submitter = (doc.get("spec") or {}).get("submitterPodTemplate")
    if doc.get("kind") == "RayJob" and submitter:
        yield "spec.submitterPodTemplate", submitter


def _containers(template: dict) -> Iterator[tuple[str, dict]]:
    spec = template.get("spec") or {}
    for key in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(key) or []):
            yield f"{key}[{index}]", container


# --------------------------------------------------------------------------------------------- token auth


def auth_errors(doc: dict) -> list[str]:
    errors = []
    for where, spec in cluster_specs(doc):
        mode = (spec.get("authOptions") or {}).get("mode")
        if mode != "token":
            errors.append(
                f"{where}.authOptions.mode is {mode!r}: Ray clusters must enforce a token (mode: token)"
            )
    for where, template in pod_templates(doc):
        for container_where, container in _containers(template):
            for var in container.get("env") or []:
                if var.get("name") in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
                    errors.append(
                        f"{where}.{container_where} sets {var['name']}: authOptions lets the operator set it"
                    )
    return errors


# --------------------------------------------------------------------------------------------- containers


def _security_context_errors(at: str, context: dict | None) -> list[str]:
    context = context or {}
    errors = []
    if context.get("allowPrivilegeEscalation") is not False:
        errors.append(f"{at}: securityContext.allowPrivilegeEscalation must be false")
    if context.get("privileged"):
        errors.append(f"{at}: must not be privileged")
    capabilities = context.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or []):
        errors.append(f"{at}: securityContext.capabilities.drop must include ALL")
    extra = set(capabilities.get("add") or []) - ALLOWED_CAPABILITIES
    if extra:
        errors.append(f"{at}: adds capabilities {sorted(extra)} that nightshift's containers do not need")
    return errors


def container_errors(doc: dict) -> list[str]:
    errors = []
    for where, template in pod_templates(doc):
        containers = list(_containers(template))
        if not containers:
            errors.append(f"{where}: no containers")
        for container_where, container in containers:
            errors += _security_context_errors(f"{where}.{container_where}", container.get("securityContext"))
    for where, spec in cluster_specs(doc):
        if spec.get("enableInTreeAutoscaling"):
            options = spec.get("autoscalerOptions") or {}
            errors += _security_context_errors(
                f"{where}.autoscalerOptions (the autoscaler container)", options.get("securityContext")
            )
    return errors


# --------------------------------------------------------------------------------------------- credentials


def _ray_containers(doc: dict) -> Iterator[tuple[str, dict]]:
    """The Ray container of every group (KubeRay's RayContainerIndex: the first)."""
    for where, spec in cluster_specs(doc):
        for group_where, _, group in groups(spec):
            containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or []
            if containers:
                yield f"{where}.{group_where}.containers[0]", containers[0]


def credential_errors(documents: list[dict]) -> list[str]:
    errors = []
    for doc in documents:
        name = f"{doc.get('kind')} {(doc.get('metadata') or {}).get('name')}"
        if doc.get("kind") == "ConfigMap":
            for key, value in (doc.get("data") or {}).items():
                text = f"{key}\n{value}".lower()
                if any(word in text for word in _CREDENTIAL_WORDS):
                    errors.append(f"{name}: data[{key!r}] holds S3 credentials; they belong in a Secret")
            continue
        for where, template in pod_templates(doc):
            for container_where, container in _containers(template):
                at = f"{name} {where}.{container_where}"
                for var in container.get("env") or []:
                    if var.get("name") not in CREDENTIAL_VARIABLES:
                        continue
                    source = var.get("valueFrom") or {}
                    if "value" in var or "secretKeyRef" not in source:
                        errors.append(f"{at}: {var['name']} must come from a Secret (valueFrom.secretKeyRef)")
        for at, container in _ray_containers(doc):
            from_secrets = {
                var["name"]
                for var in container.get("env") or []
                if "secretKeyRef" in (var.get("valueFrom") or {}) and "value" not in var
            }
            for variable in REQUIRED_IN_RAY_CONTAINERS:
                if variable not in from_secrets:
                    errors.append(f"{name} {at}: {variable} is not taken from a Secret")
    return errors


# --------------------------------------------------------------------------------------------- network policy


def _identity(doc: dict) -> tuple[str, str]:
    return doc.get("kind", ""), (doc.get("metadata") or {}).get("name", "")


def _labels(template: dict) -> dict:
    return dict((template.get("metadata") or {}).get("labels") or {})


def _matches(selector: dict, labels: dict) -> bool:
    if set(selector) - {"matchLabels"}:
        return False  # matchExpressions and friends: not understood here, so not trusted
    return all(labels.get(key) == value for key, value in (selector.get("matchLabels") or {}).items())


def _peer_kind(peer: dict, own: list[dict], others: list[dict]) -> str | None:
    """ "own" (pods of this cluster only), "operator", or None (anything wider)."""
    if set(peer) == {"podSelector"}:
        selector = peer["podSelector"] or {}
        if (selector.get("matchLabels") or {}) and all(_matches(selector, labels) for labels in own):
            if not any(_matches(selector, labels) for labels in others):
                return "own"
    if set(peer) <= {"podSelector", "namespaceSelector"} and "podSelector" in peer:
        if ((peer["podSelector"] or {}).get("matchLabels") or {}) == OPERATOR_LABELS and set(
            peer["podSelector"]
        ) == {"matchLabels"}:
            return "operator"
    return None


def _rule_ports(rule: dict) -> set[int] | None:
    """The head ports a rule opens (None: every port)."""
    if not rule.get("ports"):
        return None
    return {port.get("port") for port in rule["ports"]} & set(HEAD_PORTS)


def network_policy_errors(doc: dict, documents: list[dict]) -> list[str]:
    """`doc` is a Ray document; `documents` every document of the manifests (policies and other clusters)."""
    policies = [d for d in documents if d.get("kind") == "NetworkPolicy"]
    errors = []
    for where, spec in cluster_specs(doc):
        own = [_labels(group.get("template") or {}) for _, _, group in groups(spec)]
        submitter = (doc.get("spec") or {}).get("submitterPodTemplate")
        if doc.get("kind") == "RayJob" and submitter:
            own.append(_labels(submitter))  # it calls the head's Jobs API
        others = [
            _labels(template)
            for other in documents
            if _identity(other)
            != _identity(doc)  # another cluster (the documents may hold a copy of this one)
            for _, template in pod_templates(other)
        ]
        head = _labels((spec.get("headGroupSpec") or {}).get("template") or {})
        selecting = [
            policy
            for policy in policies
            if _matches((policy.get("spec") or {}).get("podSelector") or {}, head)
            and (policy.get("spec") or {}).get("podSelector", {}).get("matchLabels")
            and "Ingress" in ((policy.get("spec") or {}).get("policyTypes") or ["Ingress"])
        ]
        if not selecting:
            errors.append(f"{where}: no NetworkPolicy selects the head pods (labels {head})")
            continue
        reachable = [False] * len(own)
        for policy in selecting:
            name = (policy.get("metadata") or {}).get("name")
            for index, rule in enumerate((policy.get("spec") or {}).get("ingress") or []):
                at = f"NetworkPolicy {name} ingress[{index}]"
                ports = _rule_ports(rule)
                peers = rule.get("from") or []
                kinds = [_peer_kind(peer, own, others) for peer in peers]
                if ports is None or ports:
                    opened = sorted(HEAD_PORTS) if ports is None else sorted(ports)
                    if not peers:
                        errors.append(f"{at}: admits every source to {[HEAD_PORTS[p] for p in opened]}")
                    for peer, kind in zip(peers, kinds, strict=True):
                        if kind is None:
                            errors.append(
                                f"{at}: admits {peer} to {[HEAD_PORTS[p] for p in opened]}; only this cluster's "
                                "pods and the KubeRay operator may reach them"
                            )
                        elif kind == "operator" and ports is None:
                            errors.append(f"{at}: opens every port to the operator; list the head's ports")
                if ports is None:
                    for peer, kind in zip(peers, kinds, strict=True):
                        if kind == "own":
                            for position, labels in enumerate(own):
                                reachable[position] |= _matches(peer["podSelector"], labels)
        if not all(reachable):
            missing = [labels for labels, ok in zip(own, reachable, strict=True) if not ok]
            errors.append(f"{where}: pods labelled {missing} of this cluster could not reach its head")
    return errors


# --------------------------------------------------------------------------------------------- read-only root


def read_only_errors(doc: dict) -> list[str]:
    errors = []
    for where, template in pod_templates(doc):
        spec = template.get("spec") or {}
        scratch = {v["name"] for v in spec.get("volumes") or [] if "emptyDir" in v}
        for at, container in _containers(template):
            here = f"{where}.{at}"
            if ((container.get("securityContext") or {}).get("readOnlyRootFilesystem")) is not True:
                errors.append(f"{here}: securityContext.readOnlyRootFilesystem must be true")
                continue
            writable = {m["mountPath"] for m in container.get("volumeMounts") or [] if m["name"] in scratch}
            if "/tmp" not in writable:
                errors.append(
                    f"{here}: a read-only root needs an emptyDir mounted at /tmp (Ray's session dir)"
                )
            home = {e["name"]: e.get("value") for e in container.get("env") or []}.get("HOME")
            if home is None or home not in writable:
                errors.append(
                    f"{here}: a read-only root needs HOME set to an emptyDir's mountPath (the caches)"
                )
    return errors


# --------------------------------------------------------------------------------------------- egress

METADATA_ADDRESS = ipaddress.ip_address("169.254.169.254")


def _reaches_metadata(rule: dict) -> bool:
    peers = rule.get("to")
    if not peers:
        return True  # every destination
    for peer in peers:
        block = peer.get("ipBlock")
        if block is None:
            continue
        if METADATA_ADDRESS in ipaddress.ip_network(block["cidr"]) and not any(
            METADATA_ADDRESS in ipaddress.ip_network(cidr) for cidr in block.get("except") or []
        ):
            return True
    return False


def egress_errors(doc: dict, documents: list[dict]) -> list[str]:
    """`doc` is a Ray document; `documents` every document of the manifests."""
    policies = [
        d
        for d in documents
        if d.get("kind") == "NetworkPolicy" and "Egress" in ((d.get("spec") or {}).get("policyTypes") or [])
    ]
    errors = []
    for where, spec in cluster_specs(doc):
        for group_where, _, group in groups(spec):
            labels = _labels(group.get("template") or {})
            selecting = [
                p for p in policies if _matches((p.get("spec") or {}).get("podSelector") or {}, labels)
            ]
            if not selecting:
                errors.append(
                    f"{where}.{group_where}: no NetworkPolicy limits the egress of its pods ({labels})"
                )
                continue
            rules = [rule for policy in selecting for rule in (policy.get("spec") or {}).get("egress") or []]
            for index, rule in enumerate(rules):
                if _reaches_metadata(rule):
                    errors.append(
                        f"{where}.{group_where}: egress rule {index} reaches 169.254.169.254 (instance metadata); "
                        "except 169.254.0.0/16"
                    )
            if not any(
                not rule.get("ports")
                and any(
                    _matches(peer.get("podSelector") or {"x": "x"}, labels) for peer in rule.get("to") or []
                )
                for rule in rules
            ):
                errors.append(f"{where}.{group_where}: its pods may not reach the cluster's other pods")
            if not any(
                {53} <= {port.get("port") for port in rule.get("ports") or []}
                and any(
                    (peer.get("podSelector") or {}).get("matchLabels", {}).get("k8s-app") == "kube-dns"
                    for peer in rule.get("to") or []
                )
                for rule in rules
            ):
                errors.append(f"{where}.{group_where}: its pods may not reach DNS (kube-dns, port 53)")
    return errors


# --------------------------------------------------------------------------------------------- identity

# Where Kubernetes mounts a pod's API token, and where the autoscaler (Ray's KubeRay node provider) reads it.
SERVICE_ACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def _runs_as_root(context: dict) -> bool:
    return context.get("runAsNonRoot") is False or context.get("runAsUser") == 0


def pod_user(template: dict) -> int | None:
    """The uid a pod template runs its containers as (its pod-level runAsUser)."""
    return ((template.get("spec") or {}).get("securityContext") or {}).get("runAsUser")


def identity_errors(doc: dict) -> list[str]:
    errors = []
    for where, template in pod_templates(doc):
        context = (template.get("spec") or {}).get("securityContext") or {}
        at = f"{where}.spec.securityContext"
        if context.get("runAsNonRoot") is not True:
            errors.append(f"{at}.runAsNonRoot must be true: the pod must not run as root")
        uid = context.get("runAsUser")
        if not isinstance(uid, int) or isinstance(uid, bool) or uid <= 0:
            errors.append(f"{at}.runAsUser must be the image's non-root uid, got {uid!r}")
        if not isinstance(context.get("fsGroup"), int):
            errors.append(f"{at}.fsGroup must be set, so mounted volumes are writable to that user")
        for container_where, container in _containers(template):
            if _runs_as_root(container.get("securityContext") or {}):
                errors.append(f"{where}.{container_where} runs as root (runAsNonRoot false or runAsUser 0)")
    for where, spec in cluster_specs(doc):
        if spec.get("enableInTreeAutoscaling"):
            context = (spec.get("autoscalerOptions") or {}).get("securityContext") or {}
            if context.get("runAsNonRoot") is not True or _runs_as_root(context):
                errors.append(
                    f"{where}.autoscalerOptions.securityContext.runAsNonRoot must be true (the autoscaler container)"
                )
    return errors


def _token_volumes(template: dict) -> set[str]:
    """Names of the pod's volumes that carry a service-account token."""
    names = set()
    for volume in (template.get("spec") or {}).get("volumes") or []:
        sources = (volume.get("projected") or {}).get("sources") or []
        if any("serviceAccountToken" in source for source in sources):
            names.add(volume.get("name"))
    return names


def _mounts_the_token(mount: dict, token_volumes: set[str]) -> bool:
    return (
        mount.get("name") in token_volumes
        or (mount.get("mountPath") or "").rstrip("/") == SERVICE_ACCOUNT_PATH
    )


def service_account_errors(doc: dict) -> list[str]:
    errors = []
    for where, template in pod_templates(doc):
        spec = template.get("spec") or {}
        if spec.get("automountServiceAccountToken") is not False:
            errors.append(
                f"{where}.spec.automountServiceAccountToken must be false: no Ray container calls the Kubernetes API"
            )
        tokens = _token_volumes(template)
        for container_where, container in _containers(template):
            for mount in container.get("volumeMounts") or []:
                if _mounts_the_token(mount, tokens):
                    errors.append(
                        f"{where}.{container_where} mounts the Kubernetes API token ({mount.get('name')})"
                    )
    for where, spec in cluster_specs(doc):
        if not spec.get("enableInTreeAutoscaling"):
            continue
        tokens = _token_volumes((spec.get("headGroupSpec") or {}).get("template") or {})
        mounts = (spec.get("autoscalerOptions") or {}).get("volumeMounts") or []
        if not any(
            mount.get("name") in tokens and (mount.get("mountPath") or "").rstrip("/") == SERVICE_ACCOUNT_PATH
            for mount in mounts
        ):
            errors.append(
                f"{where}.autoscalerOptions.volumeMounts: the autoscaler calls the Kubernetes API; mount a projected "
                f"serviceAccountToken volume of the head pod at {SERVICE_ACCOUNT_PATH}"
            )
    return errors


# --------------------------------------------------------------------------------------------- sandbox and disk


def _requests_amd_gpus(template: dict) -> bool:
    return any(
        "amd.com/gpu" in ((container.get("resources") or {}).get("limits") or {})
        for _, container in _containers(template)
    )


def sandbox_errors(doc: dict) -> list[str]:
    errors = []
    for where, template in pod_templates(doc):
        spec = template.get("spec") or {}
        profile = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
        allowed = {"RuntimeDefault", "Unconfined"} if _requests_amd_gpus(template) else {"RuntimeDefault"}
        if profile not in allowed:
            errors.append(
                f"{where}.spec.securityContext.seccompProfile.type is {profile!r}: pods run under the runtime's "
                "default seccomp profile (RuntimeDefault)"
            )
        for container_where, container in _containers(template):
            own = ((container.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
            if own is not None and own not in allowed:
                errors.append(f"{where}.{container_where} sets seccompProfile {own!r}, looser than its pod's")
            resources = container.get("resources") or {}
            for kind in ("requests", "limits"):
                if "ephemeral-storage" not in (resources.get(kind) or {}):
                    errors.append(
                        f"{where}.{container_where}.resources.{kind} has no ephemeral-storage: the container's "
                        "writes to the node's disk must be bounded"
                    )
    return errors
