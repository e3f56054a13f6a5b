"""`nightshift serve`: start (or join) Ray, run the Serve application on HOST:PORT, and stay up until SIGINT or
SIGTERM; then shut Serve down, which stops the batches' jobs without giving them a final status, so the next
server resumes them. Deleting the application waits for the replica's graceful shutdown, which waits for the jobs,
each within its stop grace (runtime/launcher.py; server/app.py: Serve's timeout is longer)."""

from __future__ import annotations

import signal
import threading

import structlog

from pipeline.server.settings import ServerConfig

log = structlog.get_logger(__name__)


def serve_forever(config: ServerConfig) -> None:
    import ray
    from ray import serve

    from pipeline.runtime.session import start_ray
    from pipeline.server.app import APP_NAME, build_app

    start_ray(config.address)
    serve.start(http_options={"host": config.host, "port": config.port})
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
