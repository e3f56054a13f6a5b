"""Several keys on one `nightshift serve` (fake engine, one batch at a time): quotas per key, named by the labels
of the keys file, refuse what passes them with OpenAI's errors; and keys take turns on the engines, so a small
batch of one key finishes while another key's big batch is paused, which then resumes and completes with every row
once."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.failure_figures import note
from tests.fake_oracle import comparable, run_in_process
from tests.lines import chat_line
from tests.server.batches import FINAL, lines_of, wait_for, write_input
from tests.server.harness import JOB, KEY_A, KEY_B, MAX_FILE_BYTES, Server

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]

KEY_TIGHT = "key-t-" + "2" * 20
KEY_SMALL = "key-s-" + "3" * 20
STORED = 2000  # the `small` key's max_stored_bytes
TURN_SECONDS = 5.0  # seconds of work: about 40 of the big batch's rows, several times the small one's


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    server = Server(
        tmp_path_factory.mktemp("tenants"),
        JOB,
        extra={
            "limits": {"max_file_bytes": MAX_FILE_BYTES, "fair_share_seconds": TURN_SECONDS},
            "quotas": {
                "max_queued_batches": 4,
                "keys": {
                    "team-a": {"max_queued_batches": None},  # null: no limit for this key
                    "tight": {"max_files": 2, "max_queued_batches": 1},
                    "small": {"max_stored_bytes": STORED},
                },
            },
        },
        keys=f"# labelled keys\n{KEY_A} team-a\n{KEY_B}   team-b\n{KEY_TIGHT} tight\n{KEY_SMALL} small\n",
    )
    server.start()
    yield server
    server.stop()


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def sized(path, size: int):
    """A one-line JSONL request file of exactly `size` bytes."""
    line = chat_line("pad", "")
    path.write_text(chat_line("pad", "x" * (size - len(line) - 1)) + "\n")
    assert path.stat().st_size == size
    return path


def test_the_queue_and_file_count_limits_and_an_output_file_counts(shared, tmp_path):
    tight = client(shared, KEY_TIGHT)
    source = write_input(tmp_path / "in.jsonl", 4, bad=False)
    uploaded = tight.files.create(file=source.open("rb"), purpose="batch")
    batch = tight.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.RateLimitError) as refused:
        tight.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert refused.value.code == "queued_batches_limit_exceeded"
    assert "max_queued_batches: 1" in refused.value.message

    done = wait_for(tight, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed" and done.error_file_id is None
    # The input and the batch's output file: two files, the key's limit.
    with pytest.raises(openai.BadRequestError) as refused:
        tight.files.create(file=source.open("rb"), purpose="batch")
    assert refused.value.status_code == 400 and refused.value.code == "file_count_limit_exceeded"
    assert "max_files: 2" in refused.value.message
    # Deleting a file frees its place; the queue freed when the batch ended.
    tight.files.delete(done.output_file_id)
    again = tight.files.create(file=source.open("rb"), purpose="batch")
    second = tight.batches.create(
        input_file_id=again.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    tight.batches.cancel(second.id)
    # Another key is not held to this key's limits.
    other = client(shared, KEY_B)
    for _ in range(3):
        other.files.create(file=source.open("rb"), purpose="batch")
    wait_for(tight, second.id, lambda b: b.status in FINAL)


def test_the_stored_bytes_limit(shared, tmp_path):
    small = client(shared, KEY_SMALL)
    first = small.files.create(file=sized(tmp_path / "a.jsonl", 1200).open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        small.files.create(file=sized(tmp_path / "b.jsonl", 900).open("rb"), purpose="batch")
    assert refused.value.code == "storage_limit_exceeded" and refused.value.param == "file"
    assert (
        f"max_stored_bytes: {STORED}" in refused.value.message and "holds 1200 bytes" in refused.value.message
    )
    assert not list((shared.root / "data" / "tmp").iterdir())  # the refused upload left nothing behind
    assert [f.id for f in small.files.list()] == [first.id]
    small.files.create(
        file=sized(tmp_path / "c.jsonl", 800).open("rb"), purpose="batch"
    )  # 2000: at the limit
    # At the limit, a batch is refused too: its output files would need room.
    with pytest.raises(openai.BadRequestError) as refused:
        small.batches.create(input_file_id=first.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert refused.value.code == "storage_limit_exceeded" and "max_stored_bytes" in refused.value.message
    # The error is OpenAI's body, on the wire as the client saw it.
    raw = httpx.post(
        f"{shared.base_url}/files",
        headers={"Authorization": f"Bearer {KEY_SMALL}"},
        files={"file": ("d.jsonl", b'{"x": 1}\n')},
        data={"purpose": "batch"},
    )
    assert raw.status_code == 400
    assert raw.json()["error"] == {
        "message": raw.json()["error"]["message"],
        "type": "invalid_request_error",
        "param": "file",
        "code": "storage_limit_exceeded",
    }
    small.files.delete(first.id)  # frees its bytes
    small.files.create(file=sized(tmp_path / "e.jsonl", 1000).open("rb"), purpose="batch")


def test_a_small_batch_of_one_key_finishes_while_another_keys_big_batch_waits_its_turn(shared, tmp_path):
    a, b = client(shared, KEY_A), client(shared, KEY_B)
    # 240 requests of 10 tokens, 4 at a time at 0.05 s a token: about 30 s of work.
    big = write_input(tmp_path / "big.jsonl", 240, max_tokens=10)
    batch_a = a.batches.create(
        input_file_id=a.files.create(file=big.open("rb"), purpose="batch").id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_for(a, batch_a.id, lambda x: x.request_counts.completed > 0)
    small = write_input(tmp_path / "small.jsonl", 8, bad=False, max_tokens=10)
    t0 = time.monotonic()
    batch_b = b.batches.create(
        input_file_id=b.files.create(file=small.open("rb"), purpose="batch").id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    seen_a = []
    while (done_b := b.batches.retrieve(batch_b.id)).status not in FINAL and time.monotonic() - t0 < 120:
        seen_a.append(a.batches.retrieve(batch_a.id))
        time.sleep(0.3)
    b_took = time.monotonic() - t0
    now_a = a.batches.retrieve(batch_a.id)
    assert done_b.status == "completed" and done_b.request_counts.completed == 8, done_b
    # B finished while A was unfinished, paused with its rows kept (never reported as anything else).
    assert now_a.status == "in_progress" and 0 < now_a.request_counts.completed < 240, now_a
    assert {x.status for x in seen_a} == {"in_progress"}
    paused_at = now_a.request_counts.completed

    t1 = time.monotonic()
    wait_for(a, batch_a.id, lambda x: x.request_counts.completed > paused_at)
    resumed_after = time.monotonic() - t1
    done_a = wait_for(a, batch_a.id, lambda x: x.status in FINAL, timeout=180)
    assert done_a.status == "completed", done_a.errors
    assert (done_a.request_counts.completed, done_a.request_counts.failed) == (240, 2)
    results, errors = lines_of(a, done_a.output_file_id), lines_of(a, done_a.error_file_id)
    # Every row exactly once across the pause: the same rows an uninterrupted run writes.
    assert sorted(r["custom_id"] for r in results) == [f"req-{i:04d}" for i in range(240)]
    expected, expected_errors = run_in_process(big, JOB["engine"]["fake"])
    assert [comparable(r) for r in results] == [comparable(r) for r in expected]
    assert [comparable(r) for r in errors] == [comparable(r) for r in expected_errors]
    job_log = (shared.root / "data" / "batches" / batch_a.id / "job.log").read_text()
    assert "interrupted; finished rows are kept" in job_log and "resuming job" in job_log
    note(
        f"key B's 8-line batch: created -> completed in {b_took:.1f} s while key A's 240-line batch waited; "
        f"A resumed (first new row) {resumed_after:.1f} s after B completed"
    )
