"""One job across two accelerator pools on a simulated mixed cluster (a "cuda" node and a "rocm" node, tagged as
`nightshift node start` tags them), the fake engine twice as slow on one: work is pulled, so the faster pool does
about twice as much and neither becomes the tail."""

from __future__ import annotations

import pytest

from cluster.local import NodeSpec, mixed_cluster
from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.lines import chat_line, read_jsonl, write_lines

pytestmark = pytest.mark.slow

ROWS = 2400
OUTPUT_TOKENS = 10
CONCURRENCY = 16
FAST_DECODE = 0.05  # seconds per token; the "rocm" pool runs at twice this


@pytest.fixture(scope="module")
def mixed():
    import ray

    specs = [
        NodeSpec.cpu("head"),
        NodeSpec.tagged("cuda-node", "cuda", gpus=2, model="NVIDIA H100 80GB HBM3", memory_mib=81559),
        NodeSpec.tagged("rocm-node", "rocm", gpus=2, model="AMD Instinct MI300X", memory_mib=196592),
    ]
    if ray.is_initialized():  # a job earlier in this process left its local Ray running
        ray.shutdown()
    with mixed_cluster(specs) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield cluster
        finally:
            ray.shutdown()


def pool(name: str, tag: str, decode: float) -> dict:
    return {
        "name": name,
        "min_engines": 2,
        "cpus_per_engine": 0,
        "resources_per_engine": {tag: 1},
        "engine_overrides": {"decode_seconds_per_token": decode},
    }


def test_two_pools_share_the_work_by_speed(mixed, tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [chat_line(f"r-{i:05d}", f"q {i}") for i in range(ROWS)])
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "engine": {
                "backend": "fake",
                "fake": {"output_tokens": OUTPUT_TOKENS, "max_concurrency": CONCURRENCY},
            },
            "resources": {"rows_per_task": 16},
            "pools": [
                pool("cuda", "accelerator:cuda", FAST_DECODE),
                pool("rocm", "accelerator:rocm", 2 * FAST_DECODE),
            ],
        }
    )
    outcome = run_job(config, show_progress=False)

    rows = read_jsonl(outcome.output.glob("results-*.jsonl"))
    assert len(rows) == ROWS and len({r["custom_id"] for r in rows}) == ROWS
    pools = outcome.manifest["pools"]
    assert set(pools) == {"cuda", "rocm"}
    assert pools["cuda"]["engines"] == 2 and pools["rocm"]["engines"] == 2
    ratio = pools["cuda"]["rows"] / pools["rocm"]["rows"]
    assert 1.6 < ratio < 2.5, pools

    # The ideal finish: all engines busy until the queue is empty. Rates from the fake engine's time model.
    fast_rate = 2 * CONCURRENCY / (FAST_DECODE * OUTPUT_TOKENS)  # rows/s of the cuda pool
    ideal = ROWS / (fast_rate * 1.5)
    start = min(p["first_result_s"] for p in pools.values()) - FAST_DECODE * OUTPUT_TOKENS
    finish = max(p["last_result_s"] for p in pools.values())
    assert finish - start < 1.25 * ideal + 3.0, (finish - start, ideal, pools)
    # Neither pool is the tail: both stop within a few slow requests (or a tenth of the run) of each other.
    # (The margins absorb scheduling noise on a loaded 2-core box; the fake engine's time model itself is exact.)
    margin = max(8 * FAST_DECODE * OUTPUT_TOKENS, 0.1 * (finish - start))
    assert abs(pools["cuda"]["last_result_s"] - pools["rocm"]["last_result_s"]) < margin, pools
    assert pools["cuda"]["output_tokens_per_s"] > pools["rocm"]["output_tokens_per_s"]
