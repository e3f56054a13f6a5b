"""`nightshift serve` with a night window (`hours:` in server.yaml): a batch running when the window closes is
stopped, stays `in_progress` with the rows it finished, and resumes at the next opening to complete with every row
once — the same rows an uninterrupted run writes. The test clock (NIGHTSHIFT_TEST_CLOCK) starts the server's
clock 25 s before the window's end and skips the day until the next opening."""

from __future__ import annotations

import time

import openai
import pytest

from tests.fake_oracle import comparable, run_in_process
from tests.lines import chat_line
from tests.server.batches import FINAL, lines_of
from tests.server.harness import JOB, KEY_A, Server

pytestmark = [pytest.mark.timeout(240), pytest.mark.long]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    server = Server(
        tmp_path_factory.mktemp("windowed"),
        JOB,
        extra={"hours": "22:00-22:01", "timezone": "UTC"},
        env={"NIGHTSHIFT_TEST_CLOCK": "2025-03-10T22:00:35+00:00"},
    )
    server.start()
    yield server
    server.stop()


def test_a_batch_paused_by_the_window_resumes_at_the_next_opening(windowed, tmp_path):
    client = openai.OpenAI(base_url=windowed.base_url, api_key=KEY_A, max_retries=0)
    # 200 requests of 10 tokens, 4 at a time: about 25 s of work, more than the window has left.
    source = tmp_path / "in.jsonl"
    lines = [chat_line(f"req-{i:04d}", f"question {i}", max_tokens=10) for i in range(200)]
    source.write_text("\n".join([*lines, "{not json"]) + "\n")
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    seen = []
    deadline = time.monotonic() + 200
    while (current := client.batches.retrieve(batch.id)).status not in FINAL and time.monotonic() < deadline:
        seen.append((current.status, current.request_counts.completed))
        time.sleep(0.3)
    assert current.status == "completed", (current.errors, seen[-5:])
    assert (current.request_counts.completed, current.request_counts.failed) == (200, 1)
    # Never reported as anything but in progress while paused, and its counts never went back.
    assert {status for status, _ in seen} <= {"validating", "in_progress", "finalizing"}, seen
    completed = [n for _, n in seen]
    assert completed == sorted(completed), seen
    # The job was stopped by the window and resumed from its checkpoint (the batch's job log says so).
    job_log = (windowed.root / "data" / "batches" / batch.id / "job.log").read_text()
    assert "interrupted; finished rows are kept" in job_log and "resuming job" in job_log
    expected, expected_errors = run_in_process(source, JOB["engine"]["fake"])
    assert [comparable(r) for r in lines_of(client, current.output_file_id)] == [
        comparable(r) for r in expected
    ]
    assert [comparable(r) for r in lines_of(client, current.error_file_id)] == [
        comparable(r) for r in expected_errors
    ]
