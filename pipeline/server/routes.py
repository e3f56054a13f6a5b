"""The HTTP API: OpenAI's Files and Batches endpoints over a `BatchService`, as a plain FastAPI app (Ray Serve
wraps it in app.py; tests can also drive it directly).

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}` with OpenAI's status: 400 for a
request that cannot be understood, 401 without a known key, 404 for an object this key does not own (or that does
not exist — the two are indistinguishable on purpose), 413 for an upload over the limit."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.config import format_validation_error
from pipeline.endpoints import SUPPORTED_URLS
from pipeline.server import outputs
from pipeline.server.auth import Keyring
from pipeline.server.health import health_routes
from pipeline.server.metrics import exposition
from pipeline.server.runner import BatchRunner, DataDir
from pipeline.server.schemas import (
    FINAL_STATUSES,
    BatchObject,
    CreateBatchRequest,
    ErrorBody,
    ErrorDetail,
    FileDeleted,
    FileObject,
    ListPage,
)
from pipeline.server.settings import ServerConfig
from pipeline.server.store import Store, new_id
from pipeline.server.uploads import UploadError, receive_upload

MAX_JSON_BODY_BYTES = 1 << 20  # POST /v1/batches bodies are a few hundred bytes


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)


def not_found(kind: str, object_id: str, param: str = "id") -> ApiError:
    return ApiError(404, f"No such {kind} object: {object_id}", param=param)


class BatchService:
    """Everything a request needs: the state, the runner and who may call."""

    def __init__(self, config: ServerConfig, ray_address: str | None) -> None:
        self.config = config
        self.keyring = Keyring.load(config.auth)
        self.data = DataDir(config.data_dir)
        self.data.create()
        self.store = Store(self.data.database)
        self.runner = BatchRunner(config, self.store, self.data, ray_address)

    def start(self) -> None:
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()


def current_owner(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """The owner of the request's key; 401 in OpenAI's words without one."""
    found = request.app.state.service.keyring.owner(authorization)
    if found is None:
        message = (
            "Incorrect API key provided."
            if authorization
            else "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
        )
        raise ApiError(401, message, code="invalid_api_key")
    return found


# Module level, so FastAPI resolves it from the handlers' (postponed) annotations.
Owner = Annotated[str, Depends(current_owner)]


def create_app(service: BatchService) -> FastAPI:
    app = FastAPI(title="nightshift Batch API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.include_router(health_routes(service.data.database))  # /healthz, /readyz: no key (server/health.py)
    limits = service.config.limits

    def error_response(status: int, detail: ErrorDetail) -> JSONResponse:
        return JSONResponse(ErrorBody(error=detail).model_dump(), status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(
            400, ErrorDetail(message=f"{param}: {first.get('msg', 'invalid')}", param=param)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and methods, in OpenAI's shape.
        return error_response(exc.status_code, ErrorDetail(message=str(exc.detail)))

    def page_limit(limit: int) -> int:
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit must be between 1 and 100", param="limit")
        return limit

    # -- files --------------------------------------------------------------------------------------------------
    @app.post("/v1/files")
    async def upload_file(request: Request, who: Owner) -> FileObject:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limits.max_file_bytes + 64 * 1024:
            raise ApiError(
                413,
                f"file is larger than this server's limit of {limits.max_file_bytes} bytes",
                "file",
                "file_too_large",
            )
        try:
            upload = await receive_upload(
                request.headers.get("content-type"),
                request.stream(),
                service.data.scratch,
                limits.max_file_bytes,
            )
        except UploadError as exc:
            raise ApiError(exc.status, exc.message, exc.param, exc.code) from None
        try:
            purpose = upload.fields.get("purpose")
            if purpose != "batch":
                raise ApiError(
                    400, f"purpose must be 'batch' on this server, got {purpose!r}", param="purpose"
                )
            if upload.size == 0:
                raise ApiError(400, "the file is empty", param="file")
            file_id = new_id("file-")
            os.replace(upload.path, service.data.upload(file_id))
        except BaseException:
            upload.path.unlink(missing_ok=True)
            raise
        return service.store.add_file(file_id, who, upload.filename, "batch", upload.size, lines=upload.lines)

    @app.get("/v1/files")
    def list_files(
        who: Owner,
        after: str | None = None,
        limit: int = 100,
        order: str = "desc",
        purpose: str | None = None,
    ) -> ListPage:
        if order not in ("asc", "desc"):
            raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
        # OpenAI's files list allows up to 10,000 per page; 100 keeps one answer small here.
        data, more = service.store.list_files(who, after, page_limit(limit), purpose, order == "asc")
        return _page(data, more)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str, who: Owner) -> FileObject:
        return _file(file_id, who)

    def _file(file_id: str, who: str) -> FileObject:
        from pipeline.server.store import file_object

        row = service.store.file_row(file_id, who)
        if row is None:
            raise not_found("File", file_id, "file_id")
        return file_object(row)

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, who: Owner) -> StreamingResponse:
        row = service.store.file_row(file_id, who)
        if row is None:
            raise not_found("File", file_id, "file_id")
        if row["purpose"] == "batch_output":
            body: Iterator[bytes] = outputs.iter_output(service.data.output(row["batch_id"]), row["kind"])
        else:
            body = _read_file(service.data.upload(file_id))
        return StreamingResponse(body, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, who: Owner) -> FileDeleted:
        row = service.store.file_row(file_id, who)
        if row is None or not service.store.delete_file(file_id, who):
            raise not_found("File", file_id, "file_id")
        # An upload an unfinished batch still reads keeps its bytes (a resumed job checks its input is unchanged).
        if row["purpose"] == "batch" and not service.store.file_in_use(file_id):
            service.data.upload(file_id).unlink(missing_ok=True)
        return FileDeleted(id=file_id)

    # -- batches ------------------------------------------------------------------------------------------------
    @app.post("/v1/batches")
    async def create_batch(request: Request, who: Owner) -> BatchObject:
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
        batch_id = new_id("batch_")
        service.data.batch(batch_id).mkdir(parents=True)
        batch = service.store.add_batch(
            batch_id,
            who,
            wanted.endpoint,
            wanted.input_file_id,
            wanted.completion_window,
            wanted.metadata,
            total=0,
            expires_at=int(time.time()) + _window_seconds(wanted.completion_window),
        )
        service.runner.submit(batch_id, who)
        return batch

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str, who: Owner) -> BatchObject:
        batch = service.store.batch(batch_id, who)
        if batch is None:
            raise not_found("Batch", batch_id, "batch_id")
        return batch

    @app.get("/v1/batches")
    def list_batches(who: Owner, after: str | None = None, limit: int = 20) -> ListPage:
        data, more = service.store.list_batches(who, after, page_limit(limit))
        return _page(data, more)

    @app.get("/metrics")
    def metrics(who: Owner) -> Response:
        """Prometheus: the caller's batches by status, and each unfinished one's job metrics (server/metrics.py)."""
        body = exposition(
            service.store.batch_status_counts(who),
            service.store.unfinished_batches_of(who),
            service.data.output,
        )
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, who: Owner) -> BatchObject:
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

    return app


def _page(data: list[Any], more: bool) -> ListPage:
    return ListPage(
        data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=more
    )


def _window_seconds(window: str) -> int:
    """'24h' → seconds; the accepted windows are checked against the config before this."""
    units = {"h": 3600, "m": 60, "d": 86400}
    return int(window[:-1]) * units[window[-1]]


def _read_file(path: Any) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while piece := f.read(outputs.CHUNK_BYTES):
            yield piece


async def _json_body(request: Request) -> Any:
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > MAX_JSON_BODY_BYTES:
            raise ApiError(413, "request body too large")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
