"""vLLM fetches a request's media through this connector, so the job's fetch policy (media/policy.py) decides every
URL vLLM would otherwise fetch from anywhere.

vLLM's own plug-in point: a class registered in `MEDIA_CONNECTOR_REGISTRY` and named by `VLLM_MEDIA_CONNECTOR` is
the one its chat renderer builds to load `image_url`, `audio_url` and `video_url` parts. This one keeps vLLM's
handling of `data:` URLs and of decoding (its MediaIO classes), and fetches http(s):// and file:// URLs itself with
media/fetch.py: each redirect checked, the connection pinned to the checked address, a size and time limit. A URL
the policy refuses raises MediaRefused, one that cannot be had MediaFetchFailed; vLLM's serving layer answers either
(a ValueError) with a 400 carrying the message, which becomes the row's `media_refused` / `media_fetch_failed`.

Imported only in an engine's process, by VllmEngine.start (it imports vLLM).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from urllib3.util import parse_url
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

from pipeline.media.fetch import Media, fetch_media, read_data_url
from pipeline.media.policy import MediaPolicy, MediaRefused

CONNECTOR = "nightshift-policy"
# The policy of the engine this process hosts (one engine per actor process); None until it starts: no fetch then.
_policy: MediaPolicy | None = None
# Fetches wait on the network: a pool of their own, so slow servers cannot take the threads vLLM's own work runs on.
_FETCHES = ThreadPoolExecutor(max_workers=16, thread_name_prefix="media-fetch")


def use_media_policy(policy: MediaPolicy) -> None:
    """Make `policy` the one every connector vLLM builds in this process fetches by (before the engine starts)."""
    global _policy
    _policy = policy
    os.environ["VLLM_MEDIA_CONNECTOR"] = CONNECTOR


def _is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


@MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR)
class PolicyMediaConnector(MediaConnector):
    """vLLM's MediaConnector, with every fetch made by the job's media policy."""

    def load_from_url(self, url: str, media_io: Any, *, fetch_timeout: int | None = None) -> Any:
        if _is_data_url(url):
            return super().load_from_url(url, media_io, fetch_timeout=fetch_timeout)
        return media_io.load_bytes(self._fetch(url).data)

    async def load_from_url_async(self, url: str, media_io: Any, *, fetch_timeout: int | None = None) -> Any:
        if _is_data_url(url):
            return await super().load_from_url_async(url, media_io, fetch_timeout=fetch_timeout)
        loop = asyncio.get_running_loop()
        # Threads: the fetch blocks on the network (at most media.fetch_timeout_s), the decode on the CPU; the
        # engine's event loop does neither.
        media = await loop.run_in_executor(_FETCHES, self._fetch, url)
        return await loop.run_in_executor(None, media_io.load_bytes, media.data)

    def _fetch(self, url: str) -> Media:
        return _fetch_by_policy(url, self.allowed_media_domains)


def _fetch_by_policy(url: str, allowed_domains: list[str] | None) -> Media:
    """An http(s):// or file:// URL fetched by this engine's policy, narrowed further by vLLM's own
    `allowed_media_domains` (engine.vllm.extra) when set, as vLLM's connector and run-batch's downloader narrow it."""
    if _policy is None:
        raise MediaRefused("this engine was started without a media policy; it fetches nothing")
    if url[:4].lower() == "http" and allowed_domains:
        host = parse_url(url).hostname
        if host not in allowed_domains:
            raise MediaRefused(
                f"the URL must be from one of the allowed domains (vLLM's allowed_media_domains: "
                f"{allowed_domains}); its host is {host!r}"
            )
    return fetch_media(url, _policy)


async def fetch_file(url: str, allowed_domains: list[str] | None = None) -> bytes:
    """A file a line names by URL (run-batch's `file_url`: the audio of a transcription), fetched by the engine's
    policy as the connector fetches media: a `data:` URL decoded (at most media.max_bytes), any other URL fetched;
    vLLM's own `allowed_media_domains` (engine.vllm.extra) narrows http(s) URLs, as run-batch's downloader does."""
    if _policy is not None and _is_data_url(url):
        return read_data_url(url, _policy.max_bytes)
    loop = asyncio.get_running_loop()
    return (await loop.run_in_executor(_FETCHES, _fetch_by_policy, url, allowed_domains)).data
