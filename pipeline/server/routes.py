"""The HTTP API: OpenAI's Files and Batches endpoints over a `BatchService`, as a plain FastAPI app (Ray Serve
wraps it in app.py; tests can also drive it directly).

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}` with OpenAI's status: 400 for a
request that cannot be understood, 401 without a known key, 404 for an object this key does not own (or that does
not exist — the two are indistinguishable on purpose), 413 for an upload over the limit, 400 or 429 for a request
over its key's quotas (server/quotas.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Annotated, Any

import structlog
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.config import format_validation_error
from pipeline.endpoints import SUPPORTED_URLS
from pipeline.server import outputs
from pipeline.server.auth import Keyring
from pipeline.server.datadir import DataDirLock, make_private, private_umask, publish
from pipeline.server.expiry import ExpiryError, form_policy, parse_policy, seconds_of
from pipeline.server.health import health_routes
from pipeline.server.linecheck import check_upload
from pipeline.server.metrics import exposition, storage_families
from pipeline.server.quotas import QuotaExceeded, Quotas
from pipeline.server.retention import Sweeper
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
from pipeline.server.store import FileGone, Store, new_id
from pipeline.server.uploads import FORM_OVERHEAD_BYTES, UploadError, receive_upload

log = structlog.get_logger(__name__)

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
    """Everything a request needs: the state, the runner and who may call.

    It holds the data dir's lock from before the database opens until `stop` (or its process's end): a second
    service on the same dir is refused (server/datadir.py), after waiting `lock_wait` seconds for the holder to go —
    a Serve replica's predecessor may still be in its graceful shutdown."""

    def __init__(self, config: ServerConfig, ray_address: str | None, lock_wait: float = 0.0) -> None:
        self.config = config
        self.keyring = Keyring.load(config.auth)
        self.quotas = Quotas(config.quotas, self.keyring.labels)
        self.lock = DataDirLock.acquire(config.data_dir, lock_wait)
        try:
            self.data = DataDir(config.data_dir)
            self.data.create()
            self.store = Store(self.data.database)
            # Data dirs of servers that kept it world-readable, and files made before the umask below applied.
            if changed := make_private(config.data_dir):
                log.info("data dir made private", data_dir=str(config.data_dir), entries=changed)
            self.runner = BatchRunner(config, self.store, self.data, ray_address, self.quotas)
            self.sweeper = Sweeper(self.store, self.data, config.retention.sweep_seconds)
            # Before any request: what a killed predecessor left mid-request, and nothing in flight now.
            self.sweeper.clear_leftovers()
        except BaseException:
            self.lock.release()
            raise

    def start(self) -> None:
        private_umask()  # the runner's job processes inherit it
        self.runner.start()
        self.sweeper.start()

    def stop(self) -> None:
        try:
            self.sweeper.stop()
            self.runner.stop()
            self.store.close()
        finally:
            self.lock.release()


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

    @app.exception_handler(QuotaExceeded)
    async def _over_quota(_: Request, exc: QuotaExceeded) -> JSONResponse:
        return error_response(
            exc.status, ErrorDetail(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
        )

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
        if declared and declared.isdigit() and int(declared) > limits.max_file_bytes + FORM_OVERHEAD_BYTES:
            raise ApiError(
                413,
                f"file is larger than this server's limit of {limits.max_file_bytes} bytes",
                "file",
                "file_too_large",
            )
        # A key already at a limit is refused before its body is read.
        service.quotas.check_upload(service.store, who, 0)
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
            try:
                policy = form_policy(upload.fields)
            except ExpiryError as exc:
                raise ApiError(400, exc.message, param=exc.param) from None
            # Every line read once, off the event loop: a file that is not JSONL at all is refused here.
            check = await run_in_threadpool(check_upload, upload.path, service.config.job.limits)
            refusal = check.refusal()
            if refusal:
                raise ApiError(400, refusal, param="file", code="invalid_file_format")
            # No await from this check to the insert: another upload of this key cannot pass it meanwhile.
            service.quotas.check_upload(service.store, who, upload.size)
            file_id = new_id("file-")
            publish(upload.path, service.data.upload(file_id))  # durable before the row points at it
        except BaseException:
            upload.path.unlink(missing_ok=True)
            raise
        status, details = check.status()
        return service.store.add_file(
            file_id,
            who,
            upload.filename,
            "batch",
            upload.size,
            lines=check.lines,
            expires_seconds=seconds_of(policy, service.config.retention.upload_seconds),
            status=status,
            status_details=details,
        )

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
        # Its bytes go now — an upload an unfinished batch still reads keeps them until that batch ends (a resumed
        # job checks its input is unchanged); the sweeper frees them then.
        service.sweeper.free_file(file_id)
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
        service.quotas.check_batch(service.store, who)  # no await from here to the insert, as for uploads
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
        """Prometheus: the caller's batches by status, each unfinished one's job metrics, and the files and bytes
        the caller holds on disk (server/metrics.py)."""
        body = exposition(
            service.store.batch_status_counts(who),
            service.store.unfinished_batches_of(who),
            service.data.output,
            storage_families(service.store.stored_by_purpose(who)),
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
        return json.loads(body)
    except ValueError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
