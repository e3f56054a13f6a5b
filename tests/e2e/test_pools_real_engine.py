"""Two accelerator pools, each hosting the real CPU vLLM engine, in one job: both do work, nothing is lost. Its own
engines on a cluster of its own (tagged nodes), not the session's warm ones (tests/e2e/warm_cluster.py)."""

from __future__ import annotations

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.lines import chat_line, read_jsonl, write_lines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tagged_ray():
    import ray

    # One machine pretending to be two kinds of node: the tags `nightshift node start` would set.
    if ray.is_initialized():  # a job earlier in this process left its local Ray running
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        resources={"accelerator:cuda": 1, "accelerator:rocm": 1},
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def test_real_engines_in_two_pools(tagged_ray, tmp_path):
    n = 24
    questions = ["What is 2+2?", "Name a color.", "What do bees make?", "Say hello in French."]
    path = write_lines(
        tmp_path / "in.jsonl",
        [chat_line(f"p-{i:03d}", questions[i % 4], max_tokens=24, temperature=0) for i in range(n)],
    )
    pool = {"min_engines": 1, "cpus_per_engine": 0.5}
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "engine": {
                "backend": "vllm",
                "vllm": {"max_model_len": 512, "max_num_seqs": 4, "cpu_kvcache_space_gib": 1},
            },
            "resources": {"rows_per_task": 2},
            "pools": [
                {**pool, "name": "cuda", "resources_per_engine": {"accelerator:cuda": 1}},
                {
                    **pool,
                    "name": "rocm",
                    "resources_per_engine": {"accelerator:rocm": 1},
                    "engine_overrides": {"max_num_seqs": 2},
                },
            ],
        }
    )
    outcome = run_job(config, show_progress=False)
    rows = read_jsonl(outcome.output.glob("results-*.jsonl"))
    assert sorted(r["custom_id"] for r in rows) == [f"p-{i:03d}" for i in range(n)]
    pools = outcome.manifest["pools"]
    assert set(pools) == {"cuda", "rocm"}
    assert all(p["rows"] > 0 and p["completion_tokens"] > 0 for p in pools.values()), pools
    assert sum(p["rows"] for p in pools.values()) == n
