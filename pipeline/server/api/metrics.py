"""`GET /metrics`: Prometheus, for the caller's key only (the families are server/metrics.py's)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pipeline.server.api.deps import Owner, Service
from pipeline.server.metrics import exposition, storage_families, waiting_families

router = APIRouter()


@router.get("/metrics")
def metrics(who: Owner, service: Service) -> Response:
    """Prometheus: the caller's batches by status, each unfinished one's job metrics, the files and bytes the
    caller holds on disk, and its batches waiting for room on a full disk (server/metrics.py)."""
    unfinished = service.store.unfinished_batches_of(who)
    waiting = sum(1 for batch in unfinished if batch.id in service.runner.waiting_for_room)
    body = exposition(
        service.store.batch_status_counts(who),
        unfinished,
        service.data.output,
        [*storage_families(service.store.stored_by_purpose(who)), *waiting_families(waiting)],
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)
