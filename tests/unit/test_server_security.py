"""The Batch API's guards that need no running server: a per-batch metrics port refused in its config, no keys refused
wherever Serve listens beyond loopback, `serve` joining Ray with token authentication as `run` does, and the health
routes (`/healthz`, `/readyz`) on the app itself."""

from __future__ import annotations

import sqlite3
import stat

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cluster.auth import (
    AUTH_MODE_ENV,
    LOOPBACK_ENV,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    default_token_path,
    find_token,
)
from pipeline.config import ConfigError
from pipeline.server.exposure import ServeHttp, refuse_open_no_auth
from pipeline.server.settings import ServerConfig, load_server_config
from tests.unit.cluster.fake_gcs import TOKEN, FakeGcs

# ------------------------------------------------------------------------------------------ metrics port


def test_a_per_batch_metrics_port_is_refused_in_the_server_config(tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text("job:\n  observe:\n    metrics_port: 9100\n")
    with pytest.raises(ConfigError, match=r"job\.observe\.metrics_port .*unauthenticated port.*remove it"):
        load_server_config(config, {})
    from pipeline.server.app import app_builder

    with pytest.raises(ConfigError, match="metrics_port"):
        app_builder({"auth": {"disabled": True}, "job": {"observe": {"metrics_port": 9100}}})


def test_a_dataset_section_is_refused_in_the_server_config(tmp_path):
    """A batch's input is request lines, as OpenAI's are: templates over a table would misread every upload."""
    config = tmp_path / "server.yaml"
    config.write_text("job:\n  dataset:\n    template: '{{ text }}'\n")
    with pytest.raises(ConfigError, match=r"request lines, as OpenAI's are: remove job\.dataset"):
        load_server_config(config, {})


def test_a_servers_batches_fetch_media_from_public_addresses_unless_its_operator_allows_more(tmp_path):
    """A tenant's image URL must not reach the cluster's own network: `serve` refuses private networks by default,
    `run` (the user's own box) allows them; the operator may open a network or all of them."""
    from pipeline.config import JobConfig
    from pipeline.media.policy import MediaRefused

    assert JobConfig().media.allow_private_networks is True
    config = tmp_path / "server.yaml"
    config.write_text("job:\n  model: some/model\n")
    media = load_server_config(config, {}).job.media
    assert media.allow_private_networks is False
    with pytest.raises(MediaRefused, match="private or loopback"):
        media.vet("http://10.0.0.7/cat.png")
    with pytest.raises(MediaRefused, match="link-local"):
        media.vet("http://169.254.169.254/latest/meta-data/")
    config.write_text("job:\n  media:\n    allowed_networks: [10.0.0.0/24]\n")
    media = load_server_config(config, {}).job.media
    assert media.vet("http://10.0.0.7/cat.png").address == "10.0.0.7"
    with pytest.raises(MediaRefused, match="private or loopback"):
        media.vet("http://10.0.1.7/cat.png")
    config.write_text("job:\n  media:\n    allow_private_networks: true\n")
    assert load_server_config(config, {}).job.media.vet("http://10.0.1.7/x.png").address == "10.0.1.7"


# ------------------------------------------------------------------------------------------ where Serve listens


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "api.internal"])
def test_no_keys_are_refused_when_serve_listens_beyond_loopback_whatever_the_configs_host(host):
    config = ServerConfig(auth={"disabled": True})  # host: 127.0.0.1, the check of the config alone passes
    config.check()
    with pytest.raises(ConfigError) as refused:
        refuse_open_no_auth(config, ServeHttp(host=host, port=8000))
    message = str(refused.value)
    assert f"http_options.host {host}" in message and "API keys" in message and "127.0.0.1" in message


@pytest.mark.parametrize(
    "serving",
    [None, ServeHttp(host="127.0.0.1", port=8000), ServeHttp("localhost", 1), ServeHttp(None, 8000)],
)
def test_no_keys_pass_on_loopback_without_serve_or_with_its_proxies_off(serving):
    refuse_open_no_auth(ServerConfig(auth={"disabled": True}), serving)


def test_keys_pass_wherever_serve_listens():
    refuse_open_no_auth(ServerConfig(host="0.0.0.0"), ServeHttp(host="0.0.0.0", port=8000))


