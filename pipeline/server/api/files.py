"""`/v1/files`: uploads (streamed to disk under the size limit, every line checked before the file is kept), their
list, objects and content (a batch's output and error files are streamed from its shards), and deletion."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from pipeline.local_files import fsync_path
from pipeline.server import outputs
from pipeline.server.api.deps import Owner, Service, list_page, page_limit
from pipeline.server.api.errors import ApiError, not_found
from pipeline.server.datadir import publish
from pipeline.server.disk_use import TooManyUploads
from pipeline.server.expiry import ExpiryError, form_policy, seconds_of
from pipeline.server.linecheck import check_upload
from pipeline.server.quotas import QuotaExceeded
from pipeline.server.schemas import FileDeleted, FileObject, ListPage
from pipeline.server.service import BatchService
from pipeline.server.store import file_object, new_id
from pipeline.server.uploads import FORM_OVERHEAD_BYTES, UploadError, receive_upload

router = APIRouter()


@router.post("/v1/files")
async def upload_file(request: Request, who: Owner, service: Service) -> FileObject:
    limits = service.config.limits
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limits.max_file_bytes + FORM_OVERHEAD_BYTES:
        raise ApiError(
            413,
            f"file is larger than this server's limit of {limits.max_file_bytes} bytes",
            "file",
            "file_too_large",
        )
    # While it arrives, the upload counts against its key's storage at the size it declares.
    reserved = (
        int(declared) if declared and declared.isdigit() else limits.max_file_bytes + FORM_OVERHEAD_BYTES
    )
    try:
        with service.uploads.slot(who, reserved):
            return await _receive_and_keep(request, who, service, reserved)
    except TooManyUploads as exc:
        raise QuotaExceeded(429, str(exc), "concurrent_uploads_limit_exceeded", "file", "requests") from None


async def _receive_and_keep(request: Request, who: str, service: BatchService, reserved: int) -> FileObject:
    limits = service.config.limits
    # A key already at a limit is refused before its body is read.
    service.quotas.check_upload(service.store, who, 0, service.pending_bytes(who, besides=reserved))
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
            raise ApiError(400, f"purpose must be 'batch' on this server, got {purpose!r}", param="purpose")
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
        # The file's bytes reach the disk off the event loop: a 200 MB sync takes seconds, and every other request
        # of every key would wait for it there.
        await run_in_threadpool(fsync_path, upload.path)
        # No await from this check to the insert: another upload of this key cannot pass it meanwhile.
        service.quotas.check_upload(
            service.store, who, upload.size, service.pending_bytes(who, besides=reserved)
        )
        file_id = new_id("file-")
        # Durable before the row points at it: what is left on the loop is a rename and its directory's sync.
        publish(upload.path, service.data.upload(file_id), data_synced=True)
    except BaseException:
        upload.path.unlink(missing_ok=True)
        raise
    status, details = check.status()
    try:
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
    except BaseException:
        # No row points at the bytes (a full disk refused the insert): they go now, not at the next sweep.
        service.data.upload(file_id).unlink(missing_ok=True)
        raise


@router.get("/v1/files")
def list_files(
    who: Owner,
    service: Service,
    after: str | None = None,
    limit: int = 100,
    order: str = "desc",
    purpose: str | None = None,
) -> ListPage:
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
    # OpenAI's files list allows up to 10,000 per page; 100 keeps one answer small here.
    data, more = service.store.list_files(who, after, page_limit(limit), purpose, order == "asc")
    return list_page(data, more)


@router.get("/v1/files/{file_id}")
def get_file(file_id: str, who: Owner, service: Service) -> FileObject:
    row = service.store.file_row(file_id, who)
    if row is None:
        raise not_found("File", file_id, "file_id")
    return file_object(row)


@router.get("/v1/files/{file_id}/content")
def file_content(file_id: str, who: Owner, service: Service) -> StreamingResponse:
    row = service.store.file_row(file_id, who)
    if row is None:
        raise not_found("File", file_id, "file_id")
    if row["purpose"] == "batch_output":
        body: Iterator[bytes] = outputs.iter_output(service.data.output(row["batch_id"]), row["kind"])
    else:
        body = _read_file(service.data.upload(file_id))
    return StreamingResponse(body, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
def delete_file(file_id: str, who: Owner, service: Service) -> FileDeleted:
    row = service.store.file_row(file_id, who)
    if row is None or not service.store.delete_file(file_id, who):
        raise not_found("File", file_id, "file_id")
    # Its bytes go now — an upload an unfinished batch still reads keeps them until that batch ends (a resumed
    # job checks its input is unchanged); the sweeper frees them then.
    service.sweeper.free_file(file_id)
    return FileDeleted(id=file_id)


def _read_file(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while piece := f.read(outputs.CHUNK_BYTES):
            yield piece
