"""The Batch API as a Ray Serve application: one replica (the SQLite state and the batch runner live in it) whose
ingress is the FastAPI app of routes.py.

`nightshift serve` builds it with `build_app(config)`; KubeRay's RayService imports `pipeline.server.app:app_builder`
with the server config as its args (see k8s/rayservice.yaml)."""

from __future__ import annotations

from typing import Any

from ray import serve

from pipeline.runtime.hosting.launcher import STOP_GRACE_SECONDS
from pipeline.server.exposure import check_exposure
from pipeline.server.routes import BatchService, create_app
from pipeline.server.settings import ServerConfig

APP_NAME = "nightshift"
# The job's stop grace, then the drain of open requests and the warm engines' release, with room to spare.
REPLICA_SHUTDOWN_SECONDS = STOP_GRACE_SECONDS + 30.0


@serve.deployment(
    name="BatchAPI",
    # Exactly one replica: it owns the SQLite database and the batch processes. Serve restarts it if it dies, and
    # the new one resumes the unfinished batches from their checkpoints.
    num_replicas=1,
    # The replica only coordinates; the cores are for the jobs' engines and tasks.
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=256,
    # The replica's shutdown stops the batches' jobs (SIGINT) and waits for them, each within its grace: Serve
    # must wait longer than that grace, or it kills the replica (and with it the jobs) mid-grace.
    graceful_shutdown_timeout_s=REPLICA_SHUTDOWN_SECONDS,
)
@serve.ingress()
class BatchAPI:
    def __init__(self, config: ServerConfig) -> None:
        import ray

        # Before any request is taken: no keys while Serve listens beyond loopback stops the replica here, however
        # the application was built (server/exposure.py).
        check_exposure(config)
        # The batches' jobs join the cluster this replica runs in. A replica Serve replaces may still be stopping
        # (its jobs get their grace): the data dir's lock is waited for that long.
        self.service = BatchService(
            config, ray.get_runtime_context().gcs_address, lock_wait=REPLICA_SHUTDOWN_SECONDS
        )
        self.service.start()

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.service)

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.stop()


def build_app(config: ServerConfig) -> serve.Application:
    # The config object, not its JSON: JSON leaves secrets out (engine.http.api_key serializes to nothing, so it is
    # never written to a job's checkpoint), and the replica's jobs need them. Ray keeps the bound arguments in the
    # cluster's control store, behind the cluster's token.
    return BatchAPI.bind(config)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder (`import_path: pipeline.server.app:app_builder`): `args` is a server config
    (the keys of server.yaml), checked here, before any replica starts."""
    from pydantic import ValidationError

    from pipeline.config import ConfigError, format_validation_error

    try:
        config = ServerConfig.model_validate(args or {})
    except ValidationError as exc:
        raise ConfigError(f"server config: {format_validation_error(exc)}") from exc
    config.check()
    # Serve runs already when it builds an application from its config (KubeRay's serveConfigV2): its real HTTP
    # options are known here, before any replica starts.
    check_exposure(config)
    return build_app(config)
