"""Sharded engines on the real engine (README "Big models"): vLLM's CPU backend runs tensor- and pipeline-parallel
engines as one process per rank, each on cores of its own. The model is a tiny Llama with random weights made at
test time (tests/e2e/tiny_llama.py: 4 heads and 2 KV heads, so two ranks can split it; the embedded SmolLM2's 9
heads cannot be split two ways).

- One job, two pools of the same model: one engine at TP=2, one at TP=1, each answering every question under a
  name of its own — a mixed-topology job, and TP=2's texts set beside TP=1's for the same requests.
- A TP=2 engine whose second rank is SIGKILLed mid-job: the whole engine is rebuilt, its rows run again, exactly
  once. Its actor is held (SIGSTOP) from the moment it has rows in flight until the rank is dead, so the job can
  neither end nor take the actor away while the rank is looked for, however loaded the box.
- A PP=2 engine (two stages on this node: the CPU backend has no Ray executor to span nodes; the fake engine
  tests stages on two raylets, tests/integration/test_engine_groups.py).

Their own engines (not the session's warm ones, tests/e2e/warm_cluster.py): another model, and the ranks' start
and death are the subject.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.e2e.engine_victims import engine_with_work_in_flight, held, vllm_process
from tests.failure_figures import record
from tests.lines import read_jsonl, write_lines

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+2?", "Name a color.", "Who wrote Hamlet?", "What do bees make?", "Say hello.", "Why?"]


# The module's private Ray (tests/e2e/conftest.py): four logical CPUs on the two cores, since a TP=2 engine's group
# holds two and a TP=1 engine beside it one more.
PRIVATE_RAY_CPUS = 4


def chat(custom_id: str, model: str, question: str, max_tokens: int = 12) -> str:
    import json

    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**body, "temperature": 0},
        }
    )


def job_config(tmp_path: Path, job_id: str, model: Path, lines: list[str], **settings) -> JobConfig:
    return JobConfig.model_validate(
        {
            "input": str(write_lines(tmp_path / "in.jsonl", lines)),
            "output": str(tmp_path / "out"),
            "job_id": job_id,
            "model": str(model),
            "engine": {"backend": "vllm", "vllm": {"max_model_len": 256, "max_num_seqs": 8}},
            **settings,
        }
    )


def texts(rows: list[dict]) -> dict[str, str]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in rows}


def test_one_job_with_a_tp2_pool_and_a_tp1_pool_of_the_same_model(private_ray, tiny_llama, tmp_path):
    lines = [chat(f"tp2-{i}", "tiny-tp2", q) for i, q in enumerate(QUESTIONS)]
    lines += [chat(f"tp1-{i}", "tiny-tp1", q) for i, q in enumerate(QUESTIONS)]
    config = job_config(
        tmp_path,
        "mixed-topology",
        tiny_llama,
        lines,
        pools=[
            {
                "name": "tp2",
                "model": str(tiny_llama),
                "served_model_name": "tiny-tp2",
                "cpus_per_engine": 2,
                "engine_overrides": {"tensor_parallel_size": 2},
            },
            {"name": "tp1", "model": str(tiny_llama), "served_model_name": "tiny-tp1", "cpus_per_engine": 1},
        ],
    )
    result = run_job(config, show_progress=False)

    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    errors = read_jsonl(result.output.glob("errors-*.jsonl"))
    assert errors == [] and len(rows) == len(lines) == result.manifest["counts"]["total"]
    assert sorted(r["custom_id"] for r in rows) == sorted(
        f"tp{t}-{i}" for t in (1, 2) for i in range(len(QUESTIONS))
    )
    by_pool = {e["pool"]: e for e in result.manifest["engine"]["per_engine"].values()}
    assert by_pool["tp2"]["rows"] == by_pool["tp1"]["rows"] == len(QUESTIONS)  # each model name to its pool
    # The TP=2 engine ran as two ranks of vLLM's multiprocessing executor in a placement group of two bundles on
    # this node, one core each; the TP=1 engine as before, without a group.
    groups = result.manifest["placement"]["engine_groups"]
    assert list(groups) == ["tp2"] and len(groups["tp2"]) == 1 and len(groups["tp2"][0]) == 2
    assert len(set(groups["tp2"][0])) == 1
    models = result.manifest["models"]
    assert set(models) == {"tiny-tp2", "tiny-tp1"}
    tp2, tp1 = (
        texts([r for r in rows if r["custom_id"].startswith("tp2")]),
        texts([r for r in rows if r["custom_id"].startswith("tp1")]),
    )
    same = sum(tp2[f"tp2-{i}"] == tp1[f"tp1-{i}"] for i in range(len(QUESTIONS)))
    # Two ranks sum each layer's halves in another order than one: with random weights the logits are nearly flat,
    # so a greedy token may differ. Reported, not asserted.
    print(f"\nTP=2 vs TP=1 on the same {len(QUESTIONS)} requests: {same} identical texts")
    for i in range(len(QUESTIONS)):
        if tp2[f"tp2-{i}"] != tp1[f"tp1-{i}"]:
            print(f"  {QUESTIONS[i]!r}: TP=2 {tp2[f'tp2-{i}']!r} / TP=1 {tp1[f'tp1-{i}']!r}")


def test_a_rank_of_a_tp2_engine_killed_mid_job(private_ray, tiny_llama, tmp_path):
    # More lines than the engine holds at once (2 x max_num_seqs, and a chunk in reserve): when it is held, most of
    # the job is still in the queue.
    n = 128
    lines = [
        chat(f"k-{i:03d}", str(tiny_llama), QUESTIONS[i % len(QUESTIONS)], max_tokens=48) for i in range(n)
    ]
    config = job_config(
        tmp_path,
        "rank-kill",
        tiny_llama,
        lines,
        resources={"num_engines": 1, "cpus_per_engine": 2, "rows_per_task": 4},
        output_options={"rows_per_shard": 16, "staging_rows": 4},
    )
    config = config.model_copy(
        update={
            "engine": config.engine.model_copy(
                update={"vllm": config.engine.vllm.model_copy(update={"tensor_parallel_size": 2})}
            )
        }
    )
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=run_job(config, show_progress=False)))
    thread.start()

    # The engine actor is held (SIGSTOP) the moment it is seen with rows in flight: while its rank is looked for and
    # killed it acknowledges, leases and begins nothing, and does not exit, so the job cannot end under the search (on
    # a loaded box the tiny model's job once ended, its actor with it, before the rank was found). vLLM's engine core
    # and ranks run on: the core sees the rank die and tells the actor its engine is dead, which the actor reads once
    # it is continued, with chunks in flight and most of the job still in the queue.
    victim, actor_pid = engine_with_work_in_flight("rank-kill", thread)
    t_found = time.monotonic()
    with held(actor_pid):
        t_held = time.monotonic()
        worker = vllm_process(actor_pid, "Worker_TP1")
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        print(
            f"\nrank-kill: actor {actor_pid} held {t_held - t_found:.3f} s after its rows in flight were seen; "
            f"Worker_TP1 {worker.pid} found and killed {time.monotonic() - t_held:.2f} s later"
        )

    thread.join(timeout=900)
    assert not thread.is_alive()
    result = outcome["result"]
    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    errors = read_jsonl(result.output.glob("errors-*.jsonl"))
    record(
        "real vLLM TP=2 engine: one rank SIGKILLed mid-job",
        injected=1,
        input_lines=n,
        output_ids=[r["custom_id"] for r in rows + errors],
    )
    assert len(rows) + len(errors) == n == result.manifest["counts"]["total"]
    assert errors == []
    assert sorted(r["custom_id"] for r in rows) == [f"k-{i:03d}" for i in range(n)]
    # One rank gone is the whole engine gone: vLLM says EngineDeadError, the actor exits, Ray restarts it in its
    # group and the engine is built again with both ranks; the rows it had in flight ran again.
    recovery = result.manifest["recovery"]
    assert list(recovery["engines_lost"]) == [victim]
    lost = recovery["engines_lost"][victim]
    assert lost["cause"] == "EngineDeadError" and lost["rows_in_flight"] > 0
    assert lost["rows_rerun"] >= lost["rows_in_flight"]
    assert recovery["engine_restarts"] == 1
    assert result.manifest["engine"]["args"]["tensor_parallel_size"] == 2
    assert os.path.exists(result.output / "manifest.json")


def test_a_pp2_engine_runs_its_two_stages_on_this_node(private_ray, tiny_llama, tmp_path):
    lines = [chat(f"pp-{i}", str(tiny_llama), q) for i, q in enumerate(QUESTIONS)]
    config = job_config(
        tmp_path, "pp2", tiny_llama, lines, resources={"num_engines": 1, "cpus_per_engine": 2}
    )
    config = config.model_copy(
        update={
            "engine": config.engine.model_copy(
                update={"vllm": config.engine.vllm.model_copy(update={"pipeline_parallel_size": 2})}
            )
        }
    )
    result = run_job(config, show_progress=False)
    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    assert len(rows) == len(lines) == result.manifest["counts"]["succeeded"]
    assert all(texts(rows).values())
    args = result.manifest["engine"]["args"]
    # Compiled, not eager: vLLM's CPU runner warms a later stage up only when it compiles.
    assert args["pipeline_parallel_size"] == 2 and args["enforce_eager"] is False
    assert args["distributed_executor_backend"] == "mp"
    assert result.manifest["engine"]["cpu_cores"] == [[0, 1]]