# ------------------------------------------------------------------------------------------ serve joins Ray as run


@pytest.fixture
def no_ray_token(tmp_path, monkeypatch):
    """No Ray auth variables and an empty NIGHTSHIFT_HOME: the only token is what the test gives."""
    for name in (AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV, LOOPBACK_ENV):
        # Set, then deleted: monkeypatch records the variable, so what `serve` sets in this process (it pins
        # RAY_AUTH_MODE for the Ray it starts) is undone after the test, and the next Ray this process starts
        # does not inherit it.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))


class RayStarted(Exception):
    pass


@pytest.fixture
def ray_starts(monkeypatch):
    """Stands in for starting Ray: records the environment Ray would start with, then stops `serve` there."""
    import os

    import pipeline.runtime.hosting.session

    seen: list[dict] = []

    def start_ray(address):  # noqa: ANN001, ANN202
        seen.append({"address": address, **{k: os.environ.get(k) for k in (AUTH_MODE_ENV, TOKEN_PATH_ENV)}})
        raise RayStarted

    monkeypatch.setattr(pipeline.runtime.hosting.session, "start_ray", start_ray)
    return seen


def _serve(tmp_path, *args: str):  # noqa: ANN202
    from pipeline.cli import app

    return CliRunner().invoke(app, ["serve", "--no-auth", "--data-dir", str(tmp_path / "data"), *args])


def test_serve_starts_its_local_ray_with_token_auth_and_the_token_its_jobs_find(
    tmp_path, no_ray_token, ray_starts
):
    result = _serve(tmp_path)
    assert isinstance(result.exception, RayStarted), result.output
    head = default_token_path()
    assert ray_starts == [{"address": None, AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: str(head)}]
    assert stat.S_IMODE(head.stat().st_mode) == 0o600
    # A batch's job, a driver of its own, looks for a token where every nightshift driver does: it finds this one.
    assert find_token().path == head


def test_serve_keeps_the_token_its_environment_names(tmp_path, no_ray_token, ray_starts, monkeypatch):
    token = tmp_path / "ops-token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    monkeypatch.setenv(TOKEN_PATH_ENV, str(token))
    result = _serve(tmp_path)
    assert isinstance(result.exception, RayStarted), result.output
    assert ray_starts == [{"address": None, AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: str(token)}]
    assert not default_token_path().exists()


def test_serve_on_a_cluster_that_wants_a_token_it_lacks_stops_in_one_line(tmp_path, no_ray_token, ray_starts):
    gcs = FakeGcs(TOKEN)
    try:
        result = _serve(tmp_path, "--address", gcs.address)
    finally:
        gcs.server.stop(None)
    assert result.exit_code == 2 and ray_starts == []
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith(f"error: the Ray cluster at {gcs.address} requires a token and none was found")
    assert "--token-file" in line


def test_serve_on_a_cluster_joins_with_the_token_given(tmp_path, no_ray_token, ray_starts):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    gcs = FakeGcs(TOKEN)
    try:
        result = _serve(tmp_path, "--address", gcs.address, "--token-file", str(token))
    finally:
        gcs.server.stop(None)
    assert isinstance(result.exception, RayStarted), result.output
    assert ray_starts == [{"address": gcs.address, AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: str(token)}]


def test_serve_on_an_open_cluster_is_warned(tmp_path, no_ray_token, ray_starts):
    gcs = FakeGcs(None)
    try:
        result = _serve(tmp_path, "--address", gcs.address)
    finally:
        gcs.server.stop(None)
    assert isinstance(result.exception, RayStarted), result.output
    assert f"the Ray cluster at {gcs.address} does not enforce a token" in result.output


# ------------------------------------------------------------------------------------------ /healthz and /readyz


@pytest.fixture
def api(tmp_path, monkeypatch):
    """The app with an API key, over a service with no Ray connected (as in a replica whose cluster is gone)."""
    from pipeline.server.routes import BatchService, create_app

    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", "k" * 20)
    service = BatchService(ServerConfig(data_dir=tmp_path / "data"), None)
    return TestClient(create_app(service)), service


