"""Usage, model, file statuses and retention through the official `openai` client against `nightshift serve`.

The shared server (default retention: outputs kept 30 days, uploads until deleted) shows `usage` and `model` on a
completed batch and deletes that free bytes; a second server with short retention, a fast sweeper and OpenAI's
validation (`limits.line_errors: fail_batch`) shows files that expire — gone from the list, 404, their bytes gone
from disk — and a batch with invalid lines failed before it runs."""

from __future__ import annotations

import openai
import pytest

from tests.lines import chat_line
from tests.server.batches import FINAL, lines_of, stored, until, wait_for, write_input
from tests.server.harness import JOB, KEY_A, MAX_FILE_BYTES, Server

pytestmark = pytest.mark.timeout(240)

MODEL = "smollm2-135m-instruct"  # the fake engine serves the embedded model's name
THIRTY_DAYS = 30 * 24 * 3600


def test_a_completed_batch_has_usage_and_model_and_deletes_free_its_bytes(server, client_a, tmp_path):
    source = write_input(tmp_path / "usage.jsonl", 6)  # 6 requests, a broken line, a duplicate custom_id
    uploaded = client_a.files.create(file=source.open("rb"), purpose="batch")
    assert uploaded.status == "error" and "line 7:" in uploaded.status_details  # the broken line, named
    assert uploaded.expires_at is None  # the server keeps uploads until deleted unless asked
    batch = client_a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.usage is None
    done = wait_for(client_a, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed", done.errors
    assert done.model == MODEL
    results = lines_of(client_a, done.output_file_id)
    prompt = sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in results)
    completion = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in results)
    usage = done.usage
    assert (usage.input_tokens, usage.output_tokens) == (prompt, completion) and completion == 6 * 4
    assert usage.total_tokens == prompt + completion
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0

    # Output files: processed, expiring 30 days after they were made (the server's default).
    output = client_a.files.retrieve(done.output_file_id)
    assert output.status == "processed" and output.expires_at == output.created_at + THIRTY_DAYS
    folder = server.root / "data" / "batches" / batch.id
    before = stored(server, KEY_A)
    client_a.files.delete(done.error_file_id)
    assert not list((folder / "output").glob("errors-*.jsonl")) and list(
        (folder / "output").glob("results-*")
    )
    assert client_a.files.content(done.output_file_id).text.count("\n") == 6  # the other file stays whole
    client_a.files.delete(done.output_file_id)
    assert not folder.exists()  # nothing of the batch is left: its folder goes
    client_a.files.delete(uploaded.id)
    after = stored(server, KEY_A)
    size = source.stat().st_size
    assert before["batch_output"][0] - after["batch_output"][0] == 2
    assert before["batch"][1] - after["batch"][1] == size
    assert not (server.root / "data" / "files" / f"{uploaded.id}.jsonl").exists()


def test_bad_policies_and_files_that_are_not_jsonl_are_refused(client_a, tmp_path):
    source = write_input(tmp_path / "ok.jsonl", 2, bad=False)
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.files.create(
            file=source.open("rb"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 59}
        )
    assert exc.value.body["param"] == "expires_after[seconds]"
    kept = client_a.files.create(
        file=source.open("rb"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert kept.status == "processed" and kept.expires_at == kept.created_at + 3600
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.batches.create(
            input_file_id=kept.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": THIRTY_DAYS + 1},
        )
    assert exc.value.body["param"] == "output_expires_after.seconds"
    array = tmp_path / "array.json"
    array.write_text('[{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}]\n')
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.files.create(file=array.open("rb"), purpose="batch")
    assert "line 1 " in exc.value.body["message"] and "JSON array" in exc.value.body["message"]
    client_a.files.delete(kept.id)


@pytest.fixture(scope="module")
def short_lived(tmp_path_factory):
    server = Server(
        tmp_path_factory.mktemp("short-lived"),
        JOB,
        extra={
            "retention": {"upload_seconds": 6, "output_seconds": 6, "sweep_seconds": 0.5},
            "limits": {"max_file_bytes": MAX_FILE_BYTES, "line_errors": "fail_batch"},
        },
    )
    server.start()
    yield server
    server.stop()


def test_files_expire_and_their_bytes_go_but_not_under_a_running_batch(short_lived, tmp_path):
    client = openai.OpenAI(base_url=short_lived.base_url, api_key=KEY_A, max_retries=0)
    data = short_lived.root / "data"
    # 40 requests of 10 tokens, 4 at a time: about 5 s of work, past its input's 6 s.
    source = write_input(tmp_path / "in.jsonl", 40, bad=False, max_tokens=10)
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    assert uploaded.expires_at == uploaded.created_at + 6
    lonely = client.files.create(file=source.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    # An unused upload: gone from the list, 404, its bytes freed.
    until(lambda: lonely.id not in {f.id for f in client.files.list()}, what="the upload to expire")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(lonely.id)
    until(lambda: not (data / "files" / f"{lonely.id}.jsonl").exists(), what="its bytes freed")
    done = wait_for(client, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed" and done.request_counts.completed == 40, done.errors
    assert done.usage.output_tokens == 40 * 10 and done.model == MODEL
    # Its input expired while it ran: the job read it whole all the same, and its bytes go once the batch ended.
    until(lambda: not (data / "files" / f"{uploaded.id}.jsonl").exists(), what="the input's bytes freed")
    # The output files expire 6 s after they were made; with them the batch's folder goes.
    until(lambda: not (data / "batches" / batch.id).exists(), what="the batch folder removed")
    for file_id in (done.output_file_id, uploaded.id):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
    held = stored(short_lived, KEY_A)
    assert held["batch"] == (0, 0) and held["batch_output"] == (0, 0)


def test_with_fail_batch_invalid_lines_fail_the_batch_before_it_runs(short_lived, tmp_path):
    client = openai.OpenAI(base_url=short_lived.base_url, api_key=KEY_A, max_retries=0)
    source = tmp_path / "bad.jsonl"
    lines = [chat_line("a", "q"), "{not json", chat_line("a", "again"), chat_line("b", "q", model="gpt-4o")]
    source.write_text("\n".join(lines) + "\n")
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(client, batch.id, lambda b: b.status in FINAL)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert [(e.line, e.code) for e in done.errors.data] == [
        (2, "invalid_json"),
        (3, "duplicate_custom_id"),
        (4, "model_not_found"),
    ]
    assert done.in_progress_at is None  # never ran
    assert not (short_lived.root / "data" / "batches" / batch.id / "job.log").exists()
    assert done.usage.total_tokens == 0
    # A clean file runs as before.
    clean = client.files.create(
        file=write_input(tmp_path / "ok.jsonl", 3, bad=False).open("rb"), purpose="batch"
    )
    ok = client.batches.create(
        input_file_id=clean.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert wait_for(client, ok.id, lambda b: b.status in FINAL).status == "completed"
