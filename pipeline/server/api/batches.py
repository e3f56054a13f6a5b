"""`/v1/batches`: a batch created over an uploaded file (checked against the server's limits and the key's quotas,
then handed to the runner), its object, the key's list, and cancelling."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from pipeline import json_codec
from pipeline.config import format_validation_error
from pipeline.endpoints import SUPPORTED_URLS
from pipeline.server.api.deps import Owner, Service, list_page, page_limit
from pipeline.server.api.errors import ApiError, not_found
from pipeline.server.expiry import ExpiryError, parse_policy, seconds_of
from pipeline.server.schemas import FINAL_STATUSES, BatchObject, CreateBatchRequest, ListPage
from pipeline.server.store import FileGone, new_id

MAX_JSON_BODY_BYTES = 1 << 20  # POST /v1/batches bodies are a few hundred bytes
MAX_JSON_BODY_DEPTH = 32  # ... nested two levels deep (metadata is a flat object)

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(request: Request, who: Owner, service: Service) -> BatchObject:
    limits = service.config.limits
    raw = await _json_body(request)
    try:
        wanted = CreateBatchRequest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ApiError(
            400, format_validation_error(exc), param=".".join(str(p) for p in first["loc"]) or None
        ) from None
    if wanted.endpoint not in SUPPORTED_URLS:
        raise ApiError(
            400,
            f"endpoint {wanted.endpoint!r} is not served; use one of {', '.join(SUPPORTED_URLS)}",
            "endpoint",
        )
    try:
        output_policy = parse_policy(wanted.output_expires_after, "output_expires_after")
    except ExpiryError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    if wanted.completion_window not in limits.completion_windows:
        raise ApiError(
            400,
            f"completion_window must be one of {limits.completion_windows}, got {wanted.completion_window!r}",
            "completion_window",
        )
    row = service.store.file_row(wanted.input_file_id, who)
    if row is None or row["purpose"] != "batch":
        raise not_found("File", wanted.input_file_id, "input_file_id")
    if row["lines"] > limits.max_requests_per_batch:
        raise ApiError(
            400,
            f"the input file holds {row['lines']} lines; a batch may hold at most {limits.max_requests_per_batch}",
            "input_file_id",
            "too_many_requests",
        )
    # No await from here to the insert, as for uploads.
    service.quotas.check_batch(service.store, who, service.pending_bytes(who))
    batch_id = new_id("batch_")
    service.data.batch(batch_id).mkdir(parents=True)
    try:
        batch = service.store.add_batch(
            batch_id,
            who,
            wanted.endpoint,
            wanted.input_file_id,
            wanted.completion_window,
            wanted.metadata,
            total=0,
            expires_at=int(time.time()) + _window_seconds(wanted.completion_window),
            output_expires_seconds=seconds_of(output_policy, service.config.retention.output_seconds),
        )
    except FileGone:  # deleted or expired since it was looked up
        service.data.batch(batch_id).rmdir()
        raise not_found("File", wanted.input_file_id, "input_file_id") from None
    except BaseException:  # e.g. a full disk refused the row: nothing of the refused batch stays
        service.data.batch(batch_id).rmdir()
        raise
    service.runner.submit(batch_id, who)
    return batch


@router.get("/v1/batches/{batch_id}")
def get_batch(batch_id: str, who: Owner, service: Service) -> BatchObject:
    batch = service.store.batch(batch_id, who)
    if batch is None:
        raise not_found("Batch", batch_id, "batch_id")
    return batch


@router.get("/v1/batches")
def list_batches(who: Owner, service: Service, after: str | None = None, limit: int = 20) -> ListPage:
    data, more = service.store.list_batches(who, after, page_limit(limit))
    return list_page(data, more)


@router.post("/v1/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, who: Owner, service: Service) -> BatchObject:
    batch = service.store.batch(batch_id, who)
    if batch is None:
        raise not_found("Batch", batch_id, "batch_id")
    if batch.status in FINAL_STATUSES:
        raise ApiError(
            409,
            f"Cannot cancel a batch with status '{batch.status}'.",
            "batch_id",
            "batch_not_cancellable",
        )
    if batch.status != "cancelling":
        service.store.update_batch(
            batch_id,
            only_if=("validating", "in_progress", "finalizing"),
            status="cancelling",
            cancelling_at=int(time.time()),
        )
        service.runner.cancel(batch_id)
    found = service.store.batch(batch_id, who)
    assert found is not None
    return found


def _window_seconds(window: str) -> int:
    """'24h' → seconds; the accepted windows are checked against the config before this."""
    units = {"h": 3600, "m": 60, "d": 86400}
    return int(window[:-1]) * units[window[-1]]


async def _json_body(request: Request) -> Any:
    """The body, cut at MAX_JSON_BODY_BYTES as it streams in (a chunked body declares no length)."""
    too_large = ApiError(
        413, f"the request body is larger than this server's limit of {MAX_JSON_BODY_BYTES} bytes"
    )
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_JSON_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > MAX_JSON_BODY_BYTES:
            raise too_large
    try:
        # Bounded nesting: a body of a million brackets is the client's error (400), not the stack's (a 500).
        return json_codec.loads(bytes(body), MAX_JSON_BODY_DEPTH)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
