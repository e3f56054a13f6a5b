"""README "Failure model", row "an engine process dies (crash, OOM kill, `EngineDeadError`)", on the real engine:

- the engine actor's own process is SIGKILLed mid-job (a crash or an OOM kill of the actor);
- vLLM's engine-core child process is SIGKILLed under a live actor: vLLM raises `EngineDeadError`, the actor exits
  on purpose and Ray restarts it.

Either way the batches in flight re-run on the restarted engine and the output is exactly once with full accounting.
Its own engines (not the session's warm ones, tests/e2e/warm_cluster.py): their death is the subject.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
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


def _start_job(tmp_path, job_id: str, prefix: str, n: int, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A job of `n` short chats running on a thread (its outcome lands in the dict): small chunks and staged parts,
    so a kill finds rows both in flight and already staged."""
    lines = [
        chat_line(f"{prefix}-{i:03d}", QUESTIONS[i % len(QUESTIONS)], max_tokens=max_tokens, temperature=0)
        for i in range(n)
    ]
    path = write_lines(tmp_path / "in.jsonl", lines)
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "job_id": job_id,
            "engine": {"backend": "vllm", "vllm": {"max_model_len": 512, "max_num_seqs": 8}},
            "resources": {"rows_per_task": 4},
            "output_options": {"rows_per_shard": 16, "staging_rows": 4},
        }
    )
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=run_job(config, show_progress=False)))
    thread.start()
    return thread, outcome


def test_engine_actor_killed_mid_job(private_ray, tmp_path):
    """Row "an engine process dies": the actor process itself is SIGKILLed."""

    n = 40
    thread, outcome = _start_job(tmp_path, "engine-kill", "k", n, max_tokens=48)

    victim, pid = _engine_with_work_in_flight("engine-kill", thread)
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
    # Killed outright, the engine reported no cause; the rows it had in flight ran again on its restarted actor.
    recovery = result.manifest["recovery"]
    assert list(recovery["engines_lost"]) == [victim]
    lost = recovery["engines_lost"][victim]
    assert lost["cause"] is None and lost["rows_in_flight"] > 0
    assert lost["rows_rerun"] >= lost["rows_in_flight"]
    assert recovery["engine_restarts"] == 1
    assert recovery["requests_retried_after_engine_failure"] == lost["rows_rerun"]


def _engine_with_work_in_flight(job_id: str, job: threading.Thread) -> tuple[str, int]:
    """The first engine of the job with rows in flight (the monitor's work ledger: begun, not yet returned), and
    its actor's pid. Rows are begun only once the engine has started."""
    import ray

    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline and job.is_alive(), "the engine never got work"
        try:
            monitor = ray.get_actor(f"nightshift-monitor-{job_id}")
            work, engines = ray.get([monitor.work.remote(), monitor.snapshot.remote()])
        except ValueError:  # the monitor is not up yet
            work, engines = {}, {}
        for engine, info in work.items():
            if info["in_flight"] > 0 and engine in engines:
                return engine, engines[engine]["pid"]
        time.sleep(0.1)


def _engine_core(actor_pid: int) -> psutil.Process:
    """vLLM's engine-core process under an engine actor: vLLM titles it `VLLM::EngineCore` (setproctitle)."""
    cores = [
        child
        for child in psutil.Process(actor_pid).children(recursive=True)
        if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline())
    ]
    assert len(cores) == 1, f"expected one engine-core process under the actor, found {cores}"
    return cores[0]


def test_engine_core_killed_under_a_live_actor(private_ray, tmp_path):
    """Row "an engine process dies (... `EngineDeadError`)": only vLLM's engine-core process is SIGKILLed; the actor
    lives on until vLLM tells it the engine is dead, then exits so that Ray restarts it with a fresh engine."""

    n = 24
    thread, outcome = _start_job(tmp_path, "engine-core-kill", "c", n, max_tokens=16)

    # Once the engine has rows in flight, kill its engine core and nothing else.
    victim, actor_pid = _engine_with_work_in_flight("engine-core-kill", thread)
    core = _engine_core(actor_pid)
    core.send_signal(signal.SIGKILL)
    core.wait(timeout=30)

    thread.join(timeout=900)
    assert not thread.is_alive()
    result = outcome["result"]
    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    errors = read_jsonl(result.output.glob("errors-*.jsonl"))
    record(
        "real vLLM engine core SIGKILLed under a live actor",
        injected=1,
        input_lines=n,
        output_ids=[r["custom_id"] for r in rows + errors],
    )
    # Exactly once, full accounting, and not one row turned into an error by the kill.
    assert len(rows) + len(errors) == n == result.manifest["counts"]["total"]
    assert errors == []
    assert sorted(r["custom_id"] for r in rows) == [f"c-{i:03d}" for i in range(n)]
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in rows)
    # The runtime's own record: the engine reported EngineDeadError, its actor was restarted in a new process,
    # and the rows it had in flight ran again there.
    recovery = result.manifest["recovery"]
    assert list(recovery["engines_lost"]) == [victim]
    lost = recovery["engines_lost"][victim]
    assert lost["cause"] == "EngineDeadError"
    assert lost["rows_in_flight"] > 0
    assert lost["rows_rerun"] == sum(r["rows"] for r in lost["rerun_on"]) >= lost["rows_in_flight"]
    assert all(r["engine"] != victim for r in lost["rerun_on"])
    assert recovery["engine_restarts"] == 1
    assert recovery["requests_retried_after_engine_failure"] == lost["rows_rerun"]
