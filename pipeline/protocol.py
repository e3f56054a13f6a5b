"""The wire formats: OpenAI Batch request lines, result lines, error lines, and the stable error codes.

Pure module: imports neither Ray nor vLLM, so validation and finalization run anywhere (tests, `validate`, the
Batch API server). The response *bodies* are not built here — they come from vLLM's own OpenAI serving layer
(see `pipeline/engines/vllm_engine.py`); this module only wraps them in the Batch envelope.
"""

from __future__ import annotations

import hashlib
import uuid
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline import json_codec


def supported_routes() -> tuple[str, ...]:
    """Every URL a batch line may name (the route registry, pipeline/endpoints)."""
    from pipeline.endpoints import SUPPORTED_URLS

    return SUPPORTED_URLS


class ErrorCode(str, Enum):
    """Stable error codes. Documented in the README; never rename one, only add."""

    INVALID_JSON = "invalid_json"  # the line is not a JSON object
    MISSING_CUSTOM_ID = "missing_custom_id"  # custom_id absent, empty or not a string
    INVALID_CUSTOM_ID = "invalid_custom_id"  # custom_id blank, too long, or holding control characters
    LINE_TOO_LONG = "line_too_long"  # the line is longer than limits.max_line_bytes
    INVALID_REQUEST = "invalid_request"  # envelope or body fails the schema / sampling params rejected
    UNSUPPORTED_METHOD = "unsupported_method"  # method other than POST
    UNSUPPORTED_URL = "unsupported_url"  # url not a route this job serves
    STREAM_UNSUPPORTED = "stream_unsupported"  # "stream": true has no meaning in a batch
    MODEL_NOT_FOUND = "model_not_found"  # body.model names no model this job serves
    UNSUPPORTED_TASK = (
        "unsupported_task"  # the model's task cannot serve the url (e.g. embeddings from a chat model)
    )
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"  # a later line reuses a custom_id
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt (+ max_tokens) does not fit the context
    ENGINE_ERROR = "engine_error"  # the engine failed on a request it accepted
    TEMPLATE_ERROR = (
        "template_error"  # a dataset row its templates cannot render (a null or missing column, ...)
    )
    MEDIA_REFUSED = "media_refused"  # a media URL the fetch policy does not allow (media/policy.py)
    MEDIA_FETCH_FAILED = (
        "media_fetch_failed"  # media the policy allows that could not be had (unreachable, too large)
    )


class BatchRequestLine(BaseModel):
    """One line of an OpenAI Batch input file."""

    model_config = ConfigDict(extra="ignore")

    custom_id: str = Field(
        min_length=1, description="Caller's id; unique within the file; results are sorted by it."
    )
    method: str = Field(default="POST", description="HTTP method; only POST (exactly) is served.")
    url: str = Field(description="The route, e.g. /v1/chat/completions.")
    body: dict[str, Any] = Field(description="The request body exactly as the route's API takes it.")


def record_ids(seed: str | None) -> tuple[str, str]:
    """(id, request_id) of an output line. With a seed (job id + row identity) they are derived from it, so a
    resumed job writes exactly the ids the uninterrupted job would have; without one they are random."""
    digest = (
        hashlib.sha256(seed.encode("utf-8", "surrogatepass")).hexdigest() if seed else uuid.uuid4().hex * 2
    )
    return f"batch_req_{digest[:32]}", f"req_{digest[32:64]}"


def result_record(
    custom_id: str, body: dict[str, Any], status_code: int = 200, seed: str | None = None
) -> dict[str, Any]:
    """A result line (or an engine-rejected request): the response body wrapped in the Batch envelope."""
    record_id, request_id = record_ids(seed)
    return {
        "id": record_id,
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def failed_request_record(
    custom_id: str,
    code: ErrorCode,
    message: str,
    status_code: int = 400,
    error_type: str = "BadRequestError",
    seed: str | None = None,
) -> dict[str, Any]:
    """An error line for a request that was understood but failed (engine rejected it, context too long...)."""
    body = {"error": {"message": message, "type": error_type, "code": code.value}}
    return result_record(custom_id, body, status_code, seed)


def invalid_line_record(
    custom_id: str | None, code: ErrorCode, message: str, line: int, source: str, seed: str | None = None
) -> dict[str, Any]:
    """An error line for a line that could not be understood (bad JSON, schema, duplicate, unsupported url)."""
    return {
        "id": record_ids(seed)[0],
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code.value, "message": message, "line": line, "source": source},
    }


def dumps(record: dict[str, Any]) -> str:
    """One JSON line; non-ASCII kept as is (UTF-8 output), no spaces to keep shards compact."""
    return json_codec.dumps(record)
