"""The official `openai` client, unchanged, against `nightshift serve` on a loopback port (fake engine)."""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest

from tests.fake_oracle import comparable, run_in_process
from tests.lines import chat_line, completion_line
from tests.server.batches import FINAL, lines_of, wait_for, write_input
from tests.server.harness import JOB, MAX_FILE_BYTES

pytestmark = pytest.mark.timeout(180)


def test_upload_create_poll_download_matches_nightshift_run(client_a, tmp_path):
    source = write_input(tmp_path / "requests.jsonl", 40)
    uploaded = client_a.files.create(file=source.open("rb"), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == source.stat().st_size
    assert uploaded.filename == "requests.jsonl" and uploaded.purpose == "batch"
    assert client_a.files.content(uploaded.id).content == source.read_bytes()

    batch = client_a.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"project": "roundtrip"},
    )
    assert batch.status == "validating" and batch.metadata == {"project": "roundtrip"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    done = wait_for(client_a, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed", done.errors
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (42, 40, 2)
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(done, stamp) >= done.created_at
    results, errors = lines_of(client_a, done.output_file_id), lines_of(client_a, done.error_file_id)
    assert len(results) + len(errors) == 42  # accounting: input lines = result lines + error lines
    assert client_a.files.retrieve(done.output_file_id).purpose == "batch_output"

    # The same rows as `nightshift run` on that file: the job's steps done in this process (no second Ray driver).
    expected, expected_errors = run_in_process(source, JOB["engine"]["fake"])
    assert [comparable(r) for r in results] == [comparable(r) for r in expected]
    assert [comparable(r) for r in errors] == [comparable(r) for r in expected_errors]


def test_later_batches_take_the_engines_warm(server, client_a, tmp_path):
    """Batches of the same model run on the engines an earlier batch started (the fake engine takes 2 s to start,
    as a real one loads its model): the second batch's job starts none."""

    def run_one(name: str) -> dict:
        source = write_input(tmp_path / f"{name}.jsonl", 8, bad=False)
        uploaded = client_a.files.create(file=source.open("rb"), purpose="batch")
        batch = client_a.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_for(client_a, batch.id, lambda b: b.status in FINAL)
        assert done.status == "completed" and done.request_counts.completed == 8
        manifest = server.root / "data" / "batches" / batch.id / "output" / "manifest.json"
        return json.loads(manifest.read_text())

    run_one("first")  # warm from an earlier test, or started here
    later = run_one("later")
    assert later["engine"]["engines"] == 1 and later["engine"]["reused"] == 1
    assert all(e["reused"] for e in later["engine"]["per_engine"].values())


def test_a_line_for_another_endpoint_is_that_lines_error_record(client_a, tmp_path):
    source = tmp_path / "mixed.jsonl"
    source.write_text(
        chat_line("chat-1", "hello") + "\n" + completion_line("cmpl-1", "Once upon a time") + "\n"
    )
    uploaded = client_a.files.create(file=source.open("rb"), purpose="batch")
    batch = client_a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(client_a, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    (error,) = lines_of(client_a, done.error_file_id)
    assert error["custom_id"] == "cmpl-1" and error["error"]["code"] == "unsupported_url"
    assert "/v1/chat/completions" in error["error"]["message"]


def test_lists_paginate_newest_first(client_a, tmp_path):
    ids = [
        client_a.files.create(
            file=write_input(tmp_path / f"f{i}.jsonl", 2, bad=False).open("rb"), purpose="batch"
        ).id
        for i in range(3)
    ]
    first = client_a.files.list(limit=2)
    assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
    second = client_a.files.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    # The client's auto-pagination walks every page of batches.
    listed = [b.id for b in client_a.batches.list(limit=1)]
    assert len(listed) == len(set(listed)) >= 1
    created = sorted(client_a.batches.retrieve(i).created_at for i in listed)
    assert created[::-1] == [client_a.batches.retrieve(i).created_at for i in listed]


def test_another_key_sees_nothing_of_the_first(client_a, client_b, tmp_path):
    uploaded = client_a.files.create(file=write_input(tmp_path / "a.jsonl", 2).open("rb"), purpose="batch")
    batch = client_a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: client_b.files.retrieve(uploaded.id),
        lambda: client_b.files.content(uploaded.id),
        lambda: client_b.files.delete(uploaded.id),
        lambda: client_b.batches.retrieve(batch.id),
        lambda: client_b.batches.cancel(batch.id),
        lambda: client_b.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert uploaded.id not in [f.id for f in client_b.files.list()]
    assert batch.id not in [b.id for b in client_b.batches.list()]
    # Its owner can cancel it (and so frees the runner for the next test without waiting for the job).
    with contextlib.suppress(openai.ConflictError):  # 409: it finished first
        client_a.batches.cancel(batch.id)
    assert wait_for(client_a, batch.id, lambda b: b.status in FINAL).status in ("cancelled", "completed")


def test_cancel_mid_run_keeps_what_finished(client_a, tmp_path):
    # 400 lines at 4 sequences x 0.2 s each: about 20 s of work, cancelled once the first rows are staged.
    uploaded = client_a.files.create(
        file=write_input(tmp_path / "long.jsonl", 400).open("rb"), purpose="batch"
    )
    batch = client_a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(client_a, batch.id, lambda b: b.request_counts.completed > 0)
    cancelling = client_a.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(client_a, batch.id, lambda b: b.status in FINAL, timeout=60)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 402 and 0 < counts.completed < 400
    results = lines_of(client_a, done.output_file_id)
    errors = lines_of(client_a, done.error_file_id)
    assert len(results) == counts.completed and len(errors) == counts.failed
    assert len({r["custom_id"] for r in results}) == len(results)
    # Its usage is what its staged rows used: the fake engine writes 4 tokens per answer.
    assert done.usage.output_tokens == 4 * counts.completed and done.model == "smollm2-135m-instruct"
    with pytest.raises(openai.ConflictError):
        client_a.batches.cancel(batch.id)


def test_errors_are_openai_shaped(server, client_a, tmp_path):
    url = server.base_url
    missing = httpx.get(f"{url}/files")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(f"{url}/files", headers={"Authorization": "Bearer not-a-key-of-this-server"})
    assert wrong.status_code == 401
    auth = {"Authorization": f"Bearer {client_a.api_key}"}
    bad_json = httpx.post(
        f"{url}/batches", content=b"{nope", headers={**auth, "Content-Type": "application/json"}
    )
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    bad_multipart = httpx.post(
        f"{url}/files",
        content=b"--x\r\nnot a part",
        headers={**auth, "Content-Type": "multipart/form-data; boundary=x"},
    )
    assert bad_multipart.status_code == 400 and "error" in bad_multipart.json()
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.batches.create(input_file_id="file-x", endpoint="/v1/images", completion_window="24h")
    assert exc.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError):
        client_a.batches.create(
            input_file_id="file-x", endpoint="/v1/chat/completions", completion_window="1h"
        )
    with pytest.raises(openai.NotFoundError):
        client_a.batches.retrieve("batch_../../etc/passwd")
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * (MAX_FILE_BYTES + 1))
    with pytest.raises(openai.APIStatusError) as exc:
        client_a.files.create(file=big.open("rb"), purpose="batch")
    assert exc.value.status_code == 413
    assert not list((server.root / "data" / "tmp").iterdir())  # the refused upload left nothing behind


def test_restart_mid_batch_completes(server, client_a, tmp_path):
    """Last in this module: it kills the shared server (SIGKILL) and starts another on the same data dir and
    port."""
    # 40 requests of 10 tokens (0.5 s each, 4 at a time): about 5 s of work, stopped once the first rows are staged.
    uploaded = client_a.files.create(
        file=write_input(tmp_path / "restart.jsonl", 40, max_tokens=10).open("rb"), purpose="batch"
    )
    batch = client_a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    before = wait_for(client_a, batch.id, lambda b: b.request_counts.completed > 0).request_counts.completed
    server.kill()
    server.start()
    done = wait_for(client_a, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed", done.errors
    assert (done.request_counts.completed, done.request_counts.failed) == (40, 2)
    results = lines_of(client_a, done.output_file_id)
    assert sorted(r["custom_id"] for r in results) == [f"req-{i:04d}" for i in range(40)]
    assert 0 < before < 40


def test_a_batch_may_name_a_lora_adapter_and_ask_for_structured_output(server, client_a, tmp_path):
    """Lines naming the server's adapter run with it (its answers name it); lines may carry response_format; a
    line naming neither the model nor an adapter is its own model_not_found record, listing what is served."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    lines = [
        chat_line(f"lora-{i}", f"q {i}", model="support-lora", response_format=response_format)
        for i in range(4)
    ]
    lines += [chat_line("base-0", "q"), chat_line("other-0", "q", model="no-such-lora")]
    source = tmp_path / "lora.jsonl"
    source.write_text("\n".join(lines) + "\n")
    uploaded = client_a.files.create(file=source.open("rb"), purpose="batch")
    batch = client_a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(client_a, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed", done.errors
    results = {r["custom_id"]: r for r in lines_of(client_a, done.output_file_id)}
    errors = {r["custom_id"]: r for r in lines_of(client_a, done.error_file_id)}
    assert len(results) + len(errors) == 6
    assert {results[f"lora-{i}"]["response"]["body"]["model"] for i in range(4)} == {"support-lora"}
    assert results["base-0"]["response"]["body"]["model"] != "support-lora"
    assert errors["other-0"]["error"]["code"] == "model_not_found"
    assert "'support-lora'" in errors["other-0"]["error"]["message"]
    manifest = json.loads(
        (server.root / "data" / "batches" / batch.id / "output" / "manifest.json").read_text()
    )
    (served,) = manifest["models"].values()
    assert served["adapters"]["support-lora"]["rows"] == 4
