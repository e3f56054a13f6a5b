"""The real vLLM engine's actor is SIGKILLed mid-job: Ray restarts it, its in-flight batches re-run, and the
output is still exactly once with full accounting."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.conftest import chat_line, read_jsonl, write_lines
from tests.failure_figures import record

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+2?", "Name a color.", "Who wrote Hamlet?", "What do bees make?", "Say hello."]


@pytest.fixture(scope="module")
def private_ray():
    import ray

    if ray.is_initialized():  # a job earlier in this process left its local Ray running
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_engine_actor_killed_mid_job(private_ray, tmp_path):
    import ray

    n = 40
    lines = [
        chat_line(f"k-{i:03d}", QUESTIONS[i % len(QUESTIONS)], max_tokens=48, temperature=0) for i in range(n)
    ]
    path = write_lines(tmp_path / "in.jsonl", lines)
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "job_id": "engine-kill",
            "engine": {"backend": "vllm", "vllm": {"max_model_len": 512, "max_num_seqs": 8}},
            "resources": {"rows_per_task": 4},
            "output_options": {"rows_per_shard": 16, "staging_rows": 4},
        }
    )
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=run_job(config, show_progress=False)))
    thread.start()

    deadline = time.monotonic() + 300
    pid = None
    while pid is None:
        assert time.monotonic() < deadline and thread.is_alive(), "the engine never started"
        try:
            engines = ray.get(ray.get_actor("nightshift-monitor-engine-kill").snapshot.remote())
            pid = next((info["pid"] for info in engines.values()), None)
        except ValueError:
            pass
        time.sleep(0.5)
    time.sleep(3)  # requests are in flight now
    os.kill(pid, signal.SIGKILL)

    thread.join(timeout=900)
    assert not thread.is_alive()
    result = outcome["result"]
    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    errors = read_jsonl(result.output.glob("errors-*.jsonl"))
    record(
        "real vLLM engine actor SIGKILLed mid-job",
        injected=1,
        input_lines=n,
        output_ids=[r["custom_id"] for r in rows + errors],
    )
    assert len(rows) + len(errors) == n
    assert errors == []
    assert sorted(r["custom_id"] for r in rows) == [f"k-{i:03d}" for i in range(n)]
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in rows)
    assert result.manifest["recovery"]["requests_retried_after_engine_failure"] > 0
