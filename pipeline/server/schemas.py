"""OpenAI's File and Batch objects, their lists and its error body, as pydantic models.

Field names, optionality and statuses follow OpenAI's API reference, so the official `openai` client parses every
answer unchanged."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
# Statuses a batch never leaves.
FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})
# A batch's metadata, as OpenAI bounds it.
METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str = Field(description="batch (uploaded input), batch_output (a batch's output or error file)")
    status: Literal["uploaded", "processed", "error"] = Field(
        default="processed",
        description="processed: checked, every line a JSON object; error: some lines are not (status_details "
        "names them); uploads are checked as they are received, so none is ever left `uploaded`",
    )
    expires_at: int | None = Field(
        default=None, description="When the file is deleted; null: kept until deleted."
    )
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """OpenAI's `usage` of a batch: token totals of its requests."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = Field(default=None, description="The model the batch's lines ran on (most of them).")
    usage: BatchUsage | None = Field(default=None, description="Token totals, set when the batch ends.")


class CreateBatchRequest(BaseModel):
    """The body of POST /v1/batches; unknown keys are refused, as OpenAI does."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's bounds: up to 16 pairs, keys up to 64 characters, values up to 512."""
        if metadata is None:
            return None
        if len(metadata) > METADATA_MAX_PAIRS:
            raise ValueError(f"at most {METADATA_MAX_PAIRS} key-value pairs, got {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > METADATA_MAX_KEY_CHARS:
                raise ValueError(
                    f"keys are at most {METADATA_MAX_KEY_CHARS} characters; {key[:20]!r}… has {len(key)}"
                )
            if len(value) > METADATA_MAX_VALUE_CHARS:
                raise ValueError(
                    f"values are at most {METADATA_MAX_VALUE_CHARS} characters; the value of {key!r} has {len(value)}"
                )
        return metadata


class ListPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[Any]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
