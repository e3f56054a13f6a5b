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

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.e2e.engine_victims import engine_with_work_in_flight, held, until_dead, vllm_process
from tests.failure_figures import record
from tests.lines import chat_line, read_jsonl, write_lines

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+2?", "Name a color.", "Who wrote Hamlet?", "What do bees make?", "Say hello."]


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
            # One engine: its death and the restart that re-runs its rows are the subject. The restarted actor is
            # another engine (its name carries its process), so the rows still run again on an engine that is not
            # the victim.
            "resources": {"num_engines": 1, "rows_per_task": 4},
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

    victim, pid = engine_with_work_in_flight("engine-kill", thread)
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


def test_engine_core_killed_under_a_live_actor(private_ray, tmp_path):
    """Row "an engine process dies (... `EngineDeadError`)": only vLLM's engine-core process is SIGKILLed; the actor
    lives on until vLLM tells it the engine is dead, then exits so that Ray restarts it with a fresh engine."""

    # About twice the rows the engine holds at once (its chunks in flight are about 2 x max_num_seqs): when it is
    # first seen with rows in flight, half the job is still queued, so the job cannot end, its actor with it, before
    # the actor is held (with 24 rows a loaded box once saw the actor gone, the job done, by then).
    n = 40
    thread, outcome = _start_job(tmp_path, "engine-core-kill", "c", n, max_tokens=16)

    # Once the engine has rows in flight, kill its engine core and nothing else. The actor is held (SIGSTOP) from the
    # moment it is seen with rows in flight until its core is dead: meanwhile it acknowledges, leases and begins
    # nothing, so on a loaded box the job cannot end (nor its rows leave flight) while the core is looked for; once
    # continued, the actor reads that its engine is dead with its rows still in flight.
    victim, actor_pid = engine_with_work_in_flight("engine-core-kill", thread)
    with held(actor_pid):
        core = vllm_process(actor_pid, "EngineCore")
        core.send_signal(signal.SIGKILL)
        until_dead(core)  # a zombie until the held actor, its parent, is continued and reaps it

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
