"""`GET /metrics`: Prometheus, for the caller's key only (the families are server/metrics.py's)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pipeline.server.api.deps import Owner, Service
from pipeline.server.metrics import exposition, storage_families

router = APIRouter()


@router.get("/metrics")
def metrics(who: Owner, service: Service) -> Response:
    """Prometheus: the caller's batches by status, each unfinished one's job metrics, and the files and bytes
    the caller holds on disk (server/metrics.py)."""
    body = exposition(
        service.store.batch_status_counts(who),
        service.store.unfinished_batches_of(who),
        service.data.output,
        storage_families(service.store.stored_by_purpose(who)),
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)
