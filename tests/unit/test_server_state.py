"""The Batch API's pieces without a server: the SQLite store and its migrations, config checks, API keys, the
application import path KubeRay uses."""

from __future__ import annotations

import sqlite3

import pytest

from pipeline.config import ConfigError
from pipeline.server.auth import ANONYMOUS, Keyring
from pipeline.server.settings import AuthSettings, ServerConfig, load_server_config
from pipeline.server.store import MIGRATIONS, SCHEMA_VERSION, Store, StoreError, migrate, new_id


def test_a_version_1_database_is_migrated_and_keeps_its_rows(tmp_path):
    path = tmp_path / "state.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(f"BEGIN; {MIGRATIONS[0]} PRAGMA user_version = 1; COMMIT;")
    conn.execute(
        "INSERT INTO files (id, owner, filename, purpose, bytes, created_at) VALUES "
        "('file-old', 'o1', 'a.jsonl', 'batch', 10, 1), ('file-new', 'o1', 'b.jsonl', 'batch', 20, 2)"
    )
    conn.close()
    store = Store(path)
    assert store._one("PRAGMA user_version", ())[0] == SCHEMA_VERSION
    files, more = store.list_files("o1", None, 10, None, ascending=False)
    assert [f.id for f in files] == ["file-new", "file-old"] and not more  # seq backfilled in rowid order
    store.close()


def test_a_newer_database_is_refused(tmp_path):
    conn = sqlite3.connect(tmp_path / "state.sqlite", isolation_level=None)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer than this server"):
        migrate(conn, tmp_path / "state.sqlite")


def test_objects_are_per_owner_and_pages_follow_the_cursor(tmp_path):
    store = Store(tmp_path / "state.sqlite")
    ids = [store.add_file(new_id("file-"), "alice", f"{i}.jsonl", "batch", 1).id for i in range(5)]
    store.add_file(new_id("file-"), "bob", "b.jsonl", "batch", 1)
    page, more = store.list_files("alice", None, 2, None, ascending=False)
    assert [f.id for f in page] == ids[:2:-1][:2] and more
    page, more = store.list_files("alice", page[-1].id, 10, None, ascending=False)
    assert [f.id for f in page] == ids[2::-1] and not more
    assert store.file_row(ids[0], "bob") is None  # another owner's file does not exist for bob
    assert store.list_files("bob", ids[0], 10, None, ascending=False) == ([], False)  # nor is it a cursor
    batch = store.add_batch(new_id("batch_"), "alice", "/v1/chat/completions", ids[0], "24h", None, 0, 99)
    assert store.batch(batch.id, "bob") is None and store.batch(batch.id, "alice").status == "validating"
    assert not store.update_batch(batch.id, only_if=("in_progress",), status="finalizing")
    assert store.file_in_use(ids[0]) and not store.file_in_use(ids[1])
    store.close()


def test_ids_are_unguessable():
    ids = {new_id("batch_") for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == len("batch_") + 24 for i in ids)


def test_no_auth_only_on_loopback_and_keys_required_otherwise(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="only on loopback"):
        load_server_config(None, {"host": "0.0.0.0", "auth.disabled": True})
    assert load_server_config(None, {"host": "::1", "auth.disabled": True}).auth.disabled
    monkeypatch.delenv("NIGHTSHIFT_API_KEYS", raising=False)
    with pytest.raises(ConfigError, match="no API keys"):
        Keyring.load(AuthSettings())
    with pytest.raises(ConfigError, match="shorter than 16"):
        monkeypatch.setenv("TEST_KEYS", "short")
        Keyring.load(AuthSettings(keys_env="TEST_KEYS"))


