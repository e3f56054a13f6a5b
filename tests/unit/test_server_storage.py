"""The Batch API's data dir and its batches' endings, without a server: one server per data dir, private modes,
fsync before the database points at a file, output files and final status in one transaction, an expired batch
that stays expired, and errors a tenant may read. The runner runs for real; its job process is a fake at the
launcher's seam (start_job), so the runner's decisions are seen without Ray."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from pipeline.server import datadir
from pipeline.server.datadir import DataDirInUse, DataDirLock
from pipeline.server.public_errors import public_message
from pipeline.server.routes import BatchService, create_app
from pipeline.server.settings import AuthSettings, ServerConfig
from pipeline.server.store import Store, new_id
from tests.batch_outputs import commit_output

KEY = "k" * 24


@pytest.fixture
def config(tmp_path, monkeypatch) -> ServerConfig:
    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", KEY)
    return ServerConfig(
        data_dir=tmp_path / "data", auth=AuthSettings(), engine_idle_seconds=0, poll_seconds=0.01
    )


@pytest.fixture
def service(config):
    service = BatchService(config, None)  # its runner's scheduler is never started: tests drive it by hand
    yield service
    service.stop()


def add_batch(service: BatchService, status: str = "in_progress", expires_in: int = 3600) -> str:
    batch_id = new_id("batch_")
    service.store.add_batch(
        batch_id, "owner", "/v1/chat/completions", "file-x", "24h", None, 0, int(time.time()) + expires_in
    )
    service.store.update_batch(batch_id, status=status)
    service.data.batch(batch_id).mkdir(parents=True)
    return batch_id


def file_rows(store: Store, batch_id: str) -> list[sqlite3.Row]:
    return store._all("SELECT * FROM files WHERE batch_id = ?", (batch_id,))


class FakeJob:
    """The launcher's JobProcess for a job whose batch is finalizing: it runs until told to stop, and the stop
    comes as its manifest is written — it ends committed. `exit_code` set: it ends at once with that code."""

    def __init__(self, out: Path, exit_code: int | None = None) -> None:
        self.out = out
        self.exit_code = exit_code
        self.interrupted = False

    def wait(self, timeout: float | None = None) -> int | None:
        if self.exit_code is not None:
            return self.exit_code
        if self.interrupted:
            commit_output(self.out)
            return 0
        return None

    def interrupt(self) -> None:
        self.interrupted = True

    def stop(self) -> int:
        self.interrupt()
        return 0


# -- one server per data dir ------------------------------------------------------------------------------------------


def test_a_second_server_on_the_same_data_dir_is_refused_until_the_first_stops(config):
    first = BatchService(config, None)
    with pytest.raises(DataDirInUse) as refused:
        BatchService(config, None)
    message = str(refused.value)
    assert str(config.data_dir) in message and f"pid {os.getpid()}" in message and "--data-dir" in message
    first.stop()
    second = BatchService(config, None)
    # A replica Serve starts while its predecessor stops waits for the lock instead of failing.
    threading.Timer(0.5, second.stop).start()
    third = BatchService(config, None, lock_wait=30)
    assert third.lock.held
    third.stop()


def test_serve_refuses_a_data_dir_another_server_holds_before_ray_starts(tmp_path, monkeypatch):
    from pipeline.cli import app

    monkeypatch.setattr(datadir, "STARTUP_LOCK_WAIT_SECONDS", 0.0)
    held = DataDirLock.acquire(tmp_path / "data")
    umask = os.umask(0o022)
    try:
        result = CliRunner().invoke(app, ["serve", "--no-auth", "--data-dir", str(tmp_path / "data")])
    finally:
        os.umask(umask)
        held.release()
    assert result.exit_code == 2, result.output
    assert (
        f"data dir {tmp_path / 'data'} is in use" in result.output and f"pid {os.getpid()}" in result.output
    )


# -- private ----------------------------------------------------------------------------------------------------------


def test_a_data_dir_left_readable_by_others_is_made_private_at_start(config):
    root = config.data_dir
    (root / "batches" / "batch_old" / "output").mkdir(parents=True)
    (root / "files").mkdir()
    for path in (
        root / "files" / "file-old.jsonl",
        root / "batches" / "batch_old" / "output" / "manifest.json",
    ):
        path.write_text("{}\n")
        path.chmod(0o644)
    for directory in (root, root / "files", root / "batches", root / "batches" / "batch_old"):
        directory.chmod(0o755)
    BatchService(config, None).stop()
    exposed = [p for p in [root, *root.rglob("*")] if stat.S_IMODE(p.stat().st_mode) & 0o077]
    assert exposed == []
    assert stat.S_IMODE((root / "files" / "file-old.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE((root / "state.sqlite").stat().st_mode) == 0o600


# -- durable, and in one transaction ----------------------------------------------------------------------------------


def _record_fsyncs(monkeypatch, events: list[tuple[str, str]]) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_an_upload_is_on_disk_before_its_row_points_at_it(service, monkeypatch):
    """The temporary file, then (renamed) the files/ directory, fsynced before the row is inserted."""
    events: list[tuple[str, str]] = []
    _record_fsyncs(monkeypatch, events)
    add_file = service.store.add_file

    def insert(file_id, *args, **kwargs):
        events.append(("insert", str(service.data.upload(file_id))))
        return add_file(file_id, *args, **kwargs)

    monkeypatch.setattr(service.store, "add_file", insert)
    client = TestClient(create_app(service))
    response = client.post(
        "/v1/files",
        headers={"Authorization": f"Bearer {KEY}"},
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", b'{"custom_id": "a"}\n')},
    )
    assert response.status_code == 200, response.text
    final = service.data.upload(response.json()["id"])
    assert final.read_bytes() == b'{"custom_id": "a"}\n'
    kinds = [kind for kind, _ in events]
    assert kinds.count("insert") == 1
    synced = [path for kind, path in events[: kinds.index("insert")] if kind == "fsync"]
    assert len(synced) == 2
    assert Path(synced[0]).parent == service.data.scratch and Path(synced[0]).suffix == ".part"
    assert Path(synced[1]) == service.data.files


def test_output_files_are_on_disk_before_their_rows_and_come_with_the_final_status(service, monkeypatch):
    """A crash between the file rows and the batch's status must leave neither: the restarted server finishes
    the batch again, and registers its files once."""
    batch_id = add_batch(service)
    out = service.data.output(batch_id)
    written = commit_output(out)

    # The batch row's update fails (as a crash would stop it) after the file rows were written.
    service.store._conn.execute(
        "CREATE TEMP TRIGGER crash BEFORE UPDATE OF status ON batches BEGIN SELECT RAISE(ABORT, 'crash'); END"
    )
    with pytest.raises(sqlite3.DatabaseError, match="crash"):
        service.runner._finish(batch_id, "completed")
    assert file_rows(service.store, batch_id) == []
    assert service.store.batch(batch_id).status == "in_progress"
    service.store._conn.execute("DROP TRIGGER crash")

    # The restarted server: a new store on the same database finishes it again.
    service.store.close()
    service.store = service.runner.store = Store(service.data.database)
    events: list[tuple[str, str]] = []
    _record_fsyncs(monkeypatch, events)
    finish = service.store.finish_batch
    monkeypatch.setattr(
        service.store, "finish_batch", lambda *a, **k: events.append(("insert", "")) or finish(*a, **k)
    )
    service.runner._finish(batch_id, "completed")
    done = service.store.batch(batch_id)
    rows = file_rows(service.store, batch_id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (
        3,
        1,
    )
    assert sorted(r["id"] for r in rows) == sorted([done.output_file_id, done.error_file_id])
    synced = {path for kind, path in events[: [k for k, _ in events].index("insert")] if kind == "fsync"}
    assert {str(p) for p in written} | {str(out)} <= synced

    # Finished is final: another ending (a late failure, a second finish) changes nothing and adds no file.
    service.runner._finish(batch_id, "completed")
    service.runner._fail(batch_id, "server_error", "late")
    assert (
        service.store.batch(batch_id).status == "completed" and len(file_rows(service.store, batch_id)) == 2
    )


# -- expired stays expired --------------------------------------------------------------------------------------------


def test_a_batch_whose_window_passes_while_finalizing_ends_expired_with_its_output(service, monkeypatch):
    """The window passes while the job writes its shards: the runner stops the job, which commits anyway. The
    batch ends `expired` — with the committed files — not `cancelled`, and stays so."""
    batch_id = add_batch(service, status="finalizing", expires_in=-1)
    out = service.data.output(batch_id)
    jobs: list[FakeJob] = []
    monkeypatch.setattr(
        "pipeline.server.runner.start_job", lambda *a, **k: jobs.append(FakeJob(out)) or jobs[-1]
    )
    service.runner._run(batch_id)
    assert jobs[0].interrupted
    done = service.store.batch(batch_id)
    assert done.status == "expired" and done.expired_at and done.cancelled_at is None
    assert done.output_file_id and done.error_file_id and done.request_counts.completed == 3
    service.runner._fail(batch_id, "server_error", "late")
    assert service.store.batch(batch_id).status == "expired"


# -- errors a tenant may read -----------------------------------------------------------------------------------------


def test_public_messages_keep_the_reason_and_drop_paths_and_tracebacks(tmp_path):
    data = tmp_path / "data"
    trace = (
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3.11/site-packages/pipeline/runtime/job.py", line 12, in run\n'
        "    raise ValueError(x)\n"
        f"ray.exceptions.RayTaskError(ValueError): cannot read {data}/files/file-abc.jsonl: broken"
    )
    assert public_message(trace, data) == "cannot read files/file-abc.jsonl: broken"
    assert (
        public_message(f"FileNotFoundError: [Errno 2] No such file or directory: '{tmp_path}/x.txt'", data)
        == "[Errno 2] No such file or directory: '<path>'"
    )
    # Endpoints and URLs are not server paths.
    kept = "line 3: url /v1/completions is not served; see https://example.com/docs/batch"
    assert public_message(kept, data) == kept
    assert len(public_message("x" * 5000, data)) == 500


def test_a_failed_batch_tells_its_owner_the_reason_and_its_job_log_the_rest(service, monkeypatch):
    data = service.data.root
    # The runner itself fails (an exception naming a server path).
    crashing = add_batch(service)

    def crash(*_, **__):
        raise FileNotFoundError(f"[Errno 2] No such file or directory: '{data}/batches/{crashing}/job.yaml'")

    monkeypatch.setattr("pipeline.server.runner.start_job", crash)
    service.runner._run(crashing)
    (error,) = service.store.batch(crashing).errors.data
    assert error.code == "server_error"
    assert error.message == f"[Errno 2] No such file or directory: 'batches/{crashing}/job.yaml'"
    log = (service.data.batch(crashing) / "job.log").read_text()
    assert "Traceback (most recent call last)" in log and f"{data}/batches/{crashing}/job.yaml" in log

    # The job fails and says why in its last line.
    failing = add_batch(service)
    (service.data.batch(failing) / "job.log").write_text(
        f"error: input {data}/files/file-x.jsonl changed since the job started (/usr/lib/nightshift-cache/x)\n"
    )
    monkeypatch.setattr(
        "pipeline.server.runner.start_job", lambda *a, **k: FakeJob(service.data.output(failing), exit_code=1)
    )
    service.runner._run(failing)
    (error,) = service.store.batch(failing).errors.data
    assert error.code == "job_failed"
    assert error.message == "input files/file-x.jsonl changed since the job started (<path>)"
