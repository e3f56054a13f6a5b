"""The Batch API server's /metrics: the caller's batches by status, and each unfinished batch's job metrics (the
names a job's driver exports) labelled with the batch id — read from the job's saved timeline, another owner's
batches never shown."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pipeline.observe.metrics import METRICS
from pipeline.observe.timeline import TIMELINE_NAME, Timeline
from pipeline.server.metrics import STORED_BYTES_METRIC, STORED_FILES_METRIC, WAITING_FOR_DISK_METRIC
from pipeline.server.routes import BatchService, create_app
from pipeline.server.settings import AuthSettings, ServerConfig
from pipeline.server.store import new_id

KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"


def _save_timeline(output, rows_done: int) -> None:
    timeline = Timeline(total_rows=10)
    timeline.run_started(now=100.0)
    timeline.stage_started("engines", now=101.0)
    timeline.add(
        {
            "t": 102.0,
            "rows_done": rows_done,
            "rows_failed": 1,
            "rows_total": 10,
            "pools": {"default": {"rows": rows_done, "prompt_tokens": 30, "completion_tokens": 40}},
            "engines": {"default-1": {"pool": "default", "rows": rows_done, "in_flight": 2}},
        }
    )
    staging = output / "_staging"
    staging.mkdir(parents=True)
    (staging / TIMELINE_NAME).write_bytes(timeline.to_json())


def _scrape(client: TestClient, key: str) -> dict:
    response = client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def test_metrics_are_the_callers_batches_labelled_by_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", f"{KEY_A},{KEY_B}")
    config = ServerConfig(data_dir=tmp_path / "data", auth=AuthSettings())
    service = BatchService(config, None)  # its runner is never started: the rows below are the whole state
    store, data = service.store, service.data
    alice, bob = service.keyring.owner(f"Bearer {KEY_A}"), service.keyring.owner(f"Bearer {KEY_B}")
    running = store.add_batch(new_id("batch_"), alice, "/v1/chat/completions", "file-x", "24h", None, 10, 0)
    store.update_batch(running.id, status="in_progress")
    _save_timeline(data.output(running.id), rows_done=7)
    done = store.add_batch(new_id("batch_"), alice, "/v1/chat/completions", "file-x", "24h", None, 10, 0)
    store.update_batch(done.id, status="completed")
    _save_timeline(data.output(done.id), rows_done=10)  # finished: its numbers are the batch object's now
    queued = store.add_batch(new_id("batch_"), alice, "/v1/embeddings", "file-y", "24h", None, 5, 0)
    theirs = store.add_batch(new_id("batch_"), bob, "/v1/chat/completions", "file-z", "24h", None, 3, 0)
    store.update_batch(theirs.id, status="in_progress")
    _save_timeline(data.output(theirs.id), rows_done=2)

    client = TestClient(create_app(service))
    assert client.get("/metrics").status_code == 401
    mine = _scrape(client, KEY_A)
    by_status = {s.labels["status"]: s.value for s in mine["nightshift_server_batches"].samples}
    assert by_status == {"in_progress": 1, "completed": 1, "validating": 1}
    (rows,) = mine["nightshift_rows_done"].samples
    assert rows.labels == {"batch": running.id} and rows.value == 7
    (engine,) = mine["nightshift_engine_requests_in_flight"].samples
    assert (
        engine.labels == {"batch": running.id, "pool": "default", "engine": "default-1"} and engine.value == 2
    )
    # Only names a job's driver exports, plus the server's own.
    exported = {name.removesuffix("_total") for name in METRICS}
    server_own = {
        "nightshift_server_batches",
        STORED_FILES_METRIC,
        STORED_BYTES_METRIC,
        WAITING_FOR_DISK_METRIC,
    }
    assert set(mine) <= exported | server_own
    assert [s.value for s in mine[WAITING_FOR_DISK_METRIC].samples] == [0]  # no batch waits for room
    assert queued.id not in str([s.labels for f in mine.values() for s in f.samples])
    theirs_seen = _scrape(client, KEY_B)
    assert [s.labels["batch"] for s in theirs_seen["nightshift_rows_done"].samples] == [theirs.id]
