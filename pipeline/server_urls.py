"""Base URLs of OpenAI-compatible servers (the http backend's endpoints), as the job config checks them and the
engine sends to them. Pure: the standard library only, so the config and the engines both stand on it."""

from __future__ import annotations


def endpoint_base(url: str) -> str:
    """An endpoint as given (`http://host:8000`, `http://host:8000/v1/`) as the base a request's url is appended to
    (`/v1/chat/completions`, `/rerank`): no trailing slash, no trailing /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