def test_keys_map_to_owners_never_stored_in_the_clear(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# comment\n" + "a" * 20 + "\n")
    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", "b" * 20)
    ring = Keyring.load(AuthSettings(keys_file=keys))
    alice, bob = ring.owner("Bearer " + "a" * 20), ring.owner("Bearer " + "b" * 20)
    assert alice and bob and alice != bob and "a" * 20 not in alice
    assert (
        ring.owner("Bearer " + "c" * 20) is None and ring.owner(None) is None and ring.owner("a" * 20) is None
    )
    assert Keyring.load(AuthSettings(disabled=True)).owner(None) == ANONYMOUS


def test_bad_server_config_names_what_to_change(tmp_path):
    bad = tmp_path / "server.yaml"
    bad.write_text("job: {input: x.jsonl}\n")
    with pytest.raises(ConfigError, match="each batch's own"):
        load_server_config(bad, {})
    bad.write_text("limits: {max_file_bytes: 0}\n")
    with pytest.raises(ConfigError, match="limits.max_file_bytes"):
        load_server_config(bad, {})
    with pytest.raises(ConfigError, match="completion_windows"):
        load_server_config(None, {"limits.completion_windows": ["soon"]})
    with pytest.raises(ConfigError, match="does not exist"):
        load_server_config(tmp_path / "missing.yaml", {})


def test_the_serve_application_import_path_builds():
    """KubeRay's RayService imports `pipeline.server.app:app_builder` with the server config as args."""
    from ray import serve

    from pipeline.server.app import app_builder

    app = app_builder({"data_dir": "/tmp/x", "auth": {"disabled": True}})
    assert isinstance(app, serve.Application)
    with pytest.raises(ConfigError, match="only on loopback"):
        app_builder({"host": "0.0.0.0", "auth": {"disabled": True}})
    assert ServerConfig().limits.max_requests_per_batch == 50_000


def test_a_batchs_job_is_the_servers_job_with_the_batchs_own_input_output_and_cluster(tmp_path, monkeypatch):
    """The job file the runner hands the launcher: the server's job with the batch's input, output, identity,
    endpoint, warm engines and cluster; its api_key only in the child's environment."""
    import time

    import yaml

    from pipeline.runtime.hosting.launcher import job_environment, write_job_file
    from pipeline.server.runner import BatchRunner, DataDir

    data = DataDir(tmp_path)
    data.create()
    store = Store(data.database)
    store.add_batch("batch_x", "owner", "/v1/embeddings", "file-x", "24h", None, 3, int(time.time()) + 60)
    http = {"endpoints": ["http://127.0.0.1:9"], "api_key": "sk-server-side-secret-0123"}
    config = ServerConfig(
        job={"engine": {"backend": "http", "http": http}, "limits": {"max_line_bytes": 4096}}
    )
    runner = BatchRunner(config, store, data, "10.0.0.1:6379")
    runner.keeper = object()  # warm engines on

    job = runner._job("batch_x", resume=False)
    write_job_file(job, tmp_path / "job.yaml")
    # What the runner wrote before the launcher existed (it passed --address on the command line instead).
    expected = config.job.model_dump(mode="json", exclude_none=True)
    expected.update(input=str(data.upload("file-x")), output=str(data.output("batch_x")), job_id="batch_x")
    expected.update(overwrite=True)
    expected["limits"]["only_url"] = "/v1/embeddings"
    expected["limits"]["refused_fields"] = ["media_io_kwargs", "mm_processor_kwargs"]
    expected["engine"]["warm_engines"] = runner.keeper_name
    expected["engine"]["http"]["api_key_env"] = "NIGHTSHIFT_API_KEY"
    expected["resources"]["address"] = "10.0.0.1:6379"
    assert yaml.safe_load((tmp_path / "job.yaml").read_text()) == expected
    assert "sk-server-side-secret" not in (tmp_path / "job.yaml").read_text()
    assert job_environment(job)["NIGHTSHIFT_API_KEY"] == "sk-server-side-secret-0123"

    resumed = runner._job("batch_x", resume=True)
    assert (resumed.output, resumed.resources.address) == (str(data.output("batch_x")), "10.0.0.1:6379")
    assert job_environment(resumed)["NIGHTSHIFT_API_KEY"] == "sk-server-side-secret-0123"
