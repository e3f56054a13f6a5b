"""bench/gpu_check.py without vLLM: devices from recorded vendor-tool output, path plans for one GPU and for two or
more, the environment pins, the flags, and the JSON record's shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))

import engines as eb  # noqa: E402
import gpu_check as gc  # noqa: E402
from fake_smi import FakeTools  # noqa: E402

from cluster.detect import detect_node  # noqa: E402
from cluster.inventory import NodeInventory  # noqa: E402
from pipeline.model_shape import ModelShape  # noqa: E402

# SmolLM2-135M-Instruct's config.json: 9 query heads (they do not split two ways), 3 KV heads, 30 layers.
SMOLLM2 = ModelShape(
    model_type="llama",
    layers=30,
    attention_heads=9,
    kv_heads=3,
    mlp_sizes=(1536,),
    head_dim=64,
    dtype="bfloat16",
    dtype_bytes=2,
    max_model_len_limit=8192,
)
# A model tensor parallelism splits two ways (32 heads, 8 KV heads: a Llama-3-8B shape).
LLAMA8B = SMOLLM2.model_copy(
    update={"attention_heads": 32, "kv_heads": 8, "mlp_sizes": (14336,), "layers": 32}
)


@pytest.fixture
def tools(tmp_path, monkeypatch) -> FakeTools:
    return FakeTools(tmp_path / "bin", monkeypatch)


def detected(tools: FakeTools, tool: str, fixture: str) -> NodeInventory:
    tools.prints(tool, fixture)
    return detect_node()


def test_h100x8_from_nvidia_smi_gives_every_visible_gpu_or_the_ones_asked_for(tools: FakeTools) -> None:
    inventory = detected(tools, "nvidia-smi", "nvidia-smi_h100x8.csv")
    target = gc.choose_target(inventory, {}, None, smoke=False)
    assert target.vendor == "cuda" and target.ids == list(range(8))
    # The user's CUDA_VISIBLE_DEVICES narrows what the check may use; --devices picks among those.
    assert gc.choose_target(inventory, {"CUDA_VISIBLE_DEVICES": "5,6"}, None, smoke=False).ids == [5, 6]
    assert gc.choose_target(inventory, {}, [3, 1], smoke=False).ids == [3, 1]
    with pytest.raises(SystemExit, match="not among the visible GPUs"):
        gc.choose_target(inventory, {"CUDA_VISIBLE_DEVICES": "5,6"}, [0], smoke=False)


def test_amd_gpus_from_amd_smi(tools: FakeTools) -> None:
    inventory = detected(tools, "amd-smi", "amd-smi_static_mi300x-x8.json")
    target = gc.choose_target(inventory, {}, None, smoke=False)
    assert target.vendor == "rocm" and len(target.ids) == 8
    assert gc.engine_args_for(target, enforce_eager=True).dtype == "bfloat16"


def test_no_gpu_is_an_error_unless_smoke_which_takes_the_cpu_cores(tools: FakeTools) -> None:
    inventory = detect_node()  # no vendor tool on PATH
    with pytest.raises(SystemExit, match="--smoke"):
        gc.choose_target(inventory, {}, None, smoke=False)
    target = gc.choose_target(inventory, {}, None, smoke=True)
    assert target.vendor == "cpu" and target.ids == gc.fair.box_cores()


def test_bfloat16_only_where_the_gpu_has_it(tools: FakeTools) -> None:
    p100 = gc.choose_target(detected(tools, "nvidia-smi", "nvidia-smi_p100x2.csv"), {}, None, smoke=False)
    assert gc.engine_args_for(p100, enforce_eager=True).dtype == "float16"
    h100 = gc.Target(vendor="cuda", inventory=p100.inventory, devices=[])
    assert gc.engine_args_for(h100, enforce_eager=True).dtype == "bfloat16"  # no device disagrees
    h100_inventory = NodeInventory(
        vendor="cuda",
        accelerators=[a.model_copy(update={"compute_capability": "9.0"}) for a in p100.devices],
        cpu_count=2,
        source="nvidia-smi",
    )
    mixed = gc.Target(
        vendor="cuda", inventory=h100_inventory, devices=[*h100_inventory.accelerators[:1], p100.devices[1]]
    )
    assert gc.engine_args_for(mixed, enforce_eager=True).dtype == "float16"


def test_one_gpu_plans_the_three_paths_on_it(tools: FakeTools) -> None:
    inventory = detected(tools, "nvidia-smi", "nvidia-smi_h100x8.csv")
    target = gc.choose_target(inventory, {}, [4], smoke=False)
    paths, notes = gc.plan_paths(target, SMOLLM2)
    assert [(p.name, p.kind, p.devices) for p in paths] == [
        ("nightshift", "nightshift", (4,)),
        ("vllm-offline", "vllm-offline", (4,)),
        ("vllm-run-batch", "vllm-run-batch", (4,)),
    ]
    assert "skipped" in notes[0]


def test_two_gpus_add_one_engine_over_both_and_two_engines_of_one(tools: FakeTools) -> None:
    target = gc.choose_target(detected(tools, "nvidia-smi", "nvidia-smi_h100x8.csv"), {}, None, smoke=False)
    paths, _ = gc.plan_paths(target, LLAMA8B)
    by_name = {p.name: p for p in paths}
    assert list(by_name) == [
        "nightshift",
        "vllm-offline",
        "vllm-run-batch",
        "nightshift-tp2",
        "nightshift-2x1",
    ]
    assert by_name["nightshift"].devices == (0,)
    tp2, two = by_name["nightshift-tp2"], by_name["nightshift-2x1"]
    assert (tp2.devices, tp2.engines, tp2.tensor_parallel_size, tp2.ranks_per_engine) == ((0, 1), 1, 2, 2)
    assert (two.devices, two.engines, two.ranks_per_engine) == ((0, 1), 2, 1)
    assert gc.nightshift_flags(target, tp2) == [
        "--num-engines", "1", "--gpus-per-engine", "2", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1"
    ]  # fmt: skip
    assert gc.nightshift_flags(target, two)[:4] == ["--num-engines", "2", "--gpus-per-engine", "1"]


def test_the_embedded_model_cannot_split_its_heads_two_ways_so_one_engine_pipelines_over_two(
    tools: FakeTools,
) -> None:
    target = gc.choose_target(
        detected(tools, "amd-smi", "amd-smi_static_mi300x-x8.json"), {}, None, smoke=False
    )
    paths, notes = gc.plan_paths(target, SMOLLM2)
    pp2 = next(p for p in paths if p.name == "nightshift-pp2")
    assert (pp2.tensor_parallel_size, pp2.pipeline_parallel_size, pp2.ranks_per_engine) == (1, 2, 2)
    assert any("9 attention heads" in n for n in notes)


def test_the_cpu_smoke_plans_one_engine_on_all_cores_for_every_path(tools: FakeTools) -> None:
    target = gc.Target(vendor="cpu", inventory=detect_node(), cores=[0, 1])
    paths, notes = gc.plan_paths(target, SMOLLM2)
    assert [p.devices for p in paths] == [(0, 1)] * 3 and notes == []
    nightshift, offline, run_batch = paths
    assert gc.pin_env(target, nightshift) == {}  # nightshift binds its engine from --cpus-per-engine
    assert gc.nightshift_flags(target, nightshift) == ["--num-engines", "1", "--cpus-per-engine", "2"]
    assert gc.pin_env(target, offline) == gc.pin_env(target, run_batch) == {gc.fair.OMP_BIND: "0-1"}


def test_every_gpu_path_is_pinned_by_name_even_when_it_uses_every_gpu(tools: FakeTools) -> None:
    target = gc.choose_target(detected(tools, "nvidia-smi", "nvidia-smi_p100x2.csv"), {}, None, smoke=False)
    paths, _ = gc.plan_paths(target, SMOLLM2)
    pins = {p.name: gc.pin_env(target, p) for p in paths}
    assert pins["vllm-offline"] == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert pins["nightshift"] == pins["vllm-run-batch"] == pins["vllm-offline"]
    assert (
        pins["nightshift-pp2"]["CUDA_VISIBLE_DEVICES"]
        == pins["nightshift-2x1"]["CUDA_VISIBLE_DEVICES"]
        == "0,1"
    )


def test_amd_pins_hip_positions_under_a_users_rocr_mask(tools: FakeTools) -> None:
    inventory = detected(tools, "amd-smi", "amd-smi_static_mi300x-x8.json")
    env = {"ROCR_VISIBLE_DEVICES": "4,5,6"}
    target = gc.choose_target(inventory, env, None, smoke=False)
    assert target.ids == [4, 5, 6]
    paths, _ = gc.plan_paths(target, SMOLLM2)
    # HIP numbers the devices ROCR leaves from 0: GPU 4 is HIP 0; ROCR itself stays as the user set it.
    assert gc.pin_env(target, paths[0]) == {"HIP_VISIBLE_DEVICES": "0"}
    assert gc.pin_env(target, paths[-1]) == {"HIP_VISIBLE_DEVICES": "0,1"}


def _traces(visible: str, **config) -> list[dict]:
    engine_config = {
        "max_model_len": 2048,
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "tensor_parallel_size": 1,
        "visible_devices": {"CUDA_VISIBLE_DEVICES": visible},
        **config,
    }
    return [{"first_token_at": 110.0, "last_token_at": 120.0, "tokens": 5000, "engine_config": engine_config}]


def test_a_path_record_has_its_numbers_its_pins_and_the_engines_own_args(tools: FakeTools) -> None:
    target = gc.choose_target(detected(tools, "nvidia-smi", "nvidia-smi_h100x8.csv"), {}, None, smoke=False)
    paths, _ = gc.plan_paths(target, SMOLLM2)
    args = gc.engine_args_for(target, enforce_eager=True)
    timed = eb.Timed(wall_s=30.0, cores_used=1.0, steal_share=0.0, started=100.0, ended=130.0)
    outputs = {f"req-{i}": {"tokens": 10, "text": "x", "ok": i != 3} for i in range(4)}
    offline = gc.path_result(paths[1], target, args, 4, outputs, timed, _traces("0"), texts=[])
    assert (offline.rows_ok, offline.output_tokens) == (3, 30)
    assert (offline.fixed_s, offline.generation_s, offline.steady_tok_per_s, offline.tail_s) == (
        10.0,
        10.0,
        500.0,
        10.0,
    )
    assert offline.env == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert offline.engine_args == eb.asdict(args) and offline.engine_args["max_num_batched_tokens"] == 8192
    assert offline.devices_wrong is None and offline.engine_config["max_num_seqs"] == 256
    # An engine that saw another GPU than its path's is flagged; so is an engine that ran with other args.
    stray = gc.path_result(paths[0], target, args, 4, outputs, timed, _traces("0,1", max_num_seqs=128), [])
    assert "the path was pinned to 0" in stray.devices_wrong
    assert gc.engine_args_differ([offline, stray]) == ["max_num_seqs: vllm-offline=256, nightshift=128"]
    assert gc.engine_args_differ([offline, offline]) == []


def test_the_report_round_trips_through_its_json(tools: FakeTools) -> None:
    target = gc.Target(vendor="cpu", inventory=detect_node(), cores=[0, 1])
    paths, notes = gc.plan_paths(target, SMOLLM2)
    args = gc.engine_args_for(target, enforce_eager=True)
    results = [gc.PathResult(**gc._path_fields(p, target, args), rows_in=16, error="boom") for p in paths]
    report = gc.CheckReport(
        mode="smoke",
        started_at="2026-12-03T00:00:00+0000",
        versions=gc.versions(),
        host={"cpus": 2},
        devices={"vendor": "cpu", "used": target.ids},
        model={"name": "smollm2-135m-instruct", "path": "/x"},
        workload={"requests": 16, "max_tokens": 16},
        engine_args=eb.asdict(args),
        notes=notes,
        paths=results,
    )
    data = json.loads(report.model_dump_json())
    assert {"nightshift-batch", "vllm", "torch", "ray"} <= data["versions"].keys()
    assert [p["name"] for p in data["paths"]] == ["nightshift", "vllm-offline", "vllm-run-batch"]
    for key in ("fixed_s", "steady_tok_per_s", "rows_ok", "engine_args", "engine_config", "env", "devices"):
        assert all(key in p for p in data["paths"])
    assert gc.CheckReport.model_validate(data) == report
