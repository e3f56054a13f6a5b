"""No keys only where Serve really listens on loopback, on a real local Ray with Serve: the Batch API deployed from a
Serve config the way KubeRay deploys a RayService's serveConfigV2 (`import_path: pipeline.server.app:app_builder`,
the server config as args, which say nothing of a host) fails to deploy, naming http_options.host, when Serve's
proxies listen on 0.0.0.0 — and deploys and answers on 127.0.0.1. The replica refuses too, however its application
was built."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.harness import free_port

pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.timeout(600)]

APP = "nightshift-exposure"


@pytest.fixture
def serve_on():
    """serve_on(host) starts Serve's proxies on host and a free port; Serve is shut down after the test."""
    from ray import serve

    def start(host: str) -> int:
        port = free_port()
        serve.start(http_options={"host": host, "port": port})
        return port

    yield start
    serve.shutdown()


def _no_auth_args(tmp_path) -> dict:
    return {
        "data_dir": str(tmp_path / "data"),
        "auth": {"disabled": True},
        "engine_idle_seconds": 0,
        "job": {"engine": {"backend": "fake"}},
    }


def _deploy_from_config(args: dict, timeout: float = 240):  # noqa: ANN202 - ray.serve.schema.ApplicationStatusOverview
    """Deploy as KubeRay does (the Serve controller applies a config naming the import path); the application's
    status once it is RUNNING or DEPLOY_FAILED."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.parse_obj(
        {
            "applications": [
                {
                    "name": APP,
                    "route_prefix": "/",
                    "import_path": "pipeline.server.app:app_builder",
                    "args": args,
                }
            ]
        }
    )
    _get_global_client().deploy_apps(config)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and status.status in ("RUNNING", "DEPLOY_FAILED"):
            return status
        time.sleep(0.5)
    raise AssertionError(f"{APP} neither running nor failed after {timeout} s: {status}")


def test_no_auth_fails_to_deploy_where_serve_listens_on_every_interface(serve_on, tmp_path):
    serve_on("0.0.0.0")
    status = _deploy_from_config(_no_auth_args(tmp_path))
    assert status.status == "DEPLOY_FAILED"
    assert "http_options.host 0.0.0.0" in status.message and "API keys" in status.message
    assert not (tmp_path / "data").exists()  # refused before the replica, which creates the data dir


def test_the_replica_refuses_no_auth_where_serve_listens_on_every_interface(serve_on, tmp_path):
    """An application built without app_builder (as `nightshift serve` builds its own): the replica checks."""
    from ray import serve

    from pipeline.server.app import BatchAPI
    from pipeline.server.settings import ServerConfig

    serve_on("0.0.0.0")
    config = ServerConfig.model_validate(_no_auth_args(tmp_path))
    config.check()  # its own host is loopback: the config alone passes
    with pytest.raises(RuntimeError, match="failed"):
        serve.run(BatchAPI.options(max_constructor_retry_count=1).bind(config), name=APP, route_prefix="/")
    replica = serve.status().applications[APP].deployments["BatchAPI"]
    assert replica.status == "DEPLOY_FAILED" and "http_options.host 0.0.0.0" in replica.message
    assert not (tmp_path / "data").exists()


def test_no_auth_deploys_and_answers_where_serve_listens_on_loopback(serve_on, tmp_path):
    port = serve_on("127.0.0.1")
    status = _deploy_from_config(_no_auth_args(tmp_path))
    assert status.status == "RUNNING", status.message
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/v1/batches", timeout=10).json()["data"] == []  # no key needed
    assert httpx.get(f"{base}/healthz", timeout=10).json() == {"status": "ok"}
    ready = httpx.get(f"{base}/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "ray": "ok"}
