"""The HTTP API: OpenAI's Files and Batches endpoints over a `BatchService`, as a plain FastAPI app (Ray Serve
wraps it in app.py; tests can also drive it directly).

`create_app` only assembles it: the service goes to `app.state` (the handlers get it, and the caller's owner, by
dependency: api/deps.py), one router per resource (api/files.py, api/batches.py, api/metrics.py, api/health.py),
and the handlers that answer every error in OpenAI's body and status (api/errors.py)."""

from __future__ import annotations

from fastapi import FastAPI

from pipeline.server.api import batches, files, health, metrics
from pipeline.server.api.batches import MAX_JSON_BODY_BYTES
from pipeline.server.api.errors import add_error_handlers
from pipeline.server.service import BatchService

__all__ = ["MAX_JSON_BODY_BYTES", "BatchService", "create_app"]


def create_app(service: BatchService) -> FastAPI:
    app = FastAPI(title="nightshift Batch API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    add_error_handlers(app)
    app.include_router(health.router)  # /healthz, /readyz: no key
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(metrics.router)
    return app
