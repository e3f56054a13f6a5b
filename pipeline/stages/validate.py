"""Validate one input line: either a request the engines can run, or an error record.

Pure: no Ray, no vLLM. Checks what can be decided without the model — bounds on one line (JSON nesting,
custom_id), the Batch envelope, the route, the job's model name, body fields the route's vLLM request model does not
know, `stream` and the sampling fields, read with the types vLLM's request models give them — and leaves the full
body schema to vLLM's own request models at engine time (their rejections become `invalid_request` error records
there, with vLLM's message).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pipeline.config import InputLimits
from pipeline.endpoints import SUPPORTED_URLS, endpoint_for, urls_for_task
from pipeline.endpoints.base import BOOL, OPENAI_BOOKKEEPING_FIELDS, STREAM_FIELD, Endpoint, FieldSpec
from pipeline.json_codec import JSONNestingError, loads, unicode_clean
from pipeline.protocol import BatchRequestLine, ErrorCode, invalid_line_record


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


# Body fields are checked up front, so that `nightshift validate` reports them without an engine and so that every
# later step sees the value vLLM will use: a field is coerced exactly as vLLM's request models coerce it ("0.5" ->
# 0.5, "True" -> True, 2.0 -> 2) and written back into the body; what they would refuse, or what SamplingParams
# always rejects, is this line's error. Which fields a route checks is its registry entry's (`Endpoint.fields`):
# the sampling fields for generating routes (chat's logprobs a switch, completions' a count), only `stream` for
# pooling routes. Anything subtler is left to vLLM, which stays the authority.


def _read_field(name: str, value: Any, spec: FieldSpec) -> tuple[Any, str | None]:
    """(the value vLLM would use, or a problem message)."""
    if type(value) not in spec.type.plain:
        try:
            value = spec.type.adapter.validate_python(value)
        except ValidationError as exc:
            return value, f"body.{name}: {exc.errors()[0]['msg']}, got {_shown(value)}"
    if spec.type is BOOL:
        return value, None
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison
        return value, f"body.{name} must be a finite number, got {value}"
    if spec.low is not None and (value <= spec.low if spec.low_exclusive else value < spec.low):
        bound = f"> {spec.low}" if spec.low_exclusive else f">= {spec.low}"
        return value, f"body.{name} must be {bound}, got {value}"
    if spec.high is not None and value > spec.high:
        return value, f"body.{name} must be <= {spec.high}, got {value}"
    return value, None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _read_fields(fields: dict[str, FieldSpec], body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The body with its checked fields as vLLM would read them, or the first problem. Walks the body's few keys,
    not the table: this runs once per row of million-row inputs."""
    changed: dict[str, Any] = {}
    for name, value in body.items():
        spec = fields.get(name)
        if spec is None or value is None:
            continue
        read, problem = _read_field(name, value, spec)
        if problem:
            return body, problem
        if read is not value:
            changed[name] = read
    return ({**body, **changed} if changed else body), None


# vLLM's request models accept any extra body field and ignore it (they log it at debug level): a misspelt
# `max_token`, an OpenAI-only `prediction`, or vLLM's own removed `guided_json` would change nothing in the answer and
# nobody would know. OpenAI refuses such a request; so does validation, with OpenAI's words. Bookkeeping fields of
# OpenAI's that change no answer are let through (endpoints/base.py OPENAI_BOOKKEEPING_FIELDS), and so is `stream` on
# every route: a stream is refused under its own code (stream_unsupported), whichever route asks for one.
_ALWAYS_KNOWN = OPENAI_BOOKKEEPING_FIELDS | STREAM_FIELD.keys()
_GUIDED_HINT = "; vLLM's guided_* fields were replaced by structured_outputs ({'json': ...}, 'regex', 'choice', 'grammar')"


