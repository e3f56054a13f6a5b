"""Validate one input line: either a request the engines can run, or an error record.

Pure: no Ray, no vLLM. Checks what can be decided without the model — the Batch envelope, the route, the job's
model name, `stream`, obviously invalid sampling values — and leaves the full body schema to vLLM's own request
models at engine time (their rejections become `invalid_request` error records there, with vLLM's message).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pipeline.json_codec import loads, unicode_clean
from pipeline.protocol import SUPPORTED_ROUTES, BatchRequestLine, ErrorCode, invalid_line_record


@dataclass(frozen=True)
class ValidRequest:
    """A line that passed validation: what the engines need, plus where it came from."""

    custom_id: str
    url: str
    body: dict[str, Any]
    line: int  # 1-based line number (row number for Parquet) within `source`
    source: str


@dataclass(frozen=True)
class InvalidLine:
    """A line that failed validation, already shaped as an error record."""

    record: dict[str, Any]
    line: int
    source: str

    @property
    def code(self) -> str:
        return self.record["error"]["code"]


# Sampling values that vLLM's SamplingParams always rejects: caught up front so `nightshift validate` reports them
# without an engine. Anything subtler is left to vLLM, which stays the authority.
_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    # field: (minimum, maximum, minimum exclusive?)
    "temperature": (0.0, None, False),
    "top_p": (0.0, 1.0, True),
    "max_tokens": (1, None, False),
    "max_completion_tokens": (1, None, False),
    "n": (1, None, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "top_logprobs": (0, None, False),
}


def _range_problem(body: dict[str, Any]) -> str | None:
    # Walks the body's few keys, not the table: this runs once per row of million-row inputs.
    for field, value in body.items():
        limits = _RANGES.get(field)
        if limits is None or value is None:
            continue
        low, high, exclusive = limits
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"body.{field} must be a number, got {type(value).__name__}"
        if not math.isfinite(value):  # json.loads accepts NaN/Infinity, and NaN passes every comparison
            return f"body.{field} must be a finite number, got {value}"
        if low is not None and (value <= low if exclusive else value < low):
            bound = f"> {low}" if exclusive else f">= {low}"
            return f"body.{field} must be {bound}, got {value}"
        if high is not None and value > high:
            return f"body.{field} must be <= {high}, got {value}"
    return None


def _route_problem(url: str, body: dict[str, Any]) -> str | None:
    if url == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "body.messages must be a non-empty list of chat messages"
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return f"body.messages[{i}] must be an object with a string 'role'"
    elif url == "/v1/completions":
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            return "body.prompt is required for /v1/completions"
    return None


def _has_lone_surrogate(raw: str | bytes | dict[str, Any], obj: Any) -> bool:
    """An unpaired UTF-16 surrogate (a \\ud800-\\udfff escape, or CESU-8 bytes) is not Unicode: it cannot be
    written as UTF-8 downstream, so it must be caught here. Only lines that could hold one pay for the check."""
    if isinstance(raw, bytes | str):
        marker = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
        if b"\\u" not in marker and b"\xed" not in marker:
            return False
    return not unicode_clean(obj)


def _pydantic_message(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "line"
    return f"{where}: {first['msg']}"


class LineValidator:
    """Validates the lines of one job in order; remembers custom_ids to reject later duplicates.

    The seen-set is the one piece of state that grows with the input (about 100 bytes per row); it is what lets
    the first occurrence of a custom_id run and every later one become an error, as the contract requires.
    """

    def __init__(self, model_name: str, job_id: str | None = None) -> None:
        self.model_name = model_name
        self.job_id = job_id  # seeds the output ids, so a re-validation on resume reproduces them
        self._seen: set[str] = set()

    def __call__(
        self, raw: str | bytes | dict[str, Any], line: int, source: str
    ) -> ValidRequest | InvalidLine:
        def invalid(code: ErrorCode, message: str, custom_id: str | None = None) -> InvalidLine:
            seed = f"{self.job_id}:{source}:{line}" if self.job_id else None
            return InvalidLine(
                invalid_line_record(custom_id, code, message, line, source, seed), line, source
            )

        if isinstance(raw, dict):
            obj: Any = raw
        else:
            try:
                obj = loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                return invalid(ErrorCode.INVALID_JSON, f"line is not valid JSON: {exc}")
        if not isinstance(obj, dict):
            return invalid(ErrorCode.INVALID_JSON, f"line must be a JSON object, got {type(obj).__name__}")
        if _has_lone_surrogate(raw, obj):
            return invalid(
                ErrorCode.INVALID_JSON, "line holds an unpaired UTF-16 surrogate: not valid Unicode"
            )

        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            shown = custom_id if isinstance(custom_id, str) else None
            return invalid(ErrorCode.MISSING_CUSTOM_ID, "custom_id must be a non-empty string", shown)

        # The first line that names a custom_id owns it, valid or not; every later line with it is a duplicate.
        if custom_id in self._seen:
            return invalid(
                ErrorCode.DUPLICATE_CUSTOM_ID,
                f"custom_id {custom_id!r} already appeared earlier in the input",
                custom_id,
            )
        self._seen.add(custom_id)

        try:
            request = BatchRequestLine.model_validate(obj)
        except ValidationError as exc:
            return invalid(ErrorCode.INVALID_REQUEST, _pydantic_message(exc), custom_id)

        if request.method.upper() != "POST":
            return invalid(
                ErrorCode.UNSUPPORTED_METHOD, f"method must be POST, got {request.method!r}", custom_id
            )
        if request.url not in SUPPORTED_ROUTES:
            supported = ", ".join(sorted(SUPPORTED_ROUTES))
            return invalid(
                ErrorCode.UNSUPPORTED_URL,
                f"url {request.url!r} is not served; supported: {supported}",
                custom_id,
            )
        body = request.body
        if body.get("stream") is True:
            return invalid(ErrorCode.STREAM_UNSUPPORTED, "stream=true is not supported in a batch", custom_id)
        model = body.get("model")
        if model is not None and model != self.model_name:
            return invalid(
                ErrorCode.MODEL_NOT_FOUND,
                f"model {model!r} is not served by this job; it serves {self.model_name!r}",
                custom_id,
            )
        problem = _route_problem(request.url, body) or _range_problem(body)
        if problem:
            return invalid(ErrorCode.INVALID_REQUEST, problem, custom_id)

        # A body without `model` gets the job's, so vLLM's serving layer sees the name it serves.
        return ValidRequest(custom_id, request.url, {**body, "model": self.model_name}, line, source)
