"""`plan` against the real engine: the planned KV capacity is what vLLM allocates, and the command runs end to end.
vLLM's own `LLM` is started here, as a user would, to read what it allocates: no nightshift engine is involved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.model_shape import model_shape
from pipeline.planner import DeviceBudget, kv_bytes_per_token, plan_pool
from tests.unit.planner_models import plan_app

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KV_SPACE_GIB = 1
CONTEXT = 2048

# The engine starts a spawned subprocess, so the script needs the __main__ guard.
ENGINE_SCRIPT = """
import json, sys

if __name__ == "__main__":
    from vllm import LLM

    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=int(sys.argv[2]), enforce_eager=True)
    cache = llm.llm_engine.vllm_config.cache_config
    print("KV " + json.dumps({"blocks": cache.num_gpu_blocks, "block_size": cache.block_size}), flush=True)
"""


@pytest.fixture(scope="module")
def engine_kv(embedded_model, tmp_path_factory) -> dict:
    """The KV cache the real engine allocates for the embedded model at VLLM_CPU_KVCACHE_SPACE=1 (one start)."""
    script = tmp_path_factory.mktemp("plan") / "engine_kv.py"
    script.write_text(ENGINE_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), embedded_model.path, str(CONTEXT)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB)},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("KV ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    kv = json.loads(lines[-1][3:])
    kv["tokens"] = kv["blocks"] * kv["block_size"]
    return kv


def test_bytes_per_token_is_two_layers_kv_heads_head_dim_two_bytes(embedded_model):
    config = json.loads((Path(embedded_model.path) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    expected = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    assert kv_bytes_per_token(model_shape(embedded_model.path)) == expected


def test_planned_capacity_matches_the_engine_within_ten_percent(embedded_model, engine_kv):
    plan = plan_pool(model_shape(embedded_model.path), DeviceBudget.cpu(KV_SPACE_GIB), context=CONTEXT)
    assert plan.block_size == engine_kv["block_size"]
    assert abs(plan.kv_capacity_tokens - engine_kv["tokens"]) <= 0.10 * engine_kv["tokens"], (plan, engine_kv)


def test_cli_plans_the_embedded_model():
    result = CliRunner().invoke(plan_app(), ["plan", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    pool = report["pools"][0]
    assert report["model"]["name"] == "smollm2-135m-instruct"
    assert (pool["pool"], pool["kv_bytes_per_token"], pool["kv_capacity_tokens"]) == ("cpu", 23040, 93184)
    assert pool["context"] == 8192 and pool["recommended_max_num_seqs"] == 11


def test_cli_fits_the_context_to_the_example_batch():
    example = str(REPO / "examples" / "chat.jsonl")
    result = CliRunner().invoke(plan_app(), ["plan", "--input", example, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    longest = report["input"]["prompt_plus_max_tokens"]["max"]
    pool = report["pools"][0]
    # Chat template applied: the system prompt SmolLM2 inserts alone is ~20 tokens, so no prompt is tiny.
    assert report["input"]["prompt_tokens"]["max"] > 20
    assert pool["fit"]["context"] == -(-longest // 128) * 128 == pool["context"]
    assert pool["context_source"] == "fitted to --input"

    text = CliRunner().invoke(plan_app(), ["plan", "--input", example])
    assert text.exit_code == 0, text.output
    assert "fitted max_model_len" in text.output and "histogram" in text.output and "█" in text.output
