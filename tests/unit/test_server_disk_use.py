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


class GrowingJob:
    """A batch's job whose checkpoint grows by `step` bytes at each of the runner's polls until it is told to stop
    (then it exits as an interrupted job does, uncommitted)."""

    def __init__(self, out, step: int) -> None:  # noqa: ANN001
        self.staged = out / "_staging" / "results"
        self.staged.mkdir(parents=True, exist_ok=True)
        self.step, self.parts, self.interrupted = step, 0, False

    def wait(self, timeout: float | None = None) -> int | None:
        if self.interrupted:
            return 130
        if self.parts == 100:  # never stopped: it ends on its own, failed
            return 1
        (self.staged / f"part-{self.parts:05d}.parquet").write_bytes(b"\0" * self.step)
        self.parts += 1
        return None

    def interrupt(self) -> None:
        self.interrupted = True

    def stop(self) -> int:
        self.interrupt()
        return 130


def test_a_batch_whose_output_passes_the_limit_is_stopped_and_fails_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", KEY)
    limit = 256 * 1024
    config = ServerConfig.model_validate(
        {
            "data_dir": str(tmp_path / "data"),
            "limits": {"max_output_bytes_per_batch": limit},
            "min_free_bytes": 0,
            "poll_seconds": 0.01,
        }
    )
    service = BatchService(config, None)
    try:
        client = TestClient(create_app(service))
        file_id = upload(client, body(4096)).json()["id"]
        batch_id = client.post(
            "/v1/batches",
            headers=AUTH,
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        ).json()["id"]
        jobs: list[GrowingJob] = []
        monkeypatch.setattr(
            "pipeline.server.runner.start_job",
            lambda *a, **k: jobs.append(GrowingJob(service.data.output(batch_id), 64 * 1024)) or jobs[-1],
        )
        service.runner._queue.remove((batch_id, owner_of(KEY)))
        service.runner._running[batch_id] = owner_of(KEY)
        service.runner._run(batch_id)

        (job,) = jobs
        assert (
            job.interrupted and job.parts == limit // job.step + 1
        )  # stopped at the first poll past the limit
        failed = client.get(f"/v1/batches/{batch_id}", headers=AUTH).json()
        assert failed["status"] == "failed", failed
        (error,) = failed["errors"]["data"]
        assert error["code"] == "output_too_large" and str(limit) in error["message"]
    finally:
        service.stop()
