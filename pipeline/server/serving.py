"""`nightshift serve`: start (or join) Ray, run the Serve application on HOST:PORT, and stay up until SIGINT or
SIGTERM; then shut Serve down, which stops the batches' jobs without giving them a final status, so the next
server resumes them. Deleting the application waits for the replica's graceful shutdown, which waits for the jobs,
each within its stop grace (runtime/hosting/launcher.py; server/app.py: Serve's timeout is longer).

Ray's token authentication as `nightshift run` has it (cluster/auth.py): a private local Ray starts with
RAY_AUTH_MODE=token and the head's token, which each batch's job finds as it joins; a cluster given by --address is asked first whether it wants a token and takes this one — a
missing or refused token stops the server in one line that says what to set, and an open cluster is warned about."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import structlog

from pipeline.server.settings import ServerConfig

log = structlog.get_logger(__name__)


def serve_forever(config: ServerConfig, token_file: Path | None = None) -> None:
    """Raises cluster.auth.AuthError (the cluster's token) and ConfigError (keys off while Serve listens beyond
    loopback) before any request is taken."""
    from cluster.auth import driver_environment, share_local_ray

    with driver_environment(config.address, token_file) as warnings:
        for warning in warnings:
            log.warning(warning)
        if not config.address:
            share_local_ray()  # each batch's job joins this Ray as a driver of its own: it must find its token
        _serve(config)


def _serve(config: ServerConfig) -> None:
    import ray
    from ray import serve

    from pipeline.runtime.hosting.session import start_ray
    from pipeline.server.app import APP_NAME, build_app
    from pipeline.server.exposure import check_exposure

    # Serve's controller gives a starting proxy PROXY_READY_CHECK_TIMEOUT_S (5 s) to answer its ready check, then
    # kills it, and serve.start fails with the proxy's ActorDiedError: on a loaded node a proxy importing its web
    # stack takes longer. The Ray this server starts (its controller inherits this environment) waits longer.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    start_ray(config.address)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        # A cluster whose Serve already runs keeps its own HTTP options: the ones that count.
        check_exposure(config)
    except BaseException:
        ray.shutdown()
        raise
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    log.info("serving", url=f"http://{config.host}:{config.port}/v1", data_dir=str(config.data_dir))
    print(f"nightshift Batch API at http://{config.host}:{config.port}/v1", flush=True)

    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    log.info("shutting down")
    try:
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()
