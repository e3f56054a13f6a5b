"""One POST to an OpenAI-compatible server, retried the way a shared server needs: what the http engine sends.

A retry is for what may pass on its own — 429 (rate limit, a full queue), 408, any 5xx, a timeout, a refused or
dropped connection — with exponential backoff and jitter, so many clients that failed together do not come back
together; a `Retry-After` the server sends wins over the backoff. Any other 4xx is the request's own fault and is
answered at once: retrying it can only fail again.

A request that ran on the server but whose answer was lost (a dropped connection) is sent again; the job still
keeps one result per request, since the engine returns exactly one answer per request it is given.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

# 408: the server timed out waiting for us; 425/429: come back later; 5xx: the server's trouble, not the request's.
RETRY_STATUSES = frozenset({408, 425, 429}) | frozenset(range(500, 600))
# A Retry-After longer than this is not waited for whole: a job should not sleep for an hour on one header.
RETRY_AFTER_CAP_S = 300.0


class ServerUnreachable(ConnectionError):
    """The server refused or never answered a connection, through every retry: the engine (its server) is gone,
    not one request. The runtime treats it as the engine's death, so the request's chunk runs again."""


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 6
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0

    def delay(self, retry: int, retry_after: float | None) -> float:
        """Seconds before retry number `retry` (1-based): the server's Retry-After when it sent one, else the
        backoff doubled per retry with "equal jitter" (half fixed, half random)."""
        if retry_after is not None:
            return min(retry_after, RETRY_AFTER_CAP_S)
        step = min(self.backoff_max_s, self.backoff_s * 2 ** (retry - 1))
        return step / 2 + random.uniform(0, step / 2)


@dataclass
class Answer:
    """The server's last word on one request: its status and JSON body (a transport failure is a 5xx-like
    outcome with a body we wrote), and how many attempts it took."""

    status_code: int
    body: Any
    attempts: int
    transport_error: str | None = None  # set when no HTTP answer came back at all


@dataclass
class SendStats:
    """What retrying cost, per engine: attempts beyond the first by cause (status code or error name)."""

    retries: Counter = field(default_factory=Counter)
    slept_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"retries": dict(self.retries), "retry_wait_s": round(self.slept_s, 3)}


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header as seconds to wait: delta-seconds or an HTTP date (RFC 9110 10.2.3)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return {"error": {"message": response.text[:2000] or f"HTTP {response.status_code}", "type": "http"}}


async def post_json(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    policy: RetryPolicy,
    stats: SendStats | None = None,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> Answer:
    """POST `body` to `path` on the client's server, retried per `policy`; raises ServerUnreachable when no
    connection could be made through every retry."""
    stats = stats or SendStats()
    attempt = 0
    while True:
        attempt += 1
        retry_after: float | None = None
        try:
            response = await client.post(path, json=body)
        except httpx.TransportError as exc:  # refused, reset, dropped mid-answer, timed out
            cause = type(exc).__name__
            if attempt > policy.max_retries:
                if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                    raise ServerUnreachable(
                        f"{client.base_url}: no connection after {attempt} attempts ({cause}: {exc})"
                    ) from exc
                message = f"no answer from {client.base_url} after {attempt} attempts: {cause}: {exc}"
                error = {"error": {"message": message, "type": cause}}
                return Answer(504 if "Timeout" in cause else 502, error, attempt, cause)
        else:
            if response.status_code not in RETRY_STATUSES or attempt > policy.max_retries:
                return Answer(response.status_code, _json(response), attempt)
            cause = str(response.status_code)
            retry_after = retry_after_seconds(response.headers.get("retry-after"))
        stats.retries[cause] += 1
        wait = policy.delay(attempt, retry_after)
        stats.slept_s += wait
        await sleep(wait)
