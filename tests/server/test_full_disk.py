"""A full disk under the Batch API, on a real filesystem: the server's data dir is a 16 MiB tmpfs the test mounts
(tests/disks.py), filled with a file until writes fail with the kernel's own ENOSPC.

- An upload that meets the full disk is refused with OpenAI's error shape and status 507 (`insufficient_storage`);
  its partial bytes are gone at once, every file accepted before is listed and reads back whole, and the same upload
  is accepted once space returns — without a restart.
- When SQLite itself finds the disk full (its WAL cannot grow), creating a batch is refused the same way, and nothing
  of the refused batch stays: every batch listed is one the client was told was created, the database passes its
  integrity check, and the next batch is created once space returns.
- A batch whose end SQLite cannot record waits in the runner's queue, in progress, and ends once there is room.

The service runs in this process (its runner's scheduler never started: no engine is needed to take requests)."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
from fastapi.testclient import TestClient

from pipeline.server.auth import owner_of
from pipeline.server.routes import BatchService, create_app
from pipeline.server.schemas import FINAL_STATUSES
from pipeline.server.settings import AuthSettings, ServerConfig
from tests.batch_outputs import commit_output
from tests.disks import fill, free_bytes, make_room, small_filesystem

KEY = "full-disk-key-" + "0" * 16
AUTH = {"Authorization": f"Bearer {KEY}"}


def jsonl(rows: int, prefix: str = "row", pad: int = 0) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": f"question {i} " + "x" * pad}],
                    "max_tokens": 4,
                },
            }
        ).encode()
        + b"\n"
        for i in range(rows)
    )


@pytest.fixture
def disk(tmp_path):
    with small_filesystem(tmp_path / "data") as path:
        yield path


@pytest.fixture
def api(disk, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", KEY)
    # No free-space floor: the runner, when a test drives it, acts at once on the filled disk.
    config = ServerConfig(
        data_dir=disk, auth=AuthSettings(), engine_idle_seconds=0, poll_seconds=0.01, min_free_bytes=0
    )
    service = BatchService(config, None)
    try:
        yield service, TestClient(create_app(service))
    finally:
        service.stop()


def upload(client: TestClient, body: bytes, name: str = "in.jsonl"):
    return client.post("/v1/files", headers=AUTH, data={"purpose": "batch"}, files={"file": (name, body)})


def assert_disk_full(response) -> None:
    assert response.status_code == 507, response.text
    error = response.json()["error"]
    assert error["code"] == "insufficient_storage" and error["type"] == "server_error", error
    assert "disk is full" in error["message"] and "/" not in error["message"]  # no path of the server's


def test_an_upload_that_meets_a_full_disk_is_refused_and_leaves_nothing_behind(api, disk):
    service, client = api
    small = jsonl(10, "kept")
    first = upload(client, small, "first.jsonl")
    assert first.status_code == 200, first.text
    big = jsonl(2000, "big", pad=400)  # ~1 MiB
    fill(disk, leave_bytes=256 * 1024)
    free_before = free_bytes(disk)

    refused = upload(client, big, "big.jsonl")
    assert_disk_full(refused)
    assert list(service.data.scratch.iterdir()) == []  # the partial upload is gone...
    assert free_bytes(disk) == free_before  # ...and so is the space it took
    listed = client.get("/v1/files", headers=AUTH).json()["data"]
    assert [f["id"] for f in listed] == [first.json()["id"]]
    assert client.get(f"/v1/files/{first.json()['id']}/content", headers=AUTH).content == small

    make_room(disk)
    accepted = upload(client, big, "big.jsonl")
    assert accepted.status_code == 200, accepted.text
    assert client.get(f"/v1/files/{accepted.json()['id']}/content", headers=AUTH).content == big
    assert len(client.get("/v1/files", headers=AUTH).json()["data"]) == 2


def create_batch(client: TestClient, file_id: str):
    return client.post(
        "/v1/batches",
        headers=AUTH,
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )


def until_the_store_is_full(client: TestClient, file_id: str) -> tuple[list[str], object]:
    """Create batches until SQLite cannot record one more: each is a row in its WAL, which must grow on a full
    disk. The ids created, and the refusal."""
    created = []
    for _ in range(5000):
        response = create_batch(client, file_id)
        if response.status_code != 200:
            return created, response
        created.append(response.json()["id"])
    raise AssertionError("the full disk never refused a batch")


def test_a_batch_the_full_store_cannot_record_is_refused_and_nothing_of_it_stays(api, disk):
    service, client = api
    file_id = upload(client, jsonl(3)).json()["id"]
    fill(disk)
    created, refused = until_the_store_is_full(client, file_id)
    assert_disk_full(refused)

    listed = client.get("/v1/batches", headers=AUTH, params={"limit": 100}).json()
    ids = [b["id"] for b in listed["data"]]
    while listed["has_more"]:
        listed = client.get("/v1/batches", headers=AUTH, params={"limit": 100, "after": ids[-1]}).json()
        ids += [b["id"] for b in listed["data"]]
    assert sorted(ids) == sorted(created)  # told "created" exactly when it was
    assert sorted(p.name for p in (disk / "batches").iterdir()) == sorted(created)

    make_room(disk)
    again = create_batch(client, file_id)
    assert again.status_code == 200, again.text
    with sqlite3.connect(service.store.path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_batch_whose_end_the_full_store_cannot_record_waits_and_ends_once_there_is_room(
    api, disk, monkeypatch
):
    """Its job committed its output, but SQLite cannot take the batch's end (its status and file rows): the batch
    is not failed and not lost — it goes back in the runner's queue, in progress, after a pause, and ends
    `completed` with its files once there is room. (The runner is driven by hand: no engine is needed for a
    committed output.)"""
    monkeypatch.setattr("pipeline.server.runner.DISK_RETRY_FIRST_S", 0.01)
    service, client = api
    file_id = upload(client, jsonl(3)).json()["id"]
    batch_id = create_batch(client, file_id).json()["id"]
    runner, owner = service.runner, owner_of(KEY)

    def run_it() -> None:  # what the runner's scheduler does with the batch at the head of its queue
        runner._queue.remove((batch_id, owner))
        runner._running[batch_id] = owner
        runner._run(batch_id)

    commit_output(service.data.output(batch_id))
    fill(disk)
    until_the_store_is_full(client, file_id)
    run_it()
    waiting = service.store.batch(batch_id)
    assert waiting.status not in FINAL_STATUSES and not waiting.errors, waiting
    assert (batch_id, owner) in runner._queue  # back in line, not dropped

    make_room(disk)
    run_it()
    done = service.store.batch(batch_id)
    assert done.status == "completed" and done.output_file_id and done.error_file_id
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)


def test_a_queued_batch_cancelled_or_expired_on_a_full_store_ends_once_there_is_room(api, disk):
    """A cancel the store cannot record is a 507 that changed nothing: the batch is still queued, and the same
    cancel once there is room ends it `cancelled`. A queued batch whose window passed while the store is full stays
    queued — the scheduler that expires it goes on, it does not die — and expires once there is room."""
    service, client = api
    file_id = upload(client, jsonl(3)).json()["id"]
    cancelled, expiring = (create_batch(client, file_id).json()["id"] for _ in range(2))
    runner, owner = service.runner, owner_of(KEY)
    service.store.update_batch(expiring, expires_at=int(time.time()) - 1)
    fill(disk)
    until_the_store_is_full(client, file_id)

    refused = client.post(f"/v1/batches/{cancelled}/cancel", headers=AUTH)
    assert_disk_full(refused)
    runner._expire_queued()  # the scheduler's step: it must not raise
    assert (cancelled, owner) in runner._queue and (expiring, owner) in runner._queue
    assert service.store.batch(expiring).status not in FINAL_STATUSES

    assert service.store.batch(cancelled).status not in FINAL_STATUSES

    make_room(disk)
    runner._expire_queued()
    assert service.store.batch(expiring).status == "expired" and (expiring, owner) not in runner._queue
    again = client.post(f"/v1/batches/{cancelled}/cancel", headers=AUTH)
    assert again.status_code == 200 and again.json()["status"] == "cancelled", again.text
    assert (cancelled, owner) not in runner._queue