def test_healthz_answers_without_a_key_while_the_api_wants_one(api):
    client, _ = api
    assert client.get("/v1/batches").status_code == 401
    answer = client.get("/healthz")
    assert answer.status_code == 200 and answer.json() == {"status": "ok"}


def test_readyz_is_503_with_the_reason_while_ray_is_not_reachable(api):
    client, _ = api
    answer = client.get("/readyz")
    assert answer.status_code == 503
    assert answer.json() == {
        "status": "unavailable",
        "checks": {"database": "ok", "ray": "not connected to a Ray cluster"},
    }


def test_readyz_writes_to_the_database_and_says_when_it_cannot(api, monkeypatch):
    import pipeline.server.health as health

    monkeypatch.setattr(health, "ray_problem", lambda: None)
    monkeypatch.setattr(health, "READY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(health, "READY_WRITE_EVERY_S", 0.0)  # every call writes: each change shows at once
    client, service = api
    assert client.get("/readyz").json() == {"status": "ok", "checks": {"database": "ok", "ray": "ok"}}
    # Another writer holds the database: a read would pass, a write cannot.
    holder = sqlite3.connect(service.data.database, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        answer = client.get("/readyz")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert answer.status_code == 503
    assert answer.json()["checks"] == {
        "database": "the database takes no write: database is locked",
        "ray": "ok",
    }
    assert client.get("/readyz").status_code == 200
    # The data dir's database is gone: never answered by a new empty one.
    service.store.close()
    for suffix in ("", "-wal", "-shm"):
        service.data.database.with_name(service.data.database.name + suffix).unlink(missing_ok=True)
    answer = client.get("/readyz")
    assert answer.status_code == 503 and "unable to open database file" in answer.json()["checks"]["database"]
    assert str(service.data.root) not in answer.text
    assert not service.data.database.exists()


# ------------------------------------------------------------------------------------------ hostile request bodies


@pytest.mark.parametrize("depth", [33, 100_000])
def test_a_deeply_nested_batch_body_is_the_clients_400_not_a_500(api, depth):
    client, _ = api
    body = '{"metadata": ' + "[" * depth + "]" * depth + "}"
    answer = client.post(
        "/v1/batches",
        content=body,
        headers={"Authorization": "Bearer " + "k" * 20, "Content-Type": "application/json"},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and "nest" in error["message"]


def test_readyz_writes_at_most_once_per_interval_however_often_it_is_called(api, monkeypatch):
    """An unauthenticated caller hammering /readyz gets one write (one sync to disk) per READY_WRITE_EVERY_S."""
    import pipeline.server.health as health

    writes = []
    real = health.database_problem
    monkeypatch.setattr(health, "database_problem", lambda path: writes.append(path) or real(path))
    monkeypatch.setattr(health, "ray_problem", lambda: None)
    monkeypatch.setattr(health, "READY_WRITE_EVERY_S", 3600.0)
    client, _ = api
    assert all(client.get("/readyz").status_code == 200 for _ in range(50))
    assert len(writes) == 1


def test_the_state_database_syncs_every_commit(tmp_path):
    from pipeline.server.store import Store

    store = Store(tmp_path / "state.db")
    try:
        assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # noqa: SLF001 - FULL
    finally:
        store.close()


# ------------------------------------------------------------------------------------------ the event loop


def test_an_uploads_bytes_are_synced_off_the_event_loop(api, monkeypatch, tmp_path):
    """A large upload's sync to disk takes seconds: it runs in a worker thread, so the server keeps answering every
    other request meanwhile; only the rename and its directory's sync stay on the loop."""
    import asyncio

    import pipeline.server.api.files as files

    synced: list[tuple[str, bool]] = []

    def recording(path):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        synced.append((str(path), on_loop))

    monkeypatch.setattr(files, "fsync_path", recording)
    client, _ = api
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}\n'
    answer = client.post(
        "/v1/files",
        files={"file": ("in.jsonl", line * 1000)},
        data={"purpose": "batch"},
        headers={"Authorization": "Bearer " + "k" * 20},
    )
    assert answer.status_code == 200, answer.text
    assert len(synced) == 1 and synced[0][1] is False
