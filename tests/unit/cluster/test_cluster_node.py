"""`ray start` planning: tags, --num-gpus, device visibility (incl. Ray's ROCR_VISIBLE_DEVICES rule), running it."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from fake_smi import FIXTURES

from cluster.detect import parse_amd_smi_json, parse_nvidia_smi_csv
from cluster.inventory import Accelerator, NodeInventory
from cluster.node import NodeStartError, advertised_resources, plan_node, start_node
from cluster.stacks import engine_stack_for
from cluster.tags import model_tag, resource_tags
from cluster.visibility import VisibilityError

RAY = ["ray"]


def nvidia_node(fixture: str) -> NodeInventory:
    devices = parse_nvidia_smi_csv((FIXTURES / fixture).read_text())
    return NodeInventory(vendor="cuda", accelerators=devices, cpu_count=8, source="nvidia-smi")


def amd_node(fixture: str) -> NodeInventory:
    devices = parse_amd_smi_json((FIXTURES / fixture).read_text())
    return NodeInventory(vendor="rocm", accelerators=devices, cpu_count=8, source="amd-smi")


CPU_NODE = NodeInventory(vendor="cpu", cpu_count=2, source="os")


def resources_arg(argv: list[str]) -> dict:
    (value,) = [arg.removeprefix("--resources=") for arg in argv if arg.startswith("--resources=")]
    return json.loads(value)


def plan(inventory: NodeInventory, env: dict[str, str] | None = None, **kwargs):
    kwargs.setdefault("head", True)
    kwargs.setdefault("address", None)
    return plan_node(inventory, env=env or {}, ray_command=RAY, **kwargs)


# ----------------------------------------------------------------------------------------- tags and arguments


def test_h100x8_head_node():
    node_plan = plan(nvidia_node("nvidia-smi_h100x8.csv"))

    assert node_plan.argv[:3] == ["ray", "start", "--head"]
    assert "--num-gpus=8" in node_plan.argv
    assert resources_arg(node_plan.argv) == {
        "accelerator:cuda": 8,
        "accelerator_model:H100": 8,
        "gpu_memory_gib:80": 8,
    }
    assert node_plan.env == {} and node_plan.notes == []
    assert node_plan.engine_stack == "vllm (CUDA)"


def test_resource_values_are_integers_as_ray_requires():
    for inventory in (
        nvidia_node("nvidia-smi_h100x8.csv"),
        amd_node("amd-smi_static_mi300x-x8.json"),
        CPU_NODE,
    ):
        for value in resources_arg(plan(inventory).argv).values():
            assert type(value) is int


def test_mi300x_x8_counts_as_ray_gpus_with_rocm_tags():
    node_plan = plan(amd_node("amd-smi_static_mi300x-x8.json"), head=False, address="10.0.0.1:6379")

    assert node_plan.argv[2] == "--address=10.0.0.1:6379"
    assert "--num-gpus=8" in node_plan.argv  # Ray counts AMD GPUs as GPU too
    assert resources_arg(node_plan.argv) == {
        "accelerator:rocm": 8,
        "accelerator_model:MI300X": 8,
        "gpu_memory_gib:192": 8,
    }
    assert node_plan.engine_stack == "vLLM ROCm image (ROCm 6.3+)"


def test_rx7900xtx_tags():
    node_plan = plan(amd_node("amd-smi_static_rx7900xtx.json"))
    assert resources_arg(node_plan.argv) == {
        "accelerator:rocm": 1,
        "accelerator_model:RX-7900-XTX": 1,
        "gpu_memory_gib:24": 1,
    }


def test_cpu_node_offers_one_cpu_engine_slot():
    node_plan = plan(CPU_NODE)
    assert "--num-gpus=0" in node_plan.argv
    assert resources_arg(node_plan.argv) == {"accelerator:cpu": 1}
    assert node_plan.engine_stack == "vllm-cpu" and node_plan.env == {}


def test_extra_args_come_last_so_they_win():
    node_plan = plan(CPU_NODE, extra_args=["--block", "--num-cpus=4"])
    assert node_plan.argv[-2:] == ["--block", "--num-cpus=4"]


@pytest.mark.parametrize("head, address", [(True, "10.0.0.1:6379"), (False, None), (False, "")])
def test_head_and_address_are_exclusive_and_one_is_required(head, address):
    with pytest.raises(NodeStartError):
        plan(CPU_NODE, head=head, address=address)


# Importing Ray's CLI pulls in Ray Serve, whose models trigger pydantic deprecation warnings.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_rays_own_cli_parser_accepts_the_arguments():
    """Parse with the installed `ray start` command (click), without running it."""
    from ray._private.utils import parse_resources_json
    from ray.scripts.scripts import start

    node_plan = plan(amd_node("amd-smi_static_mi300x-x8.json"), head=False, address="10.0.0.1:6379")
    context = start.make_context("start", node_plan.argv[2:])

    assert context.params["address"] == "10.0.0.1:6379" and context.params["num_gpus"] == 8
    resources = parse_resources_json(context.params["resources"], cli_logger=None, cf=None)
    assert resources == node_plan.resources


def test_the_printed_command_round_trips_through_a_shell():
    node_plan = plan(nvidia_node("nvidia-smi_p100x2.csv"))
    words = shlex.split(node_plan.command_line())
    env_words = [word for word in words if "=" in word and not word.startswith("-")]
    assert dict(word.split("=", 1) for word in env_words) == node_plan.env
    assert words[len(env_words) :] == node_plan.argv


@pytest.mark.parametrize(
    "name, tag",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("Tesla T4", "T4"),
        ("Tesla P100-SXM2-16GB", "P100"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA RTX A6000", "RTX-A6000"),
        ("AMD Instinct MI300X", "MI300X"),
        ("AMD Instinct MI250X / MI250", "MI250X"),
        ("AMD Radeon RX 7900 XTX", "RX-7900-XTX"),
        ("Navi 32 [Radeon RX 7700 XT / 7800 XT]", "RX-7700-XT-7800-XT"),
        ("AMD Radeon Graphics", "UNKNOWN"),
    ],
)
def test_model_tag(name, tag):
    assert model_tag(name) == tag


def test_a_mixed_model_node_counts_each_model_and_memory_class():
    devices = [
        Accelerator(vendor="cuda", index=0, model="NVIDIA L40S", memory_mib=46068, compute_capability="8.9"),
        Accelerator(vendor="cuda", index=1, model="NVIDIA L4", memory_mib=23034, compute_capability="8.9"),
        Accelerator(vendor="cuda", index=2, model="NVIDIA L4", memory_mib=23034, compute_capability="8.9"),
    ]
    assert resource_tags("cuda", devices) == {
        "accelerator:cuda": 3,
        "accelerator_model:L4": 2,
        "accelerator_model:L40S": 1,
        "gpu_memory_gib:22": 2,
        "gpu_memory_gib:45": 1,
    }


# ----------------------------------------------------------------------------------------- unsupported devices


def test_a_node_of_only_unsupported_gpus_joins_as_a_cpu_node_with_the_gpus_hidden():
    node_plan = plan(nvidia_node("nvidia-smi_p100x2.csv"))

    assert node_plan.vendor == "cpu" and "--num-gpus=0" in node_plan.argv
    assert resources_arg(node_plan.argv) == {"accelerator:cpu": 1}
    assert node_plan.env == {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert sum("hidden from Ray" in note for note in node_plan.notes) == 2
    assert any("joins as a CPU node" in note for note in node_plan.notes)


def test_on_a_mixed_node_only_the_supported_gpu_is_visible():
    devices = parse_nvidia_smi_csv(
        "0, Tesla P100-SXM2-16GB, 16384, 6.0, GPU-a, 565.57.01\n1, Tesla T4, 15360, 7.5, GPU-b, 565.57.01\n"
    )
    node_plan = plan(NodeInventory(vendor="cuda", accelerators=devices, cpu_count=4, source="nvidia-smi"))

    assert node_plan.env == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert resources_arg(node_plan.argv) == {
        "accelerator:cuda": 1,
        "accelerator_model:T4": 1,
        "gpu_memory_gib:15": 1,
    }


def test_the_unsupported_reason_is_reported_once():
    inventory = nvidia_node("nvidia-smi_p100x2.csv")
    # What detect_node records for these devices; the plan must not repeat it next to its own notes.
    reason = engine_stack_for(inventory.accelerators[0]).warning
    node_plan = plan(inventory.model_copy(update={"warnings": [reason]}))
    assert sum("Tesla P100" in note for note in node_plan.notes) == 2  # one per hidden GPU, nothing repeated


def test_an_unknown_amd_target_stays_visible_with_a_warning():
    inventory = NodeInventory(
        vendor="rocm",
        accelerators=[
            Accelerator(vendor="rocm", index=0, model="AMD Radeon RX 6800 XT", gfx_target="gfx1030")
        ],
        cpu_count=4,
        source="amd-smi",
        warnings=["AMD Radeon RX 6800 XT: gfx target gfx1030 is not in vLLM's ROCm support list"],
    )
    node_plan = plan(inventory)
    assert "--num-gpus=1" in node_plan.argv and node_plan.env == {}
    assert node_plan.notes == inventory.warnings


def test_a_known_unsupported_amd_gpu_is_hidden_through_hip():
    devices = [
        Accelerator(vendor="rocm", index=0, model="AMD Instinct MI100", gfx_target="gfx908"),
        Accelerator(
            vendor="rocm", index=1, model="AMD Instinct MI210", gfx_target="gfx90a", memory_mib=65520
        ),
    ]
    node_plan = plan(NodeInventory(vendor="rocm", accelerators=devices, cpu_count=4, source="amd-smi"))
    assert node_plan.env == {"HIP_VISIBLE_DEVICES": "1"}
    assert resources_arg(node_plan.argv)["accelerator:rocm"] == 1


# ----------------------------------------------------------------------------------------- visibility variables


def test_cuda_visible_devices_set_by_the_user_narrows_the_node():
    node_plan = plan(nvidia_node("nvidia-smi_h100x8.csv"), env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert "--num-gpus=2" in node_plan.argv
    assert node_plan.env == {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_cuda_visible_devices_may_name_uuids():
    node_plan = plan(nvidia_node("nvidia-smi_h100x8.csv"), env={"CUDA_VISIBLE_DEVICES": "GPU-REDACTED-5"})
    assert "--num-gpus=1" in node_plan.argv and node_plan.env["CUDA_VISIBLE_DEVICES"] == "5"


def test_indices_are_written_in_pci_bus_order_even_if_the_user_chose_otherwise():
    env = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    node_plan = plan(nvidia_node("nvidia-smi_h100x8.csv"), env=env)
    assert node_plan.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert any("FASTEST_FIRST replaced by PCI_BUS_ID" in note for note in node_plan.notes)

    node_plan = plan(nvidia_node("nvidia-smi_h100x8.csv"), env={**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert node_plan.env == {"CUDA_VISIBLE_DEVICES": "0"} and node_plan.notes == []


def test_a_visibility_entry_naming_a_missing_device_is_a_clear_error():
    with pytest.raises(VisibilityError, match="names device '9'"):
        plan(nvidia_node("nvidia-smi_h100x8.csv"), env={"CUDA_VISIBLE_DEVICES": "0,9"})


def test_rocr_visible_devices_alone_is_translated_for_ray():
    """Ray >= 2.45 raises on ROCR_VISIBLE_DEVICES without HIP_VISIBLE_DEVICES; we add HIP, relative to ROCR."""
    node_plan = plan(amd_node("amd-smi_static_mi300x-x8.json"), env={"ROCR_VISIBLE_DEVICES": "4,5"})

    assert "--num-gpus=2" in node_plan.argv
    assert node_plan.env == {"HIP_VISIBLE_DEVICES": "0,1"}  # ROCR stays as the user set it
    assert any("ROCR_VISIBLE_DEVICES=4,5 alone is refused by Ray" in note for note in node_plan.notes)


def test_hip_indices_count_within_the_rocr_visible_devices():
    env = {"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "1"}
    node_plan = plan(amd_node("amd-smi_static_mi300x-x8.json"), env=env)
    assert "--num-gpus=1" in node_plan.argv and node_plan.env == {"HIP_VISIBLE_DEVICES": "1"}
    assert node_plan.notes == []


def test_always_names_the_devices_even_when_the_environment_already_matches():
    from cluster.visibility import visibility_env

    h100 = nvidia_node("nvidia-smi_h100x8.csv")
    assert visibility_env(h100, {}, h100.accelerators) == ({}, [])
    env, _ = visibility_env(h100, {}, h100.accelerators, always=True)
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    mi300x = amd_node("amd-smi_static_mi300x-x8.json")
    assert visibility_env(mi300x, {}, mi300x.accelerators[:2], always=True)[0] == {
        "HIP_VISIBLE_DEVICES": "0,1"
    }


def test_the_translated_environment_satisfies_rays_own_amd_rule(monkeypatch):
    """Check against the installed Ray's AMDGPUAcceleratorManager, not a copy of its rule."""
    from ray._private.accelerators.amd_gpu import AMDGPUAcceleratorManager

    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "4,5")
    with pytest.raises(RuntimeError, match="HIP_VISIBLE_DEVICES instead of ROCR_VISIBLE_DEVICES"):
        AMDGPUAcceleratorManager.get_visible_accelerator_ids_env_var()

    node_plan = plan(amd_node("amd-smi_static_mi300x-x8.json"), env={"ROCR_VISIBLE_DEVICES": "4,5"})
    for key, value in node_plan.env.items():
        monkeypatch.setenv(key, value)
    assert AMDGPUAcceleratorManager.get_current_process_visible_accelerator_ids() == ["0", "1"]


