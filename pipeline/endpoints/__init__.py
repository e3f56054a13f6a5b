"""The route registry: every URL a batch line may name, each answered by one `Endpoint` entry.

OpenAI's Batch API calls a route an *endpoint*; the name keeps it apart from prefix routing (`stages/prefix_key.py`).
Adding a route is adding one module here with one `Endpoint` subclass, and listing it in `ENDPOINTS`: validation,
token counting, fitting, prefix keys, both engines and the Parquet columns all read the registry.

    endpoint = endpoint_for("/v1/embeddings")   # None for a URL no entry serves
    endpoint.tasks                              # frozenset({"embed"}): model tasks that serve it
"""

from __future__ import annotations

from typing import Any

from pipeline.endpoints.audio import Transcriptions, Translations
from pipeline.endpoints.base import (
    Budget,
    Chat,
    Endpoint,
    FakeAnswer,
    FakeContext,
    Prompt,
    Templated,
    Text,
    TextPair,
    parses_as_json,
)
from pipeline.endpoints.chat import ChatCompletions
from pipeline.endpoints.completions import Completions
from pipeline.endpoints.embeddings import Embeddings
from pipeline.endpoints.responses import Responses
from pipeline.endpoints.scoring import Rerank, Score

ENDPOINTS: tuple[Endpoint, ...] = (
    ChatCompletions(),
    Completions(),
    Responses(),
    Embeddings(),
    Score(),
    Rerank(),
    Transcriptions(),
    Translations(),
)

_BY_URL: dict[str, Endpoint] = {url: endpoint for endpoint in ENDPOINTS for url in endpoint.urls}
_BY_NAME: dict[str, Endpoint] = {endpoint.name: endpoint for endpoint in ENDPOINTS}

# Every URL a line may name, in registry order.
SUPPORTED_URLS: tuple[str, ...] = tuple(_BY_URL)


def endpoint_for(url: str) -> Endpoint | None:
    return _BY_URL.get(url)


def endpoint_named(name: str) -> Endpoint:
    return _BY_NAME[name]


# The routes a dataset job may name (`dataset.route`): those that say how a row's rendered templates make a body.
TEMPLATED_ROUTES: tuple[str, ...] = tuple(e.name for e in ENDPOINTS if e.templated is not None)


def endpoint_answering(body: Any) -> Endpoint | None:
    """The route a response body came from (result lines keep the body, not the URL); None for error bodies."""
    if not isinstance(body, dict) or "error" in body:
        return None
    for endpoint in ENDPOINTS:
        if endpoint.answers(body):
            return endpoint
    return None


def json_outcome(url: str, request: dict[str, Any], status_code: int, response: Any) -> bool | None:
    """For an answered request that asked for JSON output: whether every text it generated parses as JSON (a
    constrained answer cut at max_tokens does not); None for any other request or answer."""
    endpoint = _BY_URL.get(url)
    if (
        endpoint is None
        or status_code >= 400
        or not isinstance(response, dict)
        or not endpoint.asks_json(request)
    ):
        return None
    texts = endpoint.output_texts(response)
    return bool(texts) and all(parses_as_json(text) for text in texts)


def urls_for_task(task: str | None) -> list[str]:
    """The URLs a model of this task serves (every URL when the task is unknown)."""
    return [url for e in ENDPOINTS if task is None or task in e.tasks for url in e.urls]


__all__ = [
    "ENDPOINTS",
    "SUPPORTED_URLS",
    "TEMPLATED_ROUTES",
    "Budget",
    "Chat",
    "Endpoint",
    "FakeAnswer",
    "FakeContext",
    "Prompt",
    "Templated",
    "Text",
    "TextPair",
    "endpoint_answering",
    "endpoint_for",
    "endpoint_named",
    "json_outcome",
    "urls_for_task",
]
