"""Everything a key holds on the server's disk counts against its `max_stored_bytes`, not only its files' rows: its
uploads still arriving (at the size they declare, and at most `max_concurrent_uploads_per_key` at once) and its
batches' folders beyond their registered output files — a running batch's checkpoint, a failed batch's staged rows —
until the folder is purged. The service runs in this process; the runner is never started."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from pipeline.server.auth import owner_of
from pipeline.server.disk_use import UploadsInFlight, tree_bytes
from pipeline.server.routes import BatchService, create_app
from pipeline.server.settings import ServerConfig

KEY = "disk-use-key-" + "0" * 16
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024


@pytest.fixture
def api(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", KEY)
    config = ServerConfig.model_validate(
        {
            "data_dir": str(tmp_path / "data"),
            "quotas": {"max_stored_bytes": LIMIT},
            "limits": {"max_concurrent_uploads_per_key": 2},
        }
    )
    service = BatchService(config, None)
    try:
        yield service, TestClient(create_app(service))
    finally:
        service.stop()


def body(size: int) -> bytes:
    line = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    return line * max(1, size // len(line))


def upload(client: TestClient, data: bytes):
    return client.post(
        "/v1/files", headers=AUTH, data={"purpose": "batch"}, files={"file": ("in.jsonl", data)}
    )


def test_uploads_still_arriving_count_and_a_key_sends_only_so_many_at_once(api):
    service, client = api
    owner = owner_of(KEY)
    with service.uploads.slot(owner, LIMIT // 2):  # another upload of this key is arriving
        refused = upload(client, body(LIMIT // 2 + 1024))
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "storage_limit_exceeded"
        assert "uploads in progress" in refused.json()["error"]["message"]
        with service.uploads.slot(owner, 10):
            at_once = upload(client, body(100))
            assert at_once.status_code == 429, at_once.text
            assert at_once.json()["error"]["code"] == "concurrent_uploads_limit_exceeded"
        assert upload(client, body(1000)).status_code == 200  # room for one more, within the storage left
    assert service.uploads.reserved(owner) == 0  # every slot given back, refused uploads' too
    assert upload(client, body(LIMIT // 2)).status_code == 200


def test_a_batch_folders_checkpoint_and_leftovers_count_until_the_folder_is_purged(api):
    service, client = api
    file_id = upload(client, body(4096)).json()["id"]
    batch = client.post(
        "/v1/batches",
        headers=AUTH,
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    staged = service.data.output(batch["id"]) / "_staging" / "results"
    staged.mkdir(parents=True)
    (staged / "part-0.parquet").write_bytes(b"\0" * (LIMIT - 4096))  # the running batch's checkpoint
    assert service.pending_bytes(owner_of(KEY)) == tree_bytes(service.data.batch(batch["id"]))

    refused = upload(client, body(2048))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "storage_limit_exceeded"
    service.store.update_batch(batch["id"], status="failed", failed_at=int(time.time()))
    assert upload(client, body(2048)).status_code == 400  # a failed batch's staged rows stay until purged
    service.store.mark_purged(batch["id"])
    assert upload(client, body(2048)).status_code == 200


def test_a_slot_is_given_back_whatever_ends_the_upload():
    slots = UploadsInFlight(per_key=1)
    with pytest.raises(RuntimeError), slots.slot("owner", 5):
        assert slots.reserved("owner") == 5
        raise RuntimeError("the client went away")
    assert slots.reserved("owner") == 0
    with slots.slot("owner", 7):
        assert slots.reserved("owner") == 7