def unknown_fields_problem(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """OpenAI's message for body fields the route's vLLM request model does not know, or None. A set difference of
    the body's few keys: it runs once per row."""
    unknown = body.keys() - endpoint.body_fields - _ALWAYS_KNOWN
    if not unknown:
        return None
    names = sorted(unknown)
    plural = "s" if len(names) > 1 else ""
    hint = _GUIDED_HINT if any(name.startswith("guided_") for name in names) else ""
    return f"Unrecognized request argument{plural} supplied: {', '.join(names)}{hint}"


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


# C0 and C1 control characters and DEL: invisible in logs and terminals, and no id a caller means to match on.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def custom_id_problem(custom_id: str, max_bytes: int) -> str | None:
    """Why a (non-empty, string) custom_id cannot be used, or None. Results are sorted and matched by it."""
    if not custom_id.strip():
        return "custom_id must not be blank (only whitespace)"
    if _CONTROL.search(custom_id):
        return "custom_id must not contain control characters"
    # A character is at most 4 UTF-8 bytes: most ids are decided without encoding them.
    if len(custom_id) * 4 > max_bytes and len(custom_id.encode("utf-8", "surrogatepass")) > max_bytes:
        return f"custom_id is longer than {max_bytes} bytes (limits.max_custom_id_bytes)"
    return None


class LineValidator:
    """Validates the lines of one job in order; remembers custom_ids to reject later duplicates.

    The seen-set is the one piece of state that grows with the input (about 100 bytes per row); it is what lets
    the first occurrence of a custom_id run and every later one become an error, as the contract requires.
    """

    def __init__(
        self,
        served: str | Mapping[str, str | None],
        job_id: str | None = None,
        limits: InputLimits | None = None,
    ) -> None:
        # The models this job serves, name -> task ("generate", "embed", ...; None when unknown: every route is let
        # through and the engine decides). A bare name is one model of unknown task. The first is the job's own.
        self.served: dict[str, str | None] = {served: None} if isinstance(served, str) else dict(served)
        if not self.served:
            raise ValueError("a job serves at least one model")
        self.model_name = next(iter(self.served))
        self.job_id = job_id  # seeds the output ids, so a re-validation on resume reproduces them
        self.limits = limits or InputLimits()
        self._seen: set[str] = set()

    def __call__(
        self, raw: str | bytes | dict[str, Any], line: int, source: str
    ) -> ValidRequest | InvalidLine:
        outcome, claim = self.check(raw, line, source)
        if claim is None:
            return outcome
        # The first line that names a custom_id owns it, valid or not; every later line with it is a duplicate.
        if claim in self._seen:
            return duplicate_line(claim, line, source, self.job_id)
        self._seen.add(claim)
        return outcome

    def check(
        self, raw: str | bytes | dict[str, Any], line: int, source: str
    ) -> tuple[ValidRequest | InvalidLine, str | None]:
        """The line on its own, without the duplicate check: its outcome, and the custom_id it claims (None when
        it names no usable one). A claimed id that an earlier line claimed makes this line a duplicate instead,
        whatever its outcome: `__call__` applies that rule with one set, `runtime/ingest/dedup.py` with id buckets."""

        def invalid(code: ErrorCode, message: str, custom_id: str | None = None) -> InvalidLine:
            seed = f"{self.job_id}:{source}:{line}" if self.job_id else None
            return InvalidLine(
                invalid_line_record(custom_id, code, message, line, source, seed), line, source
            )

        if isinstance(raw, dict):
            obj: Any = raw
        else:
            try:
                obj = loads(raw, self.limits.max_json_depth)
            except JSONNestingError as exc:
                return invalid(ErrorCode.INVALID_JSON, f"{exc} (limits.max_json_depth)"), None
            except (ValueError, UnicodeDecodeError) as exc:
                return invalid(ErrorCode.INVALID_JSON, f"line is not valid JSON: {exc}"), None
        if not isinstance(obj, dict):
            return invalid(
                ErrorCode.INVALID_JSON, f"line must be a JSON object, got {type(obj).__name__}"
            ), None
        if _has_lone_surrogate(raw, obj):
            return invalid(
                ErrorCode.INVALID_JSON, "line holds an unpaired UTF-16 surrogate: not valid Unicode"
            ), None

        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            shown = custom_id if isinstance(custom_id, str) else None
            return invalid(ErrorCode.MISSING_CUSTOM_ID, "custom_id must be a non-empty string", shown), None
        problem = custom_id_problem(custom_id, self.limits.max_custom_id_bytes)
        if problem:
            # Not echoed whole: a megabyte of id would make a megabyte of error line.
            shown = custom_id if len(custom_id) <= self.limits.max_custom_id_bytes else None
            return invalid(ErrorCode.INVALID_CUSTOM_ID, problem, shown), None

        # From here on the line claims its custom_id, valid or not.
        try:
            request = BatchRequestLine.model_validate(obj)
        except ValidationError as exc:
            return invalid(ErrorCode.INVALID_REQUEST, _pydantic_message(exc), custom_id), custom_id

        # Exactly as OpenAI's Batch API compares it: HTTP methods are case-sensitive, and only POST is served.
        if request.method != "POST":
            return invalid(
                ErrorCode.UNSUPPORTED_METHOD, f'method must be "POST", got {request.method!r}', custom_id
            ), custom_id
        endpoint = endpoint_for(request.url)
        if endpoint is None:
            return invalid(
                ErrorCode.UNSUPPORTED_URL,
                f"url {request.url!r} is not served; supported: {', '.join(SUPPORTED_URLS)}",
                custom_id,
            ), custom_id
        only = self.limits.only_url
        if only is not None and endpoint is not endpoint_for(only):
            return invalid(
                ErrorCode.UNSUPPORTED_URL,
                f"url {request.url!r} is not this batch's endpoint {only!r}; a batch serves one endpoint",
                custom_id,
            ), custom_id
        refused = [name for name in self.limits.refused_fields if name in request.body]
        if refused:
            return invalid(
                ErrorCode.INVALID_REQUEST,
                f"body.{refused[0]} is not accepted here: the server sets how requests are processed",
                custom_id,
            ), custom_id
        problem = self.limits.refuse_unknown_fields and unknown_fields_problem(endpoint, request.body)
        if problem:
            return invalid(ErrorCode.INVALID_REQUEST, problem, custom_id), custom_id
        body, problem = _read_fields(endpoint.fields, request.body)
        if problem:
            return invalid(ErrorCode.INVALID_REQUEST, problem, custom_id), custom_id
        # After the fields are read as vLLM reads them: "stream": "True" or 1 asks for a stream just as true does.
        if body.get("stream"):
            return invalid(
                ErrorCode.STREAM_UNSUPPORTED, "stream=true is not supported in a batch", custom_id
            ), custom_id
        model = body.get("model")
        if model is None:
            model = self.default_model(endpoint.tasks)
        elif not isinstance(model, str):
            return invalid(
                ErrorCode.INVALID_REQUEST,
                f"body.model must be a string naming a served model, got {type(model).__name__}",
                custom_id,
            ), custom_id
        elif model not in self.served:
            return invalid(
                ErrorCode.MODEL_NOT_FOUND,
                f"model {model!r} is not served by this job; it serves {self._names()}",
                custom_id,
            ), custom_id
        task = self.served[model]
        if task is not None and task not in endpoint.tasks:
            return invalid(
                ErrorCode.UNSUPPORTED_TASK,
                f"model {model!r} runs the {task!r} task, which cannot serve {request.url}; it serves "
                f"{', '.join(urls_for_task(task))}",
                custom_id,
            ), custom_id
        problem = endpoint.check(body)
        if problem:
            return invalid(ErrorCode.INVALID_REQUEST, problem, custom_id), custom_id

        # A body without `model` gets the job's, so vLLM's serving layer sees the name it serves.
        body = {**body, "model": model}
        salt = self.limits.cache_salt
        if salt is not None and "cache_salt" in endpoint.body_fields:
            # The job's, whatever the line gave: a line must not pick another tenant's prefix-cache namespace.
            body["cache_salt"] = salt
        return ValidRequest(custom_id, request.url, body, line, source), custom_id

    def default_model(self, tasks: frozenset[str]) -> str:
        """The model a body without `model` goes to: the first served model (the job's own comes first) whose task
        serves the route, else the job's model (which then reports that it cannot)."""
        for name, task in self.served.items():
            if task is None or task in tasks:
                return name
        return self.model_name

    def _names(self) -> str:
        return ", ".join(repr(name) for name in self.served)


def duplicate_line(custom_id: str, line: int, source: str, job_id: str | None = None) -> InvalidLine:
    """The error record of a line whose custom_id an earlier line (by file, then line) already claimed."""
    seed = f"{job_id}:{source}:{line}" if job_id else None
    message = f"custom_id {custom_id!r} already appeared earlier in the input"
    return InvalidLine(
        invalid_line_record(custom_id, ErrorCode.DUPLICATE_CUSTOM_ID, message, line, source, seed),
        line,
        source,
    )
