"""Expiration policies as OpenAI takes them: `expires_after` on an upload (multipart form fields) and
`output_expires_after` on a batch (JSON), each `{"anchor": "created_at", "seconds": N}` with N within OpenAI's
bounds. A file's `expires_at` is its own `created_at` plus N: for a batch's output and error files that is when the
file was made, not when the batch was (OpenAI's anchor too).

Pure: no store, no disk. The sweeper that acts on `expires_at` is retention.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# OpenAI's bounds on both policies: one hour to thirty days.
MIN_SECONDS = 3600
MAX_SECONDS = 30 * 24 * 3600
ANCHORS = ("created_at",)


class ExpiresAfter(BaseModel):
    """`{"anchor": "created_at", "seconds": N}`, N between 3600 and 2592000."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"] = Field(description="What the seconds count from: the file's created_at.")
    seconds: int = Field(
        ge=MIN_SECONDS, le=MAX_SECONDS, description="Seconds after the anchor the file expires."
    )


class ExpiryError(ValueError):
    """A policy that cannot be honoured: the request's parameter at fault and why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _problem(exc: ValidationError, name_of: Callable[[str], str], whole: str) -> ExpiryError:
    """The first problem, naming the part at fault as the request wrote it (`name_of(part)`)."""
    first = exc.errors()[0]
    part = ".".join(str(p) for p in first["loc"])
    name = name_of(part) if part else whole
    if first["type"] == "missing":
        return ExpiryError(name, f"{name} is required")
    if part == "seconds":
        return ExpiryError(
            name, f"{name} must be an integer between {MIN_SECONDS} and {MAX_SECONDS} (one hour to 30 days)"
        )
    if part == "anchor":
        return ExpiryError(name, f"{name} must be one of {list(ANCHORS)}")
    return ExpiryError(name, f"{name}: {first['msg']}")


def parse_policy(value: object, param: str) -> ExpiresAfter | None:
    """A JSON body's policy (`output_expires_after`), None when absent."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ExpiryError(param, f'{param} must be an object: {{"anchor": "created_at", "seconds": N}}')
    try:
        return ExpiresAfter.model_validate(dict(value), strict=True)  # JSON has numbers: "3600" is not one
    except ValidationError as exc:
        raise _problem(exc, lambda part: f"{param}.{part}", param) from None


def form_policy(fields: Mapping[str, str], param: str = "expires_after") -> ExpiresAfter | None:
    """An upload's policy from its form fields, as the openai client writes a nested object in a multipart body:
    `expires_after[anchor]` and `expires_after[seconds]`. None when the form has neither."""
    prefix = f"{param}["
    given = {k[len(prefix) : -1]: v for k, v in fields.items() if k.startswith(prefix) and k.endswith("]")}
    if param in fields:
        raise ExpiryError(
            param, f"send {param} as two form fields, {param}[anchor]=created_at and {param}[seconds]=N"
        )
    if not given:
        return None
    for part in sorted(given):
        if part not in ("anchor", "seconds"):
            raise ExpiryError(f"{param}[{part}]", f"{param}[{part}]: {param} takes only anchor and seconds")
    for part in ("anchor", "seconds"):
        if part not in given:
            raise ExpiryError(f"{param}[{part}]", f"{param}[{part}] is required with {param}")
    try:
        # Form values are text, read as numbers are ("3600"; not "1h" nor "3600.5").
        return ExpiresAfter.model_validate({"anchor": given["anchor"], "seconds": given["seconds"]})
    except ValidationError as exc:
        raise _problem(exc, lambda part: f"{param}[{part}]", param) from None


def seconds_of(policy: ExpiresAfter | None, default: int | None) -> int | None:
    """Seconds a file lives after its created_at: the request's policy, else the server's default (None: kept
    until deleted)."""
    return policy.seconds if policy is not None else default