def test_advertised_resources_match_the_plan():
    inventory = amd_node("amd-smi_static_mi300x-x8.json")
    assert advertised_resources(inventory, env={}) == resources_arg(plan(inventory).argv)


# ----------------------------------------------------------------------------------------- running it


def test_dry_run_prints_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr("cluster.node.subprocess.run", lambda *a, **k: pytest.fail("dry run must not run"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    code = start_node(
        head=True, address=None, dry_run=True, extra_args=[], inventory=nvidia_node("nvidia-smi_h100x8.csv")
    )

    out = capsys.readouterr().out
    assert code == 0
    assert "--num-gpus=8" in out and '"accelerator_model:H100":8' in out


def test_start_node_runs_ray_start_with_the_visibility_environment(tmp_path, monkeypatch):
    """A stand-in `ray` records its argv and environment, and its exit code is passed through."""
    record = tmp_path / "record.json"
    script = (
        "import json, os, sys; "
        f"json.dump({{'argv': sys.argv[1:], 'hip': os.environ.get('HIP_VISIBLE_DEVICES')}}, open({str(record)!r}, 'w')); "
        "sys.exit(3)"
    )
    monkeypatch.setattr("cluster.node.ray_executable", lambda: [sys.executable, "-c", script])
    monkeypatch.setattr("cluster.node.require_access", lambda *args: "accepted")  # the head is not asked here
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "6,7")
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    token = tmp_path / "token"
    token.write_text("t" * 64)

    code = start_node(
        head=False,
        address="head:6379",
        dry_run=False,
        extra_args=["--block"],
        token_file=str(token),
        inventory=amd_node("amd-smi_static_mi300x-x8.json"),
    )

    recorded = json.loads(record.read_text())
    assert code == 3
    assert recorded["hip"] == "0,1"
    assert recorded["argv"][:3] == ["start", "--address=head:6379", "--num-gpus=2"]
    assert recorded["argv"][-1] == "--block"
