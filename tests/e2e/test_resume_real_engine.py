"""The driver is SIGKILLed half way through a job on the real vLLM engine, then `nightshift resume` finishes it.

What holds on a real engine, and is asserted: every request is accounted for once (the same set of custom_ids as
the input's valid lines), the rows finished before the kill are kept as they were (not run again), the manifest's
counts and recovery figures add up, and every body is a valid chat completion. What is not asserted: that the
texts equal an uninterrupted run's. In bf16, greedy decoding depends on which requests share the engine's batch,
and a resumed job batches the remaining requests differently; byte-identical shards after resume are shown with the
fake engine (tests/integration/test_recovery.py).

Its own engines (not the session's warm ones, tests/e2e/warm_cluster.py): a killed driver takes its engines with it,
and the resumed job starts new ones; that is the subject.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.e2e.cli import run_cli
from tests.lines import MODEL_NAME, chat_line, read_jsonl, write_lines
from tests.runs import foreign_lines, once_settled

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+2?", "Name a color.", "Who wrote Hamlet?", "What do bees make?", "Say hello."]
MAX_TOKENS = 32


def _staged_results(output: Path) -> dict[str, dict]:
    """custom_id → the result record staged for it so far."""
    staged: dict[str, dict] = {}
    for part in (output / "_staging" / "results").glob("*.parquet"):
        table = pq.read_table(part, columns=["custom_id", "record"])
        for custom_id, record in zip(
            table.column("custom_id").to_pylist(), table.column("record").to_pylist(), strict=True
        ):
            staged[custom_id] = json.loads(record)
    return staged


def test_driver_killed_then_resumed_on_the_real_engine(e2e_dir, embedded_model):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    n = 24
    lines = [
        chat_line(f"r-{i:02d}", QUESTIONS[i % len(QUESTIONS)], max_tokens=MAX_TOKENS, temperature=0)
        for i in range(n)
    ]
    lines.insert(7, "{not json")  # an error record staged before the kill must survive it too
    path = write_lines(e2e_dir / "resume-in.jsonl", lines)
    valid_ids = {f"r-{i:02d}" for i in range(n)}
    config = e2e_dir / "resume-job.yaml"
    config.write_text(
        json.dumps(
            {
                "job_id": "resume-real",
                "engine": {"backend": "vllm", "vllm": {"max_model_len": 512, "max_num_seqs": 4}},
                # One engine: the killed driver and the resume are the subject, not the layout (the default puts
                # two on a box with the memory for them, each start a core's minute of this box).
                "resources": {"num_engines": 1},
                "output_options": {"rows_per_shard": 10, "staging_rows": 2},
            }
        )
    )
    output = e2e_dir / "resume-out"
    driver = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "run", str(path), str(output), "-c", str(config), "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    while len(_staged_results(output)) < 4:
        assert driver.poll() is None, driver.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no rows were staged"
        time.sleep(0.2)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert not (output / "manifest.json").exists()
    # What counts as "finished before the kill" is what staging holds once the dead driver's engines have stopped.
    staged_before = once_settled(
        lambda: _staged_results(output), quiet_s=5, timeout_s=deadline - time.monotonic()
    )
    assert 0 < len(staged_before) < n, "the kill came too late to leave work for resume"

    resumed = run_cli("resume", str(output), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert foreign_lines(resumed.stdout, resumed.stderr) == [], resumed.stderr

    results = read_jsonl(output.glob("results-*.jsonl"))
    errors = read_jsonl(output.glob("errors-*.jsonl"))
    ids = [r["custom_id"] for r in results]
    assert len(results) + len(errors) == len(lines)  # accounting
    assert len(ids) == len(set(ids)) and set(ids) == valid_ids  # the same set of ids, each once
    assert [e["error"]["code"] for e in errors] == ["invalid_json"]
    by_id = {r["custom_id"]: r for r in results}
    for custom_id, record in staged_before.items():  # finished before the kill: kept, not run again
        assert by_id[custom_id] == record, custom_id

    for row in results:  # every body is what vLLM's OpenAI server returns for a chat completion
        assert row["error"] is None and row["response"]["status_code"] == 200
        body = ChatCompletionResponse.model_validate(row["response"]["body"])
        assert body.model == MODEL_NAME
        assert body.choices[0].message.content and body.choices[0].finish_reason in ("stop", "length")
        assert 0 < body.usage.completion_tokens <= MAX_TOKENS

    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["counts"]["total"] == len(lines)
    assert manifest["counts"]["succeeded"] == n and manifest["counts"]["by_error_code"] == {"invalid_json": 1}
    assert manifest["recovery"]["resumed"] is True
    assert manifest["recovery"]["rows_from_earlier_runs"] == len(staged_before)
    assert not (output / "_staging").exists()
