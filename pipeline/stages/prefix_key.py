"""Prefix keys: which requests share a long leading prompt, so the runtime can send them to the same engine.

An engine's prefix cache only pays when requests with the same leading tokens (a system prompt, a few-shot block)
run on the same engine. The key is computed once per request at ingest and stored with the work list; the work
queue then routes by it (see runtime/engines/work_queue.py). Pure: no Ray, no vLLM, no tokenizer — characters stand in for
tokens, which is all a grouping needs.

What a key covers (the route's registry entry says which text leads, `Endpoint.prefix`):
- a chat (or a Responses request): `tools` if given (chat templates render them ahead of the messages) and every
  message but the last (system prompt or instructions, few-shot turns, earlier turns);
- otherwise (a one-message chat, a completion's string prompt), only a prompt longer than `PREFIX_CHARS`: its
  first `PREFIX_CHARS` characters (a long prompt whose head may be a shared preamble);
- pooling routes (embeddings, score, rerank) never: vLLM runs pooling models without a prefix cache.
The covered text is cut at `PREFIX_CHARS`: requests that agree that far share at least that much of the KV cache,
so grouping them is right even if their prompts part later. Shorter than `MIN_PREFIX_CHARS`, a shared part saves
too little prefill to be worth steering work by (and on CPU engines, with 128-token KV blocks, it saves nothing):
such a request gets no key and may run anywhere.

A request for a LoRA adapter is keyed by its adapter instead (`routing_key`): an engine holds only `max_loras`
adapters at once, and loading one costs more than a prefill, so the rows of one adapter go to the engine that
already holds it (the work queue spreads a key over more engines only when the others run out of work: when one
adapter has most of the rows). Its rows' shared prompts then meet on that engine too.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pipeline.endpoints import endpoint_for

PREFIX_CHARS = 1024  # about 250 tokens of English: a couple of KV blocks on CPU, dozens on GPU
MIN_PREFIX_CHARS = 256


def _key(url: str, text: str) -> str:
    return hashlib.blake2b(f"{url}\n{text[:PREFIX_CHARS]}".encode(), digest_size=8).hexdigest()


def prefix_key(url: str, body: dict[str, Any]) -> str | None:
    """A short hash naming the request's shareable prefix, or None when it has none worth routing by."""
    endpoint = endpoint_for(url)
    parts = endpoint.prefix(body) if endpoint is not None else None
    if parts is None:
        return None
    leading, whole = parts
    # The separate leading part (tools and every message but the last), when it is long enough to pay.
    if len(leading) >= MIN_PREFIX_CHARS:
        return _key(url, leading)
    # One long prompt: its head may be a shared preamble. Shorter, the key would cover the whole prompt, and
    # nothing marks a shared part in it.
    return _key(url, whole) if len(whole) > PREFIX_CHARS else None


def routing_key(
    url: str, body: dict[str, Any], adapters: frozenset[str] | set[str] = frozenset()
) -> str | None:
    """The key the work queue routes a request by: its adapter's when its `model` names one of `adapters`, else
    its prefix key."""
    model = body.get("model")
    if adapters and model in adapters:
        return hashlib.blake2b(f"lora\n{model}".encode(), digest_size=8).hexdigest()
    return prefix_key(url, body)
